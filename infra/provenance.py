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
