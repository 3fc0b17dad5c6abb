"""Faults a run must survive, and bad inputs that must be one line, not a traceback.

Each kind of failure found by trying the commands as a new user would: two
runs on one workdir, a non-finite loss during asynchronous saves, corrupted
checkpoints and metrics, out-of-range settings, non-text data, and kills at
random moments (SIGKILL, mid-save included) that must resume bit-identically.
"""

import errno
import gc
import io
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import chex
import jax
import ml_collections
import numpy as np
import pytest
from absl import logging as absl_logging

from infra import peers, signals, workdir
from lm import checkpoint, config_lib, data
from train import convert, loop, prepare_data
from train import metrics as metrics_lib
from infra import progress
from infra.cli import check_output_dir
from infra.errors import UserError
from tests.test_train import _config

REPO = pathlib.Path(__file__).parent.parent


def _run(module, *args, cwd=REPO, timeout=180, python=sys.executable):
  return subprocess.run([python, '-m', module, *args], cwd=cwd,
                        capture_output=True, text=True, timeout=timeout)


def _one_line_error(result, message):
  """The command failed with exactly one stderr line containing `message`."""
  assert result.returncode != 0, result.stdout
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], result.stderr[-3000:]
  assert 'Traceback' not in result.stdout + result.stderr


def _tmp_dirs(workdir_path):
  return [p for p in pathlib.Path(workdir_path).rglob('*') if 'tmp' in p.name
          and p.name not in ('tmp',)]


# Two runs, one workdir.

def test_a_second_run_on_a_held_workdir_is_refused_naming_the_holder(
    tmp_path):
  with workdir.lock(tmp_path):
    holder = (tmp_path / 'lock').read_text()
    assert f'pid {os.getpid()}' in holder
    with pytest.raises(UserError, match=r'in use by another run \(host .+ '
                       rf'pid {os.getpid()}\); wait for it'):
      loop.train_and_evaluate(_config(), str(tmp_path))
  assert not (tmp_path / 'metrics.jsonl').exists()  # Nothing was written.
  assert not (tmp_path / 'checkpoints').exists()
  assert (tmp_path / 'lock').read_text() == ''  # Released on the way out.


def test_a_stale_lock_of_a_dead_run_is_taken_over_with_a_note(tmp_path,
                                                              capsys):
  # What a SIGKILLed run leaves: the file, but no process holding its flock.
  (tmp_path / 'lock').write_text('host elsewhere pid 999999\n')
  loop.train_and_evaluate(_config(train__steps=5), str(tmp_path))
  out = capsys.readouterr().out
  assert 'taking over the lock of a run that ended without releasing it ' \
         '(host elsewhere pid 999999)' in out
  assert checkpoint.restore_latest(str(tmp_path))[0] == 5


def test_a_bad_lock_lease_is_refused_on_a_local_workdir_too(tmp_path,
                                                           monkeypatch):
  """GQA_LAB_LOCK_LEASE sets a bucket lock's lease; set wrong, it is refused
  wherever it is read, not ignored because this workdir is local."""
  monkeypatch.setenv('GQA_LAB_LOCK_LEASE', 'abc')
  with pytest.raises(UserError, match="GQA_LAB_LOCK_LEASE='abc' must be a "
                     r'number of seconds > 0 \(60 by default\)'):
    with workdir.lock(tmp_path):
      pass
  assert not (tmp_path / workdir.LOCK_NAME).exists()


def test_only_the_chief_process_takes_the_lock(tmp_path):
  with workdir.lock(tmp_path):
    with workdir.lock(tmp_path, enabled=False):  # Another host of the run.
      pass
    with pytest.raises(UserError, match='in use'):
      with workdir.lock(tmp_path):
        pass


# Failure paths that must not lose the last good state.

@pytest.mark.slow
def test_non_finite_loss_waits_for_saves_and_names_the_last_good_step(
    tmp_path):
  config = _config(train__learning_rate=1e12, train__checkpoint_every=1,
                   train__grad_clip=1e30, train__steps=20)
  with pytest.raises(UserError) as error:
    loop.train_and_evaluate(config, str(tmp_path))
  message = str(error.value)
  assert 'non-finite loss or gradient at step' in message
  last_good = int(message.split('last good checkpoint is step ')[1].split()[0])
  diverged = tmp_path / loop.DIVERGED_DIR
  assert not _tmp_dirs(tmp_path)  # Every save completed before the move.
  assert min(int(p.name) for p in diverged.iterdir()
             if p.name.isdigit()) == last_good + 1
  step, state = checkpoint.restore_latest(str(tmp_path))
  assert step == last_good
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state['params']))


@pytest.mark.slow
def test_a_divergence_names_the_checkpoint_from_before_the_loss_left_its_range(
    two_checkpoints, tmp_path):
  """The checkpoint saved just before the non-finite step is already a dead
  model (loss ln V): the good one is the last whose loss was in range."""
  copy = _copy(two_checkpoints, tmp_path / 'w')
  good = (copy / 'config.json').read_text()
  config = _config(train__learning_rate=1e6, train__checkpoint_every=1,
                   train__keep_checkpoints=100, train__steps=40)
  with pytest.raises(UserError) as error:
    loop.train_and_evaluate(config, str(copy))
  message = str(error.value)
  assert 'the last good checkpoint is step 20 (the ' in message, message
  assert 'with their config as config.json); rerun to resume from it with a ' \
         'lower train.learning_rate' in message
  diverged = copy / loop.DIVERGED_DIR
  moved = sorted(int(p.name) for p in diverged.iterdir() if p.name.isdigit())
  assert moved and moved[0] == 21  # Kept aside, not deleted.
  # config.json describes the checkpoints left; the failed run's config went
  # with its checkpoints, and a conversion's recipe is the good run's.
  assert (copy / 'config.json').read_text() == good
  assert config_lib.from_json(
      diverged / 'config.json').train.learning_rate == 1e6
  convert.convert_workdir(str(copy), str(tmp_path / 'mqa'), 1, 'mean')
  assert config_lib.from_json(tmp_path / 'mqa' / 'config.json'
                              ).train.learning_rate == pytest.approx(1e-3)
  step, state = checkpoint.restore_latest(str(copy))
  assert step == 20
  chex.assert_trees_all_equal(
      state, checkpoint.restore_latest(str(two_checkpoints))[1])
  # The rerun resumes there, and its history goes on from step 20.
  loop.train_and_evaluate(_config(train__steps=25), str(copy))
  steps = [m['step'] for m in metrics_lib.read_metrics(copy)]
  assert steps == [5, 10, 15, 20, 25]


@pytest.mark.parametrize('losses, step, left', [
    ([5.5, 4.0, 3.0, 3.2, 2.9], 6, 6),  # Noise stays in range: the NaN step.
    ([5.5, 3.0, 2.9, 40.0, 5.5], 6, 4),  # Left at the jump, before the NaN.
    ([5.5, 3.0, float('nan')], 9, 3),  # A NaN logged is out of range.
    ([0.02, 0.01, 0.08, 0.3], 5, 4),  # Near zero: a 0.1-nat floor.
])
def test_the_loss_leaves_its_running_range_at_the_first_jump(losses, step,
                                                             left):
  records = [{'step': i + 1, 'loss': x} for i, x in enumerate(losses)]
  assert metrics_lib.left_range_at(records, step) == left


@pytest.mark.slow
def test_a_run_failing_before_its_first_save_leaves_config_json_alone(
    tmp_path):
  loop.train_and_evaluate(_config(train__steps=10), str(tmp_path))
  before = (tmp_path / 'config.json').read_text()
  bad = _config(train__steps=20, train__learning_rate=1e12,
                train__grad_clip=1e30, train__checkpoint_every=20)
  with pytest.raises(UserError) as error:
    loop.train_and_evaluate(bad, str(tmp_path))
  # Nothing after step 10 to move aside: the line still says what to do.
  assert str(error.value).endswith(
      '; the last good checkpoint is step 10; rerun to resume from it with '
      'a lower train.learning_rate, or check the data'), str(error.value)
  assert (tmp_path / 'config.json').read_text() == before


def test_no_checkpoint_yet_is_said_so(tmp_path):
  config = _config(train__learning_rate=1e12, train__grad_clip=1e30,
                   train__steps=20, train__checkpoint_every=20)
  with pytest.raises(UserError) as error:
    loop.train_and_evaluate(config, str(tmp_path))
  message = str(error.value)
  assert message.startswith('non-finite loss or gradient at step '), message
  assert '; stopped (no checkpoint yet); ' in message, message
  assert message.endswith('; rerun with a lower train.learning_rate, or check '
                          'the data'), message


def _corrupt(step_dir: pathlib.Path, kind: str):
  default = step_dir / 'default'
  arrays = sorted(p for p in default.rglob('d/*') if p.is_file())
  if kind == 'truncated':
    for p in arrays:
      os.truncate(p, 10)
  elif kind == 'overwritten':
    for p in arrays:
      p.write_bytes(np.random.default_rng(0).bytes(p.stat().st_size))
  elif kind == 'no_metadata':
    (default / '_METADATA').unlink()
  else:  # An empty metadata file.
    (default / '_METADATA').write_text('')


@pytest.fixture(scope='module')
def two_checkpoints(tmp_path_factory):
  """A tiny run with checkpoints at steps 10 and 20."""
  path = tmp_path_factory.mktemp('two_checkpoints')
  loop.train_and_evaluate(_config(), str(path))
  assert sorted(int(p.name) for p in (path / 'checkpoints').iterdir()) == [
      10, 20]
  return path


def _copy(workdir, target):
  subprocess.run(['cp', '-r', str(workdir), str(target)], check=True)
  return target


@pytest.mark.parametrize('kind', ['truncated', 'overwritten', 'empty_metadata',
                                  'no_metadata'])
def test_reading_a_corrupt_latest_checkpoint_names_the_step_to_remove(
    two_checkpoints, tmp_path, kind):
  copy = _copy(two_checkpoints, tmp_path / 'w')
  _corrupt(copy / 'checkpoints' / '20', kind)
  verbosity = absl_logging.get_verbosity()
  with pytest.raises(UserError, match=r'checkpoint step 20 in .* cannot be '
                     r'read \(.+\); move or remove .*/checkpoints/20 to use '
                     r'step 10'):
    checkpoint.restore_latest(str(copy))
  # Orbax's warnings are muted during the read only.
  assert absl_logging.get_verbosity() == verbosity


@pytest.mark.slow
def test_a_checkpoint_without_metadata_is_one_line_from_sample_and_serve(
    two_checkpoints, tmp_path):
  """Orbax warns through absl (composite_checkpoint_handler: 'Item
  "default" was found in the checkpoint, but could not be restored') before
  our line says what to remove; the error must be the only line."""
  copy = _copy(two_checkpoints, tmp_path / 'w')
  _corrupt(copy / 'checkpoints' / '20', 'no_metadata')
  (tmp_path / 'prompts.jsonl').write_text('{"id": "a", "prompt": "ab"}\n')
  commands = [
      ['train.sample', f'--workdir={copy}', '--prompt=ab',
       '--max_new_tokens=2'],
      ['serve.generate', f'--workdir={copy}',
       f'--prompts={tmp_path / "prompts.jsonl"}',
       f'--out={tmp_path / "out.jsonl"}', '--max_new_tokens=2']]
  running = [subprocess.Popen(  # Together: each mostly imports jax.
      [sys.executable, '-m', *command], cwd=REPO, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for command in commands]
  for command, process in zip(commands, running):
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1, (command[0], stderr[-3000:])
    assert stderr.splitlines() == [
        f'error: checkpoint step 20 in {copy / "checkpoints"} cannot be read '
        '(Metadata file (named _METADATA) does not exist at '
        f'{copy / "checkpoints" / "20" / "default"}.); move or remove '
        f'{copy / "checkpoints" / "20"} to use step 10'], (command[0], stderr)


def test_train_main_falls_back_to_the_newest_intact_checkpoint(
    two_checkpoints, tmp_path, capsys):
  copy = _copy(two_checkpoints, tmp_path / 'w')
  _corrupt(copy / 'checkpoints' / '20', 'truncated')
  loop.train_and_evaluate(_config(), str(copy))
  out, err = capsys.readouterr()
  assert 'warning: checkpoint step 20 cannot be read (' in err
  assert 'resuming from step 10' in out
  # The unreadable one is kept aside, not deleted; step 20 is trained again
  # and equals the original, since a resumed run is bit-identical.
  assert (copy / checkpoint.UNREADABLE_DIR / '20' / 'default').is_dir()
  chex.assert_trees_all_equal(checkpoint.restore_latest(str(copy)),
                              checkpoint.restore_latest(str(two_checkpoints)))


@pytest.mark.parametrize('error', [
    OSError(errno.EIO, 'Input/output error'), PermissionError('denied'),
    TimeoutError('the bucket did not answer')])
def test_a_storage_fault_while_resuming_moves_nothing(
    two_checkpoints, tmp_path, monkeypatch, error):
  """A transient read error is not a damaged checkpoint: the run stops
  with one line and every checkpoint stays where it is."""
  copy = _copy(two_checkpoints, tmp_path / 'w')
  def fail(*args, **kwargs):
    raise RuntimeError('restore failed') from error
  monkeypatch.setattr(checkpoint.ocp.CheckpointManager, 'restore', fail)
  with pytest.raises(UserError, match=r'checkpoint step 20 in .* could not '
                     r'be read \(.+\), which looks like a storage fault.*'
                     'nothing was moved'):
    loop.train_and_evaluate(_config(), str(copy))
  assert sorted(p.name for p in (copy / 'checkpoints').iterdir()) == [
      '10', '20']
  assert not (copy / checkpoint.UNREADABLE_DIR).exists()


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_one_warning_line_on_stderr_and_no_traceback(
    two_checkpoints, tmp_path):
  copy = _copy(two_checkpoints, tmp_path / 'w')
  _corrupt(copy / 'checkpoints' / '20', 'truncated')
  result = _run('train.main', '--config=tiny', f'--workdir={copy}')
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith('warning: checkpoint step 20 cannot be read (')
  assert 'warning' not in result.stdout


def test_a_config_that_changes_the_model_is_refused_and_touches_nothing(
    two_checkpoints, tmp_path):
  """Not "unreadable": the checkpoints are fine, the config is not theirs.
  Refused by the table of what may change on resume, whether the change
  reshapes a parameter or not (G -> L, a window, a soft cap reshape none)."""
  copy = _copy(two_checkpoints, tmp_path / 'w')
  before = {p: p.read_bytes() for p in copy.rglob('*') if p.is_file()}
  for change, named in (
      (dict(model__attention_pattern='L', model__local_window=4),
       "model.attention_pattern 'G' -> 'L'; model.local_window None -> 4"),
      (dict(model__attention_pattern='LG', model__local_window=4),
       "model.attention_pattern 'G' -> 'LG'; model.local_window None -> 4"),
      (dict(model__logits_soft_cap=50.0),
       'model.logits_soft_cap None -> 50.0'),
      (dict(model__rope_base=500_000.0), 'model.rope_base 10000.0 -> 500000.0'),
      (dict(model__kv_share=2), 'model.kv_share 1 -> 2'),
      (dict(model__post_norms=True), 'model.post_norms False -> True'),
      (dict(model__tie_embeddings=True), 'model.tie_embeddings False -> True'),
      (dict(model__num_kv_heads=1), 'model.num_kv_heads 2 -> 1')):
    with pytest.raises(UserError, match=re.escape(
        f'{copy} holds another model: its checkpoints have {named}, which '
        'cannot change on resume; use a new --workdir')):
      loop.train_and_evaluate(_config(train__steps=30, **change), str(copy))
  after = {p: p.read_bytes() for p in copy.rglob('*') if p.is_file()}
  assert after == before  # metrics.jsonl, config.json, final.json included.
  # Without config.json (a workdir from before it was written), the
  # checkpoint's own shapes still refuse a reshaping change.
  (copy / 'config.json').unlink()
  with pytest.raises(UserError, match=re.escape(
      f'{copy / "checkpoints"} (step 20) holds another model: '
      "params['unembed']['kernel'] is [32, 256] there and absent here")):
    loop.train_and_evaluate(_config(train__steps=30, model__tie_embeddings=True
                                    ), str(copy))
  assert not (copy / checkpoint.UNREADABLE_DIR).exists()


def test_resume_allows_only_the_fields_of_its_table():
  """RESUME_MAY_CHANGE: each of its fields may change on resume; any other,
  a field the saved config lacks included, is refused, naming it."""
  saved = _config()
  fields = config_lib._leaves(saved.to_dict())  # pylint: disable=protected-access
  assert set(config_lib.RESUME_MAY_CHANGE) <= set(fields)  # No stale names.

  def changed(name):
    tree = saved.to_dict()
    *sections, field = name.split('.')
    target = tree
    for section in sections:
      target = target[section]
    target[field] = 'other'
    return ml_collections.ConfigDict(tree)
  for name in config_lib.RESUME_MAY_CHANGE:
    config_lib.check_resume(saved, changed(name), 'W')
  for name in ('model.local_window', 'model.norm_eps', 'model.param_dtype',
               'model.rope_scaling.factor', 'model.final_logits_soft_cap',
               'model.query_pre_attn_scalar', 'model.scan_layers',
               'model.qk_norm', 'data.new_field'):
    with pytest.raises(UserError, match=re.escape(
        f'W holds another model: its checkpoints have {name} ')):
      config_lib.check_resume(saved, changed(name), 'W')


def test_sample_and_convert_refuse_a_corrupt_checkpoint_in_one_line(
    two_checkpoints, tmp_path):
  copy = _copy(two_checkpoints, tmp_path / 'w')
  _corrupt(copy / 'checkpoints' / '20', 'empty_metadata')
  _one_line_error(_run('train.sample', f'--workdir={copy}'),
                  'checkpoint step 20 in')
  _one_line_error(_run('train.convert', f'--source={copy}',
                       f'--workdir={tmp_path / "new"}', '--num_kv_heads=1'),
                  'move or remove')


def test_a_partial_last_metrics_line_is_dropped_on_resume(tmp_path):
  config = _config(train__checkpoint_every=10)
  calls = []
  loop.train_and_evaluate(config, str(tmp_path),
                          should_stop=lambda: calls.append(1) or len(calls) == 10)
  with (tmp_path / 'metrics.jsonl').open('a') as f:
    f.write('{"step": 11, "loss": 2.')  # A kill in the middle of a write.
  assert [m['step'] for m in metrics_lib.read_metrics(tmp_path)] == [5, 10]
  loop.train_and_evaluate(config, str(tmp_path))
  assert [m['step'] for m in metrics_lib.read_metrics(tmp_path)] == [5, 10, 15, 20]


def test_eta_counts_step_times_not_compilation(tmp_path, capsys):
  reporter = metrics_lib.MetricsWriter(str(tmp_path), 100)
  reporter.interactive = False  # Plain lines, as in a log.
  time.sleep(0.5)  # As if compiling: must not count.
  reporter.log(10, {'loss': 1.0, 'tokens_per_sec': 1.0, 'mfu': 0.1,
                    'step_time': 0.1})
  reporter.close()
  assert 'ETA 0:09' in capsys.readouterr().out


# Progress on long operations.

class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_progress_in_a_log_is_a_line_at_the_end_or_every_so_often():
  quiet, chatty = io.StringIO(), io.StringIO()
  for stream, every in ((quiet, 30.0), (chatty, 0.0)):
    with progress.Progress('reading', 4e6, unit='MB', scale=1e6,
                           every=every, stream=stream) as bar:
      for _ in range(4):
        bar.advance(1e6)
  lines = quiet.getvalue().splitlines()
  assert len(lines) == 1 and lines[0].startswith('reading  4.0/4.0 MB  ')
  assert 'MB/s  elapsed 0:00  ETA 0:00' in lines[0]
  assert len(chatty.getvalue().splitlines()) == 5  # Each step, and the end.


def test_progress_on_a_terminal_is_one_line_redrawn_with_a_bar():
  terminal = _Terminal()
  with progress.Progress('runs', 4, stream=terminal) as bar:
    bar.advance(2)
  assert '\r\033[K[##########..........] runs  2/4  elapsed' in (
      terminal.getvalue())
  assert terminal.getvalue().endswith('\n')


def test_a_failed_operation_leaves_its_error_the_only_line():
  log = io.StringIO()
  with pytest.raises(UserError):
    with progress.Progress('reading', 10, stream=log) as bar:
      bar.advance(3)
      raise UserError('bad input')
  assert log.getvalue() == ''


def test_study_runs_announce_their_number_elapsed_and_eta():
  out = io.StringIO()
  seen = list(progress.runs(['a', 'b', 'c'], str.upper, stream=out))
  assert seen == ['a', 'b', 'c']
  lines = out.getvalue().splitlines()
  assert lines[0] == '=== run 1 of 3: A (elapsed 0:00, ETA ?)'
  assert lines[2].startswith('=== run 3 of 3: C (elapsed 0:00, ETA 0:00')


def test_a_reused_run_is_announced_as_reused_not_as_trained():
  """A resumed study printed its reused runs as if it trained them ("run 1
  of 14 ... elapsed 0:00"), and counted them in its ETA."""
  out = io.StringIO()
  list(progress.runs(['a', 'b', 'c'], str.upper, stream=out,
                     reused=lambda item: item != 'c'))
  assert out.getvalue().splitlines() == [
      '=== run 1 of 3: A: reused (finished before)',
      '=== run 2 of 3: B: reused (finished before)',
      '=== run 3 of 3: C (elapsed 0:00, ETA ?)']


# Settings that train wrongly must be refused, one line each.

@pytest.mark.parametrize('field, value, message', [
    ('train__grad_clip', -1.0, 'train.grad_clip=-1.0 must be a number > 0'),
    ('train__learning_rate', float('nan'), 'train.learning_rate=nan'),
    ('train__b1', 1.0, 'train.b1=1.0 must be a number >= 0 and < 1'),
    ('train__b2', -0.5, 'train.b2=-0.5'),
    ('train__weight_decay', -0.1, 'train.weight_decay=-0.1 must be'),
    ('train__min_learning_rate_ratio', 2.0, 'min_learning_rate_ratio=2.0'),
    ('train__warmup_steps', -1, 'train.warmup_steps=-1'),
    ('model__local_window', 0, 'model.local_window=0 must be an integer >= 1'),
    ('model__logits_soft_cap', 0.0, 'model.logits_soft_cap=0.0'),
    ('model__rope_base', 0.5, 'model.rope_base=0.5'),
    ('data__val_fraction', 1.0, 'data.val_fraction=1.0'),
])
def test_out_of_range_settings_are_refused(field, value, message):
  with pytest.raises(UserError, match=message.replace('.', r'\.')):
    config_lib.validate(_config(**{field: value}), batch_shards=1)


# Data that is not what it seems.

def test_binary_files_are_not_trained_on_as_text(tmp_path):
  noise = tmp_path / 'noise.txt'
  noise.write_bytes(np.random.default_rng(0).bytes(100_000))
  with pytest.raises(UserError, match='noise.txt is not text'):
    data.load(str(noise), val_fraction=0.1, seq_len=32)
  folder = tmp_path / 'docs'
  folder.mkdir()
  (folder / 'a.txt').write_text('plain text, café ' * 500)
  (folder / 'figure.png').write_bytes(b'\x89PNG\r\n\x1a\n\0\0\0\rIHDR' * 100)
  with pytest.raises(UserError, match='figure.png is not text'):
    data.load(str(folder), val_fraction=0.1, seq_len=32)
  (folder / 'figure.png').unlink()
  assert data.load(str(folder), val_fraction=0.1, seq_len=32).vocab_size == 256


def test_a_token_file_in_a_text_folder_is_named_as_such(tmp_path):
  (tmp_path / 'a.txt').write_text('plain text ' * 100)
  np.arange(100, dtype=np.uint16).tofile(tmp_path / 'b.bin')
  with pytest.raises(UserError, match=re.escape(
      f'{tmp_path / "b.bin"} is a token file inside a folder of text; '
      'data.path takes one .bin file, a folder with train.bin and val.bin')):
    data.load(str(tmp_path), val_fraction=0.1, seq_len=32)


def test_every_token_id_is_checked_not_only_the_first_ten_million(tmp_path):
  tokens = np.zeros(10_000_050, np.uint16)
  tokens[-3] = 4000  # In the held-out tail, past the first 10M.
  tokens.tofile(tmp_path / 'tokens.bin')
  loaded = data.load(str(tmp_path / 'tokens.bin'), val_fraction=0.01,
                     seq_len=32)
  assert loaded.vocab_size == 4001
  with pytest.raises(UserError, match='has token ids up to 4000; set '
                     'model.vocab_size >= 4001'):
    loop.train_and_evaluate(_config(data__path=str(tmp_path / 'tokens.bin')),
                            str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()


def test_bytes_are_refused_for_a_model_whose_vocabulary_is_not_256(tmp_path):
  with pytest.raises(UserError, match=r'read as UTF-8 bytes \(256 ids\), but '
                     r'model.vocab_size=4096: give the model\'s tokenizer'):
    loop.train_and_evaluate(_config(model__vocab_size=4096),
                            str(tmp_path / 'w'))


def test_building_the_corpus_cache_says_so(tmp_path, capsys):
  data.load('', val_fraction=0.1, seq_len=32, cache_dir=str(tmp_path))
  assert 'building the embedded corpus from ' in capsys.readouterr().err
  data.load('', val_fraction=0.1, seq_len=32, cache_dir=str(tmp_path))
  assert capsys.readouterr().err == ''  # Once.


def test_an_unreadable_metrics_line_before_the_last_is_an_error(tmp_path):
  (tmp_path / 'metrics.jsonl').write_text(
      '{"step": 5, "loss": 2.0}\n{"step": 10, "lo\n{"step": 15, "loss": 1.0}\n')
  with pytest.raises(UserError, match='metrics.jsonl line 2 is not JSON'):
    metrics_lib.read_metrics(tmp_path)


def test_a_folder_reached_through_a_dotted_path_is_read(tmp_path, monkeypatch):
  corpus = tmp_path / '.local' / 'corpus'
  corpus.mkdir(parents=True)
  (corpus / 'a.txt').write_text('hello world ' * 100)
  (corpus / '.hidden.txt').write_text('secret ' * 100)  # Skipped.
  monkeypatch.chdir(corpus / '..')
  for path in (str(corpus), '../.local/corpus'):
    loaded = data.load(path, val_fraction=0.1, seq_len=32)
    assert len(loaded.train) + len(loaded.val) == 1200


def test_a_folder_named_like_a_config_does_not_shadow_it(tmp_path,
                                                         monkeypatch, capsys):
  """--config=tiny is configs/tiny.py, said so when a folder tiny/ (a
  workdir of that name) is here; --config=./tiny is the folder."""
  (tmp_path / 'tiny').mkdir()
  (tmp_path / 'tiny' / 'config.json').write_text('{"train": {"steps": 7}}')
  monkeypatch.chdir(tmp_path)
  assert config_lib.resolve(['--config=tiny']) == [
      f'--config={config_lib.CONFIG_DIR / "tiny.py"}']
  assert config_lib.load('tiny').train.steps == 20
  assert capsys.readouterr().err.splitlines()[0] == (
      'note: --config=tiny is the config configs/tiny.py, not the folder '
      'tiny/ here (for that, --config=./tiny)')
  assert config_lib.load('./tiny').train.steps == 7
  assert capsys.readouterr().err == ''


# Commands that must answer in one line.

def _scripts(*args):
  return [sys.executable, '-m', *args]


@pytest.mark.parametrize('module, args, message', [
    ('train.main', ['--config=tiny', '--config.train.stepz=3'],
     """unknown config field 'stepz' in --config.train.stepz (Did you mean "steps" instead of "stepz"?);"""),
    ('train.main', ['--config=tiny', '--config.model.local_window=0'],
     'model.local_window=0 must be'),
    ('train.convert', ['--num_kv_heads=1'],
     'give one of --source (a workdir) or --from_hf'),
    ('scripts.compile_time', ['--layers=abc'],
     "argument --layers: 'abc' is not a comma-separated list"),
    ('scripts.compare', ['--out=OUT', '--kv_heads=3'],
     'model.num_heads=8 is not divisible by model.num_kv_heads=3'),
    ('scripts.bench_decode', ['--kv_heads=8,0'], 'argument --kv_heads'),
    ('scripts.bench_decode', ['--config=nope'], "unknown config 'nope'"),
    ('scripts.bench_decode', ['--variants=K2,GQA3'],
     "argument --variants: 'GQA3' is not a variant; give K<k> (GQA"),
    ('scripts.bench_decode', ['--variants=GLA48g3'],
     '--variants=GLA48g3: model.mla.latent_groups=3 must divide num_heads=8 '
     'and mla.kv_lora_rank=48'),
    ('scripts.bench_decode', ['--variants=K2', '--kv_heads=2'],
     '--kv_heads and --variants: give one'),
    ('scripts.bench_decode', ['--variants=K2,GTA2', '--equal_params'],
     '--equal_params with --variants=GTA2: it widens the MLP'),
    ('scripts.bench_decode', ['--layer', '--variants=K2'],
     '--variants: not used with --layer'),
    ('scripts.bench_decode', ['--layer', '--kv_heads=16,3'],
     '--kv_heads=3: the layer has N=16 query heads; give divisors of 16'),
    ('scripts.bench_decode', ['--layer', '--config=gqa_small'],
     '--config: not used with --layer'),
    ('scripts.bench_decode', ['--layer', '--equal_params'],
     '--equal_params: not used with --layer'),
    ('scripts.bench_decode', ['--layer', '--llama_cpp'],
     '--llama_cpp: not used with --layer'),
    ('scripts.bench_train', ['--rounds=0'], 'argument --rounds'),
    ('scripts.bench_train', ['--configs=gqa_small,nope'],
     "unknown config 'nope'"),
    ('scripts.uptrain_study', ['--out=OUT', '--recall_steps=0'],
     'argument --recall_steps'),
    ('scripts.uptrain_study', ['--out=OUT', '--config=tiny', '--kv_heads=3'],
     "--kv_heads=3: give divisors of the source's 4 query heads below 4"),
    ('scripts.bench_attention', ['--lengths=0'], 'argument --lengths'),
    ('scripts.recall_sweep', ['--out=OUT', '--config=tiny'],
     'the sweep needs a recall config'),
    ('scripts.recall_sweep', ['--out=OUT', '--kv_heads=8,3'],
     'model.num_heads=8 is not divisible by model.num_kv_heads=3'),
    ('scripts.recall_sweep', ['--out=OUT', '--d_model=-1'], '--d_model=-1'),
    ('scripts.make_hf_model', ['--out=OUT', '--num_heads=8',
                               '--num_kv_heads=3'],
     '--num_heads=8 is not divisible by --num_kv_heads=3'),
    ('train.main', ['--config=CONFIGS/syntax.py'],
     "syntax.py, line 2: '(' was never closed; fix the config file"),
    ('train.main', ['--config=CONFIGS/no_get_config.py'],
     'no_get_config.py defines no get_config()'),
])
@pytest.mark.slow
def test_bad_command_lines_are_one_line(tmp_path, module, args, message):
  configs = tmp_path / 'configs'
  configs.mkdir()
  (configs / 'syntax.py').write_text('def get_config():\n  return (\n')
  (configs / 'no_get_config.py').write_text('x = 1\n')
  args = [a.replace('OUT', str(tmp_path / 'out')).replace('CONFIGS',
                                                          str(configs))
          for a in args]
  if module in ('train.main', 'train.convert'):
    args.append(f'--workdir={tmp_path / "w"}')
  _one_line_error(_run(module, *args), message)
  assert not (tmp_path / 'out').exists()
  assert not (tmp_path / 'w').exists()  # A refused run leaves no workdir.


@pytest.mark.slow
@pytest.mark.parametrize('module, args', [
    ('scripts.bench_decode', ['--kv_heads=1', '--batches=1',
                              '--contexts=8']),
    ('scripts.accelerator_check', ['--quick']),
    ('scripts.make_hf_model', []),
])
def test_an_output_that_cannot_take_results_is_refused_before_the_work(
    tmp_path, module, args):
  a_file = tmp_path / 'results'
  a_file.write_text('')
  _one_line_error(_run(module, f'--out={a_file}', *args),
                  f'--out={a_file} is a file')
  if module != 'scripts.bench_decode':  # Reruns would report old numbers.
    used = tmp_path / 'used'
    used.mkdir()
    (used / 'accelerator.json').write_text('{}')
    _one_line_error(_run(module, f'--out={used}', *args),
                    f'--out={used} already holds results')
    assert [p.name for p in used.iterdir()] == ['accelerator.json']


def test_accelerator_check_without_the_tests_says_so_and_goes_on(
    tmp_path, monkeypatch):
  from scripts import accelerator_check  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(accelerator_check, 'REPO', tmp_path)  # As installed.
  tests = accelerator_check.run_tests(quick=True)
  assert tests['returncode'] == 0
  assert tests['summary'].startswith(f'skipped: no tests in {tmp_path}')


@pytest.mark.slow
def test_bad_workdirs_are_one_line_before_any_work(trained, tmp_path):
  a_file = tmp_path / 'a_file'
  a_file.write_text('')
  _one_line_error(_run('train.main', '--config=tiny', f'--workdir={a_file}'),
                  'is a file, not a directory')
  _one_line_error(_run('train.main', '--config=tiny', '--workdir=/proc/x/y'),
                  'cannot be written')
  _one_line_error(_run('train.convert', f'--source={trained}',
                       f'--workdir={a_file}', '--num_kv_heads=1'),
                  'is a file, not a directory')
  _one_line_error(_run('train.convert', f'--source={tmp_path / "nope"}',
                       f'--workdir={tmp_path / "new"}', '--num_kv_heads=1'),
                  f'--source={tmp_path / "nope"} is not a directory')
  _one_line_error(_run('train.sample', f'--workdir={trained}', '--top_k=257',
                       '--max_new_tokens=5'),
                  '--top_k=257 must be an integer in 0..256')


@pytest.mark.parametrize('flag, message', [
    ('--temperature=nan', '--temperature=nan must be a number >= 0'),
    ('--temperature=inf', '--temperature=inf must be a number >= 0'),
    ('--max_new_tokens=0', '--max_new_tokens=0 must be >= 1'),
    ('--seed=-1', '--seed=-1 must be an integer in 0..2**32 - 1'),
    (b'--prompt=caf\xe9', '--prompt is not valid UTF-8 text'),  # Latin-1.
])
def test_every_sampling_flag_is_range_checked(trained, flag, message):
  result = subprocess.run(
      [sys.executable.encode(), b'-m', b'train.sample',
       f'--workdir={trained}'.encode(),
       flag if isinstance(flag, bytes) else flag.encode()],
      cwd=REPO, capture_output=True, timeout=180)
  result.stdout, result.stderr = (result.stdout.decode(errors='replace'),
                                  result.stderr.decode(errors='replace'))
  _one_line_error(result, message)
  assert '\0' not in result.stdout


def test_an_exact_copy_is_called_one(trained, tmp_path):
  result = _run('train.convert', f'--source={trained}',
                f'--workdir={tmp_path / "copy"}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == (f'wrote {tmp_path / "copy"}: 2 KV heads, '
                                   'copied unchanged')


def test_object_store_paths_are_refused_not_made_into_folders(tmp_path,
                                                             monkeypatch):
  # gs:// workdirs and --source are supported (tests/test_buckets.py); any
  # other scheme there, and any URL where only a local path will do, is
  # refused in one line.
  monkeypatch.chdir(tmp_path)
  with pytest.raises(UserError, match='--workdir=s3://bucket/run: s3:// is '
                     'not supported; give a local folder or a gs:// path'):
    loop.train_and_evaluate(_config(), 's3://bucket/run')
  with pytest.raises(UserError, match='data.path=s3://b/corpus: s3://'):
    data.load('s3://b/corpus', val_fraction=0.1, seq_len=8)
  url = 'gs://bucket/x'
  for call, flag in [
      (lambda: convert.import_hf(url, 'w'), '--from_hf'),
      (lambda: convert.export_hf(str(tmp_path), url), '--to_hf'),
      (lambda: prepare_data.prepare(['embedded'], url, 'c'), '--tokenizer'),
      (lambda: prepare_data.prepare([url], 'tok.json', 'c'), '--input'),
      (lambda: prepare_data.prepare(['embedded'], 'tok.json', url), '--out'),
      (lambda: check_output_dir(url), '--out'),  # Every script's.
      (lambda: config_lib.resolve([f'--config={url}']), '--config')]:
    with pytest.raises(UserError, match=f'{flag}={url}: gs:// paths are not '
                       r'supported here \(only --workdir'):
      call()
  assert not list(tmp_path.iterdir())  # No folder named 'gs:'.


def test_sample_leaves_the_workdir_it_reads_untouched(trained, tmp_path):
  only_config = tmp_path / 'w'
  only_config.mkdir()
  (only_config / 'config.json').write_text(
      (trained / 'config.json').read_text())
  _one_line_error(_run('train.sample', f'--workdir={only_config}'),
                  'no checkpoint in')
  assert [p.name for p in only_config.iterdir()] == ['config.json']


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_a_rerun_resumes(tmp_path):
  """A 600 KB tmpfs holds the checkpoint of step 10 but not step 20's."""
  if os.geteuid() != 0 or not shutil.which('unshare'):
    pytest.skip('mounting a small tmpfs needs root and unshare')
  disk, logs = tmp_path / 'disk', tmp_path / 'logs'
  disk.mkdir()
  logs.mkdir()
  train = f'{sys.executable} -m train.main --config=tiny --workdir={disk}/run'
  script = (f'mount -t tmpfs -o size=600k tmpfs {disk} || exit 99; '
            f'{train} >{logs}/out1 2>{logs}/err1; echo $? >{logs}/rc1; '
            f'mount -o remount,size=20m {disk}; '
            f'{train} >{logs}/out2 2>{logs}/err2; echo $? >{logs}/rc2')
  run = subprocess.run(['unshare', '--mount', 'sh', '-c', script], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
  if run.returncode == 99 or not (logs / 'rc1').exists():
    pytest.skip(f'no tmpfs can be mounted here: {run.stderr.strip()}')
  full = subprocess.CompletedProcess(
      [], int((logs / 'rc1').read_text()), (logs / 'out1').read_text(),
      (logs / 'err1').read_text())
  _one_line_error(full, 'could not write checkpoint step 20 to ')
  assert f'(the disk is full); the disk at {disk} has' in full.stderr
  assert 'the last complete checkpoint is step 10; free space' in full.stderr
  assert (logs / 'rc2').read_text().strip() == '0', (logs / 'err2').read_text()
  assert 'resuming from step 10' in (logs / 'out2').read_text()


@pytest.mark.slow
def test_a_read_only_checkpoints_folder_is_one_line_about_permission(
    trained, tmp_path):
  """Refused before training; and a save refused later (the folder made
  read-only mid-run: the check bypassed here) is one line too, saying to
  make it writable, not to free space, with no warning after it."""
  if os.geteuid() != 0 or not shutil.which('unshare'):
    pytest.skip('a read-only bind mount needs root and unshare')
  work, logs = _copy(trained, tmp_path / 'w'), tmp_path / 'logs'
  logs.mkdir()
  args = f'--config=tiny --workdir={work} --config.train.steps=30'
  bypass = ('import sys; from lm import checkpoint; from train import main; '
            'checkpoint.Checkpointer._check_writable = lambda self: None; '
            'main.run()')
  ckpts = work / 'checkpoints'
  script = (f'mount --bind {ckpts} {ckpts} && '
            f'mount -o remount,bind,ro {ckpts} || exit 99; '
            f'{sys.executable} -m train.main {args} >{logs}/out1 '
            f'2>{logs}/err1; echo $? >{logs}/rc1; '
            f'{sys.executable} -c "{bypass}" {args} >{logs}/out2 '
            f'2>{logs}/err2; echo $? >{logs}/rc2')
  # Both runs end well within orbax's 5-minute wait for a save's folders,
  # where a save refused in the background left the process after its
  # error (lm.checkpoint makes the folders before save() returns).
  run = subprocess.run(['unshare', '--mount', 'sh', '-c', script], cwd=REPO,
                       capture_output=True, text=True, timeout=240)
  if run.returncode == 99 or not (logs / 'rc1').exists():
    pytest.skip(f'no read-only bind mount here: {run.stderr.strip()}')
  result = lambda n: subprocess.CompletedProcess(
      [], int((logs / f'rc{n}').read_text()), (logs / f'out{n}').read_text(),
      (logs / f'err{n}').read_text())
  _one_line_error(result(1), f'{ckpts} cannot be written (Read-only file '
                  'system); make it writable, or give another --workdir')
  _one_line_error(result(2), f'could not write checkpoint step 30 to {ckpts}')
  assert (f'the last complete checkpoint is step 20; make {ckpts} writable '
          '(or give another --workdir)') in result(2).stderr
  assert 'free' not in result(2).stderr


# Installed, not run from the repository.

@pytest.mark.slowest
@pytest.mark.slow
def test_installed_package_runs_from_any_directory(tmp_path, monkeypatch):
  """pip install . (not -e) into a fresh venv; the README's commands elsewhere.

  The new venv sees this one's dependencies through a .pth file, so the test
  needs no network; gqa-lab itself comes only from the wheel it builds (a
  PYTHONPATH naming a checkout would hide it: left out).
  """
  monkeypatch.delenv('PYTHONPATH', raising=False)
  venv = tmp_path / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', str(venv)], check=True)
  python = str(venv / 'bin' / 'python')
  site = subprocess.run([python, '-c', 'import site; print('
                         'site.getsitepackages()[0])'], check=True,
                        capture_output=True, text=True).stdout.strip()
  deps = [p for p in sys.path if p.endswith('site-packages')]
  pathlib.Path(site, 'deps.pth').write_text('\n'.join(deps) + '\n')
  install = subprocess.run([python, '-m', 'pip', 'install', '-q', '--no-deps',
                            str(REPO)], capture_output=True, text=True,
                           timeout=300)
  assert install.returncode == 0, install.stderr[-3000:]
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  where = subprocess.run([python, '-c', 'import train, configs, scripts, '
                          'studies.kv_frontier.tables; print(train.__file__, '
                          'configs.__file__, studies.__file__)'],
                         cwd=elsewhere, capture_output=True, text=True)
  assert where.stdout.count(site) == 3, where.stdout + where.stderr
  result = _run('train.main', '--config=tiny', '--workdir=run',
                '--config.train.steps=4', '--config.train.warmup_steps=1',
                cwd=elsewhere, python=python)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'done: step 4' in result.stdout
  # A script run as a file finds its package (here: the refusal's one line).
  as_file = subprocess.run([python, str(REPO / 'scripts' / 'compile_time.py'),
                            '--layers=x'], cwd=elsewhere, capture_output=True,
                           text=True)
  _one_line_error(as_file, 'argument --layers')


# Kills at random moments.

def _params_and_losses(workdir_path):
  metrics = metrics_lib.read_metrics(workdir_path)
  steps = [m['step'] for m in metrics]
  assert steps == sorted(set(steps)), 'a step was logged twice'
  losses = [(m['step'], m['loss'], m.get('eval_loss')) for m in metrics]
  return checkpoint.restore_latest(str(workdir_path))[1]['params'], losses


@pytest.mark.slowest
@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_a_straight_run(
    tmp_path):
  args = ['--config=tiny', '--config.train.steps=60',
          '--config.train.checkpoint_every=4', '--config.train.log_every=1',
          '--config.train.eval_every=20', '--config.train.keep_checkpoints=2']
  straight = _run('train.main', *args, f'--workdir={tmp_path / "straight"}')
  assert straight.returncode == 0, straight.stderr[-3000:]

  killed = tmp_path / 'killed'
  rng = random.Random(0)
  moments = ['mid-save', 'after-steps', 'mid-save']
  for moment in moments:
    proc = subprocess.Popen(
        [sys.executable, '-m', 'train.main', *args, f'--workdir={killed}'],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = killed / 'metrics.jsonl'
    logged = lambda: len(metrics.read_text().splitlines()) if (
        metrics.exists()) else 0
    start = logged()
    target = rng.randint(1, 6)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
      if moment == 'mid-save' and logged() > start and list(
          (killed / 'checkpoints').glob('*tmp*')):
        break
      if moment == 'after-steps' and logged() >= start + target:
        time.sleep(rng.uniform(0, 0.02))
        break
      time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    # Killed, not finished: each attempt runs at most a few of the 60 steps.
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]

    # The killed run could not release its lock: the next start takes it
    # over (test_a_stale_lock_of_a_dead_run_is_taken_over_with_a_note).
    assert (killed / 'lock').read_text().startswith('host ')

  resumed = _run('train.main', *args, f'--workdir={killed}')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  params, losses = _params_and_losses(killed)
  straight_params, straight_losses = _params_and_losses(tmp_path / 'straight')
  chex.assert_trees_all_equal(params, straight_params)
  assert losses == straight_losses
  assert not _tmp_dirs(killed / 'checkpoints')


@pytest.mark.slow
def test_a_second_train_main_on_a_running_workdir_is_refused_at_once(
    tmp_path):
  args = ['--config=tiny', f'--workdir={tmp_path}',
          '--config.train.steps=100000', '--config.train.log_every=1']
  first = subprocess.Popen([sys.executable, '-m', 'train.main', *args],
                           cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 120
    while not (tmp_path / 'metrics.jsonl').exists() and time.time() < deadline:
      time.sleep(0.05)
    second = _run('train.main', *args)
    _one_line_error(second, 'is in use by another run (host ')
    assert f'pid {first.pid})' in second.stderr
    assert first.poll() is None  # The first run goes on, untouched.
  finally:
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 128 + signal.SIGTERM
  steps = [m['step'] for m in metrics_lib.read_metrics(tmp_path)]
  assert steps == sorted(set(steps))


def test_a_bad_heartbeat_timeout_is_one_line_before_any_process_starts(
    tmp_path):
  env = {**os.environ, 'JAX_COORDINATOR_ADDRESS': 'localhost:1',
         'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '0',
         'GQA_LAB_HEARTBEAT_TIMEOUT': 'soon'}
  result = subprocess.run(
      [sys.executable, '-m', 'train.main', '--config=tiny',
       f'--workdir={tmp_path / "w"}'], cwd=REPO, env=env, capture_output=True,
      text=True, timeout=60)
  _one_line_error(result, "GQA_LAB_HEARTBEAT_TIMEOUT='soon' must be a whole "
                  'number of seconds >= 1')
  assert not (tmp_path / 'w').exists()


LOST_DUMP = [
    'E1201 07:50:57.790475 28789 coordination_service.cc:1549] Use error '
    'polling to propagate the following error to all tasks: UNAVAILABLE: The '
    'following tasks are unhealthy (stopped sending heartbeats):', '1',
    'F1201 07:50:57.791158 28800 client.h:80] Terminating process because the '
    'JAX distributed service detected fatal errors.',
    '*** Check failure stack trace: ***', 'Fatal Python error: Aborted']


LOST_LINE = ('error: process 1 of this run stopped answering (killed, '
             'crashed, or its host is down), so this process stopped too '
             '(after 30 s without its heartbeats); rerun the same command on '
             'every host to resume from the start')
# The error of a save whose collective the lost peer broke, as the survivor
# printed it seconds before the runtime's abort (a full suite run).
GLOO_RESET = ('UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/'
              'tcp/pair.cc:538] Read error [127.0.0.1]:5339: Connection reset '
              'by peer')


@pytest.mark.parametrize('lines, end, status, expected', [
    (['step 5 ...', *LOST_DUMP], 'abort', 1, ['step 5 ...', LOST_LINE]),
    # The peer lost mid-save: the save's line, then the abort. The lost
    # peer is the cause and the one line (both were printed).
    (['step 20 ...', f'error: could not write checkpoint step 20 to /w/'
      f'checkpoints ({GLOO_RESET}); the disk at / has 78,607.5 MB free; the '
      'last complete checkpoint is step 10; free space (or give another '
      '--workdir) and rerun the same command to resume', *LOST_DUMP],
     'abort', 1, ['step 20 ...', LOST_LINE]),
    (['step 20 ...', 'Traceback (most recent call last):', '  File "x.py"',
      f'jax.errors.JaxRuntimeError: {GLOO_RESET}', *LOST_DUMP], 'abort', 1,
     ['step 20 ...', LOST_LINE]),
    # A coordination warning, then another error: both shown as they were.
    (['W1201 preemption_sync_manager.cc:147] coordination service note',
      'error: model.num_heads=4 is not divisible'], '1', 1,
     ['W1201 preemption_sync_manager.cc:147] coordination service note',
      'error: model.num_heads=4 is not divisible']),
    (['W1201 coordination service shutting down'], '0', 0,
     ['W1201 coordination service shutting down']),
])
def test_the_watcher_turns_only_a_lost_peer_into_one_line(
    monkeypatch, capsys, lines, end, status, expected):
  monkeypatch.setenv('FAKE_PEER_EXIT', end)
  monkeypatch.delenv('GQA_LAB_HEARTBEAT_TIMEOUT', raising=False)
  monkeypatch.chdir(REPO)
  before = signal.getsignal(signal.SIGTERM)
  assert peers.watch('tests.fake_peer', lines, None) == status
  assert capsys.readouterr().err.splitlines() == expected
  assert signal.getsignal(signal.SIGTERM) is before  # Handlers given back.


@pytest.mark.slow
def test_a_childs_error_waits_for_a_lost_peer_no_longer_than_it_takes(
    monkeypatch):
  """A process that failed alone waits at its exit for the run's others
  (up to JAX's shutdown timeout, 5 minutes): its error line, held in case
  a lost peer caused it, is shown once a lost peer would have ended the
  child (the heartbeat timeout and _VERDICT_SECONDS), not at its end."""
  for var, value in (('FAKE_PEER_EXIT', '1'), ('FAKE_PEER_LINGER', '3'),
                     ('GQA_LAB_HEARTBEAT_TIMEOUT', '1')):
    monkeypatch.setenv(var, value)
  monkeypatch.setattr(peers, '_VERDICT_SECONDS', 0)
  monkeypatch.chdir(REPO)
  written = []

  class Clocked:  # stderr, each write timed.
    def write(self, text):
      written.append((time.monotonic(), text))

    def writelines(self, lines):
      for line in lines:
        self.write(line)

    def flush(self):
      pass
  monkeypatch.setattr(sys, 'stderr', Clocked())
  assert peers.watch('tests.fake_peer', ['step 5 ...', 'error: the disk is '
                                         'full'], None) == 1
  ended = time.monotonic()
  assert [text for _, text in written] == ['step 5 ...\n',
                                           'error: the disk is full\n']
  assert ended - written[1][0] > 1, ended - written[1][0]  # Not at the end.


@pytest.mark.parametrize('failure, message', [
    (jax.errors.JaxRuntimeError(GLOO_RESET),
     'a collective with another process of this run failed (Gloo AllGather '
     'failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error '
     '[127.0.0.1]:5339: Connection reset by peer): that process was killed '
     'or crashed, or its host is down; rerun the same command on every host '
     'to resume from step 10'),
    (OSError(errno.ENOSPC, 'No space left on device'),
     'could not write checkpoint step 20 to {ckpts} (the disk is full); the '
     'disk at'),
], ids=['lost_peer', 'full_disk'])
def test_a_save_a_lost_peer_broke_is_reported_as_the_lost_peer(
    tmp_path, monkeypatch, failure, message):
  """A peer killed while this process saved failed the save's collective
  (seen in a two-process run): that is no full disk ('free space' was the
  advice), but the lost peer, with the step to resume from; a save that
  the disk failed keeps its line."""
  checkpointer = checkpoint.Checkpointer(tmp_path, every=10, keep=3)
  state = {'w': np.zeros(2, np.float32)}
  checkpointer.save(10, state)
  checkpointer.wait()

  def fail(*args, **kwargs):
    raise failure
  monkeypatch.setattr(checkpointer._manager, 'save', fail)  # pylint: disable=protected-access
  with pytest.raises(UserError) as raised, peers.reported_as_lost_peer(
      str(tmp_path)):
    checkpointer.save(20, state)
  assert message.format(ckpts=tmp_path / 'checkpoints') in str(raised.value)
  assert ('free space' in str(raised.value)) == (failure.__class__ is OSError)
  checkpointer.close()


def test_only_a_broken_collective_is_reported_as_a_lost_peer(tmp_path):
  """A step's collective broken by a lost peer is one line, not a
  traceback; any other error passes through as it was."""
  with pytest.raises(UserError, match=r'^a collective with another process '
                     r'of this run failed \(Gloo all-reduce failed: .*'
                     r'Connection closed by peer\): .* resume from the '
                     r'start$'), peers.reported_as_lost_peer(str(tmp_path)):
    try:
      raise jax.errors.JaxRuntimeError(
          'UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/'
          'tcp/pair.cc:590] Connection closed by peer [127.0.0.1]:1234')
    except jax.errors.JaxRuntimeError as e:
      raise RuntimeError('the step failed') from e  # Found in the chain.
  other = ConnectionResetError(errno.ECONNRESET, 'Connection reset by peer')
  with pytest.raises(ConnectionResetError) as raised, (
      peers.reported_as_lost_peer(str(tmp_path))):
    raise other  # A bucket's, say: no collective.
  assert raised.value is other


UNJOINED_DUMP = [
    'F1201 20:57:22.128700 9278 client.h:80] Terminating process because the '
    'JAX distributed service detected fatal errors. This most likely '
    'indicates that another task died; see the other task logs for more '
    'details. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded', '',
    'RPC: /xla.coordination.CoordinationService/RegisterTask',
    '*** Check failure stack trace: ***']


@pytest.mark.parametrize('process, expected', [
    ('1', 'error: no coordinator answered at host0:1234 within 7 s '
     '(GQA_LAB_COORDINATOR_TIMEOUT); start process 0 (JAX_PROCESS_ID=0) on '
     'that host, or check the address'),
    ('0', 'error: not every process of the run joined it within 7 s '
     '(GQA_LAB_COORDINATOR_TIMEOUT); start the same command on every host '
     '(JAX_PROCESS_ID 1 to JAX_NUM_PROCESSES - 1 on the others), and check '
     'that they reach host0:1234')])
def test_processes_that_never_all_joined_are_not_called_a_lost_peer(
    monkeypatch, capsys, process, expected):
  """JAX's abort when registration with the coordinator timed out (its
  dump, as process 1 printed it with no process 0) is its own line, with
  the timeout it waited, not 'lost contact ... after 30 s'."""
  for var, value in (('JAX_COORDINATOR_ADDRESS', 'host0:1234'),
                     ('JAX_NUM_PROCESSES', '2'), ('JAX_PROCESS_ID', process),
                     ('GQA_LAB_COORDINATOR_TIMEOUT', '7'),
                     ('FAKE_PEER_EXIT', 'abort')):
    monkeypatch.setenv(var, value)
  monkeypatch.chdir(REPO)
  assert peers.watch('tests.fake_peer', UNJOINED_DUMP, None) == 1
  assert capsys.readouterr().err.splitlines() == [expected]


ALL_THREE = {'JAX_COORDINATOR_ADDRESS': 'host0:1234', 'JAX_NUM_PROCESSES': '2',
             'JAX_PROCESS_ID': '1'}
SRUN = {'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'n[0-1]',
        'SLURM_NTASKS': '2', 'SLURM_PROCID': '1', 'SLURM_LOCALID': '0'}


@pytest.mark.parametrize('env, message', [
    ({**ALL_THREE, 'JAX_PROCESS_ID': '5'},
     'JAX_PROCESS_ID=5 is not below JAX_NUM_PROCESSES=2: number the processes '
     '0 to 1'),
    ({**ALL_THREE, 'JAX_NUM_PROCESSES': 'abc'},
     "JAX_NUM_PROCESSES='abc' must be a whole number >= 1"),
    ({**ALL_THREE, 'JAX_PROCESS_ID': '-1'},
     "JAX_PROCESS_ID='-1' must be a whole number >= 0"),
    ({'JAX_COORDINATOR_ADDRESS': 'host0:1234'},
     'JAX_COORDINATOR_ADDRESS set without JAX_NUM_PROCESSES and '
     'JAX_PROCESS_ID: on every process set all three'),
    ({'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '0'},
     'JAX_NUM_PROCESSES and JAX_PROCESS_ID set without '
     'JAX_COORDINATOR_ADDRESS'),
    ({**ALL_THREE, 'JAX_COORDINATOR_ADDRESS': 'host0'},
     "JAX_COORDINATOR_ADDRESS='host0' must be HOST:PORT"),
    ({'SLURM_NTASKS': '2'},
     'SLURM_NTASKS=2 but this process was not started by srun (SLURM_JOB_ID, '
     'SLURM_STEP_NODELIST, SLURM_PROCID, SLURM_LOCALID unset): launch it '
     'with `srun python -m train.main ...`'),
    ({**ALL_THREE, 'GQA_LAB_COORDINATOR_TIMEOUT': 'soon'},
     "GQA_LAB_COORDINATOR_TIMEOUT='soon' must be a whole number of seconds"),
])
def test_each_wrong_multiprocess_variable_is_one_line_naming_it(
    monkeypatch, env, message):
  monkeypatch.setattr(peers.glob, 'glob', lambda _: [])  # Not a TPU VM.
  assert peers.is_multiprocess(env)
  with pytest.raises(UserError, match=re.escape(message)) as raised:
    peers.distributed_args(env)
  assert '\n' not in str(raised.value)


@pytest.mark.parametrize('env, expected', [
    (ALL_THREE, {'num_processes': 2, 'process_id': 1}),
    # Under srun, jax finds the address, count and id by itself; what the
    # JAX_* variables say still wins.
    (SRUN, {}),
    ({**SRUN, 'JAX_COORDINATOR_ADDRESS': 'host0:1234'}, {}),
    ({**SRUN, 'JAX_NUM_PROCESSES': '4'}, {'num_processes': 4}),
])
def test_right_multiprocess_variables_pass_to_jax(monkeypatch, env, expected):
  monkeypatch.setattr(peers.glob, 'glob', lambda _: [])
  assert peers.distributed_args({**env, 'GQA_LAB_COORDINATOR_TIMEOUT': '9'}) == {
      'heartbeat_timeout_seconds': 30, 'initialization_timeout': 9, **expected}
  assert not peers.is_multiprocess({'JAX_NUM_PROCESSES': '1'})


@pytest.mark.slow
def test_slurm_ntasks_outside_srun_is_one_line_before_any_process_starts(
    tmp_path):
  """Once a 26-line traceback from inside jax.distributed.initialize."""
  env = {k: v for k, v in os.environ.items() if not k.startswith('SLURM_')}
  result = subprocess.run(
      [sys.executable, '-m', 'train.main', '--config=tiny',
       f'--workdir={tmp_path / "w"}'], cwd=REPO, env={**env,
       'SLURM_NTASKS': '2'}, capture_output=True, text=True, timeout=60)
  _one_line_error(result, 'SLURM_NTASKS=2 but this process was not started '
                  'by srun')
  assert not (tmp_path / 'w').exists()


@pytest.mark.slow
def test_a_coordinator_that_never_answers_is_one_line_within_its_timeout(
    tmp_path):
  """Process 1 of 2, process 0 never started: one line naming the address
  and the timeout (GQA_LAB_COORDINATOR_TIMEOUT=5), where there once were
  309 s of silence and 'lost contact ... after 30 s'."""
  with socket.socket() as s:  # A port nothing listens on.
    s.bind(('localhost', 0))
    address = f'localhost:{s.getsockname()[1]}'
  env = {**os.environ, 'JAX_COORDINATOR_ADDRESS': address,
         'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '1',
         'GQA_LAB_COORDINATOR_TIMEOUT': '5'}
  start = time.monotonic()
  result = subprocess.run(
      [sys.executable, '-m', 'train.main', '--config=tiny',
       f'--workdir={tmp_path / "w"}'], cwd=REPO, env=env, capture_output=True,
      text=True, timeout=120)
  # Two interpreters' imports (watcher and child) and jax's own margin
  # around the timeout; 309 s before.
  assert time.monotonic() - start < 5 + 55
  _one_line_error(result, f'no coordinator answered at {address} within 5 s '
                  '(GQA_LAB_COORDINATOR_TIMEOUT); start process 0')
  assert 'waiting up to 5 s' in result.stdout


def _alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie, dead but not yet reaped by the
  parent it was handed to, does not)."""
  try:
    return pathlib.Path(f'/proc/{pid}/stat').read_text().split(')')[
        -1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


def _gone_within(pid: int, seconds: float) -> bool:
  deadline = time.monotonic() + seconds
  while _alive(pid) and time.monotonic() < deadline:
    time.sleep(0.1)
  return not _alive(pid)


@pytest.mark.parametrize('poll', [False, True], ids=['death_signal', 'polling'])
def test_a_watched_child_dies_with_its_watcher_even_by_sigkill(poll):
  """SIGKILL to the PID a scheduler launched (the watcher) cannot be passed
  on; the child, once orphaned and training on, now dies with it: by
  Linux's parent-death signal, or by polling where that is missing."""
  env = {**os.environ, 'FAKE_PEER_EXIT': 'hang',
         **({'FAKE_PEER_POLL': '1'} if poll else {})}
  watcher = subprocess.Popen(
      [sys.executable, '-c', 'import sys; from infra import peers; '
       'sys.exit(peers.watch("tests.fake_peer", [], None))'], cwd=REPO,
      env=env, stdout=subprocess.PIPE, text=True)
  try:
    child = int(watcher.stdout.readline())  # It follows its watcher now.
    assert _alive(child)
    watcher.kill()
    watcher.wait()
    assert _gone_within(child, 10)
  finally:
    watcher.kill()


def test_a_child_whose_watcher_died_before_it_followed_ends_at_once():
  """The race: a watcher killed between starting the child and the child's
  setting of its parent-death signal. Its parent is then another process,
  and it ends instead of training on."""
  env = {**os.environ, 'FAKE_PEER_EXIT': 'hang', peers.WATCHED: '1'}
  result = subprocess.run([sys.executable, '-m', 'tests.fake_peer'], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode == -signal.SIGKILL and not result.stdout


@pytest.mark.slow
def test_a_ctrl_c_during_a_garbage_collection_stops_the_run_at_a_step(
    tmp_path):
  """Python raises Ctrl-C's KeyboardInterrupt wherever the main thread is,
  and JAX runs Python in every garbage collection (_xla_gc_callback), where
  an exception is printed as 'Exception ignored' and dropped: a study's
  first Ctrl-C was lost and the study ran on. Now a run that no caller
  handles signals for records it, stops at its next step with a checkpoint,
  and raises Interrupted (one line, exit status 130)."""
  collections, before = [], signal.getsignal(signal.SIGINT)

  def interrupt(phase, _):  # A Ctrl-C arriving during a collection.
    collections.append(phase)
    if len(collections) == 10:
      signal.raise_signal(signal.SIGINT)
  gc.callbacks.append(interrupt)
  try:
    with pytest.raises(signals.Interrupted) as raised:
      loop.train_and_evaluate(_config(train__steps=500), str(tmp_path))
  finally:
    gc.callbacks.remove(interrupt)
  assert len(collections) >= 10
  stopped = checkpoint.restore_latest(str(tmp_path))[0]
  assert 0 < stopped < 500
  assert str(raised.value) == (
      f'interrupted by SIGINT (Ctrl-C) at step {stopped}, its checkpoint saved '
      f'in {tmp_path}; rerun the same command to go on')
  assert raised.value.exit_status == 130
  assert signal.getsignal(signal.SIGINT) is before  # Given back.


@pytest.mark.slow
def test_a_studys_first_ctrl_c_stops_it_in_one_line_keeping_its_runs(
    tmp_path):
  """SIGINT, as Ctrl-C sends it, to a study training its first variant:
  the study stops there (the next variant never starts) with one line and
  exit status 130, the interrupted run's checkpoint saved for a rerun."""
  out = tmp_path / 'out'
  # A test run in the background ignores SIGINT, and so would the study;
  # a terminal's does not. (A handled signal is default in a child.)
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    study = subprocess.Popen(
        [sys.executable, '-m', 'scripts.compare', '--config=tiny',
         '--kv_heads=2,1', '--steps=100000', f'--out={out}'], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  finally:
    signal.signal(signal.SIGINT, before)
  metrics = out / 'K2_s0' / 'metrics.jsonl'
  deadline = time.monotonic() + 240
  while not (metrics.exists() and metrics.read_text().count('\n') >= 2):
    assert study.poll() is None and time.monotonic() < deadline, (
        study.communicate())
    time.sleep(0.2)
  study.send_signal(signal.SIGINT)
  sent = time.monotonic()
  _, err = study.communicate(timeout=120)
  assert time.monotonic() - sent < 60
  assert study.returncode == 130, err[-3000:]
  stopped = checkpoint.restore_latest(str(out / 'K2_s0'))[0]
  assert err.strip().splitlines()[-1] == (
      f'error: interrupted by SIGINT (Ctrl-C) at step {stopped}, its '
      f'checkpoint saved in {out / "K2_s0"}; rerun the same command to go on')
  assert 'Traceback' not in err and 'Exception ignored' not in err
  assert not (out / 'K1_s0').exists()  # The study did not run on.
