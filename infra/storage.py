"""Where a run's files live: a local folder, or a bucket (gs://BUCKET/PATH).

A workdir is an `etils.epath.Path`, pathlib's interface over the local disk
and over object stores (gs:// through gcsfs), and the path type orbax writes
checkpoints with (through TensorStore). Everything a run writes goes through
it, with two exceptions that objects impose:
  * an object cannot be appended to, so the run's logs (metrics.jsonl,
    TensorBoard events) are written to a local folder and uploaded whole
    (`Staged`): at least every `UPLOAD_SECONDS` and before each checkpoint;
  * an object cannot be flocked, so the workdir's lock is an object created
    only if absent (infra.workdir).
A GCS emulator is found through the standard STORAGE_EMULATOR_HOST (gcsfs and
google-cloud-storage read it; TensorStore is pointed at it here).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import shutil
import tempfile
import time

from etils import epath

from infra.errors import UserError, pip_install

SCHEMES = ('gs',)  # Those a workdir may have: what gcsfs and TensorStore speak.
UPLOAD_SECONDS = 30.0


def scheme(given: str | os.PathLike) -> str | None:
  """'gs' for 'gs://b/x', None for a local path."""
  name, sep, _ = str(given).partition('://')
  return name if sep and name.isidentifier() else None


def is_local(path: str | os.PathLike) -> bool:
  return scheme(path) is None


def refuse_url(given: str | os.PathLike, flag: str, *,
               supported: str = 'only --workdir (train.main, train.convert) '
                                'and --source take gs:// paths'):
  """A URL where only a local path will do: refused in one line rather than
  created as a folder named 'gs:'."""
  if scheme(given):
    raise UserError(f'{flag}={given}: {scheme(given)}:// paths are not '
                    f'supported here ({supported}); copy it to a local '
                    'folder, or mount the bucket (e.g. gcsfuse) and give the '
                    'mounted folder')


def path(given: str | os.PathLike, flag: str = '--workdir') -> epath.Path:
  """GIVEN as a path: absolute if local; a gs:// URL if gcsfs is installed.

  Any other scheme, or gs:// without gcsfs, is a UserError naming the fix."""
  kind = scheme(given)
  if kind is None:
    return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(given))))
  if kind not in SCHEMES:
    raise UserError(f'{flag}={given}: {kind}:// is not supported; give a '
                    f'local folder or a {" or ".join(SCHEMES)}:// path')
  if importlib.util.find_spec('gcsfs') is None:
    raise UserError(f'{flag}={given} needs gcsfs to reach buckets: '
                    f'{pip_install("gcs")}')
  # gcsfs logs each retry and each guess at a bucket's type with a
  # traceback; what fails in the end is one line (`bucket_fault`).
  logging.getLogger('gcsfs').setLevel(logging.CRITICAL)
  emulator = os.environ.get('STORAGE_EMULATOR_HOST')
  if emulator and 'TENSORSTORE_GCS_HTTP_URL' not in os.environ:
    # TensorStore (orbax's arrays) has its own variable for the endpoint.
    os.environ['TENSORSTORE_GCS_HTTP_URL'] = (
        emulator if '://' in emulator else f'http://{emulator}')
  return epath.Path(str(given).rstrip('/'))


# The libraries between a run and a bucket: their errors are the bucket's.
_BUCKET_LIBRARIES = ('aiohttp', 'gcsfs', 'google.auth', 'google.api_core',
                     'google.cloud', 'google.resumable_media')


def bucket_fault(error: BaseException) -> str | None:
  """The line for an error that reaching a bucket raised (no network, no
  credentials, no such bucket, no permission), or None for any other."""
  seen = error
  while seen is not None:
    if type(seen).__module__.startswith(_BUCKET_LIBRARIES):
      cause = (str(seen).strip().splitlines() or [type(seen).__name__])[0]
      return (f'could not reach the bucket ({type(seen).__name__}: '
              f'{cause[:200]}); check the network, the bucket\'s name and '
              'the credentials (gcloud auth application-default login, or '
              'the VM\'s service account), then rerun the same command')
    seen = seen.__cause__ or seen.__context__
  return None


def copy(source: epath.Path, target: epath.Path):
  """SOURCE (a file or folder) to TARGET, across local disks and buckets."""
  if source.is_dir():
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
      copy(item, target / item.name)
  elif source.exists():
    target.write_bytes(source.read_bytes())


def move(source: epath.Path, target: epath.Path):
  """SOURCE to TARGET: a rename on a disk; in a bucket, which has neither
  renames nor empty folders to rename into, a copy and a delete."""
  if is_local(source) and is_local(target):
    target.parent.mkdir(parents=True, exist_ok=True)
    source.rename(target)
  else:
    copy(source, target)
    remove(source)


def remove(target: epath.Path):
  if target.is_dir():
    target.rmtree()
  elif target.exists():
    target.unlink()


class Staged:
  """A local folder for files that grow by appending, kept in TARGET.

  For a local TARGET it is TARGET itself. For a bucket it is a temporary
  folder, seeded with TARGET's copies of `seed` (files to append to), whose
  new or changed files `upload` writes to TARGET whole.
  """

  def __init__(self, target: epath.Path, seed: tuple[str, ...] = ()):
    self.target = target
    self._uploaded = {}  # Relative name -> (size, mtime) last uploaded.
    self._last = time.monotonic()
    if is_local(target):
      self.folder = pathlib.Path(target)
      return
    self.folder = pathlib.Path(tempfile.mkdtemp(prefix='gqa-lab-staged-'))
    for name in seed:
      copy(target / name, epath.Path(self.folder / name))

  def upload(self, *, unless_recent: bool = False):
    """Writes new or changed files to TARGET; with unless_recent, only if
    the last upload is UPLOAD_SECONDS old."""
    if is_local(self.target) or (
        unless_recent and time.monotonic() - self._last < UPLOAD_SECONDS):
      return
    for file in sorted(self.folder.rglob('*')):
      name = file.relative_to(self.folder).as_posix()
      stat = file.stat()
      if file.is_file() and self._uploaded.get(name) != (
          stat.st_size, stat.st_mtime_ns):
        (self.target / name).parent.mkdir(parents=True, exist_ok=True)
        (self.target / name).write_bytes(file.read_bytes())
        self._uploaded[name] = (stat.st_size, stat.st_mtime_ns)
    self._last = time.monotonic()

  def close(self):
    try:
      self.upload()
    finally:
      if not is_local(self.target):
        shutil.rmtree(self.folder, ignore_errors=True)
