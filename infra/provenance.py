"""How a results file was made: the command as a user would retype it, the
commit it ran at, where it wrote, and the machine it ran on (the CPU and its
vector extensions: a number measured on an AVX-512 VM names it). Every
command that writes results (train/, evaluation/, studies/, scripts/)
records this; studies add their statistics convention as a field
(`studies.stats.CONVENTION`). A report rebuilt from saved results records
its own `record` beside the one that trained them (`rebuilt`), never in
its place."""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys
from typing import Sequence


DIRTY = '+dirty'  # After a commit: the files that ran were not all its.


ROOT = pathlib.Path(__file__).resolve().parent.parent  # This checkout.


def commit(root: pathlib.Path = ROOT) -> str:
  """The commit of the repository at ROOT, with DIRTY when files differ
  from it (a tracked file changed, or an untracked Python file that is not
  ignored: a module the run may have imported, which the commit does not
  hold), or 'unknown' outside a git checkout."""
  def git(*args):
    return subprocess.run(['git', '-C', str(root), *args], capture_output=True,
                          text=True, timeout=30, check=True).stdout.strip()
  try:
    head = git('rev-parse', '--short=7', 'HEAD')
    dirty = (git('status', '--porcelain', '--untracked-files=no')
             or git('ls-files', '--others', '--exclude-standard', '--',
                    '*.py'))
  except (OSError, subprocess.SubprocessError):
    return 'unknown'
  return head + (DIRTY if dirty else '')


def ended(record: dict) -> dict:
  """RECORD (a `record`, or its commit and machine, made as a command or
  run started: the code it runs) with 'commit_at_end', the checkout's
  commit now, where that is no longer the one it started at (a commit
  made, or a file changed, while it ran: what a module imported late would
  have read)."""
  now = commit()
  if now != record['commit']:
    record['commit_at_end'] = now
  return record


def is_clean(c: str) -> bool:
  """Whether commit C (as `commit()` wrote it) names the files that ran:
  a commit, not DIRTY, not 'unknown'."""
  return bool(c) and c != 'unknown' and not c.endswith(DIRTY)


def in_history(c: str, root: pathlib.Path = ROOT) -> bool | None:
  """Whether commit C (as `commit()` wrote it, DIRTY removed) is HEAD or
  one of its ancestors in the repository at ROOT; None where that cannot
  be told (outside a git checkout, or a shallow clone that lacks the
  history)."""
  git = lambda *args: subprocess.run(
      ['git', '-C', str(root), *args], capture_output=True, text=True,
      timeout=30, check=False)
  try:
    shallow = git('rev-parse', '--is-shallow-repository')
    if shallow.returncode or shallow.stdout.strip() != 'false':
      return None
    return git('merge-base', '--is-ancestor', c.removesuffix(DIRTY),
               'HEAD').returncode == 0
  except (OSError, subprocess.SubprocessError):
    return None


# The flags that say which vector kernels a CPU runs (what a benchmark's
# speed depends on), in the order they are listed.
VECTOR_FLAGS = ('avx2', 'fma', 'avx512f', 'avx512bw', 'avx512vl',
                'avx512_bf16', 'avx512_vnni', 'avx512_fp16', 'amx_tile')


def machine(cpuinfo: str | None = None) -> dict:
  """{'cpu', 'avx2', 'avx512f', 'cores', 'family', 'model',
  'vector_flags'}: the CPU model name, whether it has AVX2 and AVX-512F
  (from /proc/cpuinfo, or the text given; None where it cannot be read),
  the cores this process may run on, its family and model numbers (None
  where not listed) and which of VECTOR_FLAGS it has."""
  if cpuinfo is None:
    try:
      cpuinfo = pathlib.Path('/proc/cpuinfo').read_text()
    except OSError:
      cpuinfo = ''
  model, flags, numbers = platform.processor() or 'unknown', None, {}
  for line in cpuinfo.splitlines():
    key, _, value = line.partition(':')
    if key.strip() == 'model name':
      model = value.strip()
    elif key.strip() in ('cpu family', 'model') and value.strip().isdigit():
      numbers.setdefault(key.strip(), int(value))
    elif key.strip() == 'flags' and flags is None:
      flags = set(value.split())
  return {'cpu': model,
          'avx2': None if flags is None else 'avx2' in flags,
          'avx512f': None if flags is None else 'avx512f' in flags,
          'cores': len(os.sched_getaffinity(0)),
          'family': numbers.get('cpu family'), 'model': numbers.get('model'),
          'vector_flags': None if flags is None else [
              f for f in VECTOR_FLAGS if f in flags]}


def describe(m: dict) -> str:
  """One line naming a `machine()` record: 'CPU (AVX-512F), 2 cores', with
  its family and model numbers where recorded ('CPU, family 26 model 2
  (AVX-512F), 2 cores')."""
  ext = ('AVX-512F' if m.get('avx512f') else 'AVX2, no AVX-512F'
         if m.get('avx2') else 'vector extensions not recorded'
         if m.get('avx2') is None else 'no AVX2')
  numbers = (f', family {m["family"]} model {m.get("model")}'
             if m.get('family') is not None else '')
  return (f'{m.get("cpu", "unknown CPU")}{numbers} ({ext}), '
          f'{m.get("cores", "?")} cores')


def record(module: str, out: str | pathlib.Path,
           argv: Sequence[str] | None = None, **fields) -> dict:
  """{'command', 'commit', 'out', 'machine', **fields}: `python -m MODULE
  ARGV` (argv defaults to this process's flags), `commit()`, str(out) and
  `machine()`."""
  argv = sys.argv[1:] if argv is None else list(argv)
  return {'command': ' '.join(['python -m', module, *argv]),
          'commit': commit(), 'out': str(out), 'machine': machine(),
          **fields}
