"""The source-replicated design's report.md, a function of results.json's
per-run curves and provenance alone (the summary recomputed: --report_only
rebuilds it byte for byte): where the runs were trained, the reading (a
bullet a finding, intervals over sources, every verdict and its reason
`stats.decision`'s words),
the plot, the tables; and `write`."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from studies import report, stats
from studies.uptrain.common import made
from studies.uptrain.design import GLA, GTA, TPA
from studies.uptrain.replicated_summary import (READS, by_length, scratch_ks,
                                                summary)
from train.convert import to_mla

# The largest loss difference an exact conversion is granted (rounding):
# TPA's at step 0 against the model it was converted from.
EXACT = 1e-5


def text(results: dict) -> str:
  """report.md: a function of results.json's per-run curves and provenance
  alone (the summary recomputed), so a rebuild is identical."""
  summ = summary(results)
  prov = results['provenance']
  return report.document([
      '# Uptraining MHA to GQA/MQA (Ainslie et al. 2023), replicated over '
      'sources and source lengths', '', made(prov), '', prov['statistics'],
      '', *report.section('Reading'), *reading(results, summ), '',
      report.figure('the gap against the source\'s length', 'sources.png'),
      '', *report.section('Tables'), *tables(results, summ), ''])


def write(out: pathlib.Path, results: dict):
  """OUT/report.md and OUT/sources.png from results."""
  text_ = text(results)
  (out / 'report.md').write_text(text_)
  plot(out, results, summary(results))
  print(text_[:text_.index('## Tables')])
  print(f'wrote {out / "report.md"}, sources.png')


def _f(est: dict, spec: str = '+.4f') -> str:
  """'mean [low, high]' over sources (or the convention's words)."""
  return report.interval(est, spec, unit='source')


def _det(est: dict) -> str:
  d = est.get('detectable', math.inf)
  return (f'detectable {d:.4f}' if math.isfinite(d) else
          'nothing detectable')


def _cell(est: dict) -> str:
  """An estimate with its verdict, as every report line states one."""
  return f'{_f(est)} ({_det(est)}; {est["verdict"]})'


def reading(results: dict, summ: dict) -> list[str]:
  """'## Reading': a bullet a finding, from the numbers (every verdict
  `stats.decide`'s, intervals over sources)."""
  plan, lengths = results['plan'], summ['lengths']
  return [_design(results, summ),
          *(_length_line(plan, S, row, summ['gate'][S])
            for S, row in lengths.items()),
          *_claim1(plan, summ), *_mqa(plan, summ), *_claim3(plan, summ),
          _claim2(plan, summ), *_mla(results, summ),
          *_latent_arms(plan, summ), _pseudo_replication(plan, summ)]


def _design(results: dict, summ: dict) -> str:
  plan, lengths = results['plan'], summ['lengths']
  kv, N = plan['kv_heads'], plan['num_heads']
  first = next(iter(lengths.values()))
  scratch = scratch_ks(results['sources'][0])
  return (
      f'- **Design**: {len(plan["source_seeds"])} MHA sources (K = N = {N}; '
      f'seeds {", ".join(map(str, plan["source_seeds"]))}) at each length S = '
      + ', '.join(f'{S:,}' for S in lengths) + ' steps, each converted to '
      f'the identity control (K = {N}), ' + (
          'mean-pooled, first-head and random (fresh K/V heads, one draw per '
          'uptraining seed)' if f'first_random_K{kv[0]}' in first else
          'mean-pooled and first-head') + ' K = '
      + ' and '.join(map(str, kv)) + f', and MLA below '
      f'GQA-{first["mla"]["K"]}\'s width' + (
          ', GTA' + ' and TPA' * (TPA in first) + ' at (or nearest) its '
          'cache bytes and GLA at its latent width'
          if GLA in first and GTA in first else '')
      + f'; {len(plan["seeds"])} uptraining seeds per arm '
      f'({", ".join(map(str, plan["seeds"]))}), averaged within the source. '
      + ('' if not scratch else
         'Beside each source, K = ' + ' and '.join(map(str, scratch))
         + ' trained from scratch for its S steps by its recipe and seed, '
         'evaluated every S/40 steps. ') +
      f'Uptrained at {plan["rate_ratio"]:.3g} x the source\'s peak rate (the '
      'single-source pilot\'s choice, fixed in advance, not piloted per '
      'source), warmup over α = 0.0125 of the source\'s steps, then '
      f'constant; read at α = {plan["paper_alpha"]} and at '
      f'{plan["fixed_steps"]} uptraining steps. The unit of replication is '
      'the source: intervals are over sources, and a trend over S is '
      'paired by source seed.')


def _length_line(plan: dict, S: int, row: dict, gate: dict) -> str:
  """One source length: its sources' loss, its reads, the control's drift
  and the gate."""
  return (
      f'- **S = {S:,}**: source loss {_f(row["source_loss"], ".4f")}; '
      f'reads at {row["reads"]["paper"]} (α = {plan["paper_alpha"]}) and '
      f'{row["reads"]["fixed"]} steps (warmup {row["warmup"]}). Control '
      'drift from the source at every evaluated step: ' + ', '.join(
          f'{d["step"]}: {_f(d)}' for d in row['drift'])
      + f'. Gate (4 × the largest |drift| = {gate["floor"]:.4f}): ' + (
          'passes' if gate['passes'] else 'fails for ' + ', '.join(
              f'{n} ({e:+.4f})' for n, e in gate['below'])
          + ' (each of those cells says so)') + '.')


def _trend(t: dict) -> str:
  """A slope over source seeds, or that there is one length only."""
  return _cell(t) if t.get('n', 0) > 1 else 'one length only'


def _claim1(plan: dict, summ: dict) -> list[str]:
  """Claim 1 (GQA) at alpha = 0.05 with its trend, and the same gap after
  the fixed steps (a diagnostic)."""
  lengths, K = summ['lengths'], summ['claim1']['K']
  trend = summ['trend'][f'gap_K{K}']
  return [
      f'- **Claim 1, GQA K = {K} (α = {plan["paper_alpha"]} of uptraining '
      f'brings GQA near MHA: ≤ {plan["near"]} nats above the control, fixed '
      f'in advance; "contradicted" only if the gap beyond it grows with the '
      f'source\'s length): {summ["claim1"]["paper"]}.** Mean-pooled minus '
      'the control at α = 0.05 by source length: ' + '; '.join(
          f'S = {S:,}: {_cell(row[f"gap_K{K}"]["paper"])}'
          for S, row in lengths.items())
      + '. Per doubling of the source\'s length (slope per source seed): '
      + _trend(trend['paper']) + '.',
      f'- **The same gap after a fixed {plan["fixed_steps"]} uptraining '
      'steps** (a diagnostic, not the paper\'s framing: α falls from '
      + ' to '.join(f'{plan["fixed_steps"] / S:g}' for S in
                    (min(lengths), max(lengths)))
      + ' as S grows, and the warmup is α = 0.0125 of S, '
      + ', '.join(str(row['warmup']) for row in lengths.values())
      + ' steps): ' + '; '.join(
          f'S = {S:,}: {_cell(row[f"gap_K{K}"]["fixed"])}'
          for S, row in lengths.items())
      + '. Per doubling: ' + _trend(trend['fixed']) + '.']


def _mqa(plan: dict, summ: dict) -> list[str]:
  """The other K's gaps (MQA): reported, not judged."""
  lengths = summ['lengths']
  return [
      f'- **MQA / K = {K}, reported, not a claim of nearness** (the paper '
      'says uptrained MQA loses some quality; it sets no margin): '
      'mean-pooled minus the control at α = '
      f'{plan["paper_alpha"]}: ' + '; '.join(
          f'S = {S:,}: {_cell(row[f"gap_K{K}"]["paper"])}'
          for S, row in lengths.items())
      + '; at ' + f'{plan["fixed_steps"]} steps: ' + '; '.join(
          f'S = {S:,}: {_cell(row[f"gap_K{K}"]["fixed"])}'
          for S, row in lengths.items())
      + '. Per doubling: ' + '; '.join(
          f'{read}: {_cell(summ["trend"][f"gap_K{K}"][read])}'
          for read in READS
          if summ['trend'][f'gap_K{K}'][read].get('n', 0) > 1) + '.'
      for K in plan['kv_heads'] if K != summ['claim1']['K']]


def _claim2(plan: dict, summ: dict) -> str:
  lengths, kv = summ['lengths'], plan['kv_heads']
  pairs = sorted({(c['better'], c['worse']) for c in summ['ranking']},
                 key=lambda pair: ['mean', 'first'].index(pair[0]))
  return (
      f'- **Claim 2 (after α = {plan["paper_alpha"]}, '
      + ' < '.join(['mean', 'first', 'random'][:len(pairs) + 1])
      + f'), each pair paired within the source, Holm over the '
      f'{len(summ["ranking"])} (length, K, pair)**: ' + '; '.join(
          f'S = {S:,}, K = {K}: ' + ', '.join(
              f'{c["better"]} − {c["worse"]} {_f(c)}'
              for c in summ['ranking'] if (c['S'], c['K']) == (S, K))
          + f' → **{summ["ordering"][S][K]}**' for S in lengths for K in kv)
      + '.' + ('' if len(pairs) > 1 else ' Random initialisation was not '
               'run in these results.'))


def _mla(results: dict, summ: dict) -> list[str]:
  """MLA below GQA's width against mean-pooled GQA of equal bytes."""
  if not summ['mla']:
    return []
  plan, lengths = results['plan'], summ['lengths']
  first = next(iter(lengths.values()))
  mla, latent = first['mla'], to_mla.latent(first['mla'])
  return [
      f'- **MLA below GQA\'s width** (kv_lora_rank {latent.width} '
      f'+ {latent.rope} RoPE dims = half of GQA-{mla["K"]}\'s '
      f'{2 * mla["K"] * plan["head_dim"]} numbers; latent '
      f'{latent.width} < d_model {plan["d_model"]}, the regime of '
      f'MHA2MLA and TransMLA), against mean-pooled K = '
      f'{first["mla_partner_K"]} at equal cache bytes '
      f'({mla["kv_bytes_per_token"]:g} bytes/token), α = '
      f'{plan["paper_alpha"]}, Holm over the {len(summ["mla"])} lengths: '
      + '; '.join(
          f'S = {c["S"]:,}: MLA − GQA {_f(c)}, {_det(c)}, '
          f'**{c["verdict"]}**' + (
              '' if stats.decide(c, rejected=c['holm']) != 'resolved' else
              ' (MLA lower)' if c['mean'] < 0 else ' (GQA lower)')
          for c in summ['mla'])
      + '. Energy kept by the SVD per layer, by source: ' + '; '.join(
          f'S = {S:,}: ' + ', '.join(
              '/'.join(f'{e:.3f}' for e in s['mla']['energy_kept'])
              for s in by_length(results)[S]) for S in lengths) + '.']


def _pseudo_replication(plan: dict, summ: dict) -> str:
  """The GQA gap's sd within a source against between sources."""
  within = [(S, row[f'gap_K{max(plan["kv_heads"])}']['paper'])
            for S, row in summ['lengths'].items()]
  return (
      '- **Pseudo-replication, measured**: the sd of the GQA gap at α = '
      f'{plan["paper_alpha"]} within a source (over its uptraining seeds, '
      'averaged) against its sd between sources: ' + '; '.join(
          f'S = {S:,}: {c["within_sd"]:.4f} within, {c["sd"]:.4f} between'
          for S, c in within) + '.')


def _latent_arms(plan: dict, summ: dict) -> list[str]:
  """The reading's GTA and GLA lines (issue #51) and TPA's (issue #63),
  where the results have those arms."""
  first = next(iter(summ['lengths'].values()))
  H, a, lines = plan['head_dim'], plan['paper_alpha'], []

  def cells(name, words):
    return '; '.join(
        f'S = {c["S"]:,}: {words} {_f(c)}, {_det(c)}, **{c["verdict"]}**'
        for c in summ[name])
  if summ.get('gta_vs_equal_bytes'):
    g = first[GTA]
    lines.append(
        f'- **GTA at MLA-below\'s cache bytes** (K/V heads mean-pooled to '
        f'K = {g["K"]}, tied, a {g["qk_rope_head_dim"]}-wide shared RoPE '
        f'key: K·H + Y = {g["K"] * H + g["qk_rope_head_dim"]} numbers, '
        f'{g["kv_bytes_per_token"]:g} bytes/token, the layout nearest '
        f'MLA-below\'s {g["target_kv_bytes_per_token"]:g}) against '
        f'mean-pooled K = {g["partner_K"]}, the GQA arm of nearest bytes '
        f'({g["partner_kv_bytes_per_token"]:g} bytes/token), α = {a}, Holm '
        f'over the {len(summ["gta_vs_equal_bytes"])} lengths: '
        + cells('gta_vs_equal_bytes', 'GTA − GQA') + '.')
  if summ.get('gla_vs_mla'):
    g = first[GLA]
    latent = to_mla.latent(g)
    lines.append(
        f'- **GLA against MLA-below at equal bytes** (Zadouri et al.: GLA '
        f'matches MLA; --latent_groups={latent.groups}, kv_lora_rank '
        f'{latent.width} + {latent.rope} RoPE dims, '
        f'{g["kv_bytes_per_token"]:g} bytes/token, MLA-below '
        f'{g["mla_kv_bytes_per_token"]:g}), α = {a}, Holm over the '
        f'{len(summ["gla_vs_mla"])} lengths: '
        + cells('gla_vs_mla', 'GLA − MLA') + '.')
  if summ.get('tpa_vs_equal_bytes'):
    lines.append(_tpa(plan, summ, cells('tpa_vs_equal_bytes', 'TPA − GQA')))
  return lines


def _tpa(plan: dict, summ: dict, cells: str) -> str:
  """TPA nearest MLA-below's bytes against the GQA arm of nearest bytes,
  with the conversion's exactness where it was converted from that arm."""
  t = next(iter(summ['lengths'].values()))[TPA]
  N, H = plan['num_heads'], plan['head_dim']
  exact = [row['tpa_conversion_exact'] for row in summ['lengths'].values()
           if 'tpa_conversion_exact' in row]
  return (
      f'- **TPA nearest MLA-below\'s cache bytes** (issue #63; K/V heads '
      f'mean-pooled to K = {t["K"]}, then key and value factors of rank '
      f'{t["K"]} whose head factors start as constant one-hots, the paper\'s '
      'Section 4, and are made contextual by the uptraining: 2·K·(N + H) = '
      f'{2 * t["K"] * (N + H)} numbers, {t["kv_bytes_per_token"]:g} '
      'bytes/token, the layout nearest MLA-below\'s '
      f'{t["target_kv_bytes_per_token"]:g}) against mean-pooled K = '
      f'{t["partner_K"]}, the GQA arm of nearest bytes '
      f'({t["partner_kv_bytes_per_token"]:g} bytes/token, so TPA caches '
      f'{t["kv_bytes_per_token"] / t["partner_kv_bytes_per_token"]:.3g}x '
      f'its bytes), α = {plan["paper_alpha"]}, Holm over the '
      f'{len(summ["tpa_vs_equal_bytes"])} lengths: {cells}.'
      + _exactness(exact))


def _exactness(exact: list[float]) -> str:
  """The TPA comparison's control: its largest |TPA - GQA| before
  uptraining, over the lengths (none: not converted from its partner)."""
  if not exact:
    return ''
  head = (' Control: TPA is converted from that mean-pooled model, exactly '
          'by construction; before uptraining (step 0)')
  if max(exact) == 0:
    return head + ' the two losses are equal on every source, bit for bit.'
  return head + (f' TPA − GQA is at most {max(exact):.1e} nats on any '
                 'source (' + ('rounding' if max(exact) <= EXACT else
                               f'beyond {EXACT:g}: not exact') + ').')


def _steps(e: dict, S: int) -> str:
  """Scratch-equivalent steps over sources, and as a fraction of S."""
  if e['censored']:
    return (f'{e["censored"]} of {len(e["values"])} sources never (the '
            'uptrained loss is below their whole scratch curve)')
  e_S = stats.Estimate(e['mean'] / S, e['sd'] / S, e['n'], e['low'] / S,
                       e['high'] / S)
  return f'{_f(e, ".0f")} steps ({_f(e_S.as_dict(), ".2f")} of S)'


def _claim3(plan: dict, summ: dict) -> list[str]:
  """The reading's claim 3 (GQA, judged) and its comparison for the other
  K (reported): the uptrained mean-pooled K at alpha = 0.05 against K
  trained from scratch for the source's steps."""
  lengths, near = summ['lengths'], plan['near']
  a = plan['paper_alpha']
  if summ['claim3'] is None:
    return ['- **Claim 3 (the cost)**: no K was trained from scratch in '
            'these results, so it is not tested here.']
  lines = []
  for K in [K for K in plan['kv_heads'] if f'vs_scratch_K{K}' in
            lengths[max(lengths)]]:
    t = summ['trend'][f'vs_scratch_K{K}']['paper']
    judged = K == summ['claim3']['K']
    head = (f'- **Claim 3, GQA K = {K} (α = {a} of uptraining an MHA '
            f'checkpoint gives a GQA-{K} model that can replace training one '
            f'separately: ≤ {near} nats above GQA-{K} trained from scratch '
            'for the source\'s S steps by its recipe and seed, the margin '
            'and control gate of claim 1; "contradicted" only if the '
            'difference beyond it grows with the source\'s length): '
            f'{summ["claim3"]["paper"]}.**' if judged else
            f'- **Claim 3\'s comparison for MQA / K = {K}, reported, not '
            'judged** (no margin is set for MQA, as in claim 1).')
    lines.append(
        head + f' Uptrained mean-pooled K = {K} minus K = {K} from scratch '
        f'at α = {a}, by source length: ' + '; '.join(
            f'S = {S:,}: {_cell(row[f"vs_scratch_K{K}"]["paper"])}'
            for S, row in lengths.items())
        + '. Per doubling of the source\'s length (slope per source seed): '
        + (_cell(t) if t.get('n', 0) > 1 else 'one length only')
        + f'. K = {K} from scratch after S steps: ' + '; '.join(
            f'S = {S:,}: {_f(row[f"scratch_K{K}"], ".4f")}'
            for S, row in lengths.items())
        + f'. The scratch run reaches the uptrained loss at α = {a} after '
        + '; '.join(f'S = {S:,}: ' + _steps(row[f'equivalent_K{K}']['paper'],
                                             S)
                    for S, row in lengths.items())
        + f' (the uptrained model costs the S-step MHA source plus α·S = '
        + ', '.join(str(row['reads']['paper']) for row in lengths.values())
        + ' uptraining steps; a point along a from-scratch cosine run is not '
        'annealed, so these steps lean high).')
  return lines


def _labels(kv: list[int]) -> dict[str, str]:
  """Each difference's column heading."""
  return {**{f'gap_K{K}': f'mean K={K} − control' for K in kv},
          **{f'vs_scratch_K{K}': f'mean K={K} − K={K} from scratch'
             for K in kv},
          **{f'order_K{K}': f'mean − first, K={K}' for K in kv},
          **{f'first_random_K{K}': f'first − random, K={K}' for K in kv},
          **{f'mean_random_K{K}': f'mean − random, K={K}' for K in kv},
          'mla_vs_equal_bytes': 'MLA-half − mean K at equal bytes',
          'mla_vs_gqa': 'MLA-half − mean GQA-K (twice its bytes)',
          'gta_vs_equal_bytes': 'GTA − mean K of nearest bytes',
          'gla_vs_mla': 'GLA − MLA-half (equal bytes)',
          'tpa_vs_equal_bytes': 'TPA − mean K of nearest bytes'}


def tables(results: dict, summ: dict) -> list[str]:
  """Per source and over sources, the differences of each group (against
  the control and K from scratch; between conversions); K from scratch;
  the trends."""
  kv, rows = results['plan']['kv_heads'], summ['lengths']

  def present(names):  # Columns the results have (older ones lack some).
    return [n for n in names if any(n in r for r in rows.values())]
  groups = [
      ('against the control and K from scratch (claims 1 and 3)', present(
          [f'gap_K{K}' for K in kv] + [f'vs_scratch_K{K}' for K in kv])),
      ('between conversions (claim 2, the MLA arm)', present(
          [f'{n}_K{K}' for n in ('order', 'first_random', 'mean_random')
           for K in kv] + ['mla_vs_equal_bytes', 'mla_vs_gqa',
                           'gta_vs_equal_bytes', 'gla_vs_mla',
                           'tpa_vs_equal_bytes']))]
  lines = []
  for title, names in groups:
    lines += _by_source(results, rows, title, names)
  return lines + _scratch_table(kv, rows) + _trend_table(kv, summ)


def _by_source(results: dict, rows: dict, title: str, names: list[str]
               ) -> list[str]:
  """One group's differences per source (at the conversion and each
  read), then over sources."""
  label = _labels(results['plan']['kv_heads'])
  per_source = []
  for S, sources in by_length(results).items():
    row = rows[S]
    for i, s in enumerate(sources):
      for read in ('conversion', *READS):
        step = 0 if read == 'conversion' else row['reads'][read]
        per_source.append(
            [f'{S:,}', s['seed'], f'{s["source"]["loss"]:.4f}',
             f'{read} ({step})', *(f'{row[n][read]["values"][i]:+.4f}'
                                   if n in row else '—' for n in names)])
  return [
      *report.section(f'Per source, {title}: differences at each read (mean '
                      'over the uptraining seeds)', 3),
      *report.table(['S', 'source seed', 'source loss', 'read (steps)',
                     *(label[n] for n in names)], per_source),
      '', *report.section(
          f'Over sources, {title}: mean [95% t interval over sources] '
          '(detectable; verdict: after Holm for a cell in one of the '
          'reading\'s families, claim 2 and the arms compared by bytes at α '
          '= 0.05, the gate applied where its length\'s control fails, '
          'otherwise uncorrected)', 3),
      *report.table(['S', 'read', *(label[n] for n in names)], (
          [f'{S:,}', f'{read} ({row["reads"][read]})',
           *(_cell(row[n][read]) if n in row else '—' for n in names)]
          for S, row in rows.items() for read in READS)), '']


def _scratch_table(kv: list[int], rows: dict) -> list[str]:
  """K from scratch: its loss after S steps, and the steps at which it
  reaches the uptrained mean-pooled loss, per source and over sources."""
  scratch = [K for K in kv if f'scratch_K{K}' in rows[max(rows)]]
  if not scratch:
    return []
  cells = []
  for S, row in rows.items():
    for K in scratch:
      for read in READS:
        e = row[f'equivalent_K{K}'][read]
        cells.append([
            f'{S:,}', K, f'{read} ({e["uptraining_steps"]})',
            ', '.join(f'{v:.4f}' for v in row[f'scratch_K{K}']['values']),
            ', '.join(f'{v:.0f}' if math.isfinite(v) else f'> {S}'
                      for v in e['values']), _steps(e, S)])
  return [*report.section(
      'K from scratch (claim 3): its loss after the source\'s S steps and '
      'the steps at which it reaches the uptrained mean-pooled loss, per '
      'source and over sources', 3), *report.table(
          ['S', 'K', 'read (uptraining steps)',
           'scratch loss after S, per source',
           'steps to the uptrained loss, per source', 'over sources'],
          cells), '']


def _trend_table(kv: list[int], summ: dict) -> list[str]:
  label = _labels(kv)
  n = next((t['family'] for by_read in summ['trend'].values()
            for t in by_read.values() if 'family' in t), 0)
  return [*report.section(
      'Trend: slope per doubling of the source\'s length (per source seed, '
      f'then over seeds; verdicts after Holm over these {n} slopes, one '
      'family fixed before they were read)', 3), *report.table(
          ['difference', 'read', 'slope', 'per seed'], (
              [label[name], read, _cell(t),
               ', '.join(f'{v:+.4f}' for v in t['values'])]
              for name, by_read in summ['trend'].items()
              for read, t in by_read.items() if t.get('n', 0) > 1))]


def plot(out: pathlib.Path, results: dict, summ: dict):
  """The mean-pooled gap to the control against the source's length (at
  both reads), and, where K was trained from scratch, the uptrained model
  minus it at alpha = 0.05: each source (dots) and the mean over sources
  with its 95% interval."""
  plt = report.pyplot()
  plan, lengths = results['plan'], summ['lengths']
  panels = [('gap', read) for read in READS] + (
      [('vs_scratch', 'paper')] if summ['claim3'] else [])
  fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4),
                           sharey=True)
  for ax, (kind, read) in zip(axes, panels):
    for j, K in enumerate(plan['kv_heads']):
      S = np.array(list(lengths))
      if f'{kind}_K{K}' not in lengths[S[0]]:
        continue
      rows = [lengths[s][f'{kind}_K{K}'][read] for s in S]
      x = S * (1 + 0.04 * (j - 0.5))  # Side by side on the log axis.
      mean = np.array([r['mean'] for r in rows])
      err = np.array([[r['mean'] - r['low'], r['high'] - r['mean']]
                      for r in rows]).T
      ax.errorbar(x, mean, yerr=np.where(np.isfinite(err), err, 0),
                  fmt='o-', capsize=3, color=f'C{j}',
                  label=f'mean-pooled K={K} − ' + (
                      'control' if kind == 'gap' else f'K={K} from scratch'))
      for xi, r in zip(x, rows):
        ax.plot([xi] * len(r['values']), r['values'], '.', color=f'C{j}',
                alpha=0.5)
    ax.axhline(plan['near'], color='gray', ls=':', lw=1,
               label=f'margin {plan["near"]} nats')
    ax.set(xscale='log', xlabel='source steps S',
           title=(f'α = {plan["paper_alpha"]} of S' if read == 'paper' else
                  f'{plan["fixed_steps"]} uptraining steps') + (
                      ', against K from scratch' if kind == 'vs_scratch'
                      else ''),
           ylabel='held-out loss gap (nats/token)')
    ax.minorticks_off()  # Only the lengths run are labelled.
    ax.set_xticks(list(lengths), [f'{s:,}' for s in lengths])
    ax.legend(fontsize=7)
  report.save(fig, out / 'sources.png', dpi=110)
