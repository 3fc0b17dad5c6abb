"""A multi-process run's watcher: a lost peer ends the run in one line.

When a process of a multi-process run dies (killed, crashed, its host gone),
JAX's coordination service misses its heartbeats for GQA_LAB_HEARTBEAT_TIMEOUT
seconds (30 by default) and every other process aborts with a C++ fatal-error
dump. So `train.main`, launched as one of several processes, runs the
training as its child: the watcher relays the child's stderr and passes it
SIGTERM and SIGINT, and when the child aborts on a lost peer it prints one
line saying what was lost and how to resume, and exits 1. Nothing half-written
is kept: an interrupted save is a temporary folder the next run removes.

A peer lost mid-collective can fail the child's collective at once (a
save's, seen; a step's waits for the abort here), seconds before the
runtime's abort names the peer: the child's line for it
(`reported_as_lost_peer`, or any last words) is held, and the lost peer, the
cause, is the one line shown.

The child dies with its watcher (`follow_watcher`): a scheduler or a user
kills the PID it launched, often with SIGKILL, which cannot be passed on.
Before any of that, the environment's multi-process variables are checked
(`distributed_args`), each mistake one line naming the variable.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from infra import storage
from infra.errors import UserError

# Set in the child, to its watcher's PID: it trains, not watches.
WATCHED = 'GQA_LAB_WATCHED'
# The coordination service's error, as the survivors' stderr shows it.
_LOST = re.compile(r'coordination[_ ]service|CoordinationService|heartbeat|'
                   r'JAX distributed service detected fatal errors')
_UNHEALTHY = re.compile(r'unhealthy \(stopped sending heartbeats\):')
# The processes never all registered with the coordinator (at the start):
# the fatal error's status, then the call it ended.
_UNJOINED = (re.compile(r'DEADLINE_EXCEEDED'), re.compile(r'/RegisterTask'))
# What makes it a lost peer rather than a warning on the way to another end.
_FATAL = re.compile(r'detected fatal errors|stopped sending heartbeats|'
                    r'UNAVAILABLE')
# The child's last words: its shell's one line (infra.cli), or a traceback.
_LAST_WORDS = ('error: ', 'Traceback (most recent call last):')
# Seconds, beyond the heartbeat timeout, within which the runtime's abort
# on a lost peer follows the collective it broke: a margin for busy hosts
# (on this machine the abort came 1-5 s after the kill, with the timeout 5).
_VERDICT_SECONDS = 30
# A collective that failed because the connection to another process broke:
# XLA wraps a failure of Gloo (jax's CPU collectives) as 'Gloo <op> failed:
# ...', here a TCP pair's read of a reset or of an end of stream, or a write
# into a closed socket. The one place that reads the runtime's error text
# for it: these errors have no type of their own (an XlaRuntimeError whose
# status is UNKNOWN).
_BROKEN = re.compile(r'Gloo [\w -]+ failed: .*?(Connection reset by peer|'
                     r'Connection closed by peer|Broken pipe|Socket closed)')


def heartbeat_timeout(env) -> int:
  """Seconds without a peer's heartbeat after which the run ends:
  GQA_LAB_HEARTBEAT_TIMEOUT, or 30 (JAX's own default is 100)."""
  return _seconds(env, 'GQA_LAB_HEARTBEAT_TIMEOUT', 30)


def coordinator_timeout(env) -> int:
  """Seconds a process waits for all of the run's processes to join through
  the coordinator: GQA_LAB_COORDINATOR_TIMEOUT, or 300 (JAX's default), as
  long as hosts started by hand may take to follow one another."""
  return _seconds(env, 'GQA_LAB_COORDINATOR_TIMEOUT', 300)


def _seconds(env, var: str, default: int) -> int:
  value = env.get(var, str(default))
  if not value.isdigit() or int(value) < 1:
    raise UserError(f'{var}={value!r} must be a whole number of seconds >= 1')
  return int(value)


# The variables by which jax.distributed finds a cluster by itself
# (jax/_src/clusters): where one is, it fills in what JAX_* leave out.
_SLURM = ('SLURM_JOB_ID', 'SLURM_STEP_NODELIST', 'SLURM_NTASKS',
          'SLURM_PROCID', 'SLURM_LOCALID')
_JAX_VARS = ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID')
_COUNTS = {'JAX_NUM_PROCESSES': (1, "the number of the run's processes"),
           'JAX_PROCESS_ID': (0, "this process's number, 0 to "
                              'JAX_NUM_PROCESSES - 1'),
           'SLURM_NTASKS': (1, 'set by SLURM'),
           'OMPI_COMM_WORLD_SIZE': (1, 'set by Open MPI')}


def is_multiprocess(env) -> bool:
  """Whether the environment asks for several processes (a TPU slice, SLURM,
  Open MPI, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES); whether it does
  so correctly is `distributed_args`'s question."""
  return ('JAX_COORDINATOR_ADDRESS' in env
          or any(env.get(var, '1').strip() != '1' for var in (
              'JAX_NUM_PROCESSES', 'SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE'))
          or ',' in env.get('TPU_WORKER_HOSTNAMES', ''))


def distributed_args(env) -> dict:
  """`jax.distributed.initialize`'s arguments from a multi-process
  environment, every variable checked first: a wrong or missing one is one
  UserError naming it and what to set (jax's own checks are tracebacks)."""
  counts = {}
  for var, (low, meaning) in _COUNTS.items():
    if var in env:
      if not env[var].strip().isdigit() or int(env[var]) < low:
        raise UserError(f'{var}={env[var]!r} must be a whole number >= {low} '
                        f'({meaning})')
      counts[var] = int(env[var])
  address = env.get('JAX_COORDINATOR_ADDRESS')
  num = counts.get('JAX_NUM_PROCESSES')
  pid = counts.get('JAX_PROCESS_ID')
  if num is not None and pid is not None and pid >= num:
    raise UserError(f'JAX_PROCESS_ID={pid} is not below JAX_NUM_PROCESSES='
                    f'{num}: number the processes 0 to {num - 1}, one each, '
                    'with 0 on the coordinator\'s host')
  if address is not None and not re.fullmatch(r'\S+:\d{1,5}', address):
    raise UserError(f'JAX_COORDINATOR_ADDRESS={address!r} must be HOST:PORT '
                    '(e.g. host0:1234): the host of process 0 and a free port')
  unset = [var for var, value in zip(_JAX_VARS, (address, num, pid))
           if value is None]
  if unset and not _cluster_present(env):  # jax would find no cluster.
    if counts.get('SLURM_NTASKS', 1) > 1:
      absent = [var for var in _SLURM if var not in env]
      raise UserError(
          f'SLURM_NTASKS={counts["SLURM_NTASKS"]} but this process was not '
          f'started by srun ({", ".join(absent)} unset): launch it with '
          '`srun python -m train.main ...`, or unset SLURM_NTASKS to train '
          'in one process')
    if len(unset) < len(_JAX_VARS):
      given = ' and '.join(v for v in _JAX_VARS if v not in unset)
      raise UserError(
          f'{given} set without {" and ".join(unset)}: on every process set '
          'all three (JAX_COORDINATOR_ADDRESS=HOST:PORT of process 0, '
          'JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=0 to N-1), or none of them to '
          'train in one process')
  return {'heartbeat_timeout_seconds': heartbeat_timeout(env),
          'initialization_timeout': coordinator_timeout(env),
          **({'num_processes': num} if num is not None else {}),
          **({'process_id': pid} if pid is not None else {})}


def _cluster_present(env) -> bool:
  """Whether jax.distributed may find the run's processes by itself: under
  srun, Open MPI, Kubernetes, or on a TPU VM (its variables, or Google's
  chips on PCI, as jax looks for them; jax sets TPU_SKIP_MDS_QUERY where
  there are none)."""
  return (all(var in env for var in _SLURM)
          or any(var.startswith(('OMPI_', 'TPU_', 'MEGASCALE_'))
                 and var != 'TPU_SKIP_MDS_QUERY' for var in env)
          or 'KUBERNETES_SERVICE_HOST' in env
          or any(pathlib.Path(vendor).read_text().strip() == '0x1ae0'
                 for vendor in glob.glob('/sys/bus/pci/devices/*/vendor')))


def follow_watcher(env, poll_seconds: float = 1.0):
  """Makes this process, a watched child, die with its watcher: SIGKILL on
  the watcher's death (Linux's parent-death signal), or a thread polling
  for it where that is missing. A watcher already gone ends this at once."""
  watcher = int(env[WATCHED])
  if not _parent_death_signal(signal.SIGKILL):
    def poll():
      while os.getppid() == watcher:
        time.sleep(poll_seconds)
      os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=poll, daemon=True, name='follow-watcher').start()
  # Checked after the signal is set: a watcher that died before it (this
  # process then has another parent) would otherwise never send it.
  if os.getppid() != watcher:
    os.kill(os.getpid(), signal.SIGKILL)


def _parent_death_signal(signum: int) -> bool:
  """prctl(PR_SET_PDEATHSIG, signum); whether it was set (Linux only)."""
  if not sys.platform.startswith('linux'):
    return False
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(1, signum, 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG.
  except (OSError, AttributeError):
    return False


def watch(module: str, args: list[str], workdir: str | None) -> int:
  """Runs `python -m MODULE ARGS` as a watched child; its exit status, or 1
  with one line on stderr when it ended because a peer was lost or the
  run's processes never all joined.

  The child's stderr is relayed line by line, but for its last words (an
  `error: ` line, a traceback), which are held until it ends: a lost peer
  shown by its end replaces them (they are its consequence: a save or a
  step whose collective broke). Held at most the heartbeat timeout and
  _VERDICT_SECONDS, by when a lost peer would have ended the child."""
  setup = distributed_args(os.environ)  # Refused here, before any child.
  timeout = setup['heartbeat_timeout_seconds']
  child = subprocess.Popen([sys.executable, '-m', module, *args],
                           env={**os.environ, WATCHED: str(os.getpid())},
                           stderr=subprocess.PIPE, text=True, bufsize=1)
  passed_on = {sig: signal.signal(sig, lambda signum, _: child.send_signal(
      signum)) for sig in (signal.SIGTERM, signal.SIGINT)}
  lines = _read(child.stderr)
  dump = None  # The fatal error's lines, once it starts.
  held, release_at = [], None  # The last words, and until when they wait.
  try:
    while True:
      try:
        line = lines.get(timeout=max(0.0, release_at - time.monotonic())
                         if held and dump is None else None)
      except queue.Empty:  # No lost peer by then: they were the end.
        _write(held)
        held = []
        continue
      if line is None:
        break
      if dump is None and _LOST.search(line):
        dump = []
      if dump is not None:
        dump.append(line)
      elif held or release_at is None and line.startswith(_LAST_WORDS):
        if not held:  # Held once: after a release, lines pass again.
          release_at = time.monotonic() + timeout + _VERDICT_SECONDS
        held.append(line)
      else:
        _write([line])
    status = child.wait()
  finally:
    for sig, handler in passed_on.items():
      signal.signal(sig, handler)
  if dump and status != 0 and all(any(p.search(line) for line in dump)
                                  for p in _UNJOINED):
    print(f'error: {_unjoined(os.environ, setup["initialization_timeout"])}',
          file=sys.stderr, flush=True)
    return 1
  if dump and status != 0 and any(_FATAL.search(line) for line in dump):
    print(f'error: {_what_was_lost(dump)}, so this process stopped too '
          f'(after {timeout} s without its heartbeats); '
          f'rerun the same command on every host to resume {_resume(workdir)}',
          file=sys.stderr, flush=True)
    return 1
  _write(held + (dump or []))  # Not a lost peer: shown as they were.
  return status if status >= 0 else 128 - status


def _read(stream) -> queue.Queue:
  """The lines of `stream`, then None, read into a queue by a thread (the
  watcher waits for them with a time limit)."""
  lines = queue.Queue()

  def read():
    for line in stream:
      lines.put(line)
    lines.put(None)
  threading.Thread(target=read, daemon=True, name='relay-stderr').start()
  return lines


def _write(lines: list[str]):
  sys.stderr.writelines(lines)
  sys.stderr.flush()


@contextlib.contextmanager
def reported_as_lost_peer(workdir: str | None):
  """Within, a collective whose connection to another process broke (a
  step's, an evaluation's, a save's) is one UserError saying so and from
  which step to resume, not a traceback or a storage fault. The watcher
  normally shows its own line instead, naming the process lost; this one
  stands where the runtime's abort does not follow."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    cause = broken_connection(e)
    if cause is None:
      raise
    raise UserError(
        f'a collective with another process of this run failed '
        f'({cause[:200]}): that process was killed or crashed, or its host is '
        f'down; rerun the same command on every host to resume '
        f'{_resume(workdir)}') from None


def broken_connection(error: BaseException) -> str | None:
  """The message of `error`, or of one it was raised from, that shows a
  collective failed because its connection to another process broke; None
  for any other error (a full disk, say)."""
  while error is not None:
    found = _BROKEN.search(str(error))
    if found:
      return found.group(0)
    error = error.__cause__ or error.__context__
  return None


def _unjoined(env, timeout: int) -> str:
  """What to do when the run's processes did not all join within `timeout`:
  from process 0 (the coordinator), start the others; from another, start
  process 0 or check its address."""
  address = env.get('JAX_COORDINATOR_ADDRESS', "the cluster's address")
  pid = next((env[v] for v in ('JAX_PROCESS_ID', 'SLURM_PROCID',
                               'OMPI_COMM_WORLD_RANK') if v in env), None)
  within = f'within {timeout} s (GQA_LAB_COORDINATOR_TIMEOUT)'
  if pid == '0':
    return (f'not every process of the run joined it {within}; start the '
            'same command on every host (JAX_PROCESS_ID 1 to '
            'JAX_NUM_PROCESSES - 1 on the others), and check that they reach '
            f'{address}')
  return (f'no coordinator answered at {address} {within}; start process 0 '
          '(JAX_PROCESS_ID=0) on that host, or check the address')


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
