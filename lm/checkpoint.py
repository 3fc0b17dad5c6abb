"""Orbax checkpoints of the train state in WORKDIR/checkpoints, and resume.

A checkpoint that cannot be read (a truncated or overwritten array file, empty
metadata) is never a traceback: `Checkpointer.restore` moves it to
WORKDIR/unreadable_checkpoints/ (nothing is deleted) and resumes from the
newest intact one, with a warning; the read-only `restore_latest` (sampling,
conversion) stops with one line naming the step directory to remove.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from typing import Callable
import warnings

from etils import epath
from flax import serialization
import jax
import numpy as np
import orbax.checkpoint as ocp

from infra import peers, storage
from infra.errors import UserError

UNREADABLE_DIR = 'unreadable_checkpoints'


class Checkpointer:
  """Saves every `every` steps (and on demand), keeps the last `keep`."""

  def __init__(self, workdir: str | epath.Path, *, every: int, keep: int):
    self.workdir = storage.path(workdir)
    self.directory = self.workdir / 'checkpoints'
    self.every = every
    self._keep = keep
    self._saving = None  # The step of the save in flight, if any.
    _quiet_background_failures()
    self._check_writable()
    self._manager = self._open()

  def _check_writable(self):
    """A local checkpoints folder that cannot take a save is refused before
    any training, not at its first save."""
    if not storage.is_local(self.directory) or not self.directory.is_dir():
      return
    try:
      fd, probe = tempfile.mkstemp(prefix='.write-test-', dir=self.directory)
      os.close(fd)
      os.unlink(probe)
    except OSError as e:
      raise UserError(f'{self.directory} cannot be written ({e.strerror}); '
                      'make it writable, or give another --workdir; nothing '
                      'was changed') from None

  def _open(self):
    return ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=self._keep, create=True,
            # The temporary folders of saves that a kill interrupted.
            cleanup_tmp_directories=True,
            # The save's folders made before save() returns, not in the
            # background: a folder that cannot be made (a read-only mount)
            # is then an error at once, where in the background it left the
            # save's write threads waiting for it, and the process exiting
            # after our one-line error, for orbax's 5-minute timeout. A
            # mkdir's time, on a local disk or a bucket.
            async_options=ocp.AsyncOptions(
                create_directories_asynchronously=False)),
        item_handlers=ocp.StandardCheckpointHandler())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def move_after(self, step: int | None, folder: str) -> list[int]:
    """Moves the checkpoints newer than `step` (all, if None) to
    WORKDIR/folder; returns their steps."""
    moved = [s for s in self.all_steps() if step is None or s > step]
    for s in moved:
      self._move(s, self.workdir / folder / str(s))
    return moved

  def restore(self, abstract_state, warn: Callable[[str], None] = print):
    """(step, state) of the newest intact checkpoint, or None if there is none.

    Restores onto `abstract_state`'s shapes and shardings; a checkpoint of
    the parameters alone (`train.convert` writes them) comes back with
    opt_state None. Unreadable newer
    checkpoints are moved out of the way (to WORKDIR/unreadable_checkpoints)
    with a warning, so that training does not stop on them or overwrite them.
    """
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        with _quiet_orbax():
          self._check_shapes(step, abstract_state)
          if 'opt_state' in self._manager.item_metadata(step):
            state = self._manager.restore(
                step, args=ocp.args.StandardRestore(abstract_state))
          else:  # Parameters only (train.convert): no optimizer state yet.
            saved = self._manager.restore(step, args=ocp.args.StandardRestore(
                {'step': abstract_state.step, 'params': abstract_state.params}))
            state = abstract_state.replace(opt_state=None, **saved)
        return step, state
      except UserError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        if _transient(e):  # The files may be fine: move nothing.
          raise UserError(
              f'checkpoint step {step} in {self.directory} could not be read '
              f'({_cause(e)}), which looks like a storage fault rather than '
              'a damaged checkpoint; nothing was moved: check the disk or '
              'mount and rerun') from None
        moved = self._move_aside(step)
        warn(f'warning: checkpoint step {step} cannot be read '
             f'({_cause(e)}); moved it to {moved}, trying the one before')
    return None

  def save(self, step: int, state, *, force: bool = False) -> bool:
    if not force and step % self.every:
      return False
    if step in self._manager.all_steps():
      return False
    with self._failed_write():  # The previous save's failure shows here.
      self._manager.wait_until_finished()
      self._saving = step
      return self._manager.save(step, args=ocp.args.StandardSave(state),
                                force=True)

  def wait(self):
    """Blocks until every pending (asynchronous) save is on disk."""
    with self._failed_write():
      self._manager.wait_until_finished()
    self._saving = None

  def close(self):
    try:
      self.wait()
    finally:
      self._manager.close()

  @contextlib.contextmanager
  def _failed_write(self):
    """A failed save (a full disk, say) as one line naming the disk and the
    checkpoint kept; the partial save stays a temporary folder, which the
    next run removes. A save whose collective lost another process is no
    fault of the storage: raised as it is, for `peers.reported_as_lost_peer`."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      failed, self._saving = self._saving, None
      # The save's other coroutines, never run, would each warn at exit.
      warnings.filterwarnings('ignore', 'coroutine .* was never awaited',
                              RuntimeWarning)
      if peers.broken_connection(e) is not None:
        raise
      kept = [s for s in self.all_steps() if s != failed]
      cause = _cause(e)
      if 'RESOURCE_EXHAUSTED' in cause or 'No space left' in cause:
        cause = 'the disk is full'
      room, fix = '', ('check the bucket (its quota, your permissions, the '
                       'network)')
      if _denied(e):
        fix = f'make {self.directory} writable (or give another --workdir)'
      elif storage.is_local(self.directory):
        disk = _mount_point(self.directory)
        room = (f'; the disk at {disk} has '
                f'{shutil.disk_usage(disk).free / 1e6:,.1f} MB free')
        fix = 'free space (or give another --workdir)'
      raise UserError(
          f'could not write checkpoint step {failed} to {self.directory} '
          f'({cause[:200]}){room}; '
          + (f'the last complete checkpoint is step {max(kept)}' if kept else
             'no checkpoint was completed')
          + f'; {fix} and rerun the same command to resume') from None

  def _move_aside(self, step: int) -> epath.Path:
    return self._move(step, self.workdir / UNREADABLE_DIR / str(step))

  def _move(self, step: int, target: epath.Path) -> epath.Path:
    base, n = target, 1
    while target.exists():  # Kept from an earlier run: keep both.
      n += 1
      target = base.with_name(f'{base.name}-{n}')
    if jax.process_index() == 0:
      storage.move(self.directory / str(step), target)
    self._manager.close()
    self._manager = self._open()
    return target

  def _check_shapes(self, step, abstract_state):
    """Raises UserError naming the first array whose presence or shape
    differs between checkpoint `step` and this run's state (a config change,
    not damage: nothing is moved or written)."""
    saved = self._manager.item_metadata(step)
    ours = serialization.to_state_dict(abstract_state)
    sections = ['params'] + (['opt_state'] if 'opt_state' in saved else [])
    for section in sections:
      mismatch = first_mismatch(saved[section], ours[section])
      if mismatch:
        path, theirs, mine = mismatch
        raise UserError(
            f'{self.directory} (step {step}) holds another model: '
            f'{section}{path} is {theirs} there and {mine} here; use the '
            f'config that wrote it ({self.workdir / "config.json"}) or a '
            'new --workdir; nothing was changed')


def first_mismatch(saved, ours) -> tuple[str, str, str] | None:
  """(path, saved shape, our shape) of the first array present in only one
  of two trees, or shaped differently in them (shapes as '[2, 64, 128]' or
  'absent'); None when they agree. `saved` may be orbax metadata."""
  theirs_flat = dict(_flatten(saved))
  ours_flat = dict(_flatten(ours))
  for path in [*ours_flat, *(p for p in theirs_flat if p not in ours_flat)]:
    mine = _shape(ours_flat.get(path))
    theirs = _shape(theirs_flat.get(path))
    if mine != theirs:
      return path, theirs, mine
  return None


def save_params(workdir: str | epath.Path, params) -> None:
  """Writes WORKDIR/checkpoints/0 holding `params` alone (`train.convert`);
  `Checkpointer.restore` then returns them with opt_state None.

  Written in about no memory beyond the arrays themselves: host (numpy)
  arrays are not copied first (orbax's default, for arrays that may change
  during an asynchronous save), and chunks are not compressed (zstd holds
  every compressed chunk until the write ends: another copy, and weights
  hardly compress).
  """
  from absl import logging  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint import type_handlers  # pylint: disable=import-outside-toplevel

  def register(handler):  # Quietly: orbax warns of every override.
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    type_handlers.register_type_handler(np.ndarray, handler, override=True)
    logging.set_verbosity(verbosity)
  default = type_handlers.get_type_handler(np.ndarray)
  register(type_handlers.NumpyHandler(deepcopy_host_arrays=False))
  manager = ocp.CheckpointManager(
      storage.path(workdir) / 'checkpoints',
      options=ocp.CheckpointManagerOptions(create=True),
      item_handlers=ocp.PyTreeCheckpointHandler(use_compression=False))
  try:
    manager.save(0, args=ocp.args.PyTreeSave(
        {'step': np.int32(0), 'params': params}), force=True)
    manager.wait_until_finished()
  finally:
    manager.close()
    register(default)


def _shape(leaf) -> str:
  if leaf is None:
    return 'absent'
  return str(list(getattr(leaf, 'shape', ()) or ()))


def _flatten(tree):
  flat, _ = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, 'shape') and not isinstance(x, dict))
  # Tuples are lists in orbax's metadata and dicts in a state dict: the
  # same path either way, ['1']['0'].
  name = lambda k: str(getattr(k, 'key', getattr(k, 'idx', getattr(
      k, 'name', k))))
  return [(''.join(f'[{name(k)!r}]' for k in p), leaf) for p, leaf in flat]


# Errors of the storage rather than of the bytes read: a checkpoint that
# raises one is not moved aside as unreadable.
_TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ESTALE,
                     errno.ENETDOWN, errno.ENETUNREACH, errno.EHOSTUNREACH,
                     errno.ECONNRESET, errno.ENOMEM}


def _transient(error: BaseException) -> bool:
  """Whether `error`, or one it was raised from, is a storage fault: a
  permission, time-out, connection or I/O error."""
  while error is not None:
    if isinstance(error, (PermissionError, TimeoutError, ConnectionError,
                          InterruptedError, MemoryError)) or (
                              isinstance(error, OSError)
                              and error.errno in _TRANSIENT_ERRNOS):
      return True
    error = error.__cause__ or error.__context__
  return False


def _denied(error: BaseException) -> bool:
  """Whether `error`, or one it was raised from, is a refused write (no
  permission, a read-only file system) rather than a lack of space."""
  while error is not None:
    if isinstance(error, PermissionError) or isinstance(error, OSError) and (
        error.errno in (errno.EACCES, errno.EPERM, errno.EROFS)):
      return True
    error = error.__cause__ or error.__context__
  return False


def _cause(error: BaseException) -> str:
  """The innermost error's first line: TensorStore names the array and file."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  line = (str(error).strip().splitlines() or [type(error).__name__])[0]
  return line if len(line) <= 300 else line[:297] + '...'


@contextlib.contextmanager
def _quiet_orbax():
  """Silences the tracebacks that follow a failed read.

  Orbax reads arrays concurrently; when one read fails, it closes its event
  loop while TensorStore still completes the others, whose callbacks then
  fail on the closed loop ("Event loop is closed", printed from TensorStore's
  threads for every pending array), and the coroutines' own failures go to
  sys.unraisablehook. Both are noise after ours: closed loops ignore
  callbacks (they could only fail), and the hook is muted here. So are
  orbax's absl warnings (a checkpoint without _METADATA: 'Item "default" was
  found in the checkpoint, but could not be restored'), which would print
  before the one line that says what is wrong: absl's verbosity is ERROR
  inside, and what it was after.
  """
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  _ignore_callbacks_on_closed_loops()
  hook = sys.unraisablehook
  sys.unraisablehook = lambda _: None
  verbosity = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    yield
  finally:
    absl_logging.set_verbosity(verbosity)
    sys.unraisablehook = hook


def _mount_point(path: epath.Path) -> str:
  path = os.path.abspath(path)
  while not os.path.ismount(path):
    path = os.path.dirname(path)
  return path


class _DropOrbaxErrors(logging.Filter):
  """Orbax logs a failed background save from each of its threads, and
  asyncio each of its tasks' exceptions (a page of tracebacks);
  `Checkpointer` raises the failure itself, as one line. Nothing else in
  these processes runs asyncio."""

  def filter(self, record):
    return not (record.levelno >= logging.ERROR and (
        record.name == 'asyncio'
        or f'{os.sep}orbax{os.sep}' in record.pathname))


def _quiet_background_failures():
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel
  handler = absl_logging.get_absl_handler()
  if not any(isinstance(f, _DropOrbaxErrors) for f in handler.filters):
    handler.addFilter(_DropOrbaxErrors())
  _ignore_callbacks_on_closed_loops()


def _ignore_callbacks_on_closed_loops():
  loop_class = asyncio.BaseEventLoop
  if getattr(loop_class.call_soon_threadsafe, 'ignores_closed', False):
    return
  call = loop_class.call_soon_threadsafe

  def call_soon_threadsafe(self, *args, **kwargs):
    if self.is_closed():
      return None
    return call(self, *args, **kwargs)
  call_soon_threadsafe.ignores_closed = True
  loop_class.call_soon_threadsafe = call_soon_threadsafe


def restore_latest(workdir: str | epath.Path,
                   check: Callable[[int, dict], None] | None = None
                   ) -> tuple[int, dict]:
  """(step, saved state as a dict of arrays) of WORKDIR's latest checkpoint.

  Read-only: nothing in WORKDIR is created, moved or changed. check(step,
  metadata), if given, sees the checkpoint's metadata (shapes, dtypes)
  before any array is read, and may raise UserError to refuse it.
  """
  directory = storage.path(workdir) / 'checkpoints'
  manager = None
  if directory.is_dir():
    manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(create=False),
        item_handlers=ocp.StandardCheckpointHandler())
  step = manager and manager.latest_step()
  if step is None:
    raise UserError(f'no checkpoint in {directory} yet; train first with '
                    f'python -m train.main --workdir={workdir}')
  try:
    with _quiet_orbax():
      # Onto this process's first device, whatever devices wrote it (a
      # pod's checkpoint sampled on a laptop).
      here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      metadata = manager.item_metadata(step)
      if check and metadata is not None:  # None: restore names the fault.
        check(step, metadata)
      target = jax.tree.map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here),
          metadata)
      return step, manager.restore(step,
                                   args=ocp.args.StandardRestore(target))
  except UserError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    older = [s for s in manager.all_steps() if s < step]
    fallback = (f'to use step {max(older)}' if older else
                'and retrain (no older checkpoint)')
    raise UserError(
        f'checkpoint step {step} in {directory} cannot be read ({_cause(e)}); '
        f'move or remove {directory / str(step)} {fallback}') from None
  finally:
    manager.close()


def fingerprint(params) -> str:
  """What a checkpoint's parameters are, as 16 hex digits: the SHA-256 of
  every array's path, dtype, shape and bytes, in path order. Two
  checkpoints with the same fingerprint hold the same numbers, whatever
  their workdir, step or files; a retrained one differs. One pass over the
  bytes as loaded (about a second per 2 GB here), so a command that loads
  a model can record it beside what it made from it, and a rerun can
  refuse to mix results of two models."""
  digest = hashlib.sha256()
  for path, leaf in sorted(_flatten(params), key=lambda item: item[0]):
    array = np.ascontiguousarray(jax.device_get(leaf))
    digest.update(f'{path} {array.dtype} {array.shape};'.encode())
    digest.update(array.reshape(-1).view(np.uint8))
  return digest.hexdigest()[:16]


def load_workdir(workdir: str, flag: str = '--workdir'):
  """(ModelConfig, params, ConfigDict) of a train.main WORKDIR's latest step.

  flag: the command-line flag that named WORKDIR, for the error messages.
  """
  return load_workdir_step(workdir, flag)[:3]


def load_workdir_config(workdir: str, flag: str = '--workdir'):
  """(its path, ConfigDict, ModelConfig) of a train.main WORKDIR's
  config.json, read without the checkpoint: what a command can refuse
  before reading any array."""
  from lm import config_lib  # pylint: disable=import-outside-toplevel
  path = storage.path(workdir, flag) / 'config.json'
  if not path.parent.is_dir():
    raise UserError(f'{flag}={workdir} is not a directory; give the workdir '
                    'of a train.main run')
  if not path.exists():
    raise UserError(f'{path} not found; {flag} must be a train.main workdir '
                    'with a checkpoint')
  config = config_lib.from_json(path)
  return path, config, config_lib.model_config(config)


def load_workdir_step(workdir: str, flag: str = '--workdir'):
  """(ModelConfig, params, ConfigDict, step): `load_workdir` and the step
  its parameters were saved at. A config.json whose model's parameters are
  not the checkpoint's (edited after training) is refused in one line
  naming the first array that differs, before any array is read."""
  path, config, mc = load_workdir_config(workdir, flag)

  def check(step, saved):
    """A config.json edited after training would otherwise load the
    checkpoint as it is and build another model around it."""
    from lm import model  # pylint: disable=import-outside-toplevel
    mismatch = first_mismatch(saved['params'], model.parameter_shapes(mc))
    if mismatch:
      where, theirs, mine = mismatch
      raise UserError(
          f'{path} does not match its checkpoint at step {step}: '
          f'params{where} is {theirs} in the checkpoint, {mine} by '
          'config.json; restore the config.json the run wrote, or retrain')

  step, state = restore_latest(workdir, check)
  return mc, state['params'], config, step
