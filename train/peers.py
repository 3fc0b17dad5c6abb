"""A multi-process run's watcher: a lost peer ends the run in one line.

When a process of a multi-process run dies (killed, crashed, its host gone),
JAX's coordination service misses its heartbeats for GQA_LAB_HEARTBEAT_TIMEOUT
seconds (30 by default) and every other process aborts with a C++ fatal-error
dump. So `train.main`, launched as one of several processes, runs the
training as its child: the watcher relays the child's stderr and passes it
SIGTERM and SIGINT, and when the child aborts on a lost peer it prints one
line saying what was lost and how to resume, and exits 1. Nothing half-written
is kept: an interrupted save is a temporary folder the next run removes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from train import storage

WATCHED = 'GQA_LAB_WATCHED'  # Set in the child: it trains, not watches.
# The coordination service's error, as the survivors' stderr shows it.
_LOST = re.compile(r'coordination[_ ]service|CoordinationService|heartbeat|'
                   r'JAX distributed service detected fatal errors')
_UNHEALTHY = re.compile(r'unhealthy \(stopped sending heartbeats\):')
# What makes it a lost peer rather than a warning on the way to another end.
_FATAL = re.compile(r'detected fatal errors|stopped sending heartbeats|'
                    r'UNAVAILABLE')


def heartbeat_timeout(env) -> int:
  """Seconds without a peer's heartbeat after which the run ends:
  GQA_LAB_HEARTBEAT_TIMEOUT, or 30 (JAX's own default is 100)."""
  value = env.get('GQA_LAB_HEARTBEAT_TIMEOUT', '30')
  if not value.isdigit() or int(value) < 1:
    from train.errors import UserError  # pylint: disable=import-outside-toplevel
    raise UserError(f'GQA_LAB_HEARTBEAT_TIMEOUT={value!r} must be a whole '
                    'number of seconds >= 1')
  return int(value)


def watch(module: str, args: list[str], workdir: str | None) -> int:
  """Runs `python -m MODULE ARGS` as a watched child; its exit status, or 1
  with one line on stderr when it ended because a peer was lost."""
  timeout = heartbeat_timeout(os.environ)  # A bad value: refused before.
  child = subprocess.Popen([sys.executable, '-m', module, *args],
                           env={**os.environ, WATCHED: '1'},
                           stderr=subprocess.PIPE, text=True, bufsize=1)
  passed_on = {sig: signal.signal(sig, lambda signum, _: child.send_signal(
      signum)) for sig in (signal.SIGTERM, signal.SIGINT)}
  dump = None  # The fatal error's lines, once it starts.
  try:
    for line in child.stderr:
      if dump is None and _LOST.search(line):
        dump = []
      if dump is None:
        sys.stderr.write(line)
        sys.stderr.flush()
      else:
        dump.append(line)
    status = child.wait()
  finally:
    for sig, handler in passed_on.items():
      signal.signal(sig, handler)
  if dump and status != 0 and any(_FATAL.search(line) for line in dump):
    print(f'error: {_what_was_lost(dump)}, so this process stopped too '
          f'(after {timeout} s without its heartbeats); '
          f'rerun the same command on every host to resume {_resume(workdir)}',
          file=sys.stderr, flush=True)
    return 1
  sys.stderr.writelines(dump or [])  # Not a lost peer: shown as it was.
  return status if status >= 0 else 128 - status


def _what_was_lost(dump: list[str]) -> str:
  """'process 1 of the run was lost', or 'contact with ... was lost'."""
  for i, line in enumerate(dump):
    if _UNHEALTHY.search(line) and i + 1 < len(dump):
      tasks = re.findall(r'\d+', dump[i + 1].split('[')[0])
      if tasks:
        which = ', '.join(tasks)
        return (f'process{"es" if len(tasks) > 1 else ""} {which} of this '
                'run stopped answering (killed, crashed, or its host is down)')
  return ('this process lost contact with the run\'s coordinator (process 0 '
          'was killed or crashed, or its host is down)')


def _resume(workdir: str | None) -> str:
  """'from step N' (the newest checkpoint in WORKDIR), or 'from the start'."""
  try:
    folder = storage.path(workdir or '.') / 'checkpoints'
    steps = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if (
        workdir and folder.is_dir()) else []
  except Exception:  # pylint: disable=broad-except
    return 'from its latest checkpoint'  # An unreachable bucket, say.
  return f'from step {max(steps)}' if steps else 'from the start'
