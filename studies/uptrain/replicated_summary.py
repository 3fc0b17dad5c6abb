"""The source-replicated design's statistics: `summary(results)` derives
every number its report states from the per-run curves (saved in
results.json beside them).

The unit of replication is the source: every value is first averaged over
a source's uptraining seeds (which replicate only the uptraining data
order), and intervals are over the sources of one length (`stats.mean` of
the per-source values, `stats.decide` for every verdict). The sources of
different lengths with the same seed share their initialisation and data
order, so a trend over S is paired by source seed: each seed's
least-squares slope of a value against log2 S, then a t interval over the
seeds.

Read points per source: alpha = 0.05 of its steps ('paper') and a fixed
number of uptraining steps ('fixed'), both of one run per (arm, seed).

The arms of a source: the identity control (K = N), mean-pooled,
first-head and random K/V heads to each K (claims 1 and 2: mean-pooled
against the control; mean < first < random, each pair paired within the
source), MLA below GQA's width, GTA and TPA at (or nearest) its cache
bytes and GLA at its latent width (issues #51, #63: GTA and TPA each
against the mean-pooled GQA arm of nearest bytes, GLA against MLA-below,
each paired within the source, Holm over the lengths), and K trained
from scratch for the source's S steps by its recipe and seed (claim 3:
the uptrained mean-pooled K at alpha = 0.05 minus it, with the scratch
steps at which its curve, evaluated every S/40, reaches the uptrained
loss: `common.equivalent_steps`). Claims 1 and 3 are read against one margin
(`nearness_verdict`): NEAR and the control gate at the longest source,
"contradicted" or "not reproduced at this scale" by the trend.
"""

from __future__ import annotations

import math

import numpy as np

from studies import stats
from studies.uptrain.common import (equivalent_steps, per_doubling,
                                    ranking_verdict)
from studies.uptrain.design import MLA_BELOW
from train.convert import to_mla

READS = ('paper', 'fixed')
# The arms compared by cache bytes beside MLA-below's, each one Holm family.
LATENT = ('gta_vs_equal_bytes', 'gla_vs_mla', 'tpa_vs_equal_bytes')


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
         'verdict': stats.decision(est).words}
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
  latent = to_mla.latent(mla)
  K = (latent.width + latent.rope) / (2 * plan['head_dim'])
  return int(K) if K == int(K) and int(K) in plan['kv_heads'] else None


def _length(plan: dict, sources: list[dict]) -> dict:
  """One source length: per read, the differences over its sources."""
  first = sources[0]
  out = {'reads': {'paper': first['reads']['paper'],
                   'fixed': first['reads']['fixed']},
         'n_sources': len(sources),
         'source_loss': _over_sources([s['source']['loss'] for s in sources]),
         'mla': first['mla'], 'warmup': first['warmup'], 'rate': first['rate'],
         **_drift(plan, sources)}
  out.update(_between_arms(plan, sources, out['reads']))
  for K in scratch_ks(first):
    out.update(_versus_scratch(plan, sources, out['reads'], K))
  out.update(_latent_arms(plan, sources, out['reads']))
  return out


def _drift(plan: dict, sources: list[dict]) -> dict:
  """The control's drift from its source at every evaluated step, and
  how far its conversion (step 0) is from the source."""
  control = ('identity', plan['num_heads'])
  evaluated = sorted({p['step'] for r in sources[0]['runs']
                      for p in r['curve'] if p['step']})
  return {'drift': [{'step': t, **_over_sources([
      float(losses(s, *control, t).mean() - s['source']['loss'])
      for s in sources])} for t in evaluated],
          'conversion_exact': max(
              float(np.abs(losses(s, *control, 0) - s['source']['loss']).max())
              for s in sources)}


def _compare(sources: list[dict], a: tuple, b: tuple, steps: dict) -> dict:
  """Arm a minus arm b ((method, K) each) over SOURCES, at each read and
  at the conversion (step 0)."""
  def at(step):
    pairs = [_difference(s, a, b, step) for s in sources]
    return _over_sources([m for m, _ in pairs], [sd for _, sd in pairs])
  return {**{read: at(steps[read]) for read in READS}, 'conversion': at(0)}


def _between_arms(plan: dict, sources: list[dict], steps: dict) -> dict:
  """Claim 1's gaps to the control, and claim 2's orderings (mean <
  first < random: random only where the results have it), per K."""
  kv, control = plan['kv_heads'], ('identity', plan['num_heads'])
  random = any(r['method'] == 'random' for r in sources[0]['runs'])
  return {name: _compare(sources, a, b, steps) for name, a, b in (
      *((f'gap_K{K}', ('mean', K), control) for K in kv),
      *((f'order_K{K}', ('mean', K), ('first', K)) for K in kv),
      *((f'{pair}_K{K}', (x, K), ('random', K)) for K in kv if random
        for pair, x in (('first_random', 'first'), ('mean_random', 'mean'))))}


def _versus_scratch(plan: dict, sources: list[dict], steps: dict, K: int
                    ) -> dict:
  """Claim 3 for K: the uptrained mean-pooled K minus K from scratch
  after the source's steps, the scratch loss, and the scratch-equivalent
  steps of the uptrained loss."""
  def at(step):
    up = [losses(s, 'mean', K, step) for s in sources]
    return _over_sources(
        [float(u.mean() - scratch_loss(s, K)) for u, s in zip(up, sources)],
        [float(u.std(ddof=1)) if len(u) > 1 else math.nan for u in up])
  return {f'vs_scratch_K{K}': {**{read: at(steps[read]) for read in READS},
                               'conversion': at(0)},
          f'scratch_K{K}': _over_sources([scratch_loss(s, K)
                                          for s in sources]),
          f'equivalent_K{K}': {read: equivalent(
              sources, K, steps[read], plan['vocab_size']) for read in READS}}


def _latent_arms(plan: dict, sources: list[dict], steps: dict) -> dict:
  """MLA-below against mean-pooled GQA of equal bytes and of its K; GTA
  and TPA against the GQA arm of nearest bytes, GLA against MLA-below
  (results made before those arms lack them)."""
  first = sources[0]
  mla = (MLA_BELOW, first['mla']['K'])
  out = {'mla_partner_K': _equal_bytes_K(plan, first['mla'])}
  for name, b in (('mla_vs_equal_bytes', ('mean', out['mla_partner_K'])),
                  ('mla_vs_gqa', ('mean', first['mla']['K']))):
    if b[1] is not None:
      out[name] = _compare(sources, mla, b, steps)
  for name, arm, b in (
      ('gta_vs_equal_bytes', first.get('gta'),
       first.get('gta') and ('mean', first['gta']['partner_K'])),
      ('gla_vs_mla', first.get('gla'), mla),
      ('tpa_vs_equal_bytes', first.get('tpa'),
       first.get('tpa') and ('mean', first['tpa']['partner_K']))):
    if arm:
      out[name] = _compare(sources, (arm['method'], arm['K']), b, steps)
      out[arm['method']] = arm
  tpa = first.get('tpa')
  if tpa and tpa['partner_K'] == tpa['K']:  # Converted from it, exactly.
    out['tpa_conversion_exact'] = max(
        abs(v) for v in out['tpa_vs_equal_bytes']['conversion']['values'])
  return out


def scratch_ks(source: dict) -> list[int]:
  """The K a source trained from scratch (none in results made before
  claim 3's arm)."""
  return [r['K'] for r in source.get('scratch', [])]


def equivalent(sources: list[dict], K: int, step: int, vocab_size: int
               ) -> dict:
  """Per source, the steps its K-from-scratch curve needs to reach the
  uptrained mean-pooled K's loss at `step` (the mean over its uptraining
  seeds; `equivalent_steps`, from ln V at step 0; inf, a
  censored source, when the whole curve stays above it), and their mean
  over sources (with `censored`: how many are beyond the curve, and then
  no interval)."""
  E = []
  for s in sources:
    curve = scratch_curve(s, K)
    E.append(equivalent_steps(
        float(losses(s, 'mean', K, step).mean()),
        [p['step'] for p in curve], [p['loss'] for p in curve],
        math.log(vocab_size)))
  censored = sum(not math.isfinite(e) for e in E)
  return {'values': E, 'censored': censored, 'uptraining_steps': step,
          **({} if censored else stats.mean(E).as_dict())}


# --- across lengths ---------------------------------------------------------

def _slopes(plan: dict, lengths: dict, name: str, read: str) -> dict:
  """Per source seed, the least-squares slope of `name`'s per-source value
  at `read` against log2 S (per doubling of the source's length), over the
  lengths that seed has; then over the seeds."""
  by_length = {S: list(zip(plan['source_seeds'], row[name][read]['values']))
               for S, row in lengths.items()}
  slopes = per_doubling(by_length)
  if not slopes:
    return {'n': 0}
  return {**_over_sources(slopes),
          'seeds': sorted({seed for pairs in by_length.values()
                           for seed, _ in pairs})}


def _holm(cells: list[dict]) -> list[dict]:
  """Holm over a family of per-source differences; each cell's verdict
  (`stats.decision`'s words) with its Holm outcome."""
  rejected = stats.holm([c['p'] for c in cells])
  return [{**c, 'holm': r, 'verdict': stats.decision(c, rejected=r).words}
          for c, r in zip(cells, rejected)]


def _trend_family(trend: dict) -> dict:
  """The trends over the source's length, one Holm family fixed before
  reading them: every slope the report states (the gap to the control and
  the difference from K trained from scratch, for each K, at both reads:
  the fixed read's are diagnostics, but a verdict is printed beside them,
  so they are counted). Each slope gets its `holm` and corrected verdict."""
  keys = [(name, read) for name, by_read in trend.items()
          for read, t in by_read.items() if t.get('n', 0) > 1]
  cells = _holm([trend[name][read] for name, read in keys])
  out = {name: dict(by_read) for name, by_read in trend.items()}
  for (name, read), cell in zip(keys, cells):
    out[name][read] = {**cell, 'family': len(keys)}
  return out


def nearness_verdict(longest: dict, trend: dict, near: float,
                     floor: float = 0.0) -> str:
  """A claim that the uptrained alpha = 0.05 model is near a reference (at
  most `near` nats above it: claim 1's control, claim 3's K trained from
  scratch), decided mechanically: 'reproduced'
  when the gap at the longest source is resolved below the margin;
  'contradicted' when it is resolved beyond it and the gap is resolved
  (after Holm over the trend family) to grow with the source's length
  (more pretraining would not close it);
  'not reproduced at this scale' when beyond it and the trend is resolved
  to shrink, or not claimed either way; otherwise the words of
  `stats.decision` on the gap's distance from the margin (its reason: the
  interval holds 0, below what the sources detect, or withheld when a gap
  beyond the margin is below the control gate's `floor`, 4 x the
  control's largest drift)."""
  beyond = stats.shifted(longest, near)
  decided = stats.decision(beyond, withheld=(
      beyond.mean > 0 and abs(longest['mean']) < floor))
  if decided.verdict != 'resolved':
    return decided.words
  if beyond.mean < 0:
    return 'reproduced'
  if trend.get('n', 0) > 1 and stats.decide(
      trend, rejected=trend['holm']) == 'resolved':
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
    claims = [(_gate_name(kind, K, read), row[f'{kind}_K{K}'][read]['mean'])
              for kind in ('gap', 'vs_scratch') for K in kv for read in READS
              if f'{kind}_K{K}' in row
              and stats.decide(stats.shifted(row[f'{kind}_K{K}'][read], near))
              == 'resolved' and row[f'{kind}_K{K}'][read]['mean'] > near]
    floor = 4 * abs(worst['mean'])
    below = [(n, e) for n, e in claims if abs(e) < floor]
    out[S] = {'worst': worst, 'floor': floor, 'claims': claims,
              'below': below, 'passes': not below}
  return out


def _as_decided(lengths: dict, gate: dict, family_cells: list[dict]):
  """Every cell of `lengths` whose verdict the reading decides otherwise
  takes that verdict, so that a table never says what the reading does
  not: a member of a Holm family its corrected verdict, a distance
  withheld by its length's control gate 'withheld by the control gate'."""
  for c in family_cells:
    lengths[c['S']][c['name']]['paper'].update(holm=c['holm'],
                                               verdict=c['verdict'])
  for S, row in lengths.items():
    withheld = {name for name, _ in gate[S]['below']}
    for kind in ('gap', 'vs_scratch'):
      for read in READS:
        for K in [int(k[len(kind) + 2:]) for k in row
                  if k.startswith(f'{kind}_K')]:
          if _gate_name(kind, K, read) in withheld:
            cell = row[f'{kind}_K{K}'][read]
            cell['verdict'] = stats.decision(cell, withheld=True).words


def _gate_name(kind: str, K: int, read: str) -> str:
  """How the gate names a distance beyond the margin: 'K=2 paper',
  'K=2 paper vs scratch'."""
  return f'K={K} {read}' + (' vs scratch' if kind == 'vs_scratch' else '')


def summary(results: dict) -> dict:
  """Every derived number of the report, from the per-run curves."""
  plan = results['plan']
  lengths = {S: _length(plan, v) for S, v in by_length(results).items()}
  kv, near = plan['kv_heads'], plan['near']
  longest, gate = lengths[max(lengths)], _gate(lengths, near, kv)
  trend = _trend_family({
      name: {read: _slopes(plan, lengths, name, read) for read in READS}
      for kind in ('gap', 'vs_scratch') for K in kv
      if (name := f'{kind}_K{K}') in longest})
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
  ranking = _holm([{'S': S, 'K': K, 'better': b, 'worse': w, 'name': name,
                    **row[name]['paper']}
                   for S, row in lengths.items() for K in kv
                   for b, w, name in (('mean', 'first', f'order_K{K}'),
                                      ('first', 'random',
                                       f'first_random_K{K}'))
                   if name in row])
  mla = _holm([{'S': S, 'name': 'mla_vs_equal_bytes',
                **row['mla_vs_equal_bytes']['paper']}
               for S, row in lengths.items() if 'mla_vs_equal_bytes' in row])
  # GTA - GQA of nearest bytes, GLA - MLA-below, TPA - GQA of nearest
  # bytes: one Holm family each.
  latent = {name: _holm([{'S': S, 'name': name, **row[name]['paper']}
                         for S, row in lengths.items() if name in row])
            for name in LATENT}
  _as_decided(lengths, gate, [*ranking, *mla, *(
      c for cells in latent.values() for c in cells)])
  return {'lengths': lengths, 'trend': trend, 'claim1': claim1,
          'claim3': claim3, 'ranking': ranking, 'ordering': {
              S: {K: ranking_verdict(
                  [c for c in ranking if c['S'] == S], K) for K in kv}
              for S in lengths}, 'mla': mla, 'gate': gate,
          **{name: cells for name, cells in latent.items() if cells}}
