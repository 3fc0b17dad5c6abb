"""The source-replicated uptraining study's statistics, reading and plot.

`scripts.uptrain_study` (its default design) trains sources of several
lengths S, each with its own seeds, and uptrains each source's conversions
with a few uptraining seeds. The unit of replication is the source: every
value is first averaged over a source's uptraining seeds (which replicate
only the uptraining data order), and intervals are over the sources of one
length (`stats.mean` of the per-source values, `stats.decide` for every
verdict). The sources of different lengths with the same seed share their
initialisation and data order, so a trend over S is paired by source seed:
each seed's least-squares slope of a value against log2 S, then a t
interval over the seeds.

Read points per source: alpha = 0.05 of its steps ('paper') and a fixed
number of uptraining steps ('fixed'), both of one run per (arm, seed).

The arms of a source: the identity control (K = N), mean-pooled,
first-head and random K/V heads to each K (claims 1 and 2: mean-pooled
against the control; mean < first < random, each pair paired within the
source), MLA below GQA's width, GTA at (or nearest) its cache bytes and
GLA at its latent width (issue #51: GTA against the mean-pooled GQA arm
of nearest bytes, GLA against MLA-below, each paired within the source,
Holm over the lengths), and K trained from scratch for the
source's S steps by its recipe and seed (claim 3: the uptrained
mean-pooled K at alpha = 0.05 minus it, with the scratch steps at which
its curve, evaluated every S/40, reaches the uptrained loss:
`uptrain_report.equivalent_steps`). Claims 1 and 3 are read against one
margin (`nearness_verdict`): NEAR and the control gate at the longest
source, "contradicted" or "not reproduced at this scale" by the trend.

`summary(results)` derives every number the report states (saved in
results.json beside the per-run curves); `write(out, results)` writes
OUT/report.md and OUT/sources.png from them alone, so --report_only
rebuilds both identically from results.json.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np

from scripts import uptrain_report
from studies import stats
from infra import provenance

MLA_BELOW = 'mla_half'  # scripts.uptrain_study's method for that arm.
GTA = 'gta'  # Its grouped-tied arm at MLA_BELOW's bytes.
GLA = 'gla_half'  # Its grouped-latent arm at MLA_BELOW's latent width.
READS = ('paper', 'fixed')


# --- per-source values --------------------------------------------------------

def _runs(source: dict, method: str, K: int) -> list[dict]:
  return sorted((r for r in source['runs'] if (r['method'], r['K']) ==
                 (method, K)), key=lambda r: r['seed'])


def losses(source: dict, method: str, K: int, step: int) -> np.ndarray:
  """[uptraining seed] held-out losses of an arm at `step` (0: the
  conversion), in seed order."""
  return np.array([next(p['loss'] for p in r['curve'] if p['step'] == step)
                   for r in _runs(source, method, K)])


def scratch_curve(source: dict, K: int) -> list[dict]:
  """K trained from scratch for the source's steps by its recipe and seed:
  its evaluations (every S/40 steps)."""
  return next(r['curve'] for r in source['scratch'] if r['K'] == K)


def scratch_loss(source: dict, K: int) -> float:
  """Its held-out loss after the source's steps."""
  return next(p['loss'] for p in scratch_curve(source, K)
              if p['step'] == source['steps'])


def _difference(source: dict, a: tuple, b: tuple, step: int
                ) -> tuple[float, float]:
  """(the mean over uptraining seeds of arm a minus arm b at `step`,
  paired by uptraining seed; their sd over those seeds)."""
  d = losses(source, *a, step) - losses(source, *b, step)
  return float(d.mean()), float(d.std(ddof=1)) if len(d) > 1 else math.nan


def _over_sources(values: list[float], within: list[float] | None = None
                  ) -> dict:
  """A difference over sources: its Estimate, p, detectable, the verdict
  (`stats.decide`), the per-source values and the mean sd within a source
  (over its uptraining seeds: the spread pseudo-replication would count)."""
  est = stats.mean(values)
  out = {**est.as_dict(), 'values': list(values),
         'p': stats.p_value(values),
         'detectable': stats.detectable(est.sd, est.n),
         'verdict': stats.decide(est)}
  if within is not None:
    out['within_sd'] = float(np.nanmean(within)) if within else math.nan
  return out


def by_length(results: dict) -> dict[int, list[dict]]:
  """{S: its sources, in seed order}."""
  out = {}
  for s in results['sources']:
    out.setdefault(s['steps'], []).append(s)
  return {S: sorted(v, key=lambda s: s['seed']) for S, v in
          sorted(out.items())}


def _equal_bytes_K(plan: dict, mla: dict) -> int | None:
  """The GQA target whose cache equals the MLA arm's (2·K·H numbers)."""
  numbers = mla['kv_lora_rank'] + mla['qk_rope_head_dim']
  K = numbers / (2 * plan['head_dim'])
  return int(K) if K == int(K) and int(K) in plan['kv_heads'] else None


def _length(plan: dict, sources: list[dict]) -> dict:
  """One source length: per read, the differences over its sources."""
  N, kv = plan['num_heads'], plan['kv_heads']
  control = ('identity', N)
  first = sources[0]
  steps = {'paper': first['reads']['paper'], 'fixed': first['reads']['fixed']}
  out = {'reads': steps, 'n_sources': len(sources),
         'source_loss': _over_sources([s['source']['loss'] for s in sources]),
         'mla': first['mla'], 'warmup': first['warmup'], 'rate': first['rate']}
  # The control's drift from its source at every evaluated step.
  evaluated = sorted({p['step'] for r in first['runs'] for p in r['curve']
                      if p['step']})
  out['drift'] = [{'step': t, **_over_sources([
      float(losses(s, *control, t).mean() - s['source']['loss'])
      for s in sources])} for t in evaluated]
  out['conversion_exact'] = max(
      float(np.abs(losses(s, *control, 0) - s['source']['loss']).max())
      for s in sources)

  def compare(a, b, step):
    pairs = [_difference(s, a, b, step) for s in sources]
    return _over_sources([m for m, _ in pairs], [sd for _, sd in pairs])
  random = any(r['method'] == 'random' for r in first['runs'])
  for name, a, b in (
      *((f'gap_K{K}', ('mean', K), control) for K in kv),
      *((f'order_K{K}', ('mean', K), ('first', K)) for K in kv),
      *((f'{pair}_K{K}', (x, K), ('random', K)) for K in kv if random
        for pair, x in (('first_random', 'first'), ('mean_random', 'mean')))):
    out[name] = {read: compare(a, b, steps[read]) for read in READS}
    out[name]['conversion'] = compare(a, b, 0)

  def versus_scratch(K, step):
    up = [losses(s, 'mean', K, step) for s in sources]
    return _over_sources(
        [float(u.mean() - scratch_loss(s, K)) for u, s in zip(up, sources)],
        [float(u.std(ddof=1)) if len(u) > 1 else math.nan for u in up])
  for K in scratch_ks(first):
    out[f'vs_scratch_K{K}'] = {read: versus_scratch(K, steps[read])
                               for read in READS}
    out[f'vs_scratch_K{K}']['conversion'] = versus_scratch(K, 0)
    out[f'scratch_K{K}'] = _over_sources([scratch_loss(s, K)
                                          for s in sources])
    out[f'equivalent_K{K}'] = {read: equivalent(
        sources, K, steps[read], plan['vocab_size']) for read in READS}
  mla = (MLA_BELOW, first['mla']['K'])
  partner = _equal_bytes_K(plan, first['mla'])
  out['mla_partner_K'] = partner
  for name, b in (('mla_vs_equal_bytes', ('mean', partner)),
                  ('mla_vs_gqa', ('mean', first['mla']['K']))):
    if b[1] is None:
      continue
    out[name] = {read: compare(mla, b, steps[read]) for read in READS}
    out[name]['conversion'] = compare(mla, b, 0)
  # Results made before the GTA and GLA arms lack them.
  for name, arm, b in (
      ('gta_vs_equal_bytes', first.get('gta'),
       first.get('gta') and ('mean', first['gta']['partner_K'])),
      ('gla_vs_mla', first.get('gla'), mla)):
    if arm:
      a = (arm['method'], arm['K'])
      out[name] = {read: compare(a, b, steps[read]) for read in READS}
      out[name]['conversion'] = compare(a, b, 0)
      out[arm['method']] = arm
  return out


def scratch_ks(source: dict) -> list[int]:
  """The K a source trained from scratch (none in results made before
  claim 3's arm)."""
  return [r['K'] for r in source.get('scratch', [])]


def equivalent(sources: list[dict], K: int, step: int, vocab_size: int
               ) -> dict:
  """Per source, the steps its K-from-scratch curve needs to reach the
  uptrained mean-pooled K's loss at `step` (the mean over its uptraining
  seeds; `uptrain_report.equivalent_steps`, from ln V at step 0; inf, a
  censored source, when the whole curve stays above it), and their mean
  over sources (with `censored`: how many are beyond the curve, and then
  no interval)."""
  E = []
  for s in sources:
    curve = scratch_curve(s, K)
    E.append(uptrain_report.equivalent_steps(
        float(losses(s, 'mean', K, step).mean()),
        [p['step'] for p in curve], [p['loss'] for p in curve],
        math.log(vocab_size)))
  censored = sum(not math.isfinite(e) for e in E)
  return {'values': E, 'censored': censored, 'uptraining_steps': step,
          **({} if censored else stats.mean(E).as_dict())}


# --- across lengths -------------------------------------------------------------

def _slopes(plan: dict, lengths: dict, name: str, read: str) -> dict:
  """Per source seed, the least-squares slope of `name`'s per-source value
  at `read` against log2 S (per doubling of the source's length), over the
  lengths that seed has; then over the seeds."""
  per_seed = {}
  for S, row in lengths.items():
    for seed, v in zip(plan['source_seeds'], row[name][read]['values']):
      per_seed.setdefault(seed, []).append((math.log2(S), v))
  slopes = [float(np.polyfit(*zip(*pts), 1)[0]) for pts in per_seed.values()
            if len(pts) > 1]
  if not slopes:
    return {'n': 0}
  return {**_over_sources(slopes), 'seeds': sorted(per_seed)}


def _holm(cells: list[dict]) -> list[dict]:
  """Holm over a family of per-source differences; each cell's verdict
  (`stats.decide`) with its Holm outcome."""
  rejected = stats.holm([c['p'] for c in cells])
  return [{**c, 'holm': r, 'verdict': stats.decide(c, rejected=r)}
          for c, r in zip(cells, rejected)]


def nearness_verdict(longest: dict, trend: dict, near: float,
                     floor: float = 0.0) -> str:
  """A claim that the uptrained alpha = 0.05 model is near a reference (at
  most `near` nats above it: claim 1's control, claim 3's K trained from
  scratch), decided mechanically: 'reproduced'
  when the gap at the longest source is resolved below the margin;
  'contradicted' when it is resolved beyond it and the gap is resolved to
  grow with the source's length (more pretraining would not close it);
  'not reproduced at this scale' when beyond it and the trend is resolved
  to shrink, or not claimed either way; 'not claimed' when the gap's
  distance from the margin is below what the sources detect, or the gap
  is below the control gate's `floor` (4 x the control's largest drift)."""
  beyond = stats.shifted(longest, near)
  if stats.decide(beyond) != 'resolved':
    return 'not claimed'
  if beyond.mean < 0:
    return 'reproduced'
  if abs(longest['mean']) < floor:
    return 'not claimed (below the control gate)'
  if trend.get('n', 0) > 1 and stats.decide(trend) == 'resolved':
    if trend['mean'] > 0:
      return 'contradicted'
    return 'not reproduced at this scale (the gap shrinks with the source)'
  return 'not reproduced at this scale (no trend with the source claimed)'


def _gate(lengths: dict, near: float, kv: list[int]) -> dict:
  """Per length, the control's drift at every evaluated step (its largest
  |mean| sets a floor of 4 x it), and the distances beyond the margin that
  are claimed (claim 1's gaps to the control, claim 3's differences from
  K trained from scratch, each resolved beyond `near`) below that floor.
  A difference resolved within the margin claims no effect, so the gate
  does not apply to it."""
  out = {}
  for S, row in lengths.items():
    worst = max(row['drift'], key=lambda d: abs(d['mean']))
    claims = [(f'K={K} {read}' + (' vs scratch' if kind == 'vs_scratch'
                                   else ''), row[f'{kind}_K{K}'][read]['mean'])
              for kind in ('gap', 'vs_scratch') for K in kv for read in READS
              if f'{kind}_K{K}' in row
              and stats.decide(stats.shifted(row[f'{kind}_K{K}'][read], near))
              == 'resolved' and row[f'{kind}_K{K}'][read]['mean'] > near]
    floor = 4 * abs(worst['mean'])
    below = [(n, e) for n, e in claims if abs(e) < floor]
    out[S] = {'worst': worst, 'floor': floor, 'claims': claims,
              'below': below, 'passes': not below}
  return out


def summary(results: dict) -> dict:
  """Every derived number of the report, from the per-run curves."""
  plan = results['plan']
  lengths = {S: _length(plan, v) for S, v in by_length(results).items()}
  kv, near = plan['kv_heads'], plan['near']
  longest, gate = lengths[max(lengths)], _gate(lengths, near, kv)
  trend = {name: {read: _slopes(plan, lengths, name, read) for read in READS}
           for kind in ('gap', 'vs_scratch') for K in kv
           if (name := f'{kind}_K{K}') in longest}
  K_gqa = max(kv)  # The paper's claims of nearness are for GQA, not MQA.
  # As the paper frames them: at alpha = 0.05 of each source's steps. The
  # fixed read is a diagnostic (its alpha falls as S grows), not judged.
  floor = gate[max(lengths)]['floor']
  claim1 = {'K': K_gqa, 'paper': nearness_verdict(
      longest[f'gap_K{K_gqa}']['paper'], trend[f'gap_K{K_gqa}']['paper'],
      near, floor)}
  claim3 = ({'K': K_gqa, 'paper': nearness_verdict(
      longest[f'vs_scratch_K{K_gqa}']['paper'],
      trend[f'vs_scratch_K{K_gqa}']['paper'], near, floor)}
            if f'vs_scratch_K{K_gqa}' in longest else None)
  # Claim 2, mean < first < random: each adjacent pair (better - worse < 0)
  # at every (length, K), one Holm family.
  ranking = _holm([{'S': S, 'K': K, 'better': b, 'worse': w,
                    **row[name]['paper']}
                   for S, row in lengths.items() for K in kv
                   for b, w, name in (('mean', 'first', f'order_K{K}'),
                                      ('first', 'random',
                                       f'first_random_K{K}'))
                   if name in row])
  mla = _holm([{'S': S, **row['mla_vs_equal_bytes']['paper']}
               for S, row in lengths.items() if 'mla_vs_equal_bytes' in row])
  # GTA - GQA of nearest bytes, GLA - MLA-below: one Holm family each.
  latent = {name: _holm([{'S': S, **row[name]['paper']}
                         for S, row in lengths.items() if name in row])
            for name in ('gta_vs_equal_bytes', 'gla_vs_mla')}
  return {'lengths': lengths, 'trend': trend, 'claim1': claim1,
          'claim3': claim3, 'ranking': ranking, 'ordering': {
              S: {K: uptrain_report.ranking_verdict(
                  [c for c in ranking if c['S'] == S], K) for K in kv}
              for S in lengths}, 'mla': mla, 'gate': gate,
          **{name: cells for name, cells in latent.items() if cells}}


# --- the reading ------------------------------------------------------------------

def _f(est: dict, spec: str = '+.4f') -> str:
  """'mean [low, high]' over sources (or the convention's words)."""
  e = stats.as_estimate(est)
  if e.n < 2:
    return f'{e.mean:{spec}} (1 source)'
  if e.deterministic:
    return f'{e.mean:{spec}} (equal on all {e.n} sources)'
  return f'{e.mean:{spec}} [{e.low:{spec}}, {e.high:{spec}}]'


def _det(est: dict) -> str:
  d = est.get('detectable', math.inf)
  return (f'detectable {d:.4f}' if math.isfinite(d) else
          'nothing detectable')


def _cell(est: dict) -> str:
  """An estimate with its verdict, as every report line states one."""
  return f'{_f(est)} ({_det(est)}; {est["verdict"]})'


def reading(results: dict, summ: dict) -> list[str]:
  plan, lengths = results['plan'], summ['lengths']
  kv, N, near = plan['kv_heads'], plan['num_heads'], plan['near']
  n_src = len(plan['source_seeds'])
  first = next(iter(lengths.values()))
  mla = first['mla']
  lines = [
      f'- **Design**: {n_src} MHA sources (K = N = {N}; seeds '
      f'{", ".join(map(str, plan["source_seeds"]))}) at each length S = '
      + ', '.join(f'{S:,}' for S in lengths) + ' steps, each converted to '
      f'the identity control (K = {N}), ' + (
          'mean-pooled, first-head and random (fresh K/V heads, one draw per '
          'uptraining seed)' if f'first_random_K{kv[0]}' in first else
          'mean-pooled and first-head') + ' K = '
      + ' and '.join(map(str, kv)) + f', and MLA below GQA-{mla["K"]}\'s '
      'width' + (', GTA at (or nearest) its cache bytes and GLA at its '
                 'latent width' if GLA in first and GTA in first else '')
      + f'; {len(plan["seeds"])} uptraining seeds per arm '
      f'({", ".join(map(str, plan["seeds"]))}), averaged within the source. '
      + ('' if not scratch_ks(results['sources'][0]) else
         'Beside each source, K = ' + ' and '.join(
             map(str, scratch_ks(results['sources'][0])))
         + ' trained from scratch for its S steps by its recipe and seed, '
         'evaluated every S/40 steps. ') +
      f'Uptrained at {plan["rate_ratio"]:.3g} x the source\'s peak rate (the '
      'single-source pilot\'s choice, fixed in advance, not piloted per '
      'source), warmup over α = 0.0125 of the source\'s steps, then '
      f'constant; read at α = {plan["paper_alpha"]} and at '
      f'{plan["fixed_steps"]} uptraining steps. The unit of replication is '
      'the source: intervals are over sources, and a trend over S is '
      'paired by source seed.']
  for S, row in lengths.items():
    g = summ['gate'][S]
    lines.append(
        f'- **S = {S:,}**: source loss {_f(row["source_loss"], ".4f")}; '
        f'reads at {row["reads"]["paper"]} (α = {plan["paper_alpha"]}) and '
        f'{row["reads"]["fixed"]} steps (warmup {row["warmup"]}). Control '
        'drift from the source at every evaluated step: ' + ', '.join(
            f'{d["step"]}: {_f(d)}' for d in row['drift'])
        + f'. Gate (4 × the largest |drift| = {g["floor"]:.4f}): ' + (
            'passes' if g['passes'] else 'fails for ' + ', '.join(
                f'{n} ({e:+.4f})' for n, e in g['below'])
            + ' (reported, not claimed)') + '.')
  K = summ['claim1']['K']
  t = summ['trend'][f'gap_K{K}']['paper']
  lines.append(
      f'- **Claim 1, GQA K = {K} (α = {plan["paper_alpha"]} of uptraining '
      f'brings GQA near MHA: ≤ {near} nats above the control, fixed in '
      f'advance; "contradicted" only if the gap beyond it grows with the '
      f'source\'s length): {summ["claim1"]["paper"]}.** Mean-pooled minus '
      'the control at α = 0.05 by source length: ' + '; '.join(
          f'S = {S:,}: {_cell(row[f"gap_K{K}"]["paper"])}' + (
              ', but withheld by that length\'s control gate: not claimed'
              if any(n == f'K={K} paper' for n, _ in summ['gate'][S]['below'])
              else '') for S, row in lengths.items())
      + '. Per doubling of the source\'s length (slope per source seed): '
      + (_cell(t) if t.get('n', 0) > 1 else 'one length only') + '.')
  t = summ['trend'][f'gap_K{K}']['fixed']
  lines.append(
      f'- **The same gap after a fixed {plan["fixed_steps"]} uptraining '
      'steps** (a diagnostic, not the paper\'s framing: α falls from '
      + ' to '.join(f'{plan["fixed_steps"] / S:g}' for S in
                    (min(lengths), max(lengths)))
      + ' as S grows, and the warmup is α = 0.0125 of S, '
      + ', '.join(str(row['warmup']) for row in lengths.values())
      + ' steps): ' + '; '.join(
          f'S = {S:,}: {_cell(row[f"gap_K{K}"]["fixed"])}'
          for S, row in lengths.items())
      + '. Per doubling: '
      + (_cell(t) if t.get('n', 0) > 1 else 'one length only') + '.')
  for K in [k for k in kv if k != summ['claim1']['K']]:
    lines.append(
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
            if summ['trend'][f'gap_K{K}'][read].get('n', 0) > 1) + '.')
  lines += _claim3(plan, summ)
  pairs = sorted({(c['better'], c['worse']) for c in summ['ranking']},
                 key=lambda pair: ['mean', 'first'].index(pair[0]))
  lines.append(
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
  if summ['mla']:
    partner = first['mla_partner_K']
    lines.append(
        f'- **MLA below GQA\'s width** (kv_lora_rank {mla["kv_lora_rank"]} '
        f'+ {mla["qk_rope_head_dim"]} RoPE dims = half of GQA-{mla["K"]}\'s '
        f'{2 * mla["K"] * plan["head_dim"]} numbers; latent '
        f'{mla["kv_lora_rank"]} < d_model {plan["d_model"]}, the regime of '
        f'MHA2MLA and TransMLA), against mean-pooled K = {partner} at equal '
        f'cache bytes ({mla["kv_bytes_per_token"]:g} bytes/token), α = '
        f'{plan["paper_alpha"]}, Holm over the {len(summ["mla"])} lengths: '
        + '; '.join(
            f'S = {c["S"]:,}: MLA − GQA {_f(c)}, {_det(c)}, '
            f'**{c["verdict"]}**' + (
                '' if c['verdict'] != 'resolved' else
                ' (MLA lower)' if c['mean'] < 0 else ' (GQA lower)')
            for c in summ['mla'])
        + '. Energy kept by the SVD per layer, by source: ' + '; '.join(
            f'S = {S:,}: ' + ', '.join(
                '/'.join(f'{e:.3f}' for e in s['mla']['energy_kept'])
                for s in by_length(results)[S]) for S in lengths) + '.')
  lines += _latent_arms(plan, summ)
  within = [(S, row[f'gap_K{max(kv)}']['paper']) for S, row in lengths.items()]
  lines.append(
      '- **Pseudo-replication, measured**: the sd of the GQA gap at α = '
      f'{plan["paper_alpha"]} within a source (over its uptraining seeds, '
      'averaged) against its sd between sources: ' + '; '.join(
          f'S = {S:,}: {c["within_sd"]:.4f} within, {c["sd"]:.4f} between'
          for S, c in within) + '.')
  return lines


def _latent_arms(plan: dict, summ: dict) -> list[str]:
  """The reading's GTA and GLA lines (issue #51), where the results have
  those arms."""
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
    lines.append(
        f'- **GLA against MLA-below at equal bytes** (Zadouri et al.: GLA '
        f'matches MLA; --latent_groups={g["latent_groups"]}, kv_lora_rank '
        f'{g["kv_lora_rank"]} + {g["qk_rope_head_dim"]} RoPE dims, '
        f'{g["kv_bytes_per_token"]:g} bytes/token, MLA-below '
        f'{g["mla_kv_bytes_per_token"]:g}), α = {a}, Holm over the '
        f'{len(summ["gla_vs_mla"])} lengths: '
        + cells('gla_vs_mla', 'GLA − MLA') + '.')
  return lines


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
            f'S = {S:,}: {_cell(row[f"vs_scratch_K{K}"]["paper"])}' + (
                ', but withheld by that length\'s control gate: not claimed'
                if judged and any(n == f'K={K} paper vs scratch' for n, _ in
                                  summ['gate'][S]['below']) else '')
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


def tables(results: dict, summ: dict) -> list[str]:
  plan, kv = results['plan'], results['plan']['kv_heads']
  label = {**{f'gap_K{K}': f'mean K={K} − control' for K in kv},
           **{f'vs_scratch_K{K}': f'mean K={K} − K={K} from scratch'
              for K in kv},
           **{f'order_K{K}': f'mean − first, K={K}' for K in kv},
           **{f'first_random_K{K}': f'first − random, K={K}' for K in kv},
           **{f'mean_random_K{K}': f'mean − random, K={K}' for K in kv},
           'mla_vs_equal_bytes': 'MLA-half − mean K at equal bytes',
           'mla_vs_gqa': 'MLA-half − mean GQA-K (twice its bytes)',
           'gta_vs_equal_bytes': 'GTA − mean K of nearest bytes',
           'gla_vs_mla': 'GLA − MLA-half (equal bytes)'}
  rows = summ['lengths']

  def present(names):  # Columns the results have (older ones lack some).
    return [n for n in names if any(n in r for r in rows.values())]
  groups = [
      ('against the control and K from scratch (claims 1 and 3)', present(
          [f'gap_K{K}' for K in kv] + [f'vs_scratch_K{K}' for K in kv])),
      ('between conversions (claim 2, the MLA arm)', present(
          [f'{n}_K{K}' for n in ('order', 'first_random', 'mean_random')
           for K in kv] + ['mla_vs_equal_bytes', 'mla_vs_gqa',
                           'gta_vs_equal_bytes', 'gla_vs_mla']))]
  lines = []
  for title, names in groups:
    lines += [f'### Per source, {title}: differences at each read (mean '
              'over the uptraining seeds)', '',
              '| S | source seed | source loss | read (steps) | ' + ' | '.join(
                  label[n] for n in names) + ' |',
              '|---|---|---|---|' + '---|' * len(names)]
    for S, sources in by_length(results).items():
      row = rows[S]
      for i, s in enumerate(sources):
        for read in ('conversion', *READS):
          step = 0 if read == 'conversion' else row['reads'][read]
          lines.append(
              f'| {S:,} | {s["seed"]} | {s["source"]["loss"]:.4f} | {read} '
              f'({step}) | ' + ' | '.join(
                  f'{row[n][read]["values"][i]:+.4f}' if n in row else '—'
                  for n in names) + ' |')
    lines += ['', f'### Over sources, {title}: mean [95% t interval over '
              'sources] (detectable; verdict, uncorrected: the reading\'s '
              'Holm families decide claim 2 and the arms compared by bytes)', '',
              '| S | read | ' + ' | '.join(label[n] for n in names) + ' |',
              '|---|---|' + '---|' * len(names)]
    for S, row in rows.items():
      for read in READS:
        lines.append(f'| {S:,} | {read} ({row["reads"][read]}) | '
                     + ' | '.join(_cell(row[n][read]) if n in row else '—'
                                  for n in names) + ' |')
    lines.append('')
  scratch = [K for K in kv if f'scratch_K{K}' in rows[max(rows)]]
  if scratch:
    lines += ['### K from scratch (claim 3): its loss after the source\'s '
              'S steps and the steps at which it reaches the uptrained '
              'mean-pooled loss, per source and over sources', '',
              '| S | K | read (uptraining steps) | scratch loss after S, per '
              'source | steps to the uptrained loss, per source | over '
              'sources |', '|---|---|---|---|---|---|']
    for S, row in rows.items():
      for K in scratch:
        for read in READS:
          e = row[f'equivalent_K{K}'][read]
          lines.append(
              f'| {S:,} | {K} | {read} ({e["uptraining_steps"]}) | '
              + ', '.join(f'{v:.4f}' for v in row[f'scratch_K{K}']['values'])
              + ' | ' + ', '.join(f'{v:.0f}' if math.isfinite(v) else
                                  f'> {S}' for v in e['values'])
              + f' | {_steps(e, S)} |')
    lines.append('')
  lines += ['### Trend: slope per doubling of the source\'s length '
            '(per source seed, then over seeds)', '',
            '| difference | read | slope | per seed |', '|---|---|---|---|']
  for name, by_read in summ['trend'].items():
    for read, t in by_read.items():
      if t.get('n', 0) > 1:
        lines.append(f'| {label[name]} | {read} | {_cell(t)} | ' + ', '.join(
            f'{v:+.4f}' for v in t['values']) + ' |')
  return lines


def plot(out: pathlib.Path, results: dict, summ: dict):
  """The mean-pooled gap to the control against the source's length (at
  both reads), and, where K was trained from scratch, the uptrained model
  minus it at alpha = 0.05: each source (dots) and the mean over sources
  with its 95% interval."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
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
  fig.tight_layout()
  fig.savefig(out / 'sources.png', dpi=110)
  plt.close(fig)


def text(results: dict) -> str:
  """report.md: a function of results.json's per-run curves and provenance
  alone (the summary recomputed), so a rebuild is identical."""
  summ = summary(results)
  prov = results['provenance']
  return '\n'.join([
      '# Uptraining MHA to GQA/MQA (Ainslie et al. 2023), replicated over '
      'sources and source lengths', '', uptrain_report.made(prov), '', prov['statistics'],
      '', '## Reading', '', *reading(results, summ), '',
      '![the gap against the source\'s length](sources.png)', '',
      '## Tables', '', *tables(results, summ), ''])


def write(out: pathlib.Path, results: dict):
  """OUT/report.md and OUT/sources.png from results."""
  report = text(results)
  (out / 'report.md').write_text(report)
  plot(out, results, summary(results))
  print(report[:report.index('## Tables')])
  print(f'wrote {out / "report.md"}, sources.png')
