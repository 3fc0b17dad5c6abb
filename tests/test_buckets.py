"""Workdirs in a bucket (gs://), against a GCS emulator on localhost.

What these prove: the run's files (checkpoints through orbax and TensorStore,
config.json, metrics.jsonl, final.json, TensorBoard events, the tokenizer,
the lock) go to the bucket through the same calls as to a disk, a killed run
resumes from it to the losses of an unbroken one, and train.sample and
train.convert read it. What they cannot: real GCS's latency, quotas and
credentials (the emulator needs none).
"""

import json
import re
import os
import signal
import socket
import subprocess
import sys
import time

import chex
from etils import epath
import pytest

from tests import gcs_emulator
from tests.test_faults import _one_line_error, _params_and_losses, _run, REPO
from tests.test_prepare_data import _word_tokenizer
from tests.test_train import _config
from infra import errors, storage, workdir
from lm import checkpoint
from train import loop
from infra.errors import UserError
from train.metrics import read_metrics


@pytest.fixture(scope='module')
def emulator():
  with gcs_emulator.start() as url:
    yield url


@pytest.fixture
def bucket(emulator, monkeypatch, request):
  """A fresh gs:// folder, with this process pointed at the emulator."""
  for name, value in gcs_emulator.environment(emulator).items():
    monkeypatch.setenv(name, value)
  return f'gs://{gcs_emulator.BUCKET}/{request.node.name[:60]}'


def _env(emulator):
  return {**os.environ, **gcs_emulator.environment(emulator)}


def _lock_object(bucket):
  return epath.Path(bucket) / workdir.LOCK_NAME


def _holder(bucket) -> dict:
  """The lock's content in one request: gcsfs reads a size and then a range,
  which a renewal in between (a new length) can cut short."""
  from google.cloud import storage as gcs  # pylint: disable=import-outside-toplevel
  name = bucket.removeprefix(f'gs://{gcs_emulator.BUCKET}/')
  return json.loads(gcs.Client().bucket(gcs_emulator.BUCKET).blob(
      f'{name}/{workdir.LOCK_NAME}').download_as_bytes())


# The lock: an object created only if absent.

def test_a_second_run_on_a_held_bucket_workdir_is_refused_naming_the_holder(
    bucket):
  with workdir.lock(storage.path(bucket)):
    holder = _holder(bucket)
    assert holder['pid'] == os.getpid()
    with pytest.raises(UserError, match=r'in use by another run \(host .+ '
                       rf'pid {os.getpid()}\); wait for it'):
      loop.train_and_evaluate(_config(), bucket)
  assert not _lock_object(bucket).exists()  # Deleted on the way out.
  assert not (epath.Path(bucket) / 'checkpoints').exists()


@pytest.mark.parametrize('host, pid, expires_in, taken', [
    ('this', 999999, 3600, True),  # This host's process is gone.
    ('elsewhere', 1, -1, True),  # Another host's lease ran out.
    ('elsewhere', 1, 3600, False),  # Another host's run, still renewing.
])
def test_a_stale_bucket_lock_is_taken_over_and_a_live_one_refused(
    bucket, capsys, host, pid, expires_in, taken):
  host = socket.gethostname() if host == 'this' else host
  _lock_object(bucket).write_text(json.dumps({
      'holder': f'host {host} pid {pid}', 'host': host, 'pid': pid,
      'expires': time.time() + expires_in}))
  if not taken:
    with pytest.raises(UserError, match=f'in use by another run '
                       rf'\(host {host} pid {pid}\)'):
      with workdir.lock(storage.path(bucket)):
        pass
    return
  with workdir.lock(storage.path(bucket)):
    assert _holder(bucket)['pid'] == os.getpid()
  assert ('taking over the lock of a run that ended without releasing it '
          f'(host {host} pid {pid})') in capsys.readouterr().out


def test_of_two_runs_taking_over_one_stale_lock_only_one_wins(bucket,
                                                              monkeypatch):
  _lock_object(bucket).write_text(json.dumps({
      'holder': 'host elsewhere pid 1', 'host': 'elsewhere', 'pid': 1,
      'expires': 0}))
  write = workdir._ObjectLock._write  # pylint: disable=protected-access

  def other_run_first(self, if_generation_match):
    if if_generation_match:  # Between our read and our takeover.
      _lock_object(bucket).write_text('{"holder": "host other pid 2"}')
    return write(self, if_generation_match)
  monkeypatch.setattr(workdir._ObjectLock, '_write', other_run_first)  # pylint: disable=protected-access
  with pytest.raises(UserError, match='in use by another run .one that took '
                     'it over just now'):
    with workdir.lock(storage.path(bucket)):
      pass
  assert 'other' in _lock_object(bucket).read_text()  # Theirs, untouched.


def test_the_holder_renews_its_lease(bucket, monkeypatch):
  monkeypatch.setenv('GQA_LAB_LOCK_LEASE', '0.4')
  with workdir.lock(storage.path(bucket)):
    first = _holder(bucket)['expires']
    time.sleep(0.5)  # Two renewals.
    assert _holder(bucket)['expires'] > first
  assert not _lock_object(bucket).exists()
  monkeypatch.setenv('GQA_LAB_LOCK_LEASE', 'soon')
  with pytest.raises(UserError, match="GQA_LAB_LOCK_LEASE='soon' must be a "
                     'number of seconds > 0'):
    with workdir.lock(storage.path(bucket)):
      pass


# A run's files.

@pytest.mark.slow
def test_a_run_writes_every_file_to_the_bucket_and_reads_it_back(bucket,
                                                                 tmp_path):
  tokenizer, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  record = loop.train_and_evaluate(
      _config(train__steps=10, data__tokenizer=str(tokenizer)), bucket)
  root = epath.Path(bucket)
  names = {p.name for p in root.iterdir()}
  assert {'checkpoints', 'config.json', 'metrics.jsonl', 'final.json',
          'tensorboard', 'tokenizer.json'} <= names and 'lock' not in names, (
              names)
  assert (root / 'tokenizer.json').read_bytes() == tokenizer.read_bytes()
  assert [r['step'] for r in read_metrics(bucket)] == [5, 10]
  assert list((root / 'tensorboard').iterdir())
  assert json.loads((root / 'final.json').read_text())['eval_loss'] == (
      record['eval_loss'])
  assert checkpoint.restore_latest(bucket)[0] == 10
  # The tokenizer and final.json, read back from the bucket.
  again = loop.train_and_evaluate(_config(train__steps=10), bucket)
  assert again['eval_loss'] == record['eval_loss']
  model_config, _, config = checkpoint.load_workdir(bucket)
  assert model_config.num_kv_heads == 2 and config.train.steps == 10


def test_checkpoints_in_a_bucket_are_moved_aside_whole(bucket):
  # What a divergence or an unreadable checkpoint does (a bucket has no
  # rename: gcsfs copies and deletes).
  loop.train_and_evaluate(_config(train__steps=10, train__checkpoint_every=5),
                          bucket)
  checkpointer = checkpoint.Checkpointer(bucket, every=5, keep=3)
  assert checkpointer.move_after(5, loop.DIVERGED_DIR) == [10]
  assert checkpointer.all_steps() == [5]
  moved = epath.Path(bucket) / loop.DIVERGED_DIR / '10'
  assert (moved / 'commit_success.txt').exists()
  checkpointer.close()
  assert checkpoint.restore_latest(bucket)[0] == 5


def test_staged_files_are_uploaded_when_new_or_changed(bucket, monkeypatch):
  staged = storage.Staged(storage.path(bucket), seed=('log',))
  (staged.folder / 'log').write_text('1\n')
  staged.upload()
  assert (epath.Path(bucket) / 'log').read_text() == '1\n'
  with (staged.folder / 'log').open('a') as f:
    f.write('2\n')
  staged.upload(unless_recent=True)  # Too soon: nothing moves.
  assert (epath.Path(bucket) / 'log').read_text() == '1\n'
  monkeypatch.setattr(storage, 'UPLOAD_SECONDS', 0.0)
  staged.upload(unless_recent=True)
  assert (epath.Path(bucket) / 'log').read_text() == '1\n2\n'
  staged.close()
  assert not staged.folder.exists()  # The local copy is temporary.
  again = storage.Staged(storage.path(bucket), seed=('log',))  # A resume.
  assert (again.folder / 'log').read_text() == '1\n2\n'
  again.close()


@pytest.mark.slowest
@pytest.mark.slow
def test_a_bucket_run_killed_and_resumed_equals_a_local_run_and_samples(
    emulator, bucket, tmp_path):
  args = ['--config=tiny', '--config.train.steps=30',
          '--config.train.checkpoint_every=10', '--config.train.log_every=1']
  straight = _run('train.main', *args, f'--workdir={tmp_path / "local"}')
  assert straight.returncode == 0, straight.stderr[-3000:]

  env = _env(emulator)
  first = subprocess.Popen(
      [sys.executable, '-m', 'train.main', *args, f'--workdir={bucket}'],
      cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  saved = epath.Path(bucket) / 'checkpoints' / '10' / 'commit_success.txt'
  deadline = time.time() + 180
  while first.poll() is None and not saved.exists() and time.time() < deadline:
    time.sleep(0.05)
  first.send_signal(signal.SIGKILL)
  first.wait(timeout=60)
  assert first.returncode == -signal.SIGKILL, first.stderr.read()[-3000:]
  assert _lock_object(bucket).exists()  # A killed run cannot delete it.
  _settle(bucket)

  resumed = subprocess.run(
      [sys.executable, '-m', 'train.main', *args, f'--workdir={bucket}'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'taking over the lock' in resumed.stdout
  assert f'resuming from step 10 ({bucket}/checkpoints)' in resumed.stdout
  params, losses = _params_and_losses(bucket)
  local_params, local_losses = _params_and_losses(tmp_path / 'local')
  assert losses == local_losses  # Each of the 30 steps once, as unbroken.
  chex.assert_trees_all_equal(params, local_params)

  samples = [subprocess.run(
      [sys.executable, '-m', 'train.sample', f'--workdir={where}',
       '--prompt=ab', '--max_new_tokens=8', '--temperature=0'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
             for where in (bucket, tmp_path / 'local')]
  assert samples[0].returncode == 0, samples[0].stderr[-3000:]
  assert samples[0].stdout == samples[1].stdout != ''
  converted = subprocess.run(
      [sys.executable, '-m', 'train.convert', f'--source={bucket}',
       f'--workdir={bucket}-mqa', '--num_kv_heads=1'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert converted.returncode == 0, converted.stderr[-3000:]
  assert checkpoint.load_workdir(f'{bucket}-mqa')[0].num_kv_heads == 1


def _settle(bucket):
  """Waits for the writes that the killed run sent before it died: the
  emulator, serving one request at a time, may still be completing them (so
  would GCS, for the moment they take), and they would land in the resumed
  run's files."""
  import gcsfs  # pylint: disable=import-outside-toplevel
  files = gcsfs.GCSFileSystem()
  listing, previous = None, ()
  while listing != previous:
    previous = listing
    time.sleep(1.0)
    files.invalidate_cache()
    listing = files.find(bucket.removeprefix('gs://'), detail=True)


# Bad paths: one line each.

def test_a_missing_bucket_is_one_line(emulator):
  result = subprocess.run(
      [sys.executable, '-m', 'train.main', '--config=tiny',
       '--workdir=gs://no-such-bucket/run'], cwd=REPO, env=_env(emulator),
      capture_output=True, text=True, timeout=300)
  _one_line_error(result, '--workdir=gs://no-such-bucket/run cannot be '
                  'written')


def test_an_unsupported_scheme_or_a_missing_gcsfs_is_one_line(monkeypatch):
  with pytest.raises(UserError, match=r'--workdir=s3://b/run: s3:// is not '
                     r'supported; give a local folder or a gs:// path'):
    storage.path('s3://b/run')
  real = storage.importlib.util.find_spec
  monkeypatch.setattr(storage.importlib.util, 'find_spec',
                      lambda name: None if name == 'gcsfs' else real(name))
  with pytest.raises(UserError, match=re.escape(
      f'needs gcsfs to reach buckets: {errors.pip_install("gcs")}')):
    storage.path('gs://b/run')


class _Installed:
  """An importlib.metadata distribution of gqa-lab, installed editable (from
  a clone) or not."""

  def __init__(self, direct_url):
    self._direct_url = direct_url

  def read_text(self, name):
    return self._direct_url if name == 'direct_url.json' else None


def test_the_install_hint_fits_how_gqa_lab_is_installed():
  editable = _Installed('{"dir_info": {"editable": true}, '
                        '"url": "file:///home/me/gqa%20lab"}')
  assert errors.pip_install('gcs', editable) == (
      "pip install -e '/home/me/gqa lab[gcs]'")
  for wheel in (_Installed(None), _Installed('{"url": "file:///w.whl"}')):
    # The docs' form (pip install -e '.[gcs]') beside the package's.
    assert errors.pip_install('gcs', wheel) == (
        "pip install 'gqa-lab[gcs]' (in a checkout: pip install -e "
        "'.[gcs]')")


def test_only_errors_of_the_bucket_libraries_read_as_an_unreachable_bucket():
  fault = storage.bucket_fault(RuntimeError('while saving'))
  assert fault is None  # Not the bucket's: shown whole.
  import aiohttp  # pylint: disable=import-outside-toplevel
  try:
    try:
      raise aiohttp.ClientConnectionError('Cannot connect to host x:443')
    except aiohttp.ClientConnectionError as e:
      raise OSError('gcsfs gave up') from e
  except OSError as e:
    fault = storage.bucket_fault(e)
  assert fault.startswith('could not reach the bucket (ClientConnectionError:'
                          ' Cannot connect to host x:443); check the network')


@pytest.mark.slow
def test_a_bucket_that_cannot_be_reached_is_one_line():
  closed = 'http://localhost:9'  # The discard port: nothing listens.
  # gcsfs's six tries, each failure logged, without the 30 s of back-off
  # between them (its only use of asyncio), which would only wait here.
  no_backoff = ('import asyncio, types; from gcsfs import retry; '
                'retry.asyncio = types.SimpleNamespace('
                'sleep=lambda _: asyncio.sleep(0)); '
                'from train import main; main.run()')
  result = subprocess.run(
      [sys.executable, '-c', no_backoff, '--config=tiny',
       '--workdir=gs://bucket/run'], cwd=REPO,
      env={**_env(closed)}, capture_output=True, text=True, timeout=300)
  _one_line_error(result, 'could not reach the bucket (ClientConnectorError: '
                  'Cannot connect to host localhost:9')
