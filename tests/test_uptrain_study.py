"""The uptraining study: its statistics and reading (on made-up results whose
answers are known), and the whole study end to end on `tiny`."""

import json
import subprocess
import sys

import numpy as np
import pytest

from scripts import uptrain_report

SOURCE = 2.0


def _results(shift: dict, noise: float = 0.0):
  """Results where a method's loss at alpha is `shift[(recipe, method)]`
  plus a decay in alpha, one row per seed; `noise` scales a per-seed term
  that differs between methods."""
  rng = np.random.default_rng(0)
  runs = []
  for alpha in (0, 0.05, 0.2):
    for recipe in uptrain_report.RECIPES:
      for method in uptrain_report.METHODS:
        K = 4 if method == 'identity' else 1
        for seed in (1, 2, 3):
          at0 = SOURCE if method == 'identity' else SOURCE + 1.0 + (
              0.2 if method == 'random' else 0.0)
          loss = at0 if alpha == 0 else SOURCE + shift[recipe, method] * (
              1 - alpha) + noise * rng.normal()
          runs.append(dict(recipe=recipe, method=method, K=K, alpha=alpha,
                           seed=seed, loss=loss, curve=[(10, loss)]))
  return {'source': {'loss': SOURCE, 'curve': [(100, SOURCE)], 'change': 0.004,
                     'steps': 100, 'tokens': 100 * 16 * 128},
          'runs': runs,
          'scratch': [dict(K=1, seed=s, loss=SOURCE + 0.5 + 0.01 * s)
                      for s in (1, 2, 3)],
          'plan': {'kv_heads': [1], 'alphas': [0, 0.05, 0.2],
                   'seeds': [1, 2, 3], 'num_heads': 4}}


SHIFTS = {('paper', 'identity'): 0.3, ('paper', 'mean'): 0.6,
          ('paper', 'first'): 0.7, ('paper', 'random'): 0.9,
          ('continued', 'identity'): -0.01, ('continued', 'mean'): 0.2,
          ('continued', 'first'): 0.3, ('continued', 'random'): 0.25}


def test_the_sound_recipe_is_the_one_that_does_not_shock_the_control():
  results = _results(SHIFTS)
  assert uptrain_report.sound_recipe(results) == 'continued'
  assert uptrain_report.control(results, 'paper')[0.2][0] == pytest.approx(
      0.3 * 0.8)
  assert uptrain_report.control(results, 'continued')[0.05][0] == \
      pytest.approx(-0.01 * 0.95)
  # Neither shocks: the one whose control ends lower.
  calm = _results({**SHIFTS, ('paper', 'identity'): -0.05})
  assert uptrain_report.sound_recipe(calm) == 'paper'


def test_recovery_is_the_fraction_of_the_conversion_drop_won_back():
  results = _results(SHIFTS)
  # mean: 3.0 at alpha 0, 2.0 + 0.2 * 0.95 = 2.19 at 0.05: 0.81 of 1.0.
  np.testing.assert_allclose(
      uptrain_report.recovery(results, 'continued', 'mean', 1, 0.05),
      [0.81] * 3)


def test_paired_differences_resolve_only_beyond_the_seed_spread():
  exact = _results(SHIFTS)
  mean, half = uptrain_report.paired(exact, 'continued', 'mean', 'first', 1,
                                     0.2)
  assert mean == pytest.approx(-0.08) and half == pytest.approx(0)
  noisy = _results(SHIFTS, noise=0.5)
  mean, half = uptrain_report.paired(noisy, 'continued', 'mean', 'first', 1,
                                     0.2)
  assert not uptrain_report.resolved(mean, half)


def test_the_reading_states_each_claim_from_the_numbers(tmp_path, capsys):
  results = _results(SHIFTS)
  uptrain_report.write(tmp_path, results)
  text = (tmp_path / 'report.md').read_text()
  assert '**continued** recipe is the sound one' in text
  assert 'mean < first: α=0.05: -0.095 (holds), α=0.2: -0.080 (holds)' in text
  # random (0.25) beats first (0.3) under the continued recipe: reversed.
  assert 'first < random: α=0.05: +0.048 (reversed)' in text
  assert '81% ± 0 of the conversion\'s drop recovered' in text
  assert '(uptraining is better)' in text  # 2.19 against 2.51-2.53.
  # The verdicts, claim by claim.
  assert ('continued recipe, claim 1 (α = 0.05 recovers most of MHA\'s '
          'quality): partly reproduced.**') in text  # 81%, 0.20 nats off.
  assert 'paper recipe, claim 2 (after uptraining, mean < first < random, ' \
         'paired by seed): reproduced.**' in text
  assert 'continued recipe, claim 2 (after uptraining, mean < first < ' \
         'random, paired by seed): not reproduced.**' in text
  assert 'continued recipe, claim 3 (uptraining beats training K from ' \
         'scratch on the same total tokens): reproduced.**' in text
  assert 'flat' in text and 'exact' in text
  for plot in ('loss_vs_alpha.png', 'curves.png'):
    assert (tmp_path / plot).stat().st_size > 10_000
  assert '## Reading' in capsys.readouterr().out


@pytest.mark.slow
def test_the_study_runs_end_to_end_through_the_training_loop(tmp_path):
  """On `tiny`: every run trained by train.main's loop (its metrics.jsonl),
  the identity control exact at alpha 0, and a rerun reuses every run."""
  out = tmp_path / 'study'
  command = [sys.executable, '-m', 'scripts.uptrain_study', f'--out={out}',
             '--config=tiny', '--steps=20', '--kv_heads=1',
             '--alphas=0,0.5', '--seeds=2']
  first = subprocess.run(command, capture_output=True, text=True, check=True)
  results = json.loads((out / 'results.json').read_text())
  trained = [r for r in results['runs'] if r['alpha']]
  # alpha 0.05 (always run: scratch's) and 0.5, 2 recipes, 4 methods, 2 seeds.
  assert len(trained) == 2 * 2 * 4 * 2
  for run in trained:
    workdir = (out / 'runs' / run['recipe'] / f'{run["method"]}_K{run["K"]}'
               / f'a{run["alpha"]:g}_s{run["seed"]}')
    assert (workdir / 'metrics.jsonl').exists()
    assert np.isfinite(run['loss'])
  identity = [r['loss'] for r in results['runs']
              if r['method'] == 'identity' and r['alpha'] == 0]
  np.testing.assert_allclose(identity, results['source']['loss'], rtol=1e-6)
  assert len(results['scratch']) == 2
  assert '## Reading' in first.stdout
  again = subprocess.run(command, capture_output=True, text=True, check=True)
  assert json.loads((out / 'results.json').read_text())['runs'] == \
      results['runs']
  assert 'MHA source' in again.stdout
