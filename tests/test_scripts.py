"""The scripts' own logic: fair comparisons, peers, verdicts."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from attention import dot_product_attention
from scripts import (bench_attention, bench_decode, compare, kv_frontier,
                     recall_sweep)
from studies import recall_sweep as recall_study
from studies.kv_frontier import analysis as frontier_analysis
from studies.kv_frontier import design as frontier_design
from studies.kv_frontier import reading as frontier_reading
from studies.kv_frontier import tables as frontier_tables
from studies import report, stats, study, timing, variants
from studies.compare import design
from infra import provenance
from lm import config_lib
from train import loop
from lm import model as model_lib
from infra.errors import UserError
from lm.model import Transformer


def _params(config):
  mc = config_lib.model_config(config)
  return sum(x.size for x in jax.tree.leaves(jax.eval_shape(
      lambda: loop.init_params(Transformer(mc), 0))))


@pytest.mark.parametrize('K', [2, 1])
def test_equal_params_widens_the_mlp_to_mha_size(K):
  mha = _params(design.variant_config('gqa_small', 8, 0, 10, False))
  plain = _params(design.variant_config('gqa_small', K, 0, 10, False))
  equal = _params(design.variant_config('gqa_small', K, 0, 10, True))
  assert plain < 0.9 * mha
  assert equal == pytest.approx(mha, rel=0.005)


@pytest.mark.slow
def test_the_repeat_kv_peer_computes_the_same_attention():
  q = jax.random.normal(jax.random.key(0), (2, 16, 8, 8))
  k, v = jax.random.normal(jax.random.key(1), (2, 2, 16, 2, 8))
  np.testing.assert_allclose(
      bench_attention.repeat_kv_attention(q, k, v),
      dot_product_attention(q, k, v, is_causal=True), atol=1e-5)


def test_a_benchmark_rewrites_its_own_sections_of_benchmarks_md(tmp_path):
  """bench_attention --markdown replaces its two sections and keeps the
  others (the training step's, the GPU notes) as they were."""
  path = tmp_path / 'BENCHMARKS.md'
  path.write_text('# Benchmarks\n\n## Training shapes (causal; B=8, N=8, '
                  'H=64)\n\nold table\n\n## Training step: train.main '
                  'against PyTorch\n\nkept\n')
  env = dict(machine='cpu', jax='0', torch=None, dtype='float32',
             read_bandwidth_GBps=10.0)
  rows = [dict(shape='train', T=512, K=2, mode='fwd', ours=0.1, **{
      'jax.nn': 0.2, 'repeat': 0.3, 'ours/best_peer': 0.5}),
          dict(shape='decode', K=2, seconds=0.01, bytes_per_sec=1e9,
               fraction_of_bandwidth=0.1, speedup_vs_mha=2.0)]
  for title, body in bench_attention.markdown(env, rows, '--x').items():
    timing.replace_section(str(path), title, body)
  text = path.read_text()
  assert 'old table' not in text and '| 512 | 2 | fwd | 100.0 |' in text
  assert text.count('Written by `python -m scripts.bench_attention --x`') == 2
  assert '## Training step: train.main against PyTorch\n\nkept\n' in text
  assert text.index('## Decode shapes') > text.index('## Training step')
  assert '|\n## ' not in text  # A blank line before every next section.


@pytest.mark.parametrize('K', [16, 4, 1])
def test_the_pytorch_decode_peer_is_the_same_layer_step(K):
  """bench_decode --layer: the PyTorch step and our pure-JAX path, from the
  same weights and cache, give our layer's output, twice (the same slot
  rewritten)."""
  contestants = bench_decode.layer_contestants(K, batch=2, context=24)
  for _ in range(2):
    expected = np.asarray(contestants['ours']())
    np.testing.assert_allclose(contestants['torch']().numpy(), expected,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(contestants['ours_jax'](), expected,
                               rtol=1e-4, atol=1e-4)
  assert expected.shape == (2, 1, bench_decode.D)
  assert np.abs(expected).mean() > 0.1  # Not a vacuous agreement.


def test_bench_decode_layer_writes_its_rows_and_its_section(tmp_path,
                                                            monkeypatch):
  markdown = tmp_path / 'BENCHMARKS.md'
  markdown.write_text('# Benchmarks\n\n## Other\n\nkept\n')
  monkeypatch.setattr(sys, 'argv', [
      'bench_decode', '--layer', '--kv_heads=4', '--batches=1',
      '--contexts=16', '--repeats=1', f'--out={tmp_path / "out"}',
      f'--markdown={markdown}'])
  bench_decode.main()
  rows = json.loads((tmp_path / 'out' / 'decode_layer.json').read_text())[
      'rows']
  assert [(r['num_kv_heads'], r['batch'], r['context']) for r in rows] == [
      (4, 1, 16)]
  assert min(rows[0][f'{name}_seconds'] for name in ('ours', 'ours_jax',
                                                     'torch')) > 0
  text = markdown.read_text()
  assert f'## {bench_decode.LAYER_SECTION}' in text and '| 4 | 1 | 16 |' in text
  assert '## Other\n\nkept' in text


def test_bench_decode_ranks_bytes_beside_speed_naming_inversions_past_noise():
  """A layout with fewer KV bytes per token that decodes slower than one
  with more is named only when its fastest round is below the other's
  slowest; within the noise (ranges overlapping) it is not."""
  def row(name, per_token, median, low, high):
    return dict(variant=name, batch=256, context=2048,
                kv_bytes_per_token=per_token, tokens_per_sec=median,
                tokens_per_sec_min=low, tokens_per_sec_max=high)
  rows = [row('K2', 2048, 100, 95, 105), row('K1', 1024, 200, 190, 210),
          row('GTA1', 768, 150, 140, 160), row('MLA48', 1024, 104, 99, 106)]
  [ranked] = bench_decode.rankings(rows)
  assert ranked['by_bytes'] == ['GTA1', 'K1', 'MLA48', 'K2']
  assert ranked['by_speed'] == ['K1', 'GTA1', 'MLA48', 'K2']
  assert ranked['inversions'] == [('GTA1', 'K1')]  # MLA48 ~ K2: noise.
  text = '\n'.join(bench_decode.ranking_markdown(ranked))
  assert 'GTA1 slower than K1.' in text and '| 2 | K1 | GTA1 |' in text
  rows[2]['tokens_per_sec_max'] = 195  # Overlaps K1's 190-210.
  [ranked] = bench_decode.rankings(rows)
  assert ranked['inversions'] == []
  assert 'the other\'s slowest): none.' in '\n'.join(
      bench_decode.ranking_markdown(ranked))


def test_profile_decode_sorts_operations_into_kinds():
  from scripts import profile_decode  # pylint: disable=import-outside-toplevel
  kinds = {name: profile_decode.kind(name) for name in (
      'ffi_call.34', 'custom-call.2', 'dot_general.241', 'dot.68',
      'ynn_fusion.15', 'multiply_multiply_fusion.2', 'copy.3')}
  assert kinds == {'ffi_call.34': 'decode kernel',
                   'custom-call.2': 'decode kernel',
                   'dot_general.241': 'matmul', 'dot.68': 'matmul',
                   'ynn_fusion.15': 'fusion',
                   'multiply_multiply_fusion.2': 'fusion', 'copy.3': 'other'}


@pytest.mark.slow
def test_profile_decode_finds_the_kernel_in_a_decode_step():
  """The command (its own process: XLA records operations only when told
  before it starts) names the decode kernel among a step's operations, a
  share of it taken by each kind; with the kernel off (the control) none
  is the kernel's."""
  from attention import cpu_kernel  # pylint: disable=import-outside-toplevel
  if not cpu_kernel.available():
    pytest.skip('the CPU kernel is not built')
  command = [sys.executable, '-m', 'scripts.profile_decode', '--config=tiny',
             '--variants=K2', '--batches=2', '--contexts=16', '--repeats=1']
  run = lambda mode: subprocess.run(
      command, capture_output=True, text=True, timeout=300,
      env={**os.environ, cpu_kernel.ENV: mode})
  on, off = run('auto'), run('off')
  assert on.returncode == 0 == off.returncode, on.stderr[-2000:]
  first = on.stdout.splitlines()[0]
  assert first.startswith('K2 batch 2 context 16: ') and 'decode kernel' in (
      first), on.stdout
  assert 'matmul' in off.stdout and 'decode kernel' not in off.stdout


@pytest.mark.slow
def test_bench_decode_reports_the_share_of_the_lower_bound(tmp_path,
                                                          monkeypatch):
  """The roofline is max(bytes / bandwidth, FLOPs / peak) per token: the
  share reported is of the lower of the two tokens/s bounds. A tiny model
  is bound by bandwidth; a peak of 1 MFLOP/s makes its FLOP bound the
  lower one, so the share must follow it."""
  monkeypatch.setattr(bench_decode.flops, 'peak_flops',
                      lambda: (1e6, 'a test peak'))
  markdown = tmp_path / 'BENCHMARKS.md'
  monkeypatch.setattr(sys, 'argv', [
      'bench_decode', '--config=tiny', '--kv_heads=4,1', '--batches=2',
      '--contexts=16', '--repeats=1', f'--out={tmp_path / "out"}',
      f'--markdown={markdown}'])
  bench_decode.main()
  results = json.loads((tmp_path / 'out' / 'decode.json').read_text())
  assert results['provenance']['command'].startswith(
      'python -m scripts.bench_decode --config=tiny')
  assert results['provenance']['commit']
  for r in results['rows']:
    bound = r['compute_roofline_tokens_per_sec']
    assert bound < r['bandwidth_roofline_tokens_per_sec']
    assert r['fraction_of_roofline'] == pytest.approx(
        r['tokens_per_sec'] / bound)
  text = markdown.read_text()
  machine = provenance.machine()
  assert (f'## {bench_decode.MODEL_SECTION} '
          f'({bench_decode.vm_kind(machine)})') in text
  assert provenance.describe(machine) in text  # The CPU named.
  share = round(100 * results['rows'][1]['fraction_of_roofline'])
  assert '| 1 | 2 | 16 | ' in text and f'| {share}% |' in text
  for r in results['rows']:  # Every round within its reported range.
    assert r['tokens_per_sec_min'] <= r['tokens_per_sec'] <= r[
        'tokens_per_sec_max']


@pytest.mark.slow
def test_bench_decode_times_each_named_variant(tmp_path, monkeypatch):
  """--variants: a row per layout, its fields and its cache as that layout
  holds it: tiny's GTA with K=2 tied heads caches K·H + Y numbers a token
  and layer where GQA-2 caches 2·K·H; GLA's latent A + Y whatever its
  groups, and each latent number serves N/G heads."""
  markdown = tmp_path / 'BENCHMARKS.md'
  monkeypatch.setattr(sys, 'argv', [
      'bench_decode', '--config=tiny', '--variants=K2,GTA2,GLA32g2',
      '--batches=2', '--contexts=16', '--repeats=1',
      f'--out={tmp_path / "out"}', f'--markdown={markdown}'])
  bench_decode.main()
  rows = {r['variant']: r for r in json.loads(
      (tmp_path / 'out' / 'decode.json').read_text())['rows']}
  assert list(rows) == ['K2', 'GTA2', 'GLA32g2']
  assert all(r['tokens_per_sec'] > 0 for r in rows.values())
  K, H, Y, N, L, A, G = 2, 8, 4, 4, 2, 32, 2  # tiny: Y = H / 2, 2 layers.
  assert rows['K2']['kv_bytes_per_token'] == 2 * K * H * 4 * L
  assert rows['GTA2']['kv_bytes_per_token'] / rows['K2'][
      'kv_bytes_per_token'] == (K * H + Y) / (2 * K * H)
  assert rows['GLA32g2']['kv_bytes_per_token'] == (A + Y) * 4 * L
  assert (rows['K2']['attention'], rows['K2']['layout']) == ('gqa', {})
  assert (rows['GTA2']['attention'], rows['GTA2']['num_kv_heads'],
          rows['GTA2']['layout']['qk_rope_head_dim']) == ('gta', K, Y)
  gla = rows['GLA32g2']
  assert (gla['attention'], gla['layout']['kv_lora_rank'],
          gla['layout']['latent_groups'], gla['num_kv_heads']) == (
              'mla', A, G, N)
  # FLOPs per float32 byte: GQA 2·G / 4 = 1; GLA 2·N·(2·A/G + Y) / (A + Y) / 4.
  assert rows['K2']['attention_flops_per_kv_byte'] == 1
  assert rows['GLA32g2']['attention_flops_per_kv_byte'] == pytest.approx(
      2 * N * (2 * A / G + Y) / (A + Y) / 4)
  text = markdown.read_text()
  for name, r in rows.items():
    assert f'| {name} | {r["num_kv_heads"]} | 2 | 16 | ' in text
  assert (tmp_path / 'out' / 'decode.png').stat().st_size > 0


def test_variants_name_their_fields():
  """Every variant sets model.attention and every layout's settings (its
  own, the others' defaults), so that one variant's MLA or GLA cannot leak
  into the next one timed."""
  config = config_lib.load('gqa_small')
  model = config.model
  for name, fields in (
      ('K1', (1, 'gqa', None, 1)), ('GLA48g2', (8, 'mla', 48, 2)),
      ('GTA2', (2, 'gta', None, 1)), ('MLA48', (8, 'mla', 48, 1))):
    variants.Variant.parse(name).apply_to(model)
    assert (model.num_kv_heads, model.attention, model.mla.kv_lora_rank,
            model.mla.latent_groups) == fields, name
    config_lib.validate(config, batch_shards=1)  # No other layout's set.
  for name, fields in (('TPA2', (8, 'tpa', 6, 2, 2)),
                       ('TPAKV3', (8, 'tpa', 0, 3, 3)),
                       ('K2', (2, 'gqa', 6, 2, 2))):
    variants.Variant.parse(name).apply_to(model)
    tpa = model.tpa
    assert (model.num_kv_heads, model.attention, tpa.q_rank, tpa.k_rank,
            tpa.v_rank) == fields, name
    config_lib.validate(config, batch_shards=1)
  for bad in ('K0', 'GQA2', 'GLA48', 'MLA', 'k2', 'GTA2,', 'TPA0', 'TPA',
              'TPAKV'):
    with pytest.raises(ValueError, match='is not a variant'):
      variants.Variant.parse(bad)


@pytest.mark.slow
def test_bench_decode_equal_params_times_the_models_compare_trains():
  """--equal_params: each K is timed with the MLP compare --equal_params
  trains it with (wider for fewer K/V heads), not the config's."""
  results = bench_decode.run('tiny', [4, 1], batches=[1], contexts=[8],
                             repeats=1, equal_params=True)
  widths = {r['num_kv_heads']: r['mlp_dim'] for r in results['rows']}
  for K in (4, 1):
    config = design.variant_config('tiny', K, seed=0, steps=0,
                                    equal_params=True)
    assert widths[K] == config.model.mlp_dim
  assert widths[1] > widths[4] == config_lib.load('tiny').model.mlp_dim


@pytest.mark.parametrize('K', [4, 2, 1])
@pytest.mark.slow
def test_the_pytorch_training_peer_is_the_same_network(K):
  """bench_train's PyTorch model: our parameter count, and our logits when
  given our parameters (so the benchmark times the same computation)."""
  torch = pytest.importorskip('torch')
  from scripts import bench_train  # pylint: disable=import-outside-toplevel
  config = config_lib.load('tiny')
  config.model.update(num_heads=4, num_kv_heads=K)
  mc = config_lib.model_config(config)
  model = Transformer(mc)
  params = jax.tree.map(np.asarray, loop.init_state(
      model, loop.make_optimizer(config.train)[0], 0).params)
  peer = bench_train.TorchTransformer(mc)
  assert sum(p.numel() for p in peer.parameters()) == _params(config)
  peer.load_params(params)
  tokens = np.random.default_rng(0).integers(0, mc.vocab_size, (2, mc.max_len))
  with torch.no_grad():
    theirs = peer(torch.from_numpy(tokens)).numpy()
  np.testing.assert_allclose(theirs, model.apply({'params': params}, tokens),
                             atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize('layout, named', [
    (dict(kv_share=2), 'kv_share'), (dict(post_norms=True), 'post_norms'),
    (dict(final_logits_soft_cap=30.0), 'final_logits_soft_cap'),
    (dict(query_pre_attn_scalar=16.0), 'query_pre_attn_scalar'),
    (dict(logits_soft_cap=50.0), 'logits_soft_cap')])
def test_the_pytorch_training_peer_refuses_what_it_does_not_mirror(layout,
                                                                  named):
  pytest.importorskip('torch')
  from scripts import bench_train  # pylint: disable=import-outside-toplevel
  config = config_lib.load('tiny')
  assert bench_train.TorchTransformer.refusal(
      config_lib.model_config(config)) is None
  config.model.update(**layout)
  refusal = bench_train.TorchTransformer.refusal(
      config_lib.model_config(config))
  assert refusal == (f'the PyTorch peer does not build {named}; benchmark a '
                     'config with the default conventions')
  with pytest.raises(UserError, match=re.escape(refusal)):
    bench_train.TorchTransformer(config_lib.model_config(config))


@pytest.mark.slow
def test_recall_sweep_writes_every_cell_with_its_seeds(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, 'argv', [
      'recall_sweep', f'--out={tmp_path}', '--kv_heads=1', '--head_dims=4',
      '--seeds=2', '--steps=20', '--eval_every=10', '--d_model=32'])
  recall_sweep.main()
  sweep = json.loads((tmp_path / 'sweep.json').read_text())
  assert [(c['K'], c['H']) for c in sweep['cells']] == [(1, 4)]
  for cell in sweep['cells']:
    assert [r['seed'] for r in cell['runs']] == [0, 1]
    assert [h['step'] for h in cell['runs'][0]['history']] == [10, 20]
    assert all(0 <= r['first'] <= 1 for r in cell['runs'])
  # K/V bytes per token: 2 layers x (keys + values) x K x H x 4 bytes.
  assert [c['kv_bytes'] for c in sweep['cells']] == [2 * 2 * 1 * 4 * 4]
  report = (tmp_path / 'report.md').read_text()
  assert '| 4 | ' in report and '| K=1 |' in report and '(0/2)' in report
  assert 'mean ± sd over seeds' in report
  assert (f'; commit {provenance.commit()} on '
          f'{provenance.describe(provenance.machine())}.') in report
  assert sweep['meta']['provenance']['out'] == str(tmp_path)
  assert (tmp_path / 'recall.png').stat().st_size > 0
  # Rerun: its finished runs are reused, histories and all; under other
  # settings they are refused before anything trains (issue 39).
  recall_sweep.main()
  again = json.loads((tmp_path / 'sweep.json').read_text())
  strip = lambda runs: [{k: v for k, v in r.items() if k not in (
      'seconds', 'reused')} for r in runs]
  assert strip(again['cells'][0]['runs']) == strip(sweep['cells'][0]['runs'])
  assert all(r['reused'] for r in again['cells'][0]['runs'])
  monkeypatch.setattr(sys, 'argv', [*sys.argv, '--steps=30'])
  with pytest.raises(UserError, match=r'K1_H4_s0 holds a finished run with '
                     r'other settings \(train.steps 20 -> 30; '):
    recall_sweep.main()


def _sweep_cell(K, H, learnt):
  """A recall_sweep cell as sweep.json holds it: per seed, learnt (reached
  0.95 at step 500) or not (0.2)."""
  return dict(K=K, H=H, kv_bytes=2 * 2 * K * H * 4, runs=[
      dict(seed=s, first=1.0 if ok else 0.2, reached=500 if ok else None)
      for s, ok in enumerate(learnt)])


def test_recall_sweep_verdicts_are_stats_decide_on_counted_seeds():
  """Whether a seed learns retrieval is all or nothing: each K against the
  most K/V heads is paired by seed on it (1 or 0), and the verdict is
  stats.decide's: every seed alike is 'equal on all seeds', never a
  claim; the reading claims nothing it does not resolve."""
  cells = [_sweep_cell(8, 16, [1, 1, 1]), _sweep_cell(1, 16, [1, 1, 1]),
           _sweep_cell(8, 8, [0, 1, 0]), _sweep_cell(1, 8, [1, 1, 0])]
  cell = {(c['K'], c['H']): c for c in cells}
  found = {(c['H'], c['K']): c for c in recall_study.comparisons(
      cell, [8, 1], [16, 8])}
  assert found[16, 1]['verdict'] == 'not claimed: equal on all seeds'
  d = found[8, 1]['difference']
  assert (found[8, 1]['learnt'], found[8, 1]['reference_learnt']) == (2, 1)
  assert d.mean == pytest.approx(1 / 3)
  assert stats.decide(d) == 'not claimed'
  assert found[8, 1]['verdict'] == stats.decision(d).words == (
      'not claimed: interval holds 0')
  meta = dict(argv=['--out=x'], description='recall', model='m', steps=500,
              batch_size=64, seeds=3, minutes=1.0, pairs=8)
  report = '\n'.join(recall_study.report_lines(cell, [8, 1], [16, 8], meta))
  assert ('no difference of K is claimed at any head size (1 not claimed: '
          'equal on all seeds, 1 not claimed: interval holds 0)') in report
  assert '| 8 | 1 | 2/3 / 1/3 | +0.33 [' in report
  assert report.count('| not claimed: interval holds 0 |') == 1
  # Six seeds that all learn with K = 1 and half with K = 8: still the
  # seeds' counts and stats.decide's verdict, whatever it is.
  cells = [_sweep_cell(8, 8, [0, 1, 0, 1, 0, 1]),
           _sweep_cell(1, 8, [1, 1, 1, 1, 1, 1])]
  (c,) = recall_study.comparisons({(x['K'], x['H']): x for x in cells},
                                  [8, 1], [8])
  assert c['verdict'] == stats.decision(c['difference']).words


def test_the_published_recall_sweep_rebuilds_identically(tmp_path,
                                                         monkeypatch):
  """docs/results/recall/sweep/report.md is what `python -m
  scripts.recall_sweep --out=DIR --report_only` makes from the sweep.json
  beside it, byte for byte, rebuilt here into a fresh folder from a copy of
  that JSON alone. Only the rebuild's own line (report.REBUILT: the command,
  commit and machine of the rebuild) is normalised, in both; that line is
  checked apart (`report.published_problems`: the rebuild sweep.json
  records, at a clean commit of this history, by the command that rebuilds
  this folder)."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel
  folder = 'docs/results/recall/sweep'
  published = pathlib.Path(__file__).resolve().parent.parent / folder
  shutil.copy(published / 'sweep.json', tmp_path / 'sweep.json')
  monkeypatch.setattr(sys, 'argv', ['recall_sweep', f'--out={tmp_path}',
                                    '--report_only'])
  recall_sweep.main()
  text = (published / 'report.md').read_text()
  assert report.normalise_rebuilt((tmp_path / 'report.md').read_text()) == (
      report.normalise_rebuilt(text))
  meta = json.loads((published / 'sweep.json').read_text())['meta']
  problems = report.published_problems(
      folder, meta, text, 'scripts.recall_sweep', 'sweep.json',
      made=meta.get('provenance', {}))
  assert not problems, '\n'.join(problems)


def _fake_model(K, pattern, share, nll, accuracy, nbytes,
                int8_shift=(0.003, -0.002, 0.002), latent=0, tie=False,
                groups=1, now=False):
  """A model's record as kv_frontier's runs wrote it before layouts had
  names (its layout's settings flat) or, with `now`, as they write it
  today (`Variant.layout`: model.attention and that layout's section);
  per-seed values made up: float NLL and accuracy, int8 NLL higher by
  int8_shift (0.001 on average, not resolved). latent: MLA's kv_lora_rank
  (K then 0); tie: GTA; groups: GLA's latent groups."""
  seeds = lambda x: [float(v) for v in x]
  v = frontier_design.Variant(K, pattern, share, latent, tie=tie,
                              groups=groups)
  layout = v.layout() if now else dict(
      kv_lora_rank=latent, qk_rope_head_dim=0, tie_kv=tie,
      latent_groups=groups)
  return dict(
      variant=v.name, num_kv_heads=K or 8, attention_pattern=pattern,
      kv_share=share, **layout,
      kv_bytes_per_token={'float': nbytes, 'int8': nbytes * 9 / 32},
      seeds={'float': {'nll': seeds(nll), 'accuracy': seeds(accuracy)},
             'int8': {'nll': seeds(np.add(nll, int8_shift)),
                      'accuracy': seeds(accuracy)}},
      kl=[0.001] * len(nll))


def _fake_grid(control_accuracy, control_nll=3.4):
  noise = np.array([0.01, -0.02, 0.015])
  return [
      _fake_model(1, 'G', 1, 1.0 + noise, 0.9 + noise, 128),
      # Equal bytes: better than MQA by 0.1 on every seed, give or take 0.01.
      _fake_model(2, 'G', 2, 0.9 + noise + [0.01, 0.0, -0.01], 0.95 + noise,
                  128),
      _fake_model(1, 'LLGG', 1, 1.0 + noise[::-1], 0.9 + noise, 80),
      # Equal bytes with local layers: no difference beyond noise.
      _fake_model(2, 'LLGG', 2, 1.0 + noise, 0.9 + noise[::-1], 80),
      _fake_model(1, 'L', 1, control_nll + noise[::-1],
                  control_accuracy + noise, 32)]


def test_kv_frontier_reads_the_control_pairs_equal_bytes_and_the_frontier():
  analysis = frontier_analysis.analyse(_fake_grid(control_accuracy=0.03))
  control = analysis['control']
  assert control['control'] == 'K1_L_share1'
  assert control['reference'] == 'K1_G_share1'
  assert control['sees_attention']
  assert control['diff']['accuracy']['mean'] == pytest.approx(-0.87)
  assert control['diff']['nll']['mean'] == pytest.approx(2.4)
  # A control that does as well as all-global: the setup is blind.
  blind = frontier_analysis.analyse(_fake_grid(control_accuracy=0.9,
                                         control_nll=1.0))['control']
  assert not blind['sees_attention']
  # Equal bytes: GQA-2 with CLA2 against MQA, in each pattern, paired.
  pairs = {(e['a'], e['b']): e for e in analysis['equal_bytes']}
  assert set(pairs) == {('K2_G_share2', 'K1_G_share1'),
                        ('K2_LLGG_share2', 'K1_LLGG_share1')}
  g = pairs['K2_G_share2', 'K1_G_share1']['diff']['nll']
  # The mean of per-seed differences; resolved although the two arms'
  # seeds spread by more than the paired differences do.
  assert g['mean'] == pytest.approx(-0.1) and g['resolved']
  assert g['high'] < 0 < g['detectable'] < 0.1
  local = pairs['K2_LLGG_share2', 'K1_LLGG_share1']['diff']['nll']
  assert not local['resolved']
  # int8 against float for every model, paired.
  assert len(analysis['int8']) == 5
  for e in analysis['int8']:
    assert e['delta']['nll']['mean'] == pytest.approx(0.001)
  # Main effects: the pattern over the two (K, share) pairs that have both.
  (pattern,) = [e for e in analysis['main_effects']
                if e['factor'] == 'LLGG vs G']
  assert pattern['pairs'] == 2
  # The frontier: the negative control (all-local, the cheapest) is left
  # out; then only points resolved better than every cheaper one: not MQA
  # at 128 bytes (K2_G_share2 int8 has fewer and is resolved better), nor a
  # float cache not resolved better than its int8.
  frontier = analysis['frontier']
  assert analysis['frontier_excludes'] == 'K1_L_share1'
  assert not any(name.startswith('K1_L_share1') for name in frontier)
  assert frontier[0] == 'K1_LLGG_share1 int8'
  assert 'K2_G_share2 float' not in frontier  # Not better than its int8.
  assert 'K1_G_share1 float' not in frontier
  made = frontier_tables.text(dict(
      provenance={'command': 'python -m scripts.kv_frontier --out=x',
                  'commit': 'abc1234', 'out': 'x'}, minutes=1.0,
      panels={'recall': dict(config='kv_recall', window=4, steps=10,
                             seeds=[1, 2, 3], task='the recall probe',
                             layers=4, models=_fake_grid(0.03),
                             analysis=analysis)}))
  assert 'Made by `python -m scripts.kv_frontier --out=x` at commit abc1234' \
      in made
  assert 'the setup sees attention' in made
  assert '| K2_G_share2 − K1_G_share1 | 128 | -0.1000 [' in made
  assert 'the negative control K1_L_share1 is left out' in made
  # A family of one effect is not Holm-corrected, and says so.
  assert 'a family of 1, uncorrected' in made and '| rejects H0 |' in made
  # An unresolved pair: what its interval allows and what the seeds detect,
  # not "any true difference is likely below".
  assert ('K2_LLGG_share2 − K1_LLGG_share1 (not claimed: interval holds 0): '
          'the interval allows differences up to 0.') in made
  assert 'with 80% power' in made
  assert 'likely below' not in made and 'ties' not in made
  # A difference equal on every seed has no interval, not [-inf, +inf].
  assert report.interval(stats.paired([0.5] * 3, [0.5] * 3).as_dict()) == \
      '+0.0000 (equal on all 3 seeds)'


def test_kv_frontier_pairs_mla_at_equal_bytes_and_keeps_it_off_the_factors():
  noise = np.array([0.01, -0.02, 0.015])
  models = _fake_grid(control_accuracy=0.03) + [
      # As many bytes as MQA: paired with MQA and with GQA-2 + CLA2.
      _fake_model(0, 'G', 1, 1.2 + noise[::-1], 0.8 + noise, 128,
                  latent=32),
      # Fewer: a frontier point, in no equal-bytes pair.
      _fake_model(0, 'G', 1, 1.5 + noise, 0.7 + noise, 64, latent=16)]
  analysis = frontier_analysis.analyse(models)
  pairs = {(e['a'], e['b']): e for e in analysis['equal_bytes']}
  assert set(pairs) == {('K2_G_share2', 'K1_G_share1'),
                        ('K2_LLGG_share2', 'K1_LLGG_share1'),
                        ('MLA32_G_share1', 'K1_G_share1'),
                        ('MLA32_G_share1', 'K2_G_share2')}
  assert pairs['MLA32_G_share1', 'K1_G_share1']['diff']['nll'][
      'mean'] == pytest.approx(0.2)
  # MLA is not a level of K, kv_share or the pattern: the factors are the
  # GQA grid's alone, as without it.
  assert [(e['factor'], e['pairs']) for e in analysis['main_effects']] == [
      (e['factor'], e['pairs']) for e in frontier_analysis.analyse(
          _fake_grid(control_accuracy=0.03))['main_effects']]
  assert len(analysis['int8']) == 7
  # A conversion (MQA into MLA at half its bytes): a frontier point,
  # compared with its source, not a layout of the grid or a pair.
  converted = _fake_model(0, 'G', 1, 1.3 + noise[::-1], 0.85 + noise, 64,
                          latent=16)
  converted.update(variant='MLA16_G_share1_from_K1_G_share1 +100',
                   source='K1_G_share1', uptrain_steps=100)
  with_conversion = frontier_analysis.analyse(models + [converted])
  assert with_conversion['equal_bytes'] == analysis['equal_bytes']
  assert with_conversion['main_effects'] == analysis['main_effects']
  (conversion,) = with_conversion['conversions']
  assert conversion['source'] == 'K1_G_share1'
  assert conversion['diff']['nll']['mean'] == pytest.approx(0.3)
  report = frontier_tables.text(dict(
      provenance={'command': 'python -m scripts.kv_frontier --out=x',
                  'commit': 'abc1234', 'out': 'x'}, minutes=1.0,
      panels={'recall': dict(config='kv_recall', window=2, steps=10,
                             seeds=[1, 2, 3], task='the recall probe',
                             layers=4, models=models + [converted],
                             analysis=with_conversion)}))
  assert '| MLA32_G_share1 − K1_G_share1 | 128 | +0.2000 [' in report
  assert ('| MLA16_G_share1_from_K1_G_share1 +100 | 128 → 64 | +0.3000 ['
          in report)


def _with_first(model, first):
  """MODEL (`_fake_model`'s) with first-query accuracies by seed, the same
  through both caches."""
  for cache in frontier_design.CACHES:
    model['seeds'][cache]['first'] = [float(f) for f in first]
  return model


def test_kv_frontier_reading_is_made_from_the_numbers_by_stats_decide():
  """The report's reading (no hand-written text): the control, retrieval
  counted k of n seeds, the pairs and effects with stats.decide's verdicts,
  and a text that reads an outcome only where that outcome holds."""
  noise = np.array([0.01, -0.02, 0.015])
  models = _fake_grid(control_accuracy=0.03)
  firsts = {'K1_G_share1': [0.2, 0.19, 0.93], 'K2_G_share2': [0.18, 0.2, 0.21],
            'K1_LLGG_share1': [1.0, 1.0, 0.99],
            'K2_LLGG_share2': [1.0, 0.98, 1.0],
            'K1_L_share1': [0.03, 0.04, 0.02]}
  for m in models:
    _with_first(m, firsts[m['variant']])
  analysis = frontier_analysis.analyse(models)
  panel = dict(config='kv_recall', window=2, steps=10, seeds=[1, 2, 3],
               task='the recall probe', layers=4, models=models,
               analysis=analysis)
  text = '\n'.join(frontier_reading.reading(dict(panels={'recall': panel})))
  assert text.startswith('## What it shows')
  assert ('- **recall** (10 steps of `kv_recall`), **the negative control**'
          in text)
  assert 'The setup sees attention reaching the pairs' in text
  # Retrieval is counted, a seed near the rule named.
  assert 'K1_G_share1 0/3 (first query 0.440, all answers' in text
  assert 'seed 3 at 0.930' in text and 'K1_LLGG_share1 3/3' in text
  assert 'a reading this run does not test is that local layers' in text
  # Both LLGG arms retrieve on every seed: the pair is at the floor.
  assert 'at the floor, so the pair cannot show a limit' in text
  # Every verdict is stats.decide's, with what the seeds detect.
  pair = next(e for e in analysis['equal_bytes']
              if e['a'] == 'K2_G_share2')['diff']['nll']
  places = frontier_reading.decimals(pair)
  assert (f'NLL {report.interval(pair, f"+.{places}f")} nats '
          f'({stats.decide(pair)}; detectable {pair["detectable"]:.2g})'
          ) in text
  # Nothing retrieves: no reading of a retrieval gap.
  for m in models:
    _with_first(m, [0.2, 0.2, 0.2])
  flat = '\n'.join(frontier_reading.reading(dict(panels={'recall': dict(
      panel, analysis=frontier_analysis.analyse(models))})))
  assert 'a reading this run does not test' not in flat
  assert 'at the floor' not in flat
  # A blind setup says so, in bold.
  blind = _fake_grid(control_accuracy=0.9, control_nll=1.0)
  blind_text = '\n'.join(frontier_reading.reading(dict(panels={'recall': dict(
      panel, models=blind, analysis=frontier_analysis.analyse(blind))})))
  assert '**The control is not worse on NLL (not claimed: ' in blind_text
  assert '): the setup is blind' in blind_text


def test_kv_frontier_says_not_claimed_below_the_detectable_effect():
  """An interval that excludes 0 with an effect below what the seeds
  detect is 'not claimed' in the reading, as in the tables."""
  d = stats.paired([0.036, 0.004, 0.032, 0.008, 0.02], [0.0] * 5)
  assert d.resolved and stats.decide(d) == 'not claimed'
  said = frontier_reading.said({**d.as_dict(),
                            'detectable': stats.detectable(d.sd, d.n)})
  assert '(not claimed: below the detectable effect; detectable' in said


@pytest.mark.parametrize('folder', ['docs/results/kv_frontier',
                                    'docs/results/kv_frontier/quick',
                                    'docs/results/kv_frontier/zadouri',
                                    'docs/results/kv_frontier/tpa'])
def test_a_published_kv_frontier_report_rebuilds_identically(
    tmp_path, monkeypatch, folder):
  """FOLDER/report.md is what `python -m scripts.kv_frontier --out=DIR
  --report_only` makes from the frontier.json beside it, byte for byte,
  rebuilt here into a fresh folder from a copy of that JSON alone: the
  reading included (nothing hand-written). Only the rebuild's own line
  (report.REBUILT: the command, commit and machine of the rebuild) is
  normalised, in both; that line is checked apart
  (`report.published_problems`: the rebuild frontier.json records, at a
  clean commit of this history, by the command that rebuilds FOLDER; issue
  60: zadouri and quick had been rebuilt on dirty trees)."""
  import pathlib  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel
  published = pathlib.Path(__file__).resolve().parent.parent / folder
  shutil.copy(published / 'frontier.json', tmp_path / 'frontier.json')
  monkeypatch.setattr(sys, 'argv', ['kv_frontier', f'--out={tmp_path}',
                                    '--report_only'])
  kv_frontier.main()
  text = (published / 'report.md').read_text()
  assert report.normalise_rebuilt((tmp_path / 'report.md').read_text()) == (
      report.normalise_rebuilt(text))
  problems = report.published_problems(
      folder, json.loads((published / 'frontier.json').read_text())[
          'provenance'], text, 'scripts.kv_frontier', 'frontier.json')
  assert not problems, '\n'.join(problems)


def test_kv_frontier_mla_variant_costs_what_mqa_costs():
  """The recall panel's MLA point: the latent as wide as MQA's K and V,
  so its float cache has MQA's bytes per token (int8 has fewer: one scale
  per token for the latent, not one for K and one for V)."""
  panel = frontier_design.PANELS['recall']
  mla, = [v for v in panel.variants
          if v.latent and v.pattern == 'G' and v.groups == 1]
  costs = {}
  for v in (mla, frontier_design.REFERENCE):
    config = frontier_design.variant_config(panel.config, v, 1, 2, panel.window)
    config_lib.validate(config, batch_shards=1)
    mc = config_lib.model_config(config)
    assert mc.layout.name == ('mla' if v.latent else 'gqa')
    costs[v.name] = [model_lib.kv_bytes_per_token(dataclasses.replace(
        mc, kv_cache_dtype=dtype)) for dtype in (None, 'int8')]
  (mla_float, mla_int8), (mqa_float, mqa_int8) = costs.values()
  assert mla_float == mqa_float and mla_int8 == mqa_int8 - 4 * 4  # 4 layers.


def test_kv_frontier_gta_and_gla_points_cost_what_their_pairs_say():
  """Zadouri et al.'s points: without RoPE (recall) GTA-2 holds MQA's bytes
  and GTA-1 half; with the LM panel's RoPE key of 16 (H = 32), GTA-1 holds
  (32 + 16) / 64 of MQA's; GLA holds exactly its MLA's bytes."""
  def nbytes(panel, v):
    config = frontier_design.variant_config(panel.config, v, 1, 2, panel.window)
    config_lib.validate(config, batch_shards=1)
    mc = config_lib.model_config(config)
    assert mc.layout.name == ('gta' if v.tie else 'mla' if v.latent
                              else 'gqa')
    if v.latent:
      assert mc.layout.latent_groups == v.groups
    return model_lib.kv_bytes_per_token(mc)
  V = frontier_design.Variant
  recall, lm = frontier_design.PANELS['recall'], frontier_design.PANELS['lm']
  mqa = nbytes(recall, frontier_design.REFERENCE)
  assert nbytes(recall, V(2, 'G', 1, tie=True)) == mqa
  assert nbytes(recall, V(1, 'G', 1, tie=True)) == mqa / 2
  assert nbytes(recall, V(0, 'G', 1, latent=32, groups=2)) == nbytes(
      recall, V(0, 'G', 1, latent=32))
  mqa = nbytes(lm, frontier_design.REFERENCE)
  assert nbytes(lm, V(1, 'G', 1, rope=16, tie=True)) == mqa * 48 / 64
  assert nbytes(lm, V(0, 'G', 1, latent=48, rope=16, groups=2)) == nbytes(
      lm, V(0, 'G', 1, latent=48, rope=16)) == mqa
  assert {v.name for v in recall.variants} >= {
      'GTA2_G_share1', 'GTA1_G_share1', 'GLA32g2_G_share1'}
  assert {v.name for v in lm.variants} >= {'GTA1r16_G_share1',
                                            'GLA48g2r16_G_share1'}


def test_kv_frontier_pairs_gta_with_gqa_of_its_heads_and_gla_with_mla():
  """same_heads: GTA-1 against MQA (K = 1), GLA against MLA of its latent,
  paired by seed; a GTA-2 without a GQA-2 of its pattern and sharing has no
  pair. GTA and GLA stay out of the GQA grid's main effects."""
  noise = np.array([0.01, -0.02, 0.015])
  models = _fake_grid(control_accuracy=0.03) + [
      # GTA-1: worse than MQA by 0.2 on every seed, give or take 0.01.
      _fake_model(1, 'G', 1, 1.2 + noise[::-1] * 0.5, 0.9 + noise, 64,
                  tie=True),
      _fake_model(2, 'G', 1, 1.0 + noise, 0.9 + noise, 128, tie=True),
      _fake_model(0, 'G', 1, 1.0 + noise, 0.9 + noise, 128, latent=32),
      _fake_model(0, 'G', 1, 1.0 + noise[::-1], 0.9 + noise, 128, latent=32,
                  groups=2)]
  analysis = frontier_analysis.analyse(models)
  pairs = {(e['a'], e['b']): e for e in analysis['same_heads']}
  assert set(pairs) == {('GTA1_G_share1', 'K1_G_share1'),
                        ('GLA32g2_G_share1', 'MLA32_G_share1')}
  gta = pairs['GTA1_G_share1', 'K1_G_share1']
  assert gta['bytes_ratio'] == 0.5
  assert gta['diff']['nll']['mean'] == pytest.approx(0.2, abs=0.02)
  assert gta['diff']['nll']['resolved']
  assert not pairs['GLA32g2_G_share1', 'MLA32_G_share1']['diff']['nll'][
      'resolved']
  assert all('GTA' not in e['factor'] for e in analysis['main_effects'])
  assert [e['factor'] for e in analysis['main_effects']] == [
      e['factor'] for e in frontier_analysis.analyse(_fake_grid(
          control_accuracy=0.03))['main_effects']]
  # GTA-2 and GLA hold MQA's bytes: equal-bytes pairs with MQA and GQA-2.
  equal = {(e['a'], e['b']) for e in analysis['equal_bytes']}
  assert ('GTA2_G_share1', 'K1_G_share1') in equal
  assert ('GLA32g2_G_share1', 'K1_G_share1') in equal
  report = frontier_tables.text({'provenance': {
      'command': 'test', 'commit': 'x', 'out': 'x'}, 'minutes': 1.0,
      'panels': {'recall': dict(config='kv_recall', window=2, steps=10,
                                seeds=[1, 2, 3], task='t', layers=4,
                                models=models, analysis=analysis)}})
  assert "Zadouri et al.'s pairs" in report
  assert 'GTA1_G_share1 − K1_G_share1' in report


def test_kv_frontier_reads_a_layout_however_its_record_names_it():
  """A record written before layouts had names (kv_lora_rank, tie_kv and
  latent_groups flat, read through configs._json.upgrade_model) and one
  written today (model.attention and its section) are the same point of
  the design: analysed alike, Zadouri et al.'s pairs and the main effects
  included. A GLA whose latent no MLA has finds no pair (the pairing can
  fail)."""
  noise = np.array([0.01, -0.02, 0.015])
  def grid(now):
    return [_fake_model(K, pattern, share, 1.0 + noise * (i + 1),
                        0.9 + noise, nbytes, latent=latent, tie=tie,
                        groups=groups, now=now)
            for i, (K, pattern, share, nbytes, latent, tie, groups) in
            enumerate([(1, 'G', 1, 128, 0, False, 1),
                       (2, 'G', 2, 128, 0, False, 1),
                       (1, 'LLGG', 1, 80, 0, False, 1),
                       (1, 'L', 1, 32, 0, False, 1),
                       (1, 'G', 1, 64, 0, True, 1),
                       (0, 'G', 1, 128, 32, False, 1),
                       (0, 'G', 1, 128, 32, False, 2),
                       (0, 'G', 1, 64, 16, False, 2)])]
  then, now = grid(now=False), grid(now=True)
  assert 'kv_lora_rank' in then[5] and 'kv_lora_rank' not in now[5]
  assert now[5]['attention'] == 'mla' and now[4]['attention'] == 'gta'
  for old, new in zip(then, now):
    assert frontier_design.point(old) == frontier_design.point(new)
  analysis = frontier_analysis.analyse(then)
  assert analysis == frontier_analysis.analyse(now)
  assert {(e['a'], e['b']) for e in analysis['same_heads']} == {
      ('GTA1_G_share1', 'K1_G_share1'),
      ('GLA32g2_G_share1', 'MLA32_G_share1')}
  # The GQA grid's one pair (K1 LLGG and G): GTA-1 is not a level of it.
  assert [(e['factor'], e['pairs']) for e in analysis['main_effects']] == [
      ('LLGG vs G', 1)]


def test_kv_frontier_recall_control_reaches_no_pair():
  """The negative control is blind by construction: from the first query's
  position (where its answer is predicted), four local layers reach back
  less far than the last pair's value, while the previous-token head that
  'LLGG' needs fits a local layer."""
  panel = frontier_design.PANELS['recall']
  config = frontier_design.variant_config(
      panel.config, frontier_design.CONTROL, 1, 2, panel.window)
  m, d = config.model, config.data
  reach = m.num_layers * (m.local_window - 1)
  first_query, last_value = 2 * d.recall_pairs + d.recall_gap, \
      2 * d.recall_pairs - 1
  assert m.attention_pattern == 'L' and 2 <= m.local_window
  assert first_query - last_value > reach


def test_kv_frontier_refuses_unequal_bytes_as_an_equal_bytes_pair():
  models = _fake_grid(0.03)
  models[1]['kv_bytes_per_token'] = {'float': 256, 'int8': 72}
  with pytest.raises(ValueError, match='differ in bytes'):
    frontier_analysis.analyse(models)


@pytest.mark.slowest
@pytest.mark.slow
def test_kv_frontier_trains_reads_and_reports_a_small_grid(tmp_path,
                                                           monkeypatch):
  config = tmp_path / 'small_recall.py'
  config.write_text(
      'from configs import kv_recall\n\n\ndef get_config():\n'
      '  config = kv_recall.get_config()\n'
      '  config.model.update(d_model=16, num_heads=2, head_dim=16, '
      'mlp_dim=32)\n'
      '  config.train.update(batch_size=8, eval_batches=1)\n'
      '  return config\n')
  out = tmp_path / 'out'
  monkeypatch.setattr(sys, 'argv', [
      'kv_frontier', f'--out={out}', f'--config={config}', '--quick',
      '--seeds=2', '--steps=2'])
  kv_frontier.main()
  result = json.loads((out / 'frontier.json').read_text())
  assert result['provenance']['commit'] and result['provenance'][
      'command'].startswith('python -m scripts.kv_frontier --out=')
  # Each run's own record (commit and machine), by name, for the report.
  prov = result['provenance']
  assert sorted(prov['runs']) == sorted(
      f'{v.name}_s{seed}' for v in frontier_design.PANELS[
          'recall'].quick_variants for seed in (1, 2))
  assert all(r == {'commit': prov['commit'], 'machine': prov['machine']}
             for r in prov['runs'].values())
  assert f'Runs trained: {study.describe_runs(prov["runs"])}.' in (
      out / 'report.md').read_text()
  panel = result['panels']['recall']
  assert {m['variant'] for m in panel['models']} == {
      v.name for v in frontier_design.PANELS['recall'].quick_variants}
  for m in panel['models']:
    for cache in frontier_design.CACHES:
      for metric in ('nll', 'accuracy', 'first'):
        assert len(m['seeds'][cache][metric]) == 2
    assert all(k > -1e-6 for k in m['kl'])  # A KL, up to rounding.
    assert m['num_heads'] == 2 and m['params'] > 0
  # The runs are the loop's: the float cache reads what the evaluator did.
  final = json.loads((out / 'recall' / 'runs' / 'K1_G_share1_s1' /
                      'final.json').read_text())
  ref = next(m for m in panel['models'] if m['variant'] == 'K1_G_share1')
  assert ref['seeds']['float']['nll'][0] == pytest.approx(
      final['eval_loss'], abs=1e-4)
  analysis = panel['analysis']
  assert analysis['control'] is not None
  # GQA-2 with CLA2 against MQA in 'G' and 'LLGG', MLA against both.
  assert len(analysis['equal_bytes']) == 4
  assert len(analysis['int8']) == len(panel['models']) == 6
  report = (out / 'report.md').read_text()
  assert 'Negative control' in report and stats.CONVENTION in report
  assert (out / 'frontier.png').stat().st_size > 0


def test_bench_prepare_measures_both_contestants_in_their_own_processes(
    tmp_path, monkeypatch):
  from scripts import bench_prepare  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(sys, 'argv', [
      'bench_prepare', '--sizes_mb=1', '--rounds=1', f'--out={tmp_path}'])
  bench_prepare.main()
  (row,) = json.loads((tmp_path / 'bench_prepare.json').read_text())
  assert row['megabytes'] >= 1.0
  for kind in ('prepare', 'encoder'):
    assert row[f'{kind}_mb_per_s'] > 0
    assert 50 < row[f'{kind}_peak_rss_mb'] < 1024  # Its own, not pytest's.
  assert row['ratio'] == pytest.approx(
      row['prepare_mb_per_s'] / row['encoder_mb_per_s'])


@pytest.mark.slowest
@pytest.mark.slow
def test_bench_train_times_train_main_and_torch_in_processes_of_their_own(
    tmp_path, monkeypatch):
  pytest.importorskip('torch')
  from scripts import bench_train  # pylint: disable=import-outside-toplevel
  markdown = tmp_path / 'BENCHMARKS.md'
  monkeypatch.setattr(sys, 'argv', [
      'bench_train', '--configs=tiny', '--rounds=2', '--steps=5',
      '--warmup=2', '--no_compile', f'--json={tmp_path / "out.json"}',
      f'--markdown={markdown}'])
  bench_train.main()
  row, = json.loads((tmp_path / 'out.json').read_text())['rows']
  for peer in ('ours', 'torch eager'):
    assert len(row[peer]['rounds_s']) == 2 and min(row[peer]['rounds_s']) > 0
  ratio = row['ours/torch eager']
  assert ratio['median'] == pytest.approx(
      row['ours']['tokens_per_s'] / row['torch eager']['tokens_per_s'])
  assert ratio['min'] <= ratio['max']
  text = markdown.read_text()
  assert text.startswith(f'## {bench_train.SECTION}\n')
  assert 'each contestant in its own process (5 steps' in text
