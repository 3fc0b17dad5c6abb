"""A run's workdir: checked before any work, and held by one run at a time.

Two runs writing one workdir interleave their metrics and race their
checkpoint saves, so `train.main` holds WORKDIR/lock for the whole run,
naming the holder's host and pid:
  * On a local disk, an exclusive `flock` on that file. The kernel drops the
    flock when its process dies, however it dies (SIGKILL included), so a
    lock file whose flock can be taken is stale, and is taken over with a
    note. The file stays after a run, empty.
  * In a bucket (gs://), an object created only if absent (a generation
    precondition: of two runs starting together, one wins). The holder
    renews its lease every quarter lease; a lock whose lease has expired,
    or whose holder was a process on this host that is gone, is stale and
    taken over, again under a precondition. The object is deleted at the end.
    GQA_LAB_LOCK_LEASE sets the lease (60 s); a local lock has none, but
    a value that is not a lease is refused there too.
Multi-host runs share one workdir by design: only process 0 writes, and only
process 0 takes the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from typing import Callable, Iterator

from etils import epath

from infra import storage
from infra.errors import UserError

LOCK_NAME = 'lock'


def check_writable(workdir: str, flag: str = '--workdir') -> epath.Path:
  """Creates WORKDIR if needed; raises UserError if it cannot hold a run."""
  if not workdir:
    raise UserError(f'{flag} is empty; give a directory for the run')
  path = storage.path(workdir, flag)
  try:
    if path.exists() and not path.is_dir():
      raise UserError(f'{flag}={workdir} is a file, not a directory; give a '
                      'directory (new or a run\'s) instead')
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f'.write-test-{socket.gethostname()}-{os.getpid()}'
    probe.write_text('')
    probe.unlink()
  except UserError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    # OSError locally; a bucket adds HTTP and credential errors.
    cause = getattr(e, 'strerror', None) or str(e).strip().split('\n')[0]
    raise UserError(f'{flag}={workdir} cannot be written ({cause[:200]}); '
                    'give a directory you can write to' + (
                        '' if storage.is_local(path) else
                        ' (a bucket needs credentials: gcloud auth '
                        'application-default login, or a VM\'s service '
                        'account)')) from None
  return path


CONVERT_INFO = 'convert.json'  # Written by train.convert.


def recipe_learning_rate(workdir: str | os.PathLike) -> float | None:
  """The uptraining recipe's peak rate that `train.convert` recorded in
  WORKDIR/convert.json; None for a workdir it did not write."""
  info = epath.Path(workdir) / CONVERT_INFO
  if not info.exists():
    return None
  return json.loads(info.read_text()).get('recipe', {}).get(
      'train.learning_rate')


@contextlib.contextmanager
def new_or_existing(workdir: str, flag: str = '--workdir'
                    ) -> Iterator[epath.Path]:
  """`check_writable`'s WORKDIR; one it created is removed again if the run
  fails having written nothing but its lock (a refused config, say)."""
  existed = storage.path(workdir, flag).exists()
  path = check_writable(workdir, flag)
  try:
    yield path
  except BaseException:
    if not existed and storage.is_local(path) and {
        p.name for p in path.iterdir()} <= {LOCK_NAME}:
      path.rmtree(missing_ok=True)
    raise


@contextlib.contextmanager
def lock(workdir: str | os.PathLike, *, enabled: bool = True,
         say: Callable[[str], None] = print,
         flag: str = '--workdir') -> Iterator[None]:
  """Holds WORKDIR/lock for the duration; refuses if a live run holds it
  (`flag`: the folder's flag, for the message; local folders)."""
  lease_seconds()  # Set wrong, refused on any workdir, though only a
  # bucket's lock has a lease.
  if not enabled:
    yield
  elif storage.is_local(workdir):
    with _file_lock(os.path.join(workdir, LOCK_NAME), workdir, say, flag):
      yield
  else:
    held = _ObjectLock(str(workdir), say)
    try:
      yield
    finally:
      held.release()


def lease_seconds(env=os.environ) -> float:
  """How long a bucket lock outlives a holder that stopped renewing it:
  GQA_LAB_LOCK_LEASE, or 60."""
  value = env.get('GQA_LAB_LOCK_LEASE', '60')
  try:
    seconds = float(value)
  except ValueError:
    seconds = 0.0
  if not 0 < seconds < 1e6:
    raise UserError(f'GQA_LAB_LOCK_LEASE={value!r} must be a number of '
                    'seconds > 0 (60 by default)')
  return seconds


def _busy(workdir, holder: str, flag: str = '--workdir') -> UserError:
  return UserError(f'{workdir} is in use by another run ({holder}); wait for '
                   f'it to finish or stop it, or use another {flag}')


def _taking_over(holder: str) -> str:
  return ('note: taking over the lock of a run that ended without releasing '
          f'it ({holder})')


def _me() -> str:
  return f'host {socket.gethostname()} pid {os.getpid()}'


@contextlib.contextmanager
def _file_lock(path: str, workdir, say, flag: str) -> Iterator[None]:
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise _busy(workdir, _holder(fd), flag) from None
    stale = _holder(fd)
    if stale:
      say(_taking_over(stale))
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'{_me()}\n'.encode(), 0)
    try:
      yield
    finally:
      os.ftruncate(fd, 0)  # Emptied, not removed: a removed file could be
      # flocked by one waiter while the next creates and flocks a new one.
  finally:
    os.close(fd)  # Releases the flock.


def _holder(fd: int) -> str:
  return os.pread(fd, 200, 0).decode(errors='replace').strip()


class _ObjectLock:
  """WORKDIR/lock in a bucket, held from construction to `release`."""

  def __init__(self, workdir: str, say):
    from google.api_core import exceptions  # pylint: disable=import-outside-toplevel
    from google.cloud import storage as gcs  # pylint: disable=import-outside-toplevel
    self._conflict = exceptions.PreconditionFailed
    self._missing = exceptions.NotFound
    self._lease = lease_seconds()
    bucket, _, prefix = workdir.removeprefix('gs://').partition('/')
    client = gcs.Client()
    self._blob = lambda: client.bucket(bucket).blob(
        f'{prefix}/{LOCK_NAME}' if prefix else LOCK_NAME)
    self._stop = threading.Event()
    self._generation = self._acquire(workdir, say)
    self._renewer = threading.Thread(target=self._renew, args=(workdir,),
                                     daemon=True)
    self._renewer.start()

  def _acquire(self, workdir, say) -> int:
    for _ in range(3):  # Released between our create and our read: again.
      try:
        return self._write(0)  # Only if absent.
      except self._conflict:
        blob = self._blob()
        try:  # The holder, as of one generation.
          blob.reload()
          seen = int(blob.generation)
          holder = json.loads(blob.download_as_bytes(
              if_generation_match=seen) or b'{}')
        except (self._conflict, self._missing):
          continue
        if _alive(holder):
          raise _busy(workdir, holder.get('holder', '?')) from None
        try:  # Only if no other run took it over since we read it.
          generation = self._write(seen)
        except self._conflict:
          raise _busy(workdir, 'one that took it over just now') from None
        say(_taking_over(holder.get('holder', '?')))
        return generation
    raise _busy(workdir, 'runs starting and stopping as this one starts')

  def _write(self, if_generation_match: int) -> int:
    assert if_generation_match is not None  # Never an unconditional write.
    blob = self._blob()
    blob.upload_from_string(json.dumps({
        'holder': _me(), 'host': socket.gethostname(), 'pid': os.getpid(),
        'expires': time.time() + self._lease}),
        if_generation_match=if_generation_match)
    return int(blob.generation)

  def _renew(self, workdir):
    while not self._stop.wait(self._lease / 4):
      try:
        self._generation = self._write(self._generation)
      except self._conflict:
        print(f'warning: another run took over the lock of {workdir} (this '
              'one did not renew it in time); stop one of them',
              file=sys.stderr, flush=True)
        return
      except Exception:  # pylint: disable=broad-except
        pass  # A network fault: the next renewal tries again.

  def release(self):
    self._stop.set()
    self._renewer.join()
    try:
      self._blob().delete(if_generation_match=self._generation)
    except Exception:  # pylint: disable=broad-except
      pass  # Taken over, or unreachable: the lease expires either way.


def _alive(holder: dict) -> bool:
  """Whether a bucket lock's holder may still be running: a process of this
  host that exists, or any other whose lease has not expired."""
  if holder.get('host') == socket.gethostname() and 'pid' in holder:
    try:
      os.kill(holder['pid'], 0)
      return True
    except ProcessLookupError:
      return False
    except PermissionError:
      return True  # Another user's process.
  return holder.get('expires', 0) > time.time()
