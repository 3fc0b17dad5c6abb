"""A run's workdir: checked before any work, and held by one run at a time.

Two runs writing one workdir interleave their metrics and race their
checkpoint saves, so `train.main` holds WORKDIR/lock for the whole run: an
exclusive `flock` on a file naming the holder's host and pid. The kernel drops
the flock when its process dies, however it dies (SIGKILL included), so a
lock file whose flock can be taken is stale, and is taken over with a note.
The file stays after a run, empty. Multi-host runs share one workdir by
design: only process 0 writes, and only process 0 takes the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import socket
from typing import Callable, Iterator

from train.errors import UserError

LOCK_NAME = 'lock'


def check_writable(workdir: str, flag: str = '--workdir') -> pathlib.Path:
  """Creates WORKDIR if needed; raises UserError if it cannot hold a run."""
  if not workdir:
    raise UserError(f'{flag} is empty; give a directory for the run')
  refuse_url(workdir, flag)
  path = pathlib.Path(workdir).expanduser()
  if path.exists() and not path.is_dir():
    raise UserError(f'{flag}={workdir} is a file, not a directory; give a '
                    'directory (new or a run\'s) instead')
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f'.write-test-{os.getpid()}'
    probe.touch()
    probe.unlink()
  except OSError as e:
    raise UserError(f'{flag}={workdir} cannot be written ({e.strerror}); '
                    'give a directory you can write to') from None
  return path


CONVERT_INFO = 'convert.json'  # Written by train.convert.


def recipe_learning_rate(workdir: str | os.PathLike) -> float | None:
  """The uptraining recipe's peak rate that `train.convert` recorded in
  WORKDIR/convert.json; None for a workdir it did not write."""
  info = pathlib.Path(workdir) / CONVERT_INFO
  if not info.exists():
    return None
  return json.loads(info.read_text()).get('recipe', {}).get(
      'train.learning_rate')


def refuse_url(path: str, flag: str):
  """An object-store path (gs://, s3://) is not a local folder: refused
  rather than created as one named 'gs:'."""
  scheme, sep, _ = str(path).partition('://')
  if sep and scheme.isidentifier():
    raise UserError(f'{flag}={path}: {scheme}:// paths are not supported yet; '
                    'mount the bucket (e.g. gcsfuse) and give the mounted '
                    'folder')


@contextlib.contextmanager
def new_or_existing(workdir: str, flag: str = '--workdir'
                    ) -> Iterator[pathlib.Path]:
  """`check_writable`'s WORKDIR; one it created is removed again if the run
  fails having written nothing but its lock (a refused config, say)."""
  existed = pathlib.Path(workdir).expanduser().exists()
  path = check_writable(workdir, flag)
  try:
    yield path
  except BaseException:
    if not existed and {p.name for p in path.iterdir()} <= {LOCK_NAME}:
      shutil.rmtree(path, ignore_errors=True)
    raise


@contextlib.contextmanager
def lock(workdir: str | os.PathLike, *, enabled: bool = True,
         say: Callable[[str], None] = print) -> Iterator[None]:
  """Holds WORKDIR/lock for the duration; refuses if a live run holds it."""
  if not enabled:
    yield
    return
  path = pathlib.Path(workdir) / LOCK_NAME
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise UserError(
          f'{workdir} is in use by another run ({_holder(fd)}); wait for it '
          'to finish or stop it, or use another --workdir') from None
    stale = _holder(fd)
    if stale:
      say(f'note: taking over the lock of a run that ended without releasing '
          f'it ({stale})')
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'host {socket.gethostname()} pid {os.getpid()}\n'.encode(),
              0)
    try:
      yield
    finally:
      os.ftruncate(fd, 0)  # Emptied, not removed: a removed file could be
      # flocked by one waiter while the next creates and flocks a new one.
  finally:
    os.close(fd)  # Releases the flock.


def _holder(fd: int) -> str:
  return os.pread(fd, 200, 0).decode(errors='replace').strip()
