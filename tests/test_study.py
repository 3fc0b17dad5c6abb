"""studies/study.py: a study reuses a finished run only under the settings it
was trained with (issue 39: kv_frontier --quick, then --steps=30, reported
"30 steps" over runs of 15)."""

import json
import math
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny
from scripts import compare
from studies import report, study
from studies.compare import design, plots
from studies.compare import runs as compare_runs
from lm import checkpoint
from lm import config_lib
from infra import provenance
from infra.errors import UserError

from tests.test_faults import REPO, _one_line_error


def _snapshot(workdir):
  return {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file()}


def test_a_finished_run_is_reused_under_its_own_settings(trained, tmp_path):
  before = _snapshot(trained)
  record = study.train(tiny.get_config(), trained, tmp_path / 'log.txt')
  assert record == json.loads((trained / 'final.json').read_text())
  assert not (tmp_path / 'log.txt').exists()  # Nothing trained.
  # How often it logs and saves cannot change its numbers: still this run.
  config = tiny.get_config()
  config.train.update(log_every=1, checkpoint_every=5, keep_checkpoints=1)
  assert study.train(config, trained, tmp_path / 'log.txt') == record
  assert _snapshot(trained) == before


def test_a_finished_run_with_other_settings_is_refused_in_one_line(
    trained, tmp_path):
  before = _snapshot(trained)
  config = tiny.get_config()
  config.train.steps = 30
  config.model.num_kv_heads = 1
  with pytest.raises(UserError) as e:
    study.train(config, trained, tmp_path / 'log.txt')
  message = str(e.value)
  assert '\n' not in message and str(trained) in message
  assert 'model.num_kv_heads 2 -> 1; train.steps 20 -> 30' in message
  assert 'another --out' in message and f'delete {trained}' in message
  assert _snapshot(trained) == before  # Neither retrained nor touched.
  # Its learning rate alone is enough: every field but the few that cannot
  # change the numbers counts.
  config = tiny.get_config()
  config.train.learning_rate = 3e-3
  with pytest.raises(UserError, match='train.learning_rate 0.01 -> 0.003'):
    study.check_reusable(config, trained)


def test_a_finished_run_without_its_config_is_refused(trained, tmp_path):
  copy = tmp_path / 'run'
  copy.mkdir()
  shutil.copy(trained / 'final.json', copy)
  with pytest.raises(UserError, match='without its config.json'):
    study.check_reusable(tiny.get_config(), copy)


@pytest.mark.slow
def test_an_interrupted_run_resumes_only_under_the_settings_it_started_with(
    tmp_path):
  """train.main's resume takes other steps, rates and data
  (config_lib.RESUME_MAY_CHANGE), so a study rerun with other settings over
  an interrupted run would have resumed it and reported a mix of the two:
  study.train records the settings it asked for (study.REQUESTED) before
  the first step, and a rerun under others is refused with nothing
  touched."""
  config = tiny.get_config()
  config.train.update(steps=4, eval_every=4, checkpoint_every=2)
  workdir, log = tmp_path / 'run', tmp_path / 'log.txt'
  study.train(config, workdir, log)
  assert study.differences(
      config_lib.from_json(workdir / study.REQUESTED), config) == []
  # As if stopped after its step-2 save.
  (workdir / 'final.json').unlink()
  shutil.rmtree(workdir / 'checkpoints' / '4')
  before = _snapshot(workdir)
  other = tiny.get_config()
  other.train.update(steps=6, eval_every=4, checkpoint_every=2,
                     learning_rate=3e-3)
  with pytest.raises(UserError) as e:
    study.train(other, workdir, log)
  message = str(e.value)
  assert '\n' not in message and str(workdir) in message
  assert ('holds an interrupted run with other settings (train.learning_rate '
          '0.01 -> 0.003; train.steps 4 -> 6)') in message
  assert 'mix the two' in message and f'delete {workdir}' in message
  assert _snapshot(workdir) == before
  # Under the settings it started with, it resumes and finishes.
  assert 'eval_loss' in study.train(config, workdir, log)
  assert (workdir / 'final.json').exists()


def test_a_run_a_signal_stopped_mid_way_is_resumed_not_reused(tmp_path,
                                                              monkeypatch):
  """A signal stops a run mid-way with its checkpoint and a final.json that
  says 'stopped_at' (train.loop): the study's rerun resumes it to its last
  step; it had reused the half-trained run as finished (a fresh user's
  Ctrl-C, issue 60's recipe study: a 25-step source read as its 160)."""
  from train import loop  # pylint: disable=import-outside-toplevel
  config = tiny.get_config()
  config.train.update(steps=6, eval_every=6, checkpoint_every=2,
                      log_every=1)
  workdir, log = tmp_path / 'run', tmp_path / 'log.txt'
  real = loop.train_and_evaluate
  monkeypatch.setattr(loop, 'train_and_evaluate', lambda c, w, **k: real(
      c, w, should_stop=lambda: True, **k))
  stopped = study.train(config, workdir, log)
  assert stopped['stopped_at'] < 6 and not study.finished(workdir)
  monkeypatch.setattr(loop, 'train_and_evaluate', real)
  record = study.train(config, workdir, log)
  assert 'stopped_at' not in record and 'eval_loss' in record
  assert study.finished(workdir)
  steps = [r['step'] for r in map(json.loads, (
      workdir / 'metrics.jsonl').read_text().splitlines())]
  assert steps[-1] == 6


@pytest.mark.slow
def test_a_run_stopped_between_its_last_save_and_final_json_gets_its_record(
    trained, tmp_path, capsys):
  """A rerun found the last checkpoint, said "nothing to do" and returned
  {}: a study then read no held-out loss from a finished run. Now the last
  checkpoint is evaluated and final.json written, with the numbers the run
  logged at that step."""
  copy = tmp_path / 'run'
  shutil.copytree(trained, copy)
  record = json.loads((copy / 'final.json').read_text())
  (copy / 'final.json').unlink()
  again = study.train(tiny.get_config(), copy, tmp_path / 'log.txt')
  for key in ('eval_loss', 'eval_accuracy', 'kv_bytes_per_token'):
    assert again[key] == pytest.approx(record[key], rel=1e-6), key
  assert json.loads((copy / 'final.json').read_text()) == again
  assert 'final.json was never written' in (tmp_path / 'log.txt').read_text()


def test_compare_out_that_is_a_file_is_named_as_out(tmp_path, monkeypatch):
  """It was refused as an internal --workdir=OUT/K8_s0."""
  path = tmp_path / 'results.txt'
  path.write_text('x')
  monkeypatch.setattr(sys, 'argv', ['compare', f'--out={path}'])
  with pytest.raises(UserError, match=r'^--out=.*results.txt is a file; give '
                     'a folder'):
    compare.main()


@pytest.mark.slow
def test_compare_refuses_its_finished_runs_under_other_steps(tmp_path):
  """The issue's repro through the command line: runs finished at 2 steps,
  the study asked for 3; refused before anything trains or is timed."""
  out = tmp_path / 'out'
  config = design.variant_config('tiny', 4, 0, 2, False)
  study.train(config, out / 'K4_s0', out / 'K4_s0' / 'log.txt')
  before = _snapshot(out / 'K4_s0')
  result = subprocess.run(
      [sys.executable, '-m', 'scripts.compare', f'--out={out}',
       '--config=tiny', '--kv_heads=4', '--steps=3'], cwd=REPO,
      capture_output=True, text=True, timeout=180)
  _one_line_error(result, f'{out / "K4_s0"} holds a finished run with other '
                  'settings (')
  assert 'train.steps 2 -> 3' in result.stderr
  assert _snapshot(out / 'K4_s0') == before
  assert not (out / 'report.md').exists()


@pytest.mark.parametrize('name', config_lib.known_configs())
def test_every_named_config_reads_back_from_its_json_unchanged(name,
                                                               tmp_path):
  """What check_reusable compares: a config against its config.json read
  back. A spurious difference would refuse every rerun of a study."""
  config = config_lib.load(name)
  path = tmp_path / 'config.json'
  path.write_text(config.to_json(indent=2))
  assert study.differences(config_lib.from_json(path), config) == []


def test_a_saved_result_is_strict_json_and_reads_back_its_infinities(
    tmp_path):
  """An unbounded interval (one seed, or every seed equal) is written as
  strict JSON, which jq and JavaScript read (Python's own writes the bare
  words Infinity and NaN), and --report_only reads the same floats back."""
  result = {'estimate': {'mean': 0.5, 'low': -math.inf, 'high': math.inf,
                         'sd': math.nan, 'n': 1},
            'seeds': [1.0, math.inf], 'label': 'K=2'}
  path = tmp_path / 'results.json'
  path.write_text(study.to_json(result))
  json.loads(path.read_text(), parse_constant=_refuse)  # Strict.
  back = study.saved(path)
  assert back['estimate']['low'] == -math.inf
  assert back['estimate']['high'] == math.inf
  assert math.isnan(back['estimate']['sd'])
  assert back['seeds'] == [1.0, math.inf] and back['label'] == 'K=2'
  # Files written before (Python's bare Infinity) still read.
  path.write_text(json.dumps(result))
  assert study.saved(path)['estimate']['high'] == math.inf


def _refuse(constant):
  raise ValueError(f'not strict JSON: {constant}')


@pytest.mark.slow
def test_compare_report_only_rebuilds_what_results_json_holds(
    tmp_path, monkeypatch):
  """Runs trained with --no_control (or before the control existed):
  --report_only rebuilds from results.json alone, which says the control
  was left out (the flags given with it do not matter); without a
  results.json it says to run without it first. One seed trains no control
  (it could not be tested)."""
  out = tmp_path / 'out'
  for plot in ('loss', 'throughput'):
    monkeypatch.setattr(plots, plot, lambda *_: None)
  monkeypatch.setattr(compare_runs.timing, 'decode_step_seconds',
                      lambda *_, **__: 1e-3)
  monkeypatch.setattr(compare_runs.timing, 'read_bandwidth', lambda *_: 1e10)
  argv = ['compare', f'--out={out}', '--config=tiny', '--kv_heads=4',
          '--steps=2']
  monkeypatch.setattr(sys, 'argv', argv + ['--seeds=1', '--report_only'])
  with pytest.raises(UserError, match=r'results.json not found: '
                     r'--report_only rebuilds the report'):
    compare.main()
  monkeypatch.setattr(sys, 'argv', argv + ['--seeds=2', '--no_control'])
  compare.main()
  trained = (out / 'report.md').read_text()
  monkeypatch.setattr(sys, 'argv', argv + ['--seeds=2', '--report_only'])
  compare.main()
  rebuilt = (out / 'report.md').read_text()
  assert ('Negative control (a model without context): left out '
          '(--no_control, or one seed)') in rebuilt
  assert report.normalise_rebuilt(rebuilt).replace(
      f'{report.REBUILT}\n\n', '') == trained
  # Each run's own record (its commit as it started, its machine), by name,
  # is the report's sentence on where the runs were trained.
  prov = json.loads((out / 'results.json').read_text())['provenance']
  assert sorted(prov['runs']) == ['K4_s0', 'K4_s1', 'aa_s0', 'aa_s1']
  assert all(r == {'commit': prov['commit'], 'machine': prov['machine']}
             for r in prov['runs'].values())
  assert (f'Runs trained by commit {prov["commit"]} on '
          f'{provenance.describe(prov["machine"])} (4 runs); decode timed '
          'and results.json written by `python -m scripts.compare') in rebuilt
  monkeypatch.setattr(sys, 'argv', argv + ['--seeds=1'])
  compare.main()
  assert not list(out.glob('control_s*'))
  assert ('Negative control (a model without context): left out '
          '(--no_control, or one seed)') in (out / 'report.md').read_text()


def _retrained(workdir):
  """WORKDIR's checkpoints replaced by other parameters (its final.json and
  config.json kept): a run trained again in its place, or a hand edit."""
  _, state = checkpoint.restore_latest(workdir)
  other = jax.tree.map(lambda x: np.asarray(x) + 1, state['params'])
  shutil.rmtree(workdir / 'checkpoints')
  checkpoint.save_params(workdir, other)


def test_a_conversion_is_reused_only_from_the_same_parameters(trained,
                                                              tmp_path):
  """A study's conversion was reused when its folder held a config.json,
  whatever it was made from. Now its record (the source's fingerprint and
  the settings) decides: the same, reused; another source or setting,
  refused in one line; none (interrupted), made again."""
  source = tmp_path / 'source'
  shutil.copytree(trained, source)
  made = []
  def make(workdir):
    return lambda: (workdir.mkdir(), made.append(workdir))
  converted = tmp_path / 'converted'
  inputs = lambda: {'source': study.fingerprint(source), 'method': 'mean',
                    'K': 1}
  study.made_once(converted, inputs(), make(converted))
  study.made_once(converted, inputs(), make(converted))
  assert len(made) == 1  # Reused.
  with pytest.raises(UserError, match=r"holds a conversion made from other "
                     r"inputs \(K 1 -> 2\); give another --out, or delete "):
    study.made_once(converted, {**inputs(), 'K': 2}, make(converted))
  _retrained(source)
  with pytest.raises(UserError, match=r'made from other inputs \(source '
                     r'[0-9a-f]{16} -> [0-9a-f]{16}\)'):
    study.made_once(converted, inputs(), make(converted))
  (converted / study.MADE_FROM).unlink()  # As if interrupted.
  study.made_once(converted, inputs(), make(converted))
  assert len(made) == 2


def test_a_run_started_from_another_conversion_is_refused(trained,
                                                          tmp_path):
  """An uptraining run copies its conversion (and its record); a rerun
  whose conversion was made again from other inputs refuses the run that
  started from the old one, which its config alone could not tell."""
  converted = tmp_path / 'converted'
  study.made_once(converted, {'source': 'a'},
                  lambda: shutil.copytree(trained, converted))
  run = tmp_path / 'run'
  shutil.copytree(converted, run)  # What `train` does with start=.
  study.check_reusable(tiny.get_config(), run, start=converted)
  shutil.rmtree(converted)
  study.made_once(converted, {'source': 'b'},
                  lambda: shutil.copytree(trained, converted))
  with pytest.raises(UserError, match=r"run holds a run started from another "
                     r"conversion than .*converted \(made from \{'source': "
                     r"'a'\}, not \{'source': 'b'\}\); give another --out"):
    study.check_reusable(tiny.get_config(), run, start=converted)


def test_task_scores_are_scored_again_for_another_checkpoint(
    trained, tmp_path, monkeypatch):
  """scored.json was reused when the settings and final.json matched,
  though the checkpoint in the workdir had been replaced."""
  from evaluation import evaluate  # pylint: disable=import-outside-toplevel
  from studies import task_scores  # pylint: disable=import-outside-toplevel
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  calls = []
  def scored(*args, **kwargs):
    calls.append(args)
    return {'results': {'t': {'acc,none': 0.5}}}
  monkeypatch.setattr(evaluate, 'write_results', scored)
  what = task_scores.Spec(('t',))
  first = task_scores.score(what, workdir, tmp_path / 'scores')
  assert task_scores.score(what, workdir, tmp_path / 'scores') == first
  assert len(calls) == 1
  _retrained(workdir)
  again = task_scores.score(what, workdir, tmp_path / 'scores')
  assert len(calls) == 2 and again['checkpoint'] != first['checkpoint']


XEON = {'cpu': 'Intel Xeon', 'avx2': True, 'avx512f': True, 'cores': 2}


def test_the_runs_missing_a_record_are_named_never_only_counted(tmp_path):
  """Where each run was trained, from its own record (TRAINED_BY): runs
  grouped by commit and machine; a run whose record has no machine, and a
  run with no record, named (issue 60: '117 runs with no record')."""
  runs = {'a/K8_s1': {'commit': 'abc1234', 'machine': XEON},
          'a/K8_s2': {'commit': 'abc1234', 'machine': XEON},
          'b/K1_s1': {'commit': 'abc1234'}, 'b/K1_s2': None}
  for name, record in runs.items():
    (tmp_path / name).mkdir(parents=True)
    if record:
      (tmp_path / name / study.TRAINED_BY).write_text(json.dumps(record))
  records = study.run_records(tmp_path / name for name in runs)
  assert records == {'a/K8_s1': {'commit': 'abc1234', 'machine': XEON},
                     'a/K8_s2': {'commit': 'abc1234', 'machine': XEON},
                     'b/K1_s1': {'commit': 'abc1234'}, 'b/K1_s2': None}
  assert study.describe_runs(records) == (
      'commit abc1234 on a machine not recorded (1 run: b/K1_s1); commit '
      'abc1234 on Intel Xeon (AVX-512F), 2 cores (2 runs); 1 run with no '
      'record: b/K1_s2')
  assert study.trained_by([tmp_path / 'b' / 'K1_s2']) == (
      '1 run with no record: K1_s2')
  moved = {'commit': 'abc1234', 'commit_at_end': 'def5678', 'machine': XEON}
  assert study.describe_runs({'K8_s1': moved}) == (
      'commit abc1234 (the checkout at def5678 by its end) on Intel Xeon '
      '(AVX-512F), 2 cores (1 run)')
  assert report.command_at({'command': 'python -m x', **moved}) == (
      '`python -m x` at commit abc1234 (the checkout at def5678 by its end) '
      'on Intel Xeon (AVX-512F), 2 cores')
  assert report.command_at({'command': 'python -m x', 'commit': 'abc1234'}
                           ).endswith(' on a machine not recorded')
  assert study.describe_runs({}) is None


def _rebuilt(commit, folder='docs/results/x', module='scripts.compare'):
  """A saved provenance rebuilt by `python -m MODULE --out=FOLDER
  --report_only` at COMMIT, and the report's rebuild line it makes."""
  prov = {'command': 'python -m scripts.compare --out=runs/x',
          'commit': commit.removesuffix(provenance.DIRTY), 'machine': XEON,
          'rebuilt': {'command': f'python -m {module} --out={folder} '
                                 '--report_only',
                      'commit': commit, 'machine': XEON}}
  return prov, report.rebuilt_lines(prov, 'results.json')[0]


def test_a_published_report_built_on_a_dirty_tree_is_named_with_the_fix():
  """A report rebuilt, or numbers measured, at a commit with uncommitted
  changes is a problem naming the report and the command that rebuilds it
  at a clean commit (issue 60: kv_frontier/zadouri at cd9876c+dirty)."""
  head = provenance.commit().removesuffix(provenance.DIRTY)
  clean, line = _rebuilt(head)
  assert report.published_problems('docs/results/x', clean, line,
                                   'scripts.compare', 'results.json') == []
  dirty, dirty_line = _rebuilt(head + provenance.DIRTY)
  assert report.published_problems(
      'docs/results/x', dirty, dirty_line, 'scripts.compare',
      'results.json') == [
          f'docs/results/x/report.md: rebuilt at commit {head}+dirty (not a '
          'clean commit): commit the changes, then rebuild it at the clean '
          'commit: python -m scripts.compare --out=docs/results/x '
          '--report_only']
  measured = {**clean, 'commit': 'abc1234+dirty'}
  assert report.published_problems(
      'docs/results/x', measured, line, 'scripts.compare',
      'results.json') == ['docs/results/x/results.json: measured at commit '
                          'abc1234+dirty, which no commit holds: rerun its '
                          'command at a clean commit']
  # The measuring record apart (sweep.json keeps it in meta.provenance).
  assert report.published_problems(
      'docs/results/x', clean, line, 'scripts.compare', 'results.json',
      made={'commit': 'unknown'})[0].endswith('rerun its command at a clean '
                                              'commit')


def test_a_published_rebuild_that_is_not_what_its_json_records_is_named():
  """The rebuild line edited by hand, a recorded rebuild of another folder,
  and a rebuild at a commit outside this history each fail, saying what to
  run."""
  head = provenance.commit().removesuffix(provenance.DIRTY)
  prov, line = _rebuilt(head)
  again = 'rebuild it: python -m scripts.compare --out=docs/results/x'
  edited = line.replace(f'commit {head}', 'commit 1234567')
  found, = report.published_problems('docs/results/x', prov, edited,
                                     'scripts.compare', 'results.json')
  assert found.startswith('docs/results/x/report.md: its rebuild line is not '
                          'the one results.json records') and again in found
  other, line = _rebuilt(head, folder='docs/results/y')
  found, = report.published_problems('docs/results/x', other, line,
                                     'scripts.compare', 'results.json')
  assert 'does not rebuild this folder' in found and again in found
  if provenance.in_history(head) is not None:  # A full git checkout.
    elsewhere, line = _rebuilt('0000000')
    found, = report.published_problems('docs/results/x', elsewhere, line,
                                       'scripts.compare', 'results.json')
    assert 'rebuilt at commit 0000000, not in this history' in found


@pytest.mark.parametrize('text', ['{"provenance": {"com', '', '\x00\x01'])
def test_a_damaged_results_file_is_one_line_not_a_traceback(tmp_path, text):
  """--report_only on a truncated, empty or binary results file names it
  and what to do (it had raised JSONDecodeError); a folder in its place
  is named too."""
  path = tmp_path / 'results.json'
  path.write_text(text)
  with pytest.raises(UserError, match='is not the JSON a study writes'):
    study.saved(path)
  path.unlink()
  path.mkdir()
  with pytest.raises(UserError, match=r'not found \(a folder\)'):
    study.saved(path)
