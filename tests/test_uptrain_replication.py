"""The source-replicated uptraining study (studies/uptrain/replicated*.py):
its statistics and verdicts on made-up results whose answers are known, and
its report rebuilt from results.json alone."""

import json
import sys

import numpy as np
import pytest

from scripts import uptrain_study
from studies import stats
from studies.uptrain import (common, design, replicated_report,
                             replicated_summary)
from studies.uptrain import results as uptrain_results

SOURCE = {400: 1.90, 1600: 1.66, 3200: 1.60}  # Loss of a source of S steps.
GTA = {'K': 1, 'qk_rope_head_dim': 14, 'method': 'gta', 'pooling': 'mean',
       'kv_bytes_per_token': 240.0, 'target_kv_bytes_per_token': 256.0,
       'partner_K': 1, 'partner_kv_bytes_per_token': 256.0}
GLA = {'K': 2, 'kv_lora_rank': 24, 'qk_rope_head_dim': 8, 'method': 'gla_half',
       'latent_groups': 2, 'kv_bytes_per_token': 256.0,
       'mla_kv_bytes_per_token': 256.0, 'energy_kept': [0.8, 0.82]}
TPA = {'K': 1, 'method': 'tpa', 'pooling': 'mean', 'kv_bytes_per_token': 320.0,
       'target_kv_bytes_per_token': 256.0, 'partner_K': 1,
       'partner_kv_bytes_per_token': 256.0}


def _results(gap, noise=0.003, sources=3, drift=-0.001,
             above_scratch=lambda S, K, seed: 0.01 * seed, random=0.05,
             gta=0.05, gla=0.0, latent=True, tpa=-0.04, tpa_at0=0.0):
  """Sources of each length S (seeds 0..), 2 uptraining seeds each;
  mean-pooled K's loss at every read is the control's + gap(S, K, seed)
  (+ noise per uptraining seed), first-head 0.05 above mean, random
  `random` above first, MLA-half 0.03 below mean-pooled K = 1; K trained
  from scratch for S steps (evaluated every S/40) ends above_scratch(S, K,
  seed) below mean-pooled K's noiseless loss at alpha = 0.05, from 3.0 at
  S/40 in equal steps. latent: with GTA (K = 1, 240 bytes/token) `gta`
  above mean-pooled K = 1 and GLA `gla` above MLA-half; and, unless `tpa`
  is None, TPA (K = 1, 320 bytes/token) `tpa` (+ 0.002 a source seed,
  + 0.001 an uptraining seed) above mean-pooled K = 1 after uptraining,
  and `tpa_at0` above it at its conversion (step 0: exact)."""
  rng = np.random.default_rng(0)
  plan = {'design': 'sources', 'source_steps': list(SOURCE),
          'source_seeds': list(range(sources)), 'seeds': [1, 2],
          'kv_heads': [2, 1], 'scratch_kv_heads': [2, 1], 'num_heads': 4,
          'head_dim': 16, 'd_model': 64, 'vocab_size': 256,
          'paper_alpha': 0.05, 'fixed_steps': 80, 'near': 0.02,
          'rate_ratio': 1 / 3}
  mla = {'K': 2, 'kv_lora_rank': 24, 'qk_rope_head_dim': 8, 'd_model': 64,
         'kv_bytes_per_token': 256.0, 'gqa_kv_bytes_per_token': 512.0,
         'method': 'mla_half', 'energy_kept': [0.85, 0.87]}
  out = []
  for S, loss in SOURCE.items():
    read = design.reads(S, 80)
    steps = sorted({0, read['paper'], read['fixed']})
    for seed in range(sources):
      src = loss + 0.01 * seed
      runs = []
      for method, K in (('identity', 4), ('mean', 2), ('mean', 1),
                        ('first', 2), ('first', 1), ('random', 2),
                        ('random', 1), ('mla_half', 2),
                        *((('gta', 1), ('gla_half', 2)) if latent else ())):
        for up in (1, 2):
          def at(step):
            if method == 'identity':
              return src + (drift if step else 0.0)
            k = 1 if method in ('mla_half', 'gla_half') else K
            base = src + drift + gap(S, k, seed) + noise * rng.normal()
            return base + {'mean': 0.0, 'first': 0.05,
                           'random': 0.05 + random, 'mla_half': -0.03,
                           'gta': gta, 'gla_half': -0.03 + gla}[
                               method] + (1.0 if step == 0 else 0.0)
          runs.append({'method': method, 'K': K, 'start': 'fresh',
                       'seed': up, 'curve': [{'step': t, 'loss': at(t),
                                              'accuracy': 0.0}
                                             for t in steps]})
      with_tpa = latent and tpa is not None
      for up in (1, 2) if with_tpa else ():  # From mean-pooled K = 1's.
        mean1 = next(r for r in runs if (r['method'], r['K'], r['seed']) ==
                     ('mean', 1, up))
        runs.append({**mean1, 'method': 'tpa', 'curve': [
            {**p, 'loss': p['loss'] + (tpa + 0.002 * seed + 0.001 * up
                                       if p['step'] else tpa_at0)}
            for p in mean1['curve']]})
      scratch = []
      for K in (2, 1):
        end = src + drift + gap(S, K, seed) - above_scratch(S, K, seed)
        evals = np.arange(S // 40, S + 1, S // 40)
        scratch.append({'K': K, 'seed': seed, 'curve': [
            {'step': int(t), 'loss': float(l), 'accuracy': 0.0}
            for t, l in zip(evals, np.linspace(3.0, end, len(evals)))]})
      out.append({'steps': S, 'seed': seed, 'source': {'loss': src},
                  'runs': runs, 'scratch': scratch, 'reads': read,
                  'rate': 1e-3, 'warmup': design.unit_steps(S),
                  'mla': mla, **({'gta': GTA, 'gla': GLA} if latent
                                 else {}),
                  **({'tpa': TPA} if with_tpa else {})})
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
  summ = replicated_summary.summary(results)
  gap = summ['lengths'][1600]['gap_K2']['paper']
  assert gap['n'] == 3  # Sources, not sources x uptraining seeds.
  first = next(s for s in results['sources'] if (s['steps'], s['seed']) ==
               (1600, 0))
  by_hand = (replicated_summary.losses(first, 'mean', 2, 80)
             - replicated_summary.losses(first, 'identity', 4, 80)).mean()
  assert gap['values'][0] == pytest.approx(by_hand)
  assert gap['within_sd'] > 0  # The uptraining seeds' spread, reported.
  # The MLA arm is paired with the GQA of equal bytes (K = 1: 32 numbers).
  assert summ['lengths'][400]['mla_partner_K'] == 1
  assert summ['lengths'][400]['mla_vs_equal_bytes']['paper']['mean'] == \
      pytest.approx(-0.03, abs=0.01)


def test_gta_and_gla_are_paired_within_the_source_and_decided():
  # GTA 0.05 nats above mean-pooled K = 1 (its nearest bytes), GLA 0.001
  # from MLA-half: far below what 3 sources with 0.003 of noise per
  # uptraining seed detect.
  summ = replicated_summary.summary(_results(_growing, gla=0.001))
  row = summ['lengths'][1600]
  first = next(s for s in _results(_growing, gla=0.001)['sources']
               if (s['steps'], s['seed']) == (1600, 0))
  by_hand = (replicated_summary.losses(first, 'gta', 1, 80)
             - replicated_summary.losses(first, 'mean', 1, 80)).mean()
  assert row['gta_vs_equal_bytes']['paper']['values'][0] == \
      pytest.approx(by_hand)
  assert row['gta_vs_equal_bytes']['paper']['n'] == 3  # Over sources.
  assert [c['verdict'] for c in summ['gta_vs_equal_bytes']] == \
      ['resolved'] * 3
  gla = summ['gla_vs_mla']
  assert [c['S'] for c in gla] == list(SOURCE)  # One Holm family.
  for c in gla:
    assert abs(c['mean']) < c['detectable']
    assert c['verdict'].startswith('not claimed: ')
  text = replicated_report.text(_results(_growing, gla=0.001))
  assert '**GTA at MLA-below\'s cache bytes** (K/V heads mean-pooled to ' \
      'K = 1, tied, a 14-wide shared RoPE key: K·H + Y = 30 numbers, ' \
      '240 bytes/token' in text
  assert 'GLA − MLA' in text and '**not claimed: ' in text
  # Results made before these arms report without them.
  old = replicated_summary.summary(_results(_growing, latent=False))
  assert 'gla_vs_mla' not in old and 'gta_vs_equal_bytes' not in old
  assert 'GTA' not in replicated_report.text(_results(_growing,
                                                         latent=False))


def test_tpa_is_paired_with_the_gqa_it_was_converted_from():
  # TPA 0.04 nats below mean-pooled K = 1 (its nearest bytes and its
  # conversion's source) after uptraining, equal to it at step 0.
  results = _results(_growing)
  summ = replicated_summary.summary(results)
  row = summ['lengths'][1600]
  first = next(s for s in results['sources'] if (s['steps'], s['seed']) ==
               (1600, 0))
  by_hand = (replicated_summary.losses(first, 'tpa', 1, 80)
             - replicated_summary.losses(first, 'mean', 1, 80)).mean()
  assert row['tpa_vs_equal_bytes']['paper']['values'][0] == \
      pytest.approx(by_hand)
  assert row['tpa_vs_equal_bytes']['paper']['n'] == 3  # Over sources.
  cells = summ['tpa_vs_equal_bytes']
  assert [c['S'] for c in cells] == list(SOURCE)  # One Holm family.
  assert all(c['verdict'] == 'resolved' and c['mean'] < 0 for c in cells)
  assert row['tpa_conversion_exact'] == 0.0
  text = replicated_report.text(results)
  assert ('**TPA nearest MLA-below\'s cache bytes** (issue #63; K/V heads '
          'mean-pooled to K = 1, then key and value factors of rank 1') in text
  assert ('2·K·(N + H) = 40 numbers, 320 bytes/token, the layout nearest '
          'MLA-below\'s 256) against mean-pooled K = 1, the GQA arm of '
          'nearest bytes (256 bytes/token, so TPA caches 1.25x its bytes), '
          'α = 0.05, Holm over the 3 lengths: S = 400: TPA − GQA -0.0365') \
      in text
  assert ('before uptraining (step 0) the two losses are equal on every '
          'source, bit for bit.') in text
  assert 'GTA and TPA at (or nearest) its cache bytes' in text
  assert '| TPA − mean K of nearest bytes |' in text  # Its table column.
  # As good as GQA: below what 3 sources detect, not claimed.
  tie = replicated_summary.summary(_results(_growing, tpa=0.0))
  assert all(c['verdict'].startswith('not claimed: ')
             for c in tie['tpa_vs_equal_bytes'])
  # Rounding is named as such, and a conversion that is not exact is
  # named, not read as rounding.
  near = replicated_report.text(_results(_growing, tpa_at0=2e-7))
  assert 'TPA − GQA is at most 2.0e-07 nats on any source (rounding).' \
      in near
  off = replicated_report.text(_results(_growing, tpa_at0=0.01))
  assert 'at most 1.0e-02 nats on any source (beyond 1e-05: not exact).' \
      in off
  # Results made before the TPA arm (with GTA and GLA) report without it.
  old = _results(_growing, tpa=None)
  assert 'tpa_vs_equal_bytes' not in replicated_summary.summary(old)
  old_text = replicated_report.text(old)
  assert 'TPA' not in old_text
  assert 'GTA at (or nearest) its cache bytes' in old_text


def test_claim_1_is_decided_by_the_trend_over_source_length():
  grows = replicated_summary.summary(_results(_growing))
  assert grows['trend']['gap_K2']['paper']['mean'] > 0
  assert grows['claim1']['paper'] == 'contradicted'
  shrinks = replicated_summary.summary(_results(_shrinking))
  assert shrinks['claim1']['paper'] == (
      'not reproduced at this scale (the gap shrinks with the source)')
  near = replicated_summary.summary(_results(
      lambda S, K, seed: 0.002 * seed))
  assert near['claim1']['paper'] == 'reproduced'
  # A gap whose distance from the margin is below what 3 sources detect.
  unsure = replicated_summary.summary(_results(
      lambda S, K, seed: 0.02 + 0.03 * (seed - 1), noise=0.0))
  assert unsure['claim1']['paper'] == 'not claimed: interval holds 0'


def test_the_gate_reads_the_drift_at_every_read_and_withholds_claim_1():
  summ = replicated_summary.summary(_results(_growing, drift=-0.08))
  assert not summ['gate'][3200]['passes']
  assert summ['claim1']['paper'] == 'not claimed: withheld by the control gate'
  steps = [d['step'] for d in summ['lengths'][400]['drift']]
  assert steps == [20, 80]  # Both reads of a 400-step source.


def test_claim_2_is_holm_corrected_and_decided_by_the_convention():
  summ = replicated_summary.summary(_results(_growing))
  assert len(summ['ranking']) == 12  # 3 lengths x 2 K x 2 pairs.
  assert {(c['better'], c['worse']) for c in summ['ranking']} == {
      ('mean', 'first'), ('first', 'random')}
  assert all(c['verdict'] == 'resolved' and c['mean'] < 0
             for c in summ['ranking'])
  assert all(v == 'reproduced' for by_K in summ['ordering'].values()
             for v in by_K.values())
  # Random as good as first-head: that pair is below what 3 sources
  # detect, so the ordering is not claimed (and never contradicted).
  tie = replicated_summary.summary(_results(_growing, random=0.0))
  cells = [c for c in tie['ranking'] if c['worse'] == 'random']
  assert all(c['verdict'].startswith('not claimed: ') for c in cells)
  assert all(v.startswith('not reproduced (') and 'first < random: not claimed'
             in v for by_K in tie['ordering'].values() for v in by_K.values())
  # Random worse than first by the same amount on every source: one
  # measurement, never resolved, so the ordering is not claimed either.
  same = [{'S': 400, 'K': 2, 'better': b, 'worse': w,
           **replicated_summary._over_sources([-0.05] * 3)}
          for b, w in (('mean', 'first'), ('first', 'random'))]
  family = replicated_summary._holm(same)
  assert [c['verdict'] for c in family] == [
      'not claimed: equal on all seeds'] * 2
  assert common.ranking_verdict(family, 2) == (
      'not reproduced (mean < first: not claimed: equal on all seeds; '
      'first < random: not claimed: equal on all seeds)')


def test_claim_3_is_judged_against_the_margin_and_by_the_trend():
  """Uptrained mean-pooled GQA-2 at alpha = 0.05 minus GQA-2 trained from
  scratch for the source's steps: within the margin, beyond it and
  growing or shrinking with S, or closer to it than the sources detect."""
  def claim3(above, **kw):
    summ = replicated_summary.summary(_results(_growing, above_scratch=above,
                                                **kw))
    return summ, summ['claim3']['paper']
  summ, verdict = claim3(lambda S, K, seed: 0.2 + 0.1 * np.log2(S / 400) / 3
                         + 0.004 * seed)
  assert summ['claim3']['K'] == 2  # GQA: the paper's claim; MQA reported.
  assert summ['trend']['vs_scratch_K2']['paper']['mean'] == pytest.approx(
      0.1 / 3, abs=0.005)
  assert verdict == 'contradicted'
  _, verdict = claim3(lambda S, K, seed: 0.4 - 0.1 * np.log2(S / 400)
                      + 0.004 * seed * (S / 400))
  assert verdict == ('not reproduced at this scale (the gap shrinks with '
                     'the source)')
  _, verdict = claim3(lambda S, K, seed: -0.05 + 0.002 * seed)
  assert verdict == 'reproduced'  # Uptrained as good as scratch, or better.
  _, verdict = claim3(lambda S, K, seed: 0.02 + 0.03 * (seed - 1),
                      noise=0.0)
  assert verdict == 'not claimed: interval holds 0'
  # Beyond the margin but below the control gate's floor: withheld.
  summ, verdict = claim3(lambda S, K, seed: 0.2 + 0.004 * seed, drift=-0.08)
  assert verdict == 'not claimed: withheld by the control gate'
  assert ('K=2 paper vs scratch', pytest.approx(0.204, abs=0.01)) in \
      summ['gate'][3200]['below']


def test_claim_3_reads_the_steps_each_scratch_curve_needs():
  results = _results(_growing)
  summ = replicated_summary.summary(results)
  source = next(s for s in results['sources'] if (s['steps'], s['seed']) ==
                (1600, 2))
  up = replicated_summary.losses(source, 'mean', 2, 80).mean()
  curve = replicated_summary.scratch_curve(source, 2)
  steps = [p['step'] for p in curve]
  losses = [p['loss'] for p in curve]
  # Linear between the evaluations either side of the uptrained loss.
  j = next(i for i, l in enumerate(losses) if l <= up)
  by_hand = steps[j - 1] + (steps[j] - steps[j - 1]) * (
      losses[j - 1] - up) / (losses[j - 1] - losses[j])
  row = summ['lengths'][1600]
  assert row['equivalent_K2']['paper']['values'][2] == pytest.approx(by_hand)
  assert row['scratch_K2']['values'][2] == losses[-1]
  assert row['vs_scratch_K2']['paper']['values'][2] == pytest.approx(
      up - losses[-1])
  # An uptrained loss below the whole scratch curve is censored, not
  # averaged: no interval over sources.
  better = replicated_summary.summary(_results(
      _growing, above_scratch=lambda S, K, seed: -0.1))
  e = better['lengths'][1600]['equivalent_K2']['paper']
  assert e['censored'] == 3 and 'mean' not in e


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
  text, no stale reading; and its provenance is true
  (`report.published_problems`: measured and rebuilt at clean commits of
  this history, by the command that rebuilds its folder)."""
  import pathlib  # pylint: disable=import-outside-toplevel
  from studies import report, study  # pylint: disable=import-outside-toplevel
  repo = pathlib.Path(__file__).resolve().parent.parent
  found = sorted((repo / 'docs/results/uptrain').glob('**/results.json'))
  assert len(found) >= 2
  problems = []
  for path in found:
    results = study.saved(path)
    folder = str(path.parent.relative_to(repo))
    text = (path.parent / 'report.md').read_text()
    assert uptrain_results.text(results) == text, (
        f'{folder}/report.md is not what its results.json makes: '
        f'python -m scripts.uptrain_study --out={folder} --report_only')
    problems += report.published_problems(
        folder, results['provenance'], text, 'scripts.uptrain_study',
        'results.json')
  assert not problems, '\n'.join(problems)


@pytest.mark.slowest
@pytest.mark.slow
def test_the_replicated_study_runs_end_to_end(tmp_path):
  """On `tiny`: sources of two lengths, two seeds each, every arm per
  source (random included) with two uptraining seeds read at both points,
  MLA below d_model, GTA, GLA and TPA by bytes, K from scratch for the
  source's steps by its seed,
  the machine and each run's commit in the provenance; a rerun reuses
  everything and names the pass before it."""
  import subprocess  # pylint: disable=import-outside-toplevel
  out = tmp_path / 'study'
  command = [sys.executable, '-m', 'scripts.uptrain_study', f'--out={out}',
             '--config=tiny', '--source_steps=40,80', '--source_seeds=2',
             '--seeds=2', '--kv_heads=2']
  subprocess.run(command, capture_output=True, text=True, check=True)
  results = json.loads((out / 'results.json').read_text())
  assert [(s['steps'], s['seed']) for s in results['sources']] == [
      (40, 0), (40, 1), (80, 0), (80, 1)]
  for source in results['sources']:
    arms = {(r['method'], r['K'], r['seed']) for r in source['runs']}
    assert arms == {(m, k, s) for m, k in (
        ('identity', 4), ('mean', 2), ('first', 2), ('random', 2),
        ('mla_half', 2), ('gta', source['gta']['K']), ('gla_half', 2),
        ('tpa', source['tpa']['K']))
                    for s in (1, 2)}
    [scratch] = source['scratch']
    assert (scratch['K'], scratch['seed']) == (2, source['seed'])
    assert [p['step'] for p in scratch['curve']][-1] == source['steps']
    for r in source['runs']:
      steps = {p['step'] for p in r['curve']}
      assert {0, source['reads']['paper'], source['reads']['fixed']} <= steps
    assert source['mla']['kv_lora_rank'] < source['mla']['d_model']
    # The cache the converted models report is the plan's.
    for arm in ('mla', 'gta', 'gla', 'tpa'):
      assert source[arm]['converted_kv_bytes_per_token'] == \
          source[arm]['kv_bytes_per_token']
    assert source['gla']['kv_bytes_per_token'] == \
        source['mla']['kv_bytes_per_token']
    assert (out / 'sources' / f'S{source["steps"]}_s{source["seed"]}' /
            'source' / 'final.json').exists()
  assert 'avx512f' in results['provenance']['machine']
  commit = results['provenance']['commit']
  assert results['provenance']['trained'].startswith(f'commit {commit} on ')
  assert results['provenance']['trained'].endswith(' (72 runs)')
  assert 'earlier' not in results['provenance']
  summary = results['summary']
  assert summary['lengths']['80']['gap_K2']['paper']['n'] == 2
  assert summary['lengths']['80']['vs_scratch_K2']['paper']['n'] == 2
  assert len(summary['gta_vs_equal_bytes']) == len(summary['gla_vs_mla']) == \
      len(summary['tpa_vs_equal_bytes']) == 2
  assert len(summary['ranking']) == 4  # 2 lengths x 2 pairs.
  report = (out / 'report.md').read_text()
  assert '**Claim 3, GQA K = 2' in report  # K = 2 is the GQA target here.
  assert '**GLA against MLA-below at equal bytes**' in report
  assert '**TPA nearest MLA-below\'s cache bytes**' in report
  again = subprocess.run(command, capture_output=True, text=True, check=True)
  assert 'source seed 0, 40 steps' in again.stdout
  rerun = json.loads((out / 'results.json').read_text())
  assert rerun['sources'] == results['sources']  # Reused, not retrained.
  assert rerun['provenance']['earlier'] == [{
      k: results['provenance'][k] for k in ('command', 'commit', 'machine')}]
  assert 'reusing the finished runs of the earlier pass' in (
      out / 'report.md').read_text()
  assert (out / 'report.md').read_text().split('\n')[4:] == \
      report.split('\n')[4:]
