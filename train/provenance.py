"""How a results file was made: the command as a user would retype it, the
commit it ran at, and where it wrote. Every command that writes results
(train/, evaluation/, scripts/) records this; scripts add their statistics
convention as a field (`scripts.stats.CONVENTION`)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from typing import Sequence


def commit() -> str:
  """The repository's commit, '+dirty' when files differ from it, or
  'unknown' outside a git checkout."""
  root = pathlib.Path(__file__).resolve().parent.parent
  def git(*args):
    return subprocess.run(['git', '-C', str(root), *args], capture_output=True,
                          text=True, timeout=30, check=True).stdout.strip()
  try:
    head = git('rev-parse', '--short=7', 'HEAD')
    dirty = git('status', '--porcelain', '--untracked-files=no')
  except (OSError, subprocess.SubprocessError):
    return 'unknown'
  return head + ('+dirty' if dirty else '')


def record(module: str, out: str | pathlib.Path,
           argv: Sequence[str] | None = None, **fields) -> dict:
  """{'command', 'commit', 'out', **fields}: `python -m MODULE ARGV` (argv
  defaults to this process's flags), `commit()` and str(out)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  return {'command': ' '.join(['python -m', module, *argv]),
          'commit': commit(), 'out': str(out), **fields}
