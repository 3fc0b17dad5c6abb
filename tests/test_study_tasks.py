"""Task scores in the studies (issue 42, item 4): `scripts.compare --tasks`
scores each variant x seed's final checkpoint as `evaluation.evaluate` does, and
reports them by seed and paired against MHA; bad task flags are one line
before anything trains. (The uptraining study's --tasks run end to end in
tests/test_uptrain_study.py.)"""

import json
import os
import subprocess
import sys
import types

import pytest

from evaluation import evaluate as evaluate_lib
from scripts import compare
from studies import stats, task_scores, timing
from studies.compare import plots
from infra.errors import UserError

from tests.test_faults import REPO

os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # Local tasks only.
TASKS_DIR = REPO / 'tests' / 'lm_eval_tasks'


def _args(**flags):
  return types.SimpleNamespace(**{'tasks': None, 'include_path': None,
                                  'task_limit': None, **flags})


def test_without_tasks_nothing_is_checked_and_lm_eval_not_imported(
    monkeypatch):
  monkeypatch.setitem(sys.modules, 'lm_eval', None)  # Importing it fails.
  assert task_scores.spec(_args()) is None
  with pytest.raises(UserError, match='--include_path and --task_limit go '
                     'with --tasks'):
    task_scores.spec(_args(task_limit=2))


def test_a_machine_without_lm_eval_is_told_how_to_install_it(monkeypatch):
  monkeypatch.setitem(sys.modules, 'lm_eval', None)
  with pytest.raises(UserError, match=r"^lm_eval is not installed; pip "
                     r"install -e '\.\[eval\]'$"):
    task_scores.spec(_args(tasks='gqa_lab_choice'))


@pytest.mark.slowest
@pytest.mark.slow  # A subprocess importing lm_eval: seconds.
def test_an_unknown_task_is_one_line_before_anything_trains(tmp_path):
  """Through the command line: refused with the name, and no run
  started (no K4_s0)."""
  pytest.importorskip('lm_eval')
  out = tmp_path / 'out'
  result = subprocess.run(
      [sys.executable, '-m', 'scripts.compare', f'--out={out}',
       '--config=tiny', '--kv_heads=4', '--steps=2',
       '--tasks=gqa_lab_choice,no_such_task', f'--include_path={TASKS_DIR}'],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, 'PYTHONPATH': str(REPO)})
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and "unknown task 'no_such_task'" in lines[0], (
      result.stderr[-3000:])
  assert not (out / 'K4_s0').exists()


@pytest.mark.slow
def test_compare_scores_every_run_by_seed_and_paired_against_mha(
    tmp_path, monkeypatch):
  """The smallest grid (tiny: MHA and MQA, 2 seeds, 6 steps), in process;
  decode timing and plots stubbed (not what is tested)."""
  pytest.importorskip('lm_eval')
  out = tmp_path / 'out'
  monkeypatch.setattr(sys, 'argv', [
      'compare', f'--out={out}', '--config=tiny', '--kv_heads=4,1',
      '--seeds=2', '--steps=6', '--tasks=gqa_lab_choice',
      f'--include_path={TASKS_DIR}', '--task_limit=2'])
  monkeypatch.setattr(timing, 'decode_step_seconds', lambda *_, **__: 1e-3)
  monkeypatch.setattr(timing, 'read_bandwidth', lambda *_: 1e10)
  for plot in ('loss', 'throughput'):
    monkeypatch.setattr(plots, plot, lambda *_: None)
  compare.main()
  result = json.loads((out / 'results.json').read_text())
  by_K = {v['K']: v for v in result['variants']}
  acc = {(K, s['seed']): s['tasks']['gqa_lab_choice']['acc']
         for K, v in by_K.items() for s in v['seeds']}
  assert sorted(acc) == [(1, 0), (1, 1), (4, 0), (4, 1)]
  assert result['tasks']['documents'] == {'gqa_lab_choice': 2}
  # MQA minus MHA, paired by seed, acc and acc_norm.
  c = next(c for c in result['tasks']['comparisons'] if c['metric'] == 'acc')
  assert (c['arm'], c['reference'], c['seeds']) == ('K=1', 'K=4', [0, 1])
  d = stats.paired([acc[1, 0], acc[1, 1]], [acc[4, 0], acc[4, 1]])
  assert c['difference']['mean'] == pytest.approx(d.mean)
  report = (out / 'report.md').read_text()
  assert '### Task scores (lm-evaluation-harness)' in report
  assert '| task | metric | K=4 | K=1 |' in report
  assert f'| gqa_lab_choice | acc | 1 | {acc[4, 1]:.4g} | {acc[1, 1]:.4g} |' \
      in report
  assert f'| gqa_lab_choice | acc ↑ | K=1 | {d:+.4g} |' in report
  # The negative control: MHA without context, the same seeds, trained and
  # paired, not scored on tasks.
  control = result['control']
  assert (control['K'], control['seeds']) == (4, [0, 1])
  assert control['losses'] == pytest.approx([json.loads(
      (out / f'control_s{s}' / 'final.json').read_text())['eval_loss']
                                             for s in (0, 1)])
  assert 'Negative control: K=4 with every layer attending to its own' \
      in report
  assert not (out / 'tasks' / 'control_s0').exists()
  # The score is evaluation.evaluate's of the same workdir, to the last digit
  # (without lm_eval's environment report: seconds of pip list each).
  direct = evaluate_lib.evaluate(str(out / 'K1_s1'), ['gqa_lab_choice'],
                                 include_path=str(TASKS_DIR), limit=2)
  for metric in ('acc', 'acc_norm'):
    assert by_K[1]['seeds'][1]['tasks']['gqa_lab_choice'][metric] == (
        direct['results']['gqa_lab_choice'][f'{metric},none'])
  assert 'pretty_env_info' not in direct
  saved = json.loads((out / 'tasks' / 'K1_s1' / 'results.json').read_text())
  assert saved['provenance']['command'] == (
      f'python -m evaluation.evaluate --workdir={out / "K1_s1"} '
      f'--tasks=gqa_lab_choice --include_path={TASKS_DIR} --limit=2 '
      f'--out={out / "tasks" / "K1_s1"}')
  # A rerun reuses every evaluation; other settings score again.
  scored = {p: p.stat().st_mtime_ns for p in (out / 'tasks').glob(
      '*/scored.json')}
  compare.main()
  assert {p: p.stat().st_mtime_ns for p in scored} == scored
  again = task_scores.score(
      task_scores.Spec(('gqa_lab_choice',), str(TASKS_DIR), 1),
      out / 'K1_s1', out / 'tasks' / 'K1_s1')
  assert again['documents'] == {'gqa_lab_choice': 1}


def test_uptrain_study_refuses_tasks_with_report_only(tmp_path,
                                                      monkeypatch):
  from scripts import uptrain_study  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(sys, 'argv', ['uptrain_study', f'--out={tmp_path}',
                                    '--report_only', '--tasks=x'])
  with pytest.raises(UserError, match='^--tasks scores runs as the study '
                     'trains them, not with --report_only'):
    uptrain_study.main()
