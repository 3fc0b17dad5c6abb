"""Tensor product attention on the KV frontier (issue 63): its points'
names, layouts and bytes, the families of pairs the design fixes, and their
Holm-corrected verdicts in the report and its reading."""

import argparse

import numpy as np
import pytest

from attention import tensor_product
from lm import config_lib
from lm import model as model_lib
from studies import stats, variants
from studies.kv_frontier import analysis, design, reading, tables


def _model_config(panel: str, v: design.Variant):
  p = design.PANELS[panel]
  config = design.variant_config(p.config, v, 1, 2, p.window)
  config_lib.validate(config, batch_shards=1)
  return config_lib.model_config(config)


def _bytes(panel: str, v: design.Variant) -> float:
  return model_lib.kv_bytes_per_token(_model_config(panel, v))


def test_a_tpa_point_is_named_as_the_benchmarks_name_it_and_set_in_model_tpa():
  """TPA<r> and TPAKV<r>, as `studies.variants` parses them, and the same
  layout: T6's factored queries (the config's q_rank) or per-head ones
  (q_rank 0), K and V of rank r, all heads (num_kv_heads = num_heads)."""
  t6 = config_lib.defaults().model.tpa.q_rank
  for v, q_rank in ((design.Variant(0, 'G', 1, rank=2), t6),
                    (design.Variant(0, 'G', 1, rank=1, kv_only=True), 0)):
    bench = variants.Variant.parse(v.name.split('_')[0])
    assert v.name == f'{bench.name}_G_share1'
    assert v.layout() == {'attention': 'tpa', 'tpa': dict(
        k_rank=v.rank, v_rank=v.rank, **({'q_rank': 0} if v.kv_only else {}))}
    mc = _model_config('lm', v)
    assert mc.layout == tensor_product.TPA(q_rank=q_rank, k_rank=v.rank,
                                           v_rank=v.rank)
    assert mc.num_kv_heads == mc.num_heads == 8
    for key, value in bench.settings:
      assert getattr(mc.layout, key) == value
    # A record's point reads the layout back from the record alone.
    record = dict(variant=v.name, num_kv_heads=8, attention_pattern='G',
                  kv_share=1, **v.layout())
    assert design.point(record).layout == mc.layout
  assert design.Variant(0, 'G', 1, rank=1).name != design.Variant(
      0, 'G', 1, rank=1, kv_only=True).name


def test_tpa_points_cost_the_bytes_the_design_states():
  """(R_K + R_V)(N + H) float32 numbers per token and layer: on the recall
  panel (N = 4, H = 16) and gqa_small (N = 8, H = 32) TPA's nearest
  ranks cost 1.25x their baselines'; with 16 heads of 16 (N = H) TPA-R
  costs exactly GQA-2R's."""
  V, TPA = design.Variant, design.TPA
  for panel in ('recall', 'lm', 'heads'):
    mc = _model_config(panel, TPA[1])
    assert _bytes(panel, TPA[1]) == (
        2 * (mc.num_heads + mc.head_dim) * 4 * mc.num_layers)
  assert _bytes('recall', TPA[1]) == 1.25 * _bytes('recall',
                                                   design.REFERENCE)
  mqa = _bytes('lm', design.REFERENCE)
  assert _bytes('lm', TPA[1]) == 1.25 * mqa
  assert _bytes('lm', V(0, 'G', 1, latent=48, rope=16)) == mqa
  assert _bytes('lm', TPA[2]) == 1.25 * _bytes('lm', V(2, 'G', 1))
  assert _bytes('heads', TPA[1]) == _bytes('heads', V(2, 'G', 1)) == \
      _bytes('heads', design.TPAKV1)
  assert _bytes('heads', TPA[2]) == _bytes('heads', V(4, 'G', 1))
  # Not at gqa_small's 8 heads of 32: no rank matches a GQA there.
  gqa = {_bytes('lm', V(K, 'G', 1)) for K in (1, 2, 4, 8)}
  assert not gqa & {_bytes('lm', V(0, 'G', 1, rank=R)) for R in (1, 2, 3)}


def test_every_family_pair_is_trained_by_its_panel_as_its_family_says():
  """The design's families name pairs of their own panel's grid (so the
  default run makes every one): the bytes- and heads-matched families'
  arms with the same query heads, the heads family's at equal bytes; the
  paper's framing T6 with more heads than MHA at MHA's parameters (within
  0.5%) beside T6 with MHA's heads. The negative control stays."""
  params = lambda panel, v: model_lib.num_params(_model_config(panel, v))
  for name, panel in design.PANELS.items():
    for family in panel.families:
      assert family.record(panel.variants)['pairs'] == [
          [a.name, b.name] for a, b in family.pairs]
      for a, b in family.pairs:
        same_heads = _model_config(name, a).num_heads == _model_config(
            name, b).num_heads
        assert same_heads == (a != design.TPA2_PARAMS)
        if family.name == 'TPA, heads-matched':
          assert _bytes(name, a) == _bytes(name, b)
  assert [len(p.families) for p in design.PANELS.values()] == [1, 2, 1]
  more_heads = _model_config('lm', design.TPA2_PARAMS).num_heads
  assert more_heads > 2 * _model_config('lm', design.MHA8).num_heads
  assert params('lm', design.TPA2_PARAMS) == pytest.approx(
      params('lm', design.MHA8), rel=0.005)
  assert params('lm', design.TPA[2]) < 0.9 * params('lm', design.MHA8)
  assert design.TPA2_PARAMS.name == 'TPA2h17_G_share1'
  assert design.CONTROL in design.PANELS['recall'].variants


def test_a_subset_of_the_grid_keeps_the_family_pairs_it_trains():
  """--panels=heads --variants=...: the plan holds only the named variants
  and the family, recorded, only the pairs both of whose arms it trains."""
  args = argparse.Namespace(
      panels='heads', quick=False, kv_heads=None, steps=None, lm_steps=None,
      seeds=None, config='kv_recall',
      variants='TPA1_G_share1,K2_G_share1,TPA2_G_share1')
  (name, plan), = design.plan(args).items()
  assert name == 'heads' and plan.steps == 40 and plan.seeds == [1, 2, 3]
  assert [v.name for v in plan.variants] == [
      'K2_G_share1', 'TPA1_G_share1', 'TPA2_G_share1']
  (family,) = plan.panel.families
  assert family.record(plan.variants)['pairs'] == [
      ['TPA1_G_share1', 'K2_G_share1']]
  assert family.record(plan.variants[:1]) is None


def _record(v: design.Variant, nll, nbytes: float, params: int) -> dict:
  """A model's record as `measure` writes it, per-seed values made up."""
  seeds = lambda x: [float(y) for y in x]
  accuracy = seeds(np.full(3, 0.5))
  return dict(variant=v.name, num_kv_heads=16, attention_pattern='G',
              kv_share=1, **v.layout(), num_heads=16, params=params,
              kv_bytes_per_token={'float': nbytes, 'int8': nbytes * 9 / 32},
              seeds={'float': {'nll': seeds(nll), 'accuracy': accuracy},
                     'int8': {'nll': seeds(np.add(nll, [1e-3, 2e-3, 0])),
                              'accuracy': accuracy}}, kl=[1e-4] * 3)


def _heads_panel() -> dict:
  """The heads family's three pairs: TPA1 − GQA-2 worse on every seed (Holm
  rejects), TPA2 − GQA-4 resolved uncorrected but not by Holm (second
  smallest p, above 0.05 / 2), TPA-KV-only − GQA-2 within noise."""
  V, TPA = design.Variant, design.TPA
  base = 1.0 + np.array([0.01, -0.02, 0.015])
  models = [_record(V(2, 'G', 1), base, 1024, 3_082_496),
            _record(V(4, 'G', 1), base[::-1], 2048, 3_148_032),
            _record(TPA[1], base + [0.30, 0.31, 0.29], 1024, 3_016_960),
            _record(TPA[2], base[::-1] + [0.11, 0.20, 0.16], 2048,
                    3_082_496),
            _record(design.TPAKV1, base + [0.05, -0.05, 0.01], 1024,
                    3_082_496)]
  (family,) = design.PANELS['heads'].families
  families = [family.record(design.PANELS['heads'].variants)]
  return dict(config='gqa_small_h16', window=64, steps=40, seeds=[1, 2, 3],
              task='held-out text', layers=4, models=models,
              families=families,
              analysis=analysis.analyse(models, families))


def test_a_family_is_holm_corrected_before_a_verdict_is_given():
  """A pair resolved on its own (interval excludes 0, above the detectable
  effect) that Holm's step-down does not reject is 'not claimed'; the
  family's p values are those of the per-seed NLL differences."""
  (family,) = _heads_panel()['analysis']['families']
  pairs = {(e['a'], e['b']): e for e in family['pairs']}
  assert list(pairs) == [('TPA1_G_share1', 'K2_G_share1'),
                         ('TPA2_G_share1', 'K4_G_share1'),
                         ('TPAKV1_G_share1', 'K2_G_share1')]
  worse = pairs['TPA1_G_share1', 'K2_G_share1']
  holm_only = pairs['TPA2_G_share1', 'K4_G_share1']
  noise = pairs['TPAKV1_G_share1', 'K2_G_share1']
  assert worse['diff']['nll']['mean'] == pytest.approx(0.30)
  assert worse['p'] == pytest.approx(stats.p_value([0.30, 0.31, 0.29]))
  assert [worse['holm'], holm_only['holm'], noise['holm']] == [
      True, False, False]
  # The precondition that makes the Holm case one: resolved alone.
  assert 0.025 < holm_only['p'] < 0.05
  assert stats.decide(holm_only['diff']['nll']) == 'resolved'
  assert stats.decide(holm_only['diff']['nll'], rejected=False) == \
      'not claimed'
  assert (worse['num_heads_a'], worse['num_heads_b']) == (16, 16)
  assert (worse['params_a'], worse['bytes_a'], worse['bytes_b']) == (
      3_016_960, 1024, 1024)
  # An arm not trained: its pair left out, the rest still a family.
  cut = analysis.analyse(_heads_panel()['models'][:4], _heads_panel()[
      'families'])['families'][0]
  assert [e['a'] for e in cut['pairs']] == ['TPA1_G_share1', 'TPA2_G_share1']


def test_the_report_gives_each_family_its_claim_correction_and_verdicts():
  """report.md's family table and reading: the claim as the paper states
  it and the critique's, how the family was corrected, both arms' heads,
  parameters and bytes, every verdict stats.decide's with Holm's decision;
  the reading counts what is resolved which way."""
  panel = _heads_panel()
  text = tables.text(dict(
      provenance={'command': 'python -m scripts.kv_frontier --out=x',
                  'commit': 'abc1234', 'out': 'x'}, minutes=1.0,
      panels={'heads': panel}))
  assert '"matches or beats MHA/MQA/GQA/MLA on perplexity"' in text
  assert 'A public critique: the paper matched parameters, not heads' in text
  assert ('**TPA, heads-matched** (a minus b, paired by seed; the family '
          'fixed in the design before any run, Holm over the family of 3 '
          'NLL differences; H0: no difference)') in text
  row = next(line for line in text.split('\n')
             if line.startswith('| TPA2_G_share1 − K4_G_share1 |'))
  assert ('| 16 vs 16 | 3,082,496 vs 3,148,032 | 2,048 vs 2,048 (1.00x) | '
          '+0.1567 [') in row
  assert '| does not reject H0 | not claimed: failed Holm (0.' in row
  assert '| rejects H0 | resolved (' in next(
      line for line in text.split('\n')
      if line.startswith('| TPA1_G_share1 − K2_G_share1 |'))
  lines = reading.panel_reading('heads', panel)
  (bullet,) = [b for b in lines if '**TPA, heads-matched**' in b]
  assert ('. Claimed worse: TPA1_G_share1 than K2_G_share1; no other '
          'pair.') in bullet
  assert 'Holm over the family of 3 NLL differences' in bullet
  d = panel['analysis']['families'][0]['pairs'][1]['diff']['nll']
  assert reading.said(d, ' nats', rejected=False) in bullet
  # The same family the other way round: better, said as such.
  for m in panel['models']:
    if m['variant'].startswith('TPA'):
      for cache in ('float', 'int8'):
        m['seeds'][cache]['nll'] = list(2 * 1.0 - np.array(
            m['seeds'][cache]['nll']))
  panel['analysis'] = analysis.analyse(panel['models'], panel['families'])
  (bullet,) = [b for b in reading.panel_reading('heads', panel)
               if '**TPA, heads-matched**' in b]
  assert '. Claimed better: TPA1_G_share1 than K2_G_share1' in bullet
  # Nothing resolved: said so, and no pair called worse or better.
  flat = _heads_panel()
  for m in flat['models']:
    m['seeds'] = flat['models'][0]['seeds']
  flat['analysis'] = analysis.analyse(flat['models'], flat['families'])
  (bullet,) = [b for b in reading.panel_reading('heads', flat)
               if '**TPA, heads-matched**' in b]
  assert 'On NLL nothing is claimed either way.' in bullet
  assert 'Claimed worse:' not in bullet


def test_a_report_without_families_has_no_family_section():
  """Records written before the families (the published frontiers): no
  family table or bullet, and the analysis an empty list."""
  panel = dict(_heads_panel(), families=[])
  panel['analysis'] = analysis.analyse(panel['models'])
  assert panel['analysis']['families'] == []
  text = tables.text(dict(
      provenance={'command': 'c', 'commit': 'x', 'out': 'x'}, minutes=1.0,
      panels={'heads': panel}))
  assert 'heads-matched' not in text and 'Holm over the family of 3' not in text
