"""The uptraining study: its statistics and reading (on made-up results whose
answers are known), and the whole study end to end on `tiny`."""

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from scripts import uptrain_study
from studies import stats
from studies.uptrain import (common, design, single_reading, single_summary,
                             single_tables)
from lm import config_lib
from lm import model as model_lib
from train.convert import to_mla, to_tpa

SOURCE = 2.0
STEPS = [1, 2, 4, 8, 16]  # Uptraining steps of the alphas, S = 100.


def _scratch_loss(step, K, seed):
  """Linear in steps: E(loss) = 30 (5 - loss) on the seed-mean curve."""
  return 5 - step / 30 + (0.01 if K == 1 else 0.0) + 0.001 * (seed - 2)


def _results(up: dict, noise: float = 0.0, pooled_gain: float = 0.0,
             mla=None):
  """LM results where arm (method, start)'s loss at alpha step s is
  up[method](s) (minus pooled_gain for pooled Adam), plus per-seed noise;
  mla(s, seed): the MLA arm's (none without)."""
  rng = np.random.default_rng(0)
  runs = []
  for arm in design.plan_arms(4, [1]):
    for seed in (1, 2, 3):
      curve = [{'step': 0, 'loss': up[arm.method](0), 'accuracy': 0.0}]
      for s in STEPS:
        loss = up[arm.method](s) + noise * rng.normal() - (
            pooled_gain if arm.start == 'pooled' else 0.0)
        curve.append({'step': s, 'loss': loss, 'accuracy': 0.0})
      runs.append({'method': arm.method, 'K': arm.K, 'start': arm.start,
                   'seed': seed, 'curve': curve})
  scratch = [{'K': K, 'seed': seed, 'curve': [
      {'step': s, 'loss': _scratch_loss(s, K, seed), 'accuracy': 0.0}
      for s in range(10, 121, 10)]} for K in (4, 1) for seed in (1, 2, 3)]
  lm = {'source': {'loss': SOURCE, 'steps': 100, 'tokens': 100 * 16 * 64,
                   'curve': []},
        'pilot': {'K': 1, 'steps': 4, 'rate': 1e-3, 'rows': [
            {'rate': 1e-3, 'mean': 3.0, 'identity': 2.0, 'drift': 0.0}]},
        'runs': runs, 'scratch': scratch,
        'plan': {'kv_heads': [1], 'seeds': [1, 2, 3], 'num_heads': 4,
                 'steps': 100, 'alpha_steps': STEPS,
                 'alphas': list(design.ALPHAS), 'near': 0.02,
                 'paper_alpha': 0.05, 'vocab_size': 256}}
  recall_curve = lambda hit: [{'step': 0, 'loss': 1.0, 'accuracy': 0.3},
                              {'step': 10, 'loss': 0.1,
                               'accuracy': 0.97 if hit else 0.5}]
  recall = {
      'source': {'accuracy': 1.0, 'steps_to_target': 700},
      'runs': [{'method': 'mean', 'K': 1, 'seed': s, 'curve': recall_curve(
          s != 3), 'steps_to_target': 10 if s != 3 else None}
               for s in (1, 2, 3)],
      'scratch': [{'K': 1, 'seed': s, 'curve': recall_curve(True),
                   'steps_to_target': 600 + s} for s in (1, 2, 3)],
      'plan': {'budget': 16, 'target': 0.95}}
  if mla:
    conversion = {'K': 1, 'kv_lora_rank': 24, 'qk_rope_head_dim': 8,
                  'kv_bytes_per_token': 256.0,
                  'gqa_kv_bytes_per_token': 256.0,
                  'energy_kept': [0.8, 0.85]}
    lm['mla'] = {'conversions': [conversion], 'runs': [
        {'method': 'mla', 'K': 1, 'start': 'fresh', 'seed': seed, 'curve': [
            {'step': s, 'loss': mla(s, seed), 'accuracy': 0.0}
            for s in [0, *STEPS]]} for seed in (1, 2, 3)]}
    recall['mla'] = {'conversions': [{**conversion, 'qk_rope_head_dim': 0,
                                      'kv_lora_rank': 32}], 'runs': [
        {'method': 'mla', 'K': 1, 'seed': s, 'curve': recall_curve(True),
         'steps_to_target': 10} for s in (1, 2, 3)]}
  return {'provenance': {'command': 'python -m scripts.uptrain_study --out=x',
                         'commit': 'abc1234', 'out': 'x',
                         'statistics': 'convention.'},
          'lm': lm, 'recall': recall}


# The control drifts 0.002 nats by alpha's last step; mean-pooled reaches
# loss 3.0 (E = 60 scratch steps) at the paper's alpha (step 4); first
# trails mean by 0.05, random first by 0.2.
UP = {'identity': lambda s: SOURCE + 0.002 * s / 16,
      'mean': lambda s: 3.0 if s == 4 else 3.5 - 0.05 * s,
      'first': lambda s: 3.05 if s == 4 else 3.55 - 0.05 * s,
      'random': lambda s: 3.25 if s == 4 else 3.75 - 0.05 * s}


def test_equivalent_steps_interpolate_the_running_minimum_and_censor():
  steps, curve = [10, 20, 30], [4.0, 4.5, 3.0]  # A bump at 20.
  # On the running minimum [4, 4, 3]: 3.5 is halfway from 20 to 30.
  assert common.equivalent_steps(3.5, steps, curve, 6.0) == 25
  assert common.equivalent_steps(5.0, steps, curve, 6.0) == 5
  assert common.equivalent_steps(7.0, steps, curve, 6.0) == 0
  assert common.equivalent_steps(2.9, steps, curve, 6.0) == math.inf


def test_summary_maps_uptrained_losses_to_scratch_steps_and_judges_claims():
  results = _results(UP, noise=0.0005)
  summ = single_summary.summary(results)
  row = summ['compute'][1][2]  # The paper's alpha: 4 uptraining steps.
  np.testing.assert_allclose(row['E'], 30 * (5 - 3.0 - 0.01), atol=1)
  assert row['advantage']['mean'] == pytest.approx(59.7 / 4, abs=0.3)
  assert row['retained']['mean'] == pytest.approx((59.7 - 4) / 100, abs=0.01)
  assert single_reading._compute_verdict(row) == 'reproduced'
  # The gap from scratch: K = 1 is 0.01 worse at every seed: resolved.
  assert summ['gap'][1]['end']['mean'] == pytest.approx(0.01)
  assert summ['gap'][1]['end']['low'] > 0
  # Claim 2: mean < first and first < random, both resolved after Holm.
  assert [c['holm'] for c in summ['ranking']] == [True, True]
  assert summ['ranking'][0]['mean'] == pytest.approx(-0.05, abs=0.003)
  assert common.ranking_verdict(summ['ranking'], 1) == 'reproduced'
  # The gate: drift 0.002 at the last alpha, floor 0.008, below every
  # effect it applies to (the gap 0.01, claim 1's 1.0).
  assert summ['gate']['floor'] == pytest.approx(0.008, abs=0.004)
  assert summ['gate']['passes']
  # Claim 1: 1.0 nats above the control at 0.05: the interval excludes the
  # paper's margin; from one source that is "not reproduced at this scale",
  # never "contradicted" (the trend over source length decides that).
  assert single_reading._near_verdict(summ['near'][1], 2, 0.02).startswith(
      'not reproduced at this scale (one source')
  assert summ['recall']['arms']['mean_K1']['k'] == 2
  assert summ['recall']['scratch'][1]['median'] == 602


def test_the_gate_fails_when_the_control_drifts_by_a_claimed_effect():
  drifting = {**UP, 'identity': lambda s: SOURCE + 0.02 * s / 16}
  summ = single_summary.summary(_results(drifting, noise=0.0005))
  assert not summ['gate']['passes']
  # Only effects against the source or control: an arm-vs-arm difference
  # (mean - first, 0.05 < the floor 0.08) cancels the shared drift.
  assert [name for name, _ in summ['gate']['below']] == [
      'K=1 - MHA from scratch']
  assert common.ranking_verdict(summ['ranking'], 1) == 'reproduced'
  assert 'not to arm-vs-arm differences' in single_summary.GATE_RULE


def test_near_mha_and_the_optimizer_start_are_read_with_their_intervals():
  near = {**UP, 'mean': lambda s: SOURCE + 0.01 if s else 3.5}
  summ = single_summary.summary(_results(near, noise=0.0005,
                                         pooled_gain=0.03))
  assert single_reading._near_verdict(summ['near'][1], 2, 0.02) == \
      'reproduced'
  assert all(c['holm'] and c['mean'] == pytest.approx(-0.03, abs=0.003)
             for c in summ['start'])
  assert single_reading._start_recommendation(summ['start']).startswith(
      '**pooled** Adam wins on this source')
  noisy = single_summary.summary(_results(near, noise=0.05))
  recommendation = single_reading._start_recommendation(noisy['start'])
  assert recommendation.startswith('no start wins after Holm (mean K=1: '
                                   'not claimed: ') and 'not as the better' \
      in recommendation
  # Claim 1 with an interval straddling the margin: not claimed, not
  # "not reproduced"; the detectable difference is printed.
  assert single_reading._near_verdict(noisy['near'][1], 2, 0.02).startswith(
      'not claimed: interval holds 0 (detectable 0.')


def test_claim_2_tells_unresolved_from_contradicted():
  # mean - first: +0.0043 [-0.0175, +0.0261] (unresolved); first - random
  # resolved negative.
  family = [{'K': 1, 'better': 'mean', 'worse': 'first', 'holm': False,
             'mean': 0.0043, 'sd': 0.0137, 'n': 4, 'low': -0.0175,
             'high': 0.0261, 'detectable': 0.0213},
            {'K': 1, 'better': 'first', 'worse': 'random', 'holm': True,
             'mean': -0.11, 'sd': 0.01, 'n': 4, 'low': -0.126,
             'high': -0.094, 'detectable': 0.02}]
  assert common.ranking_verdict(family, 1) == (
      'not reproduced (mean < first: not claimed: interval holds 0; '
      'first < random: reproduced)')
  # Resolved the other way (first beats mean, beyond what seeds detect).
  family[0].update(holm=True, mean=0.05, low=0.03, high=0.07)
  assert common.ranking_verdict(family, 1).startswith('contradicted')
  # Resolved and Holm-rejected, but below the detectable effect: not claimed.
  family[0].update(mean=0.0043, sd=0.0025, low=0.0003, high=0.0083)
  assert common.ranking_verdict(family, 1).startswith(
      'not reproduced (mean < first: not claimed: ')


def test_recall_median_counts_censored_seeds_beyond_every_observed_one():
  assert single_summary.censored_median([500, None, 575]) == 575
  assert single_summary.censored_median([500, None, None]) == math.inf
  assert single_reading._median({'k': 3, 'median': 6.0, 'steps': [5, 6, 7]},
                                '192 steps') == ' (median 6 steps; each: 5, 6, 7)'
  assert single_reading._median({'k': 1, 'median': math.inf,
                                 'steps': [500, None, None]},
                                '192 steps').startswith(' (median > 192 steps')


def test_claim_3_reads_each_seed_on_its_own_scratch_curve():
  results = _results(UP)  # Every seed's uptrained loss is 3.0.
  summ = single_summary.summary(results)
  # Seed s's K = 1 scratch curve is 5.01 + 0.001 (s - 2) - step / 30: on
  # the seed-mean curve every seed would read 60.3.
  E = summ['compute'][1][2]['E']
  np.testing.assert_allclose(E, [30 * (5.01 + 0.001 * (s - 2) - 3.0)
                                 for s in (1, 2, 3)], atol=1e-6)
  assert summ['compute_unpaired'][1] == []
  # A seed without a scratch run falls back to the seed-mean curve, named.
  results['lm']['scratch'] = [r for r in results['lm']['scratch']
                              if r['seed'] != 3]
  summ = single_summary.summary(results)
  assert summ['compute_unpaired'][1] == [3]
  lines = '\n'.join(single_reading.reading(results, summ))
  assert 'seeds 3 have no scratch run' in lines


def _with_task_scores(results):
  """Made-up --tasks scores: at both alphas scored, acc = the method's
  level + 0.01 seed (+ 0.03 at the larger alpha, for mean); from scratch,
  MHA 0.1 above K = 1 with a seed-varying jitter."""
  level = {'identity': 0.5, 'mean': 0.4, 'first': 0.35, 'random': 0.3}
  runs = [{'method': m, 'K': 4 if m == 'identity' else 1, 'start': 'fresh',
           'seed': seed, 'step': step, 'scores': {'choice': {
               'acc': level[m] + 0.01 * seed + 0.03 * (
                   m == 'mean' and step == 16) + 0.002 * seed ** 2 * (
                       m == 'random')}},
           **({'replay_loss': 3.0, 'run_loss': 3.0 + 1e-7 * seed}
              if step == 4 else {})}
          for m in level for seed in (1, 2, 3) for step in (4, 16)]
  results['lm']['tasks'] = {
      'settings': {}, 'documents': {'choice': 4},
      'higher_is_better': {'choice': {'acc': True}},
      'source': {'choice': {'acc': 0.55}}, 'runs': runs,
      'scratch': [{'K': K, 'seed': s, 'step': 120, 'scores': {'choice': {
          'acc': 0.3 + 0.1 * (K == 4) + 0.01 * s * (K == 4) ** s}}}
                  for K in (4, 1) for s in (1, 2, 3)]}
  return results


def test_task_scores_are_paired_against_the_control_at_each_alpha():
  results = _with_task_scores(_results(UP, noise=0.0005))
  summ = single_summary.summary(results)
  assert list(summ['tasks']) == ['uptrained α = 0.05 (4 steps)',
                                 'uptrained α = 0.2 (16 steps)',
                                 'from scratch, step 120']
  at = {c['arm']: c for c in summ['tasks']['uptrained α = 0.2 (16 steps)']}
  assert set(at) == {'mean K=1', 'first K=1', 'random K=1'}
  assert at['mean K=1']['reference'] == 'identity (control)'
  assert at['mean K=1']['difference']['mean'] == pytest.approx(-0.07)
  assert at['mean K=1']['seeds'] == [1, 2, 3]
  d = stats.paired(at['random K=1']['values'],
                   at['random K=1']['reference_values'])
  assert at['random K=1']['difference']['low'] == pytest.approx(d.low)
  assert at['random K=1']['detectable'] == pytest.approx(
      stats.detectable(d.sd, 3))
  scratch = summ['tasks']['from scratch, step 120'][0]
  assert (scratch['arm'], scratch['reference']) == ('K=1', 'MHA')
  text = '\n'.join(single_tables.task_lines(results))
  assert 'differs from the run\'s by at most 3.0e-07 nats' in text
  assert 'The source: choice acc 0.55.' in text
  assert '| choice | acc ↑ | 0.52 [' in text  # The control's mean.
  assert f'| choice | acc ↑ | random K=1 | {d:+.4g} |' in text
  assert '| choice | acc | 3 | 0.53 | 0.43 | 0.38 |' in text  # By seed.
  assert '**not** the run' not in text
  results['lm']['tasks']['runs'][0]['run_loss'] = 3.01  # A replay off.
  assert '**not** the run\'s state' in '\n'.join(
      single_tables.task_lines(results))
  assert single_tables.task_lines(_results(UP)) == []  # No --tasks.


def test_mla_plan_matches_the_gqa_targets_cache_bytes():
  mc = config_lib.model_config(design.source_config('uptrain_source', None))
  # N = 4 heads of H = 16, RoPE: 2·N = 8 RoPE dims (a pair per head), the
  # rest of 2·K·H to the latent.
  for K, rank in ((2, 56), (1, 24)):
    plan = design.mla_plan(mc, K)
    assert (plan['kv_lora_rank'], plan['qk_rope_head_dim']) == (rank, 8)
    assert plan['kv_bytes_per_token'] == plan['gqa_kv_bytes_per_token'] == \
        2 * K * 16 * mc.num_layers * 4  # float32.
  recall = config_lib.model_config(design.source_config(
      'uptrain_recall', None))  # No RoPE: the whole budget to the latent.
  plan = design.mla_plan(recall, 1)
  assert (plan['kv_lora_rank'], plan['qk_rope_head_dim']) == (32, 0)
  assert plan['kv_bytes_per_token'] == plan['gqa_kv_bytes_per_token']
  # A latent capped at its full rank (d_model 16 < 2·2·16 - 8): the
  # nearest, and the bytes say so.
  narrow = design.mla_plan(dataclasses.replace(mc, d_model=16), 2)
  assert narrow['kv_lora_rank'] == 16
  assert narrow['kv_bytes_per_token'] < narrow['gqa_kv_bytes_per_token']


def test_gta_and_gla_plans_sit_at_mla_belows_cache_bytes():
  mc = config_lib.model_config(design.source_config('uptrain_source', None))
  below = design.mla_below_plan(mc, [2, 1])
  assert below['kv_bytes_per_token'] == 32 * mc.num_layers * 4  # GQA-1's.
  # GLA-2: MLA-below's latent and RoPE dims, so its bytes.
  gla = design.gla_plan(mc, [2, 1])
  assert (gla['kv_lora_rank'], gla['qk_rope_head_dim'],
          gla['latent_groups']) == (24, 8, 2)
  assert gla['kv_bytes_per_token'] == below['kv_bytes_per_token']
  # What the reports read of a plan, and the conversion it passes through
  # (`train.convert.to_mla`, the one place that reads those settings).
  assert to_mla.latent(gla) == (24, 8, 2) and to_mla.latent(below) == (
      24, 8, 1)
  assert to_mla.arguments(gla) == dict(kv_lora_rank=24, qk_rope_head_dim=8,
                                       latent_groups=2)
  # GTA caches K·H + Y (H = 16, Y even in 2..14, K | 4): 32 numbers is not
  # among them; 30 (K = 1, Y = 14) and 34 (K = 2, Y = 2) are as near, and
  # the tie goes to the smaller cache. Its GQA partner: K = 1 (32 numbers).
  gta = design.gta_plan(mc, below['kv_bytes_per_token'], [2, 1])
  assert (gta['K'], gta['qk_rope_head_dim']) == (1, 14)
  assert gta['kv_bytes_per_token'] == 30 * mc.num_layers * 4
  assert (gta['partner_K'], gta['partner_kv_bytes_per_token']) == (
      1, below['kv_bytes_per_token'])
  # Where a layout has the bytes exactly, it is the one: GQA-2's 64 numbers
  # is GTA K = 2 with a 32-wide key, out of range; 40 = K = 2, Y = 8 is in.
  exact = design.gta_plan(mc, 40 * mc.num_layers * 4, [2, 1])
  assert (exact['K'], exact['qk_rope_head_dim']) == (2, 8)
  assert exact['kv_bytes_per_token'] == exact['target_kv_bytes_per_token']
  # GLA needs 2 groups to divide the latent: tiny's MLA-below has R = 1.
  tiny = config_lib.model_config(design.source_config('tiny', 40))
  assert design.gla_plan(tiny, [1]) is None


def test_tpa_plan_sits_nearest_mla_belows_bytes_beside_its_gqa_partner():
  mc = config_lib.model_config(design.source_config('uptrain_source', None))
  below = design.mla_below_plan(mc, [2, 1])
  # TPA of rank K caches 2·K·(N + H) numbers (N = 4, H = 16): 40, 80, 160
  # for K = 1, 2, 4; nearest MLA-below's 32 is K = 1, a quarter above it.
  # Its partner: mean-pooled K = 1 (32 numbers), the model it converts.
  tpa = design.tpa_plan(mc, below['kv_bytes_per_token'], [2, 1])
  layer_bytes = mc.num_layers * 4  # float32.
  assert (tpa['K'], tpa['method'], tpa['pooling']) == (1, 'tpa', 'mean')
  assert tpa['kv_bytes_per_token'] == 40 * layer_bytes
  assert tpa['target_kv_bytes_per_token'] == below['kv_bytes_per_token']
  assert (tpa['partner_K'], tpa['partner_kv_bytes_per_token']) == (
      1, 32 * layer_bytes)
  # The bytes are the converted model's (`train.convert.to_tpa`).
  converted, _ = to_tpa.target_config(dataclasses.replace(mc, num_kv_heads=1))
  assert model_lib.kv_bytes_per_token(converted) == tpa['kv_bytes_per_token']
  # At GQA-2's 64 numbers: K = 2 (80) is nearer than K = 1 (40); partner
  # GQA-2. Midway between 40 and 80 the tie goes to the smaller cache.
  at_gqa2 = design.tpa_plan(mc, 64 * layer_bytes, [2, 1])
  assert (at_gqa2['K'], at_gqa2['partner_K']) == (2, 2)
  assert at_gqa2['kv_bytes_per_token'] == 80 * layer_bytes
  assert design.tpa_plan(mc, 60 * layer_bytes, [2, 1])['K'] == 1


def test_mla_is_compared_with_mean_pooled_gqa_paired_by_seed():
  # MLA is 0.1 below mean-pooled GQA at every alpha (more or less a
  # seed's 0.002), 0.03 below at alpha 0 (one conversion each).
  mla = lambda s, seed: UP['mean'](s) - (0.03 if s == 0 else
                                         0.1 + 0.002 * (seed - 2))
  results = _results(UP, noise=0.0005, mla=mla)
  summ = single_summary.summary(results)
  K1 = summ['mla']['by_K'][1]
  assert K1['minus_gqa'][0]['mean'] == pytest.approx(-0.03)
  assert K1['minus_gqa'][0]['sd'] == 0  # Deterministic: one measurement.
  assert [c['mean'] for c in K1['minus_gqa'][1:]] == pytest.approx(
      [-0.1] * 5, abs=0.003)
  cell = summ['mla']['paper'][0]
  assert cell['holm'] and single_reading._mla_verdict(cell) == 'MLA lower'
  # The single-source default run's K=2: +0.0065 [+0.0010, +0.0120], 4 seeds.
  small = {'mean': 0.0065, 'sd': 0.003457, 'n': 4, 'low': 0.0010,
           'high': 0.0120, 'holm': True, 'detectable': 0.0072}
  assert single_reading._mla_verdict(small) == (  # pylint: disable=protected-access
      'not claimed: below the detectable effect (detectable 0.0072 nats)')
  # E on GQA K=1's scratch curve: loss 2.9 at the paper's alpha.
  np.testing.assert_allclose(K1['compute'][2]['E'], [
      30 * (5.01 + 0.001 * (s - 2) - (2.9 - 0.002 * (s - 2)))
      for s in (1, 2, 3)], atol=0.1)
  assert summ['recall']['arms']['mla_K1']['k'] == 3
  text = '\n'.join(single_reading.reading(results, summ) +
                   single_tables.tables(results, summ))
  assert ('equal cache bytes, K = 1: MLA lower** at α = 0.05' in text and
          'kv_lora_rank 24 + 8 RoPE dims = 32 numbers per token and layer, '
          '256 bytes/token as GQA K = 1\'s 256' in text)
  assert 'energy kept per layer 0.800, 0.850' in text
  assert 'kv_lora_rank 32 + 0 RoPE dims, 256 bytes/token against GQA\'s ' \
         '256, energy kept 0.800, 0.850, held-out accuracy before ' \
         'uptraining 0.300' in text
  assert '| MLA − GQA (paired) | -0.0300 (equal on all' in text
  assert '| its detectable difference | nothing detectable: no spread ' \
         'over seeds | 0.' in text
  assert 'MLA lower** at α = 0.05 (MLA minus GQA, paired by seed, Holm ' \
         'over the 1 K): -0.09' in text and ', detectable 0.0' in text
  # A same-loss MLA: not resolved, with what the seeds could detect.
  same = single_summary.summary(_results(
      UP, noise=0.0005, mla=lambda s, seed: UP['mean'](s) + 0.001 * (
          seed - 2)))
  assert single_reading._mla_verdict(same['mla']['paper'][0]).startswith(
      'not claimed: interval holds 0 (detectable 0.')
  # Results from before the MLA arm read as before.
  assert 'mla' not in single_summary.summary(_results(UP, noise=0.0005))


@pytest.mark.slow  # The plots: about 3 s.
def test_the_report_states_each_claim_and_its_provenance(tmp_path, capsys):
  single_tables.write(tmp_path, _results(
      UP, noise=0.0005, mla=lambda s, seed: UP['mean'](s) - 0.1))
  text = (tmp_path / 'report.md').read_text()
  assert '### MHA → MLA at K = 1\'s cache bytes' in text
  assert 'Runs trained by `python -m scripts.uptrain_study --out=x` at ' \
         'commit abc1234 (--out x) on a machine the results do not ' \
         'record' in text
  assert 'Claim 3, K = 1 (the marginal cost' in text and \
         'reproduced.** After 4 uptraining steps' in text
  assert 'mean K1: 2 of 3 (median 10 steps, — counted beyond the budget; ' \
         'each: 10, 10, —)' in text
  assert '**Control gate**' in text and 'It **passes**' in text
  for plot in ('curves.png', 'compute.png', 'recall.png'):
    assert (tmp_path / plot).stat().st_size > 10_000
  assert '## Reading' in capsys.readouterr().out


@pytest.mark.slowest
@pytest.mark.slow
def test_the_study_runs_end_to_end_through_the_training_loop(tmp_path):
  """On `tiny`: one uptraining run per (conversion, seed) evaluated at
  every alpha, the identity control exact at alpha 0, scratch curves for
  MHA and K per seed, the recall arm, MLA at K's bytes, provenance, task
  scores (--tasks: evaluation.evaluate's, by seed); a rerun reuses it all."""
  out = tmp_path / 'study'
  tasks = importlib.util.find_spec('lm_eval') is not None  # The eval extra.
  include = pathlib.Path(__file__).parent / 'lm_eval_tasks'
  command = [sys.executable, '-m', 'scripts.uptrain_study', f'--out={out}',
             '--single_source', '--config=tiny', '--steps=80', '--kv_heads=1',
             '--seeds=2',
             '--recall_steps=40'] + [
                 '--tasks=gqa_lab_choice', f'--include_path={include}',
                 '--task_limit=2'] * tasks
  env = {**os.environ, 'HF_DATASETS_OFFLINE': '1'}
  first = subprocess.run(command, capture_output=True, text=True, check=True,
                         env=env)
  results = json.loads((out / 'results.json').read_text())
  lm = results['lm']
  assert lm['plan']['alpha_steps'] == [1, 2, 4, 8, 16]
  assert len(lm['runs']) == 6 * 2  # 4 fresh + 2 pooled arms, 2 seeds.
  for run in lm['runs']:
    steps = [p['step'] for p in run['curve']]
    assert set([0, *lm['plan']['alpha_steps']]) <= set(steps)
    assert (out / 'runs' / run['start'] / f'{run["method"]}_K{run["K"]}'
            / f's{run["seed"]}' / 'metrics.jsonl').exists()
  identity = [r['curve'][0]['loss'] for r in lm['runs']
              if r['method'] == 'identity']
  np.testing.assert_allclose(identity, lm['source']['loss'], rtol=1e-6)
  assert sorted((s['K'], s['seed']) for s in lm['scratch']) == [
      (1, 1), (1, 2), (4, 1), (4, 2)]
  assert all(s['curve'][-1]['step'] == 96 for s in lm['scratch'])
  assert len(results['recall']['runs']) == 4 * 2
  # MHA -> MLA at K = 1's bytes, per seed, in both arms: the conversion's
  # cache (lm.model's count, in its convert.json) is GQA K = 1's.
  for arm in (lm, results['recall']):
    (conversion,) = arm['mla']['conversions']
    assert conversion['converted_kv_bytes_per_token'] == \
        conversion['gqa_kv_bytes_per_token']
    assert [r['seed'] for r in arm['mla']['runs']] == [1, 2]
  assert all((out / 'runs/fresh/mla_K1' / f's{s}' / 'final.json').exists()
             for s in (1, 2))
  assert results['provenance']['commit'] and \
      results['provenance']['out'] == str(out)
  assert '## Reading' in first.stdout
  if tasks:
    _check_task_scores(out, results, include)
  scored = {p: p.stat().st_mtime_ns for p in out.glob('tasks/**/scored.json')}
  again = subprocess.run(command, capture_output=True, text=True, check=True,
                         env=env)
  rerun = json.loads((out / 'results.json').read_text())['lm']
  assert rerun['runs'] == lm['runs'] and rerun['mla'] == lm['mla']
  assert 'from scratch' in again.stdout
  assert {p: p.stat().st_mtime_ns for p in scored} == scored  # Reused.


def _check_task_scores(out, results, include):
  """Per seed: the fresh-Adam conversions at the paper's alpha (a replay
  whose held-out loss is the run's there) and the largest, scratch end
  points; in the report paired against the control; evaluation.evaluate's."""
  from evaluation import evaluate  # pylint: disable=import-outside-toplevel
  tasks = results['lm']['tasks']
  assert sorted((r['method'], r['seed'], r['step']) for r in tasks['runs']
                ) == sorted((m, s, a) for m in single_summary.UP_METHODS
                            for s in (1, 2) for a in (4, 16))
  for r in tasks['runs']:
    assert 0 <= r['scores']['gqa_lab_choice']['acc'] <= 1
    if r['step'] == 4:
      assert r['replay_loss'] == pytest.approx(r['run_loss'], rel=1e-6)
  assert sorted((r['K'], r['seed']) for r in tasks['scratch']) == [
      (1, 1), (1, 2), (4, 1), (4, 2)]
  assert set(tasks['source']['gqa_lab_choice']) == {'acc', 'acc_norm'}
  found = results['summary']['tasks']['uptrained α = 0.2 (16 steps)']
  assert {(c['arm'], c['metric']) for c in found} == {
      (f'{m} K=1', k) for m in ('mean', 'first', 'random')
      for k in ('acc', 'acc_norm')}
  assert all(c['reference'] == 'identity (control)' and c['seeds'] == [1, 2]
             for c in found)
  report = (out / 'report.md').read_text()
  assert '## Task scores (lm-evaluation-harness)' in report
  assert ('| task | metric | identity (control) | mean K=1 | first K=1 | '
          'random K=1 |') in report
  assert '### from scratch, step 96' in report
  mean = next(r for r in tasks['runs'] if (r['method'], r['seed'], r['step'])
              == ('mean', 2, 16))
  direct = evaluate.write_results(
      str(out / 'runs' / 'fresh' / 'mean_K1' / 's2'), ['gqa_lab_choice'],
      str(out / 'direct'), include_path=str(include), limit=2)
  assert mean['scores']['gqa_lab_choice']['acc'] == (
      direct['results']['gqa_lab_choice']['acc,none'])


@pytest.mark.slow  # The plots: about 3 s.
def test_report_only_rebuilds_the_reading_from_saved_results(tmp_path,
                                                             monkeypatch):
  results = _results(UP, noise=0.0005)
  results['summary'] = {'stale': True}
  (tmp_path / 'results.json').write_text(json.dumps(results))
  monkeypatch.setattr(sys, 'argv', ['uptrain_study', f'--out={tmp_path}',
                                    '--report_only'])
  uptrain_study.main()  # Nothing to train: it would fail on made-up runs.
  saved = json.loads((tmp_path / 'results.json').read_text())
  assert 'stale' not in saved['summary'] and saved['summary']['compute']
  assert saved['provenance']['commit'] == 'abc1234'  # Who trained them.
  assert saved['provenance']['rebuilt']['command'].endswith('--report_only')
  text = (tmp_path / 'report.md').read_text()
  assert 'at commit abc1234' in text and 'rebuilt by `python -m' in text
