"""The source-replicated uptraining study (scripts/uptrain_replication.py):
its statistics and verdicts on made-up results whose answers are known, and
its report rebuilt from results.json alone."""

import json
import sys

import numpy as np
import pytest

from scripts import stats, uptrain_replication, uptrain_study

SOURCE = {400: 1.90, 1600: 1.66, 3200: 1.60}  # Loss of a source of S steps.


def _results(gap, noise=0.003, sources=3, drift=-0.001):
  """Sources of each length S (seeds 0..), 2 uptraining seeds each;
  mean-pooled K's loss at every read is the control's + gap(S, K, seed)
  (+ noise per uptraining seed), first-head 0.05 above mean, MLA-half
  0.03 below mean-pooled K = 1."""
  rng = np.random.default_rng(0)
  plan = {'design': 'sources', 'source_steps': list(SOURCE),
          'source_seeds': list(range(sources)), 'seeds': [1, 2],
          'kv_heads': [2, 1], 'num_heads': 4, 'head_dim': 16, 'd_model': 64,
          'paper_alpha': 0.05, 'fixed_steps': 80, 'near': 0.02,
          'rate_ratio': 1 / 3}
  mla = {'K': 2, 'kv_lora_rank': 24, 'qk_rope_head_dim': 8, 'd_model': 64,
         'kv_bytes_per_token': 256.0, 'gqa_kv_bytes_per_token': 512.0,
         'method': 'mla_half', 'energy_kept': [0.85, 0.87]}
  out = []
  for S, loss in SOURCE.items():
    read = uptrain_study.reads(S, 80)
    steps = sorted({0, read['paper'], read['fixed']})
    for seed in range(sources):
      src = loss + 0.01 * seed
      runs = []
      for method, K in (('identity', 4), ('mean', 2), ('mean', 1),
                        ('first', 2), ('first', 1), ('mla_half', 2)):
        for up in (1, 2):
          def at(step):
            if method == 'identity':
              return src + (drift if step else 0.0)
            k = 1 if method == 'mla_half' else K
            base = src + drift + gap(S, k, seed) + noise * rng.normal()
            return base + {'mean': 0.0, 'first': 0.05, 'mla_half': -0.03}[
                method] + (1.0 if step == 0 else 0.0)
          runs.append({'method': method, 'K': K, 'start': 'fresh',
                       'seed': up, 'curve': [{'step': t, 'loss': at(t),
                                              'accuracy': 0.0}
                                             for t in steps]})
      out.append({'steps': S, 'seed': seed, 'source': {'loss': src},
                  'runs': runs, 'reads': read, 'rate': 1e-3,
                  'warmup': uptrain_study.unit_steps(S), 'mla': mla})
  return {'provenance': {'command': 'python -m scripts.uptrain_study --out=x',
                         'commit': 'abc1234', 'out': 'x',
                         'machine': {'cpu': 'Xeon', 'avx2': True,
                                     'avx512f': True, 'cores': 2},
                         'statistics': stats.CONVENTION},
          'plan': plan, 'sources': out}


def _growing(S, K, seed):
  return 0.1 * np.log2(S / 400) / 3 + 0.2 + 0.004 * seed + 0.1 * (K == 1)


def _shrinking(S, K, seed):
  return 0.4 - 0.1 * np.log2(S / 400) + 0.004 * seed * (S / 400)


def test_values_are_averaged_within_a_source_and_intervals_are_over_sources():
  results = _results(_growing)
  summ = uptrain_replication.summary(results)
  gap = summ['lengths'][1600]['gap_K2']['paper']
  assert gap['n'] == 3  # Sources, not sources x uptraining seeds.
  first = next(s for s in results['sources'] if (s['steps'], s['seed']) ==
               (1600, 0))
  by_hand = (uptrain_replication.losses(first, 'mean', 2, 80)
             - uptrain_replication.losses(first, 'identity', 4, 80)).mean()
  assert gap['values'][0] == pytest.approx(by_hand)
  assert gap['within_sd'] > 0  # The uptraining seeds' spread, reported.
  # The MLA arm is paired with the GQA of equal bytes (K = 1: 32 numbers).
  assert summ['lengths'][400]['mla_partner_K'] == 1
  assert summ['lengths'][400]['mla_vs_equal_bytes']['paper']['mean'] == \
      pytest.approx(-0.03, abs=0.01)


def test_claim_1_is_decided_by_the_trend_over_source_length():
  grows = uptrain_replication.summary(_results(_growing))
  assert grows['trend']['gap_K2']['paper']['mean'] > 0
  assert grows['claim1']['paper'] == 'contradicted'
  shrinks = uptrain_replication.summary(_results(_shrinking))
  assert shrinks['claim1']['paper'] == (
      'not reproduced at this scale (the gap shrinks with the source)')
  near = uptrain_replication.summary(_results(
      lambda S, K, seed: 0.002 * seed))
  assert near['claim1']['paper'] == 'reproduced'
  # A gap whose distance from the margin is below what 3 sources detect.
  unsure = uptrain_replication.summary(_results(
      lambda S, K, seed: 0.02 + 0.03 * (seed - 1), noise=0.0))
  assert unsure['claim1']['paper'] == 'not claimed'


def test_the_gate_reads_the_drift_at_every_read_and_withholds_claim_1():
  summ = uptrain_replication.summary(_results(_growing, drift=-0.08))
  assert not summ['gate'][3200]['passes']
  assert summ['claim1']['paper'] == 'not claimed (below the control gate)'
  steps = [d['step'] for d in summ['lengths'][400]['drift']]
  assert steps == [20, 80]  # Both reads of a 400-step source.


def test_claim_2_is_holm_corrected_and_decided_by_the_convention():
  summ = uptrain_replication.summary(_results(_growing))
  assert len(summ['ranking']) == 6  # 3 lengths x 2 K.
  assert all(c['verdict'] == 'resolved' and c['mean'] < 0
             for c in summ['ranking'])


def test_report_only_rebuilds_the_report_identically(tmp_path, monkeypatch):
  results = _results(_growing)
  (tmp_path / 'results.json').write_text(json.dumps(results))
  monkeypatch.setattr(sys, 'argv', ['uptrain_study', f'--out={tmp_path}',
                                    '--report_only'])
  uptrain_study.main()
  first = (tmp_path / 'report.md').read_text()
  saved = json.loads((tmp_path / 'results.json').read_text())
  assert saved['provenance']['commit'] == 'abc1234'  # Who trained them.
  assert saved['provenance']['rebuilt']['command'].endswith('--report_only')
  assert 'avx512f' in saved['provenance']['rebuilt']['machine']
  uptrain_study.main()
  assert (tmp_path / 'report.md').read_text() == first
  assert first.startswith('# Uptraining MHA to GQA/MQA')
  assert 'Runs trained by `python -m scripts.uptrain_study --out=x` at ' \
         'commit abc1234 (--out x) on Xeon (AVX-512F), 2 cores; statistics ' \
         'and reading rebuilt by' in first
  assert '**Claim 1, GQA K = 2 (α = 0.05 of uptraining' in first
  assert 'contradicted' not in json.dumps(saved['summary']['claim1']) or \
      saved['summary']['claim1']['paper'] == 'contradicted'
  assert (tmp_path / 'sources.png').stat().st_size > 10_000


def test_every_published_uptrain_report_is_what_its_json_makes():
  """docs/results/uptrain/**/report.md equals the report its results.json
  makes today (--report_only rebuilds it identically): no hand-written
  text, no stale reading."""
  import pathlib  # pylint: disable=import-outside-toplevel
  from scripts import study, uptrain_report  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(__file__).resolve().parent.parent / 'docs/results/uptrain'
  found = sorted(root.glob('**/results.json'))
  assert len(found) >= 2
  for path in found:
    results = study.saved(path)
    report = (uptrain_replication if 'sources' in results else
              uptrain_report)
    assert report.text(results) == (path.parent / 'report.md').read_text(), (
        f'{path.parent}/report.md is not what its results.json makes: '
        f'python -m scripts.uptrain_study --out={path.parent} --report_only')


@pytest.mark.slowest
@pytest.mark.slow
def test_the_replicated_study_runs_end_to_end(tmp_path):
  """On `tiny`: sources of two lengths, two seeds each, every arm per
  source with two uptraining seeds read at both points, MLA below d_model,
  the machine in the provenance; a rerun reuses everything."""
  import subprocess  # pylint: disable=import-outside-toplevel
  out = tmp_path / 'study'
  command = [sys.executable, '-m', 'scripts.uptrain_study', f'--out={out}',
             '--config=tiny', '--source_steps=40,80', '--source_seeds=2',
             '--seeds=2', '--kv_heads=1']
  subprocess.run(command, capture_output=True, text=True, check=True)
  results = json.loads((out / 'results.json').read_text())
  assert [(s['steps'], s['seed']) for s in results['sources']] == [
      (40, 0), (40, 1), (80, 0), (80, 1)]
  for source in results['sources']:
    arms = {(r['method'], r['K'], r['seed']) for r in source['runs']}
    assert arms == {(m, k, s) for m, k in (('identity', 4), ('mean', 1),
                                           ('first', 1), ('mla_half', 1))
                    for s in (1, 2)}
    for r in source['runs']:
      steps = {p['step'] for p in r['curve']}
      assert {0, source['reads']['paper'], source['reads']['fixed']} <= steps
    assert source['mla']['kv_lora_rank'] < source['mla']['d_model']
    assert (out / 'sources' / f'S{source["steps"]}_s{source["seed"]}' /
            'source' / 'final.json').exists()
  assert 'avx512f' in results['provenance']['machine']
  assert results['summary']['lengths']['80']['gap_K1']['paper']['n'] == 2
  report = (out / 'report.md').read_text()
  again = subprocess.run(command, capture_output=True, text=True, check=True)
  assert 'source seed 0, 40 steps' in again.stdout
  rerun = json.loads((out / 'results.json').read_text())
  assert rerun['sources'] == results['sources']  # Reused, not retrained.
  assert (out / 'report.md').read_text().split('\n')[4:] == \
      report.split('\n')[4:]
