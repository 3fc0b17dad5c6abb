"""The uptraining study's statistics, reading and plots.

`summary(results)` takes `scripts.uptrain_study`'s per-seed results and
derives every number the report states (stored in results.json beside them);
`write(out, results)` writes OUT/report.md, curves.png, compute.png and
recall.png. Statistics are `scripts.stats`'s: differences paired by seed
with 95% t intervals, Holm's correction over the comparisons read together.

Scratch-equivalent steps E: the steps the same seed's from-scratch curve of
the same K needs to reach a loss (paired by seed; the seed-mean curve only
for a seed without a scratch run, named in the report) (linear between its evaluations, made monotone
by its running minimum; from ln V at step 0). An uptrained run that spent
a = alpha x S steps on a source of S steps is worth E scratch steps:
  cost advantage  E / a        (claim 3 as the paper frames it: the marginal
                                cost of a K model given an MHA checkpoint)
  retained compute rho = (E - a) / S  (the source's steps the result keeps)
A loss below the whole scratch curve is censored: E > its last step.

With --tasks, `task_lines` adds the lm-evaluation-harness scores
(`scripts.task_scores`), paired against the identity control and against
MHA from scratch.

The MLA arm (`_mla`, results from before it have none): MHA -> MLA at
GQA-K's cache bytes minus MHA -> mean-pooled K, paired by seed at each
alpha (alpha 0: the two conversions, one measurement each), Holm over K at
the paper's alpha; its E read on GQA-K's scratch curve (no MLA is trained
from scratch, so E is what an equal-cache GQA model needs to match it).
"""

from __future__ import annotations

import math
import pathlib

import numpy as np

from studies import stats, task_scores
from infra import provenance

UP_METHODS = ('identity', 'mean', 'first', 'random')
MLA = 'mla'  # The MLA arm's method in scripts.uptrain_study's runs.
PAPER_COLUMN = 3  # alpha = 0.05 among [0, 0.0125, 0.025, 0.05, ...].


# --- the per-seed numbers ----------------------------------------------------

def _at(curve: list[dict], step: int, key: str = 'loss') -> float:
  return next(p[key] for p in curve if p['step'] == step)


def losses(lm: dict, method: str, K: int, start: str = 'fresh') -> np.ndarray:
  """[seed, alpha] held-out losses (alpha 0: the conversion), seed order."""
  steps = [0, *lm['plan']['alpha_steps']]
  runs = sorted((r for r in lm['runs'] if (r['method'], r['K'], r['start'])
                 == (method, K, start)), key=lambda r: r['seed'])
  return np.array([[_at(r['curve'], s) for s in steps] for r in runs])


def seeds(lm: dict, method: str, K: int, start: str = 'fresh') -> list[int]:
  """The seeds of `losses`' rows, in its order."""
  return sorted(r['seed'] for r in lm['runs']
                if (r['method'], r['K'], r['start']) == (method, K, start))


def scratch_curve(lm: dict, K: int) -> tuple[np.ndarray, np.ndarray]:
  """(steps, [seed, step] losses) of K trained from scratch."""
  runs = sorted((r for r in lm['scratch'] if r['K'] == K),
                key=lambda r: r['seed'])
  steps = np.array([p['step'] for p in runs[0]['curve']])
  return steps, np.array([[p['loss'] for p in r['curve']] for r in runs])


def scratch_seeds(lm: dict, K: int) -> list[int]:
  """The seeds of `scratch_curve`'s rows, in its order."""
  return sorted(r['seed'] for r in lm['scratch'] if r['K'] == K)


def equivalent_steps(loss: float, steps, mean_curve, start_loss: float
                     ) -> float:
  """The steps a scratch curve (one seed's) needs to reach `loss`; inf when
  it never does (censored), interpolated linearly on its running minimum,
  with (0, start_loss) prepended."""
  x = np.concatenate([[0.0], np.asarray(steps, float)])
  y = np.minimum.accumulate(np.concatenate([[start_loss], mean_curve]))
  if loss < y[-1]:
    return math.inf
  if loss >= y[0]:
    return 0.0
  j = int(np.argmax(y <= loss))  # First point at or below it (j >= 1).
  if y[j] == y[j - 1]:
    return float(x[j])
  return float(x[j - 1] + (x[j] - x[j - 1]) * (y[j - 1] - loss)
               / (y[j - 1] - y[j]))


def _estimate(values) -> dict:
  """stats.mean of per-seed values, or, when some are censored (inf), the
  count and the bound."""
  values = list(values)
  finite = [v for v in values if math.isfinite(v)]
  if len(finite) == len(values):
    return {**stats.mean(values).as_dict(), 'censored': 0}
  return {'censored': len(values) - len(finite), 'n': len(values),
          'mean': math.inf, 'low': min(values), 'high': math.inf}


def _paired(a, b) -> dict:
  est = stats.paired(a, b)
  d = np.asarray(a, float) - np.asarray(b, float)
  return {**est.as_dict(), 'p': stats.p_value(d),
          'detectable': stats.detectable(est.sd, est.n), 'values': d.tolist()}


def _with_holm(comparisons: list[dict]) -> list[dict]:
  rejected = stats.holm([c['p'] for c in comparisons])
  return [{**c, 'holm': r} for c, r in zip(comparisons, rejected)]


def summary(results: dict) -> dict:
  """Every derived number of the report, from the per-seed results."""
  lm, plan = results['lm'], results['lm']['plan']
  N, S, a_steps = plan['num_heads'], plan['steps'], plan['alpha_steps']
  paper = plan['alphas'].index(plan['paper_alpha']) + 1
  assert paper == PAPER_COLUMN, plan['alphas']
  source = lm['source']['loss']
  control = losses(lm, 'identity', N)
  out = {'control_drift': [
      {'alpha_steps': s, **stats.mean(control[:, i + 1] - source).as_dict(),
       'values': (control[:, i + 1] - source).tolist()}
      for i, s in enumerate(a_steps)],
         'control_exact': float(np.abs(control[:, 0] - source).max())}
  # The MHA-K gap from scratch, paired by seed, at the end and at S.
  mha_steps, mha = scratch_curve(lm, N)
  at_s = int(np.argmin(np.abs(mha_steps - S)))
  out['gap'] = {}
  for K in plan['kv_heads']:
    _, k_curve = scratch_curve(lm, K)
    out['gap'][K] = {'end': _paired(k_curve[:, -1], mha[:, -1]),
                     'at_source_steps': _paired(k_curve[:, at_s], mha[:, at_s]),
                     'end_step': int(mha_steps[-1])}
  # Claim 1: mean-pooled minus the control, per alpha.
  out['near'] = {K: [_paired(losses(lm, 'mean', K)[:, i], control[:, i])
                     for i in range(1, len(a_steps) + 1)]
                 for K in plan['kv_heads']}
  # Claim 2 at the paper's alpha: one Holm family over K and both pairs.
  family = []
  for K in plan['kv_heads']:
    for better, worse in (('mean', 'first'), ('first', 'random')):
      family.append({'K': K, 'better': better, 'worse': worse, **_paired(
          losses(lm, better, K)[:, paper], losses(lm, worse, K)[:, paper])})
  out['ranking'] = _with_holm(family)
  out['ranking_by_alpha'] = {K: {f'{b}-{w}': [
      stats.paired(losses(lm, b, K)[:, i], losses(lm, w, K)[:, i]).as_dict()
      for i in range(len(a_steps) + 1)]
      for b, w in (('mean', 'first'), ('first', 'random'))}
                             for K in plan['kv_heads']}
  # Claim 3: scratch-equivalent steps of the mean-pooled runs, each seed's
  # uptrained loss on the same seed's scratch curve (paired by seed); the
  # seed-mean curve only for a seed without a scratch run.
  out['compute'], out['compute_unpaired'] = {}, {}
  out['above_scratch'] = {}
  for K in plan['kv_heads']:
    out['compute'][K], out['compute_unpaired'][K] = _equivalents(
        lm, K, losses(lm, 'mean', K), seeds(lm, 'mean', K))
    # The paper's framing of the cost: alpha = 0.05 of uptraining in place
    # of training K separately; how far above K trained S steps from
    # scratch the uptrained model sits (paired by seed).
    _, k_curve = scratch_curve(lm, K)
    own = dict(zip(scratch_seeds(lm, K), k_curve[:, at_s]))
    up_seeds = seeds(lm, 'mean', K)
    if all(s in own for s in up_seeds):
      out['above_scratch'][K] = _paired(
          losses(lm, 'mean', K)[:, paper], [own[s] for s in up_seeds])
  # The optimizer start: pooled minus fresh, one Holm family at 0.05.
  start = []
  for method, K in [('identity', N)] + [('mean', K) for K in plan['kv_heads']]:
    pooled, fresh = losses(lm, method, K, 'pooled'), losses(lm, method, K)
    start.append({'method': method, 'K': K, **_paired(
        pooled[:, paper], fresh[:, paper]), 'by_alpha': [
            stats.paired(pooled[:, i], fresh[:, i]).as_dict()
            for i in range(1, len(a_steps) + 1)]})
  out['start'] = _with_holm(start)
  out['gate'] = _gate(out)
  out['recall'] = _recall(results['recall'])
  if 'tasks' in lm:
    out['tasks'] = {name: task_scores.comparisons(arms, reference)
                    for name, (arms, reference) in task_arms(lm).items()}
  if 'mla' in lm:  # Studies run before the MLA arm have none.
    out['mla'] = _mla(lm)
  return out


def _equivalents(lm: dict, K: int, up: np.ndarray, up_seeds: list[int]
                 ) -> tuple[list[dict], list[int]]:
  """(per alpha: the scratch-equivalent steps E of the uptrained losses
  up [seed, alpha] (alpha 0 first) with the cost advantage and retained
  compute, the seeds read on the seed-mean curve): each seed's loss read
  on the same seed's from-scratch curve of K (the seed-mean curve for a
  seed without one)."""
  plan = lm['plan']
  steps, curves = scratch_curve(lm, K)
  own = dict(zip(scratch_seeds(lm, K), curves))
  rows = []
  for i, a in enumerate(plan['alpha_steps']):
    E = [equivalent_steps(x, steps, own.get(seed, curves.mean(0)),
                          math.log(plan['vocab_size']))
         for x, seed in zip(up[:, i + 1], up_seeds)]
    rows.append({'alpha_steps': a, 'E': E,
                 'equivalent': _estimate(E),
                 'advantage': _estimate([e / a for e in E]),
                 'retained': _estimate([(e - a) / plan['steps'] for e in E])})
  return rows, [s for s in up_seeds if s not in own]


def _mla(lm: dict) -> dict:
  """MHA -> MLA at GQA-K's cache bytes against MHA -> mean-pooled GQA-K
  (both fresh Adam, same rate and steps), per K: the conversion, MLA minus
  GQA paired by seed at each alpha (alpha 0: the two conversions, one
  measurement each), and MLA's scratch-equivalent steps on GQA-K's
  from-scratch curve (the layout of equal cache bytes: no MLA is trained
  from scratch); `paper`: the differences at the paper's alpha, one Holm
  family over K."""
  mla = {**lm, 'runs': lm['mla']['runs']}
  by_K = {}
  for conversion in lm['mla']['conversions']:
    K = conversion['K']
    x, gqa = losses(mla, MLA, K), losses(lm, 'mean', K)
    if seeds(mla, MLA, K) != seeds(lm, 'mean', K):
      raise ValueError(f'MLA at K={K} and mean-pooled K={K} ran other seeds')
    compute, unpaired = _equivalents(lm, K, x, seeds(mla, MLA, K))
    by_K[K] = {'conversion': conversion,
               'mla': [stats.mean(x[:, i]).as_dict()
                       for i in range(x.shape[1])],
               'gqa': [stats.mean(gqa[:, i]).as_dict()
                       for i in range(gqa.shape[1])],
               'minus_gqa': [_paired(x[:, i], gqa[:, i])
                             for i in range(x.shape[1])],
               'compute': compute, 'compute_unpaired': unpaired}
  return {'by_K': by_K, 'paper': _with_holm([
      {'K': K, **r['minus_gqa'][PAPER_COLUMN]} for K, r in by_K.items()])}


# The gate's rule: the control's drift is a change every uptrained arm shares
# (all start from the same source with the same optimizer), so it cancels in
# an arm-vs-arm difference paired by seed (claim 2, the optimizer start) and
# the gate applies only to effects measured against the source or the control
# (claim 1, the MHA-K gap).
GATE_RULE = (
    'The gate applies to effects measured against the source or the control '
    '(claim 1, the MHA–K gap); not to arm-vs-arm differences paired by seed '
    '(claim 2, the optimizer start), in which the drift every arm uptrained '
    'from the same source shares cancels.')


def _claimed(out: dict) -> list[tuple[str, float]]:
  """The effects the gate applies to (GATE_RULE): resolved gaps and claim
  1's resolved distances from the control (at alpha's PAPER_COLUMN)."""
  claims = []
  for K, gap in out['gap'].items():
    if _resolved(gap['end']):
      claims.append((f'K={K} - MHA from scratch', gap['end']['mean']))
  paper = PAPER_COLUMN - 1
  for K, rows in out['near'].items():
    if _resolved(rows[paper]):
      claims.append((f'K={K}: mean-pooled - control', rows[paper]['mean']))
  return claims


def _resolved(est: dict) -> bool:
  """stats.decide's verdict (the one rule every report applies)."""
  return stats.decide(est) == 'resolved'


def _gate(out: dict) -> dict:
  """The control gate: the identity control's drift at every alpha is
  read, and the largest (in |mean|) must be under a quarter of the
  smallest effect the report claims."""
  drift = max(out['control_drift'], key=lambda d: abs(d['mean']))
  floor = 4 * abs(drift['mean'])
  claims = _claimed(out)
  below = [(name, e) for name, e in claims if abs(e) < floor]
  return {'drift': drift, 'floor': floor, 'claims': claims,
          'below': below, 'passes': not below}


def censored_median(steps: list) -> float | None:
  """The median steps to the target over every seed, a seed that never
  reached it (None) counted as larger than every observed value: inf when
  the median falls among those (more than half censored), None for none."""
  if not steps:
    return None
  return float(np.median([math.inf if s is None else s for s in steps]))


def _recall(recall: dict) -> dict:
  """k of n seeds that regained (reached) the target, their steps and the
  median over all n (censored seeds counted beyond every observed one)."""
  plan = recall['plan']

  def count(runs):
    steps = [r['steps_to_target'] for r in runs]
    hit = sorted(s for s in steps if s is not None)
    return {'k': len(hit), 'n': len(steps), 'steps': steps,
            'median': censored_median(steps)}
  arms = {}
  for r in recall['runs'] + recall.get('mla', {}).get('runs', []):
    arms.setdefault(f'{r["method"]}_K{r["K"]}', []).append(r)
  scratch = {}
  for r in recall['scratch']:
    scratch.setdefault(r['K'], []).append(r)
  return {'source_accuracy': recall['source']['accuracy'],
          'source_steps_to_target': recall['source']['steps_to_target'],
          'arms': {k: count(v) for k, v in arms.items()},
          'scratch': {K: count(v) for K, v in scratch.items()},
          'budget': plan['budget'], 'target': plan['target']}


# --- the reading -------------------------------------------------------------

def _f(est: dict, spec: str = '+.4f') -> str:
  """'mean [low, high]' of an Estimate dict."""
  if est.get('censored'):
    if math.isinf(est['low']):
      return f'beyond the scratch curve (all {est["n"]} seeds)'
    return (f'≥ {est["low"]:{spec.lstrip("+")}} ({est["censored"]} of '
            f'{est["n"]} seeds beyond the scratch curve)')
  return format(stats.Estimate(est['mean'], est['sd'], est['n'], est['low'],
                               est['high']), spec)


def _detectable(est: dict) -> str:
  d = est.get('detectable', math.inf)
  return (f'detectable {d:.4f} nats' if math.isfinite(d) else
          'nothing detectable: no spread over seeds')


def _near_verdict(rows: list[dict], paper: int, near: float,
                  floor: float = 0.0) -> str:
  """Claim 1 (GQA) at the paper's alpha, from one source: reproduced if
  the distance from the margin `near` is resolved below it
  (`stats.decide`), not reproduced at this scale if resolved beyond it and
  clear of the gate's `floor` (one source cannot say whether the gap
  shrinks with the source's length: never "contradicted"), otherwise not
  claimed, with the smallest difference the seeds detect."""
  row = rows[paper]
  verdict = stats.decide(stats.shifted(row, near))
  if verdict != 'resolved':
    return ('not claimed (' + (verdict if verdict != 'not claimed' else
                               _detectable(row)) + ')')
  if row['mean'] < near:
    return 'reproduced'
  if row['mean'] < floor:
    return (f'not claimed (beyond the margin, but below the control gate\'s '
            f'{floor:.4f} nats)')
  return ('not reproduced at this scale (one source: whether the gap '
          'shrinks with the source\'s length is the source-replicated '
          'study\'s question)')


def _pair_outcome(c: dict) -> str:
  """One claimed ordering (better < worse: a negative difference), read
  after Holm by `stats.decide`: reproduced, contradicted (resolved the
  other way) or not claimed (with the convention's reason where it is
  not the size: equal on all seeds, one seed)."""
  verdict = stats.decide(c, rejected=c['holm'])
  if verdict == 'resolved':
    return 'reproduced' if c['mean'] < 0 else 'contradicted'
  if verdict != 'not claimed':
    return f'not claimed ({verdict})'
  return f'not claimed, {_detectable(c)}'


def ranking_verdict(family: list[dict], K: int) -> str:
  """Claim 2 for K: reproduced if every ordering is, contradicted if one is
  resolved the other way, otherwise not resolved (each ordering named)."""
  cells = [c for c in family if c['K'] == K]
  outcomes = [_pair_outcome(c) for c in cells]
  if all(o == 'reproduced' for o in outcomes):
    return 'reproduced'
  label = ('contradicted' if 'contradicted' in outcomes else
           'not claimed')
  return label + ' (' + '; '.join(
      f'{c["better"]} < {c["worse"]}: {o}'
      for c, o in zip(cells, outcomes)) + ')'


def _compute_verdict(row: dict) -> str:
  """Claim 3 as a marginal cost: the advantage minus 1 read by
  `stats.decide`: reproduced (above 1), contradicted (below), otherwise
  not claimed (censored seeds: not claimed)."""
  adv = row['advantage']
  if adv.get('censored'):
    return 'not claimed (seeds beyond the scratch curve)'
  if stats.decide(stats.shifted(adv, 1.0)) != 'resolved':
    return 'not claimed'
  return 'reproduced' if adv['mean'] > 1 else 'contradicted'


def _start_recommendation(family: list[dict]) -> str:
  """Which optimizer start to use after a conversion: the one the
  mean-pooled comparisons resolve for (Holm); fresh when none resolves
  (nothing to carry). Arm-vs-arm: the gate does not apply (GATE_RULE)."""
  means = [c for c in family if c['method'] == 'mean' and
           stats.decide(c, rejected=c['holm']) == 'resolved']
  won = {'pooled' if c['mean'] < 0 else 'fresh' for c in means}
  if len(won) == 1:
    return (f'**{won.pop()}** Adam wins (resolved after Holm over the '
            f'{len(family)} comparisons at α = 0.05)')
  if not won:
    return ('not claimed after Holm (' + '; '.join(
        f'{c["method"]} K={c["K"]}: {_detectable(c)}' for c in family
        if c['method'] == 'mean') + '): **fresh** Adam is recommended, as '
            'the simpler start (no state to carry), not as the better one')
  return 'mixed: pooled wins for one K and fresh for another'


def reading(results: dict, summ: dict) -> list[str]:
  lm, plan = results['lm'], results['lm']['plan']
  N, S = plan['num_heads'], plan['steps']
  a_steps, paper = plan['alpha_steps'], plan['alphas'].index(
      plan['paper_alpha'])
  src, pilot, gate = lm['source'], lm['pilot'], summ['gate']
  near = plan['near']
  a_top = a_steps[-1]
  lines = [
      '- **One source**: every uptraining comparison below converts the same '
      'source checkpoint (seed 0), so its seeds replicate only the '
      'uptraining data order and the conversion (α = 0) is equal on all of '
      'them; a claim about uptraining in general needs sources replicated '
      '(the source-replicated study, `scripts.uptrain_study` without '
      '`--single_source`).',
      f'- **Source**: MHA (K = N = {N}), {S} steps ({src["tokens"] / 1e6:.2f}M '
      f'tokens, seed 0), held-out loss {src["loss"]:.4f} nats/token. The '
      f'identity conversion evaluates to it within '
      f'{summ["control_exact"]:.1e} (the conversion path is exact).',
      f'- **Learning-rate pilot** (seed 0, {pilot["steps"]} steps, mean-pooled '
      f'K = {pilot["K"]} and the control): ' + '; '.join(
          f'{r["rate"]:.2g}: mean {r["mean"]:.4f}, control drift '
          f'{r["drift"]:+.4f}' for r in pilot['rows'])
      + f'. Chosen by the rule fixed in advance (the lowest mean-pooled loss '
      f'among rates whose control drifts ≤ {near} nats): '
      f'**{pilot["rate"]:.2g}**, warmup {a_steps[0]} steps then constant.',
      '- **Control gate**: the identity control\'s drift from the source '
      'at every α: ' + ', '.join(
          f'{d["alpha_steps"] / S:g}: {_f(d)}' for d in summ['control_drift'])
      + f'; the largest, {_f(gate["drift"])} at α = '
      f'{gate["drift"]["alpha_steps"] / S:g}, sets the floor: effects under '
      f'4 × |drift| = {gate["floor"]:.4f} nats are not claimed. ' + (
          ('It **passes**: every effect claimed below is at least that'
           if gate['claims'] else 'No effect is claimed, so nothing is '
           'below it') if gate['passes'] else
          '**It fails for**: ' + ', '.join(
              f'{name} ({e:+.4f})' for name, e in gate['below'])
          + ' (reported, not claimed)') + '. ' + GATE_RULE]
  for K in plan['kv_heads']:
    gap = summ['gap'][K]
    lines.append(
        f'- **MHA–K gap from scratch, K = {K}** (K minus MHA, paired by seed, '
        f'{len(plan["seeds"])} seeds): {_f(gap["end"])} nats after '
        f'{gap["end_step"]} steps (detectable: {gap["end"]["detectable"]:.4f}),'
        f' {_f(gap["at_source_steps"])} at step {S}. ' + (
            'Resolved.' if _resolved(gap['end']) else
            f'Not claimed: any gap is below about '
            f'{gap["end"]["detectable"]:.3f} nats.'))
  for K in plan['kv_heads']:
    rows = summ['near'][K]
    if K == 1 and max(plan['kv_heads']) > 1:  # MQA: the paper sets no margin.
      lines.append(
          f'- **MQA (K = 1), reported, not a claim of nearness** (the paper '
          'says uptrained MQA loses some quality; it sets no margin): '
          'mean-pooled minus the control: ' + ', '.join(
              f'α = {s / S:g}: {_f(r)}' for s, r in zip(a_steps, rows))
          + f' ({_detectable(rows[paper])} at α = {plan["paper_alpha"]}).')
      continue
    lines.append(
        f'- **Claim 1, K = {K} (α = {plan["paper_alpha"]} of uptraining brings '
        f'mean-pooled K near MHA: ≤ {near} nats above the control, fixed in '
        f'advance): {_near_verdict(rows, paper, near, gate["floor"])}.** '
        'Mean-pooled minus the control: ' + ', '.join(
            f'α = {s / S:g}: {_f(r)}' for s, r in zip(a_steps, rows))
        + f' ({_detectable(rows[paper])} at α = {plan["paper_alpha"]}). '
        '(Reproduced: the distance from the margin resolved below it; not '
        'reproduced at this scale: resolved beyond it. One source cannot '
        'say "contradicted": that needs the gap\'s trend over sources of '
        'several lengths.)')
  for K in plan['kv_heads']:
    cells = [c for c in summ['ranking'] if c['K'] == K]
    lines.append(
        f'- **Claim 2, K = {K} (after uptraining α = {plan["paper_alpha"]}, '
        f'mean < first < random): '
        f'{ranking_verdict(summ["ranking"], K)}** (Holm over '
        f'the {len(summ["ranking"])} comparisons): ' + '; '.join(
            f'{c["better"]} − {c["worse"]} {_f(c)}, p = {c["p"]:.3g}, '
            f'{_detectable(c)} ({stats.decide(c, rejected=c["holm"])})'
            for c in cells) + '. (Arm-vs-arm differences from one source: '
        'the conversion is equal on all seeds; what varies is the uptraining '
        'data order.)')
  for K in plan['kv_heads']:
    rows = summ['compute'][K]
    row = rows[paper]
    lines.append(
        f'- **Claim 3, K = {K} (the marginal cost of a K model given the MHA '
        f'checkpoint: uptraining beats training K from scratch to the same '
        f'loss): {_compute_verdict(row)}.** After {row["alpha_steps"]} '
        f'uptraining steps (α = {row["alpha_steps"] / S:g}) mean-pooled K '
        f'is worth {_f(row["equivalent"], ".0f")} steps of K from scratch: '
        f'a cost advantage of {_f(row["advantage"], ".2f")}x, retained '
        f'compute ρ = {_f(row["retained"], ".3f")} of the source\'s {S} '
        'steps. By α: ' + ', '.join(
            f'{r["alpha_steps"] / S:g}: {_f(r["advantage"], ".2f")}x'
            for r in rows) + '. (Each seed\'s uptrained loss is read on the '
        'same seed\'s scratch curve, so the interval is paired by seed'
        + ('' if not summ['compute_unpaired'][K] else
           '; seeds ' + ', '.join(map(str, summ['compute_unpaired'][K]))
           + ' have no scratch run and are read on the seed-mean curve')
        + '; a point along a from-scratch cosine '
        'run is not annealed, so E leans high and the advantage with it.)'
        + ('' if K not in summ.get('above_scratch', {}) else
           ' The paper\'s cost claim is stronger: that α = '
           f'{plan["paper_alpha"]} of uptraining replaces training a '
           f'separate K model. Here the uptrained model sits '
           f'{_f(summ["above_scratch"][K])} nats above K trained {S} steps '
           f'from scratch (paired by seed; '
           f'{stats.decide(summ["above_scratch"][K])}), so at this scale it '
           'does not replace one.'))
  lines.append(
      '- **Optimizer start** (pooled Adam moments minus fresh Adam, '
      f'α = {plan["paper_alpha"]}, Holm over {len(summ["start"])}): ' +
      '; '.join(f'{c["method"]} K={c["K"]}: {_f(c)}, {_detectable(c)} '
                f'({stats.decide(c, rejected=c["holm"])})'
                for c in summ['start'])
      + f'. Recommendation: {_start_recommendation(summ["start"])}.')
  rec = summ['recall']
  budget, source_steps = f'{rec["budget"]} steps', 'the source\'s steps'
  lines.append(
      f'- **Recall arm**: the MHA source reaches held-out accuracy '
      f'{rec["source_accuracy"]:.3f} (' + (
          f'≥ {rec["target"]} first at step {rec["source_steps_to_target"]}'
          if rec['source_steps_to_target'] is not None else
          f'NOT converged: never ≥ {rec["target"]}') + f'). Steps to regain ≥ {rec["target"]} '
      f'after conversion (within {rec["budget"]} steps), k of n seeds: ' +
      '; '.join(f'{name.replace("_", " ")}: {c["k"]} of {c["n"]}'
                f'{_median(c, budget)}'
                for name, c in rec['arms'].items())
      + '. From scratch (within the source\'s steps): ' + '; '.join(
          f'K={K}: {c["k"]} of {c["n"]}{_median(c, source_steps)}'
          for K, c in rec['scratch'].items()) + '.')
  return lines + _mla_reading(results, summ)


def _mla_verdict(c: dict) -> str:
  """MLA minus GQA at one alpha, read after Holm: which is lower, or not
  resolved with the smallest difference the seeds detect. A difference
  below that is not claimed, resolved or not (stats.CONVENTION)."""
  verdict = stats.decide(c, rejected=c['holm'])
  if verdict == 'resolved':
    return 'MLA lower' if c['mean'] < 0 else 'GQA lower'
  if c['holm'] and stats.as_estimate(c).resolved:
    return (f'{"MLA" if c["mean"] < 0 else "GQA"} lower by less than the '
            f'seeds detect: not claimed ({_detectable(c)})')
  return f'not claimed ({_detectable(c)})'


def _mla_reading(results: dict, summ: dict) -> list[str]:
  """The MLA arm's lines: per K, MLA against mean-pooled GQA at equal
  cache bytes; the recall arm's MLA conversion."""
  if 'mla' not in summ:
    return []
  plan = results['lm']['plan']
  S, family = plan['steps'], summ['mla']['paper']
  lines = []
  for K, r in summ['mla']['by_K'].items():
    c, cell = r['conversion'], next(f for f in family if f['K'] == K)
    row = r['compute'][PAPER_COLUMN - 1]
    R, Y = c['kv_lora_rank'], c['qk_rope_head_dim']
    lines.append(
        f'- **MHA → MLA against MHA → mean-pooled GQA at equal cache bytes, '
        f'K = {K}: {_mla_verdict(cell)}** at α = {plan["paper_alpha"]} (MLA '
        f'minus GQA, paired by seed, Holm over the {len(family)} K): '
        f'{_f(cell)}, p = {cell["p"]:.3g}, {_detectable(cell)}. The '
        'conversion (`train.convert --to_mla`, SVD of [W_K | W_V], partial '
        f'RoPE): kv_lora_rank {R} + {Y} RoPE dims = '
        f'{R + Y} numbers per token and layer, {c["kv_bytes_per_token"]:g} '
        f'bytes/token ' + (
            'as GQA K = ' if c['kv_bytes_per_token'] ==
            c['gqa_kv_bytes_per_token'] else
            'NOT equal (the nearest its ranks allow) to GQA K = ')
        + f'{K}\'s {c["gqa_kv_bytes_per_token"]:g}; energy kept per layer '
        + ', '.join(f'{e:.3f}' for e in c['energy_kept'] if e is not None)
        + f'. Before uptraining (α = 0): MLA {_f(r["mla"][0], ".4f")} '
        f'against GQA {_f(r["gqa"][0], ".4f")} nats. Both uptrained by the '
        'same recipe (the chosen rate, fresh Adam, one run per seed). MLA '
        'minus GQA by α: ' + ', '.join(
            f'{s / S:g}: {_f(d)}' for s, d in zip(plan['alpha_steps'],
                                                  r['minus_gqa'][1:]))
        + f'. After {row["alpha_steps"]} uptraining steps MLA is worth '
        f'{_f(row["equivalent"], ".0f")} steps of GQA K = {K} trained from '
        f'scratch (each seed on its own curve), '
        f'{_f(row["advantage"], ".2f")}x its uptraining steps: read on the '
        'from-scratch curve of the layout with the same cache bytes, since '
        'no MLA is trained from scratch here; so not claim 3\'s marginal '
        'cost of an MLA model, but the steps an equal-cache GQA model '
        'needs to match it.')
  recall = results['recall'].get('mla')
  if recall:
    lines.append(
        '- **Recall arm, MLA**: the rows `mla K` above are MHA → MLA at K\'s '
        'cache bytes (' + '; '.join(
            f'K = {c["K"]}: kv_lora_rank {c["kv_lora_rank"]} + '
            f'{c["qk_rope_head_dim"]} RoPE dims, {c["kv_bytes_per_token"]:g} '
            f'bytes/token against GQA\'s {c["gqa_kv_bytes_per_token"]:g}, '
            'energy kept ' + ', '.join(f'{e:.3f}' for e in c['energy_kept']
                                       if e is not None)
            + ', held-out accuracy before uptraining ' + ', '.join(sorted({
                f'{r["curve"][0]["accuracy"]:.3f}' for r in recall['runs']
                if r['K'] == c['K']}))
            for c in recall['conversions'])
        + '), uptrained as the recall arm\'s GQA conversions are. '
        + ' '.join(
            f'At K = {c["K"]} the latent ({c["kv_lora_rank"]} + '
            f'{c["qk_rope_head_dim"]}) is as wide as d_model '
            f'({c["d_model"]}): the conversion is lossless by shape, so '
            'its needing no uptraining says nothing of MLA below that '
            'width (the regime of MHA2MLA and TransMLA; the '
            'source-replicated study has an arm there).'
            for c in [{'d_model': results['recall'].get('plan', {}).get(
                'config', {}).get('model', {}).get('d_model', math.inf), **c}
                      for c in recall['conversions']]
            if c['kv_lora_rank'] + c['qk_rope_head_dim'] >= c['d_model']))
  return lines


def _median(c: dict, budget: str) -> str:
  """The median over all seeds (— : beyond the budget, counted larger than
  every observed value) and each seed's steps."""
  if not c['k']:
    return ''
  median = (f'> {budget}' if math.isinf(c['median']) else
            f'{c["median"]:.0f} steps')
  censored = ', — counted beyond the budget' if c['k'] < len(c['steps']) else ''
  return f' (median {median}{censored}; each: ' + ', '.join(
      '—' if s is None else str(s) for s in c['steps']) + ')'


def tables(results: dict, summ: dict) -> list[str]:
  lm, plan = results['lm'], results['lm']['plan']
  N, S, a_steps = plan['num_heads'], plan['steps'], plan['alpha_steps']
  head = ('| | α=0 | ' + ' | '.join(f'α={s / S:g} ({s})' for s in a_steps)
          + ' |')
  rule = '|---|' + '---|' * (len(a_steps) + 1)
  lines = []
  for K in plan['kv_heads']:
    lines += [f'### MHA → K = {K}: held-out loss, mean [95% interval] over '
              'seeds', '', head, rule]
    for method, start in [*((m, 'fresh') for m in UP_METHODS),
                          ('identity', 'pooled'), ('mean', 'pooled')]:
      k = N if method == 'identity' else K
      x = losses(lm, method, k, start)
      lines.append(f'| {method}{" (control)" if k == N else ""}, {start} '
                   'Adam | ' + ' | '.join(
                       f'{stats.mean(x[:, i]):.4f}'
                       for i in range(x.shape[1])) + ' |')
    lines += ['', f'Paired differences (negative: the first is better), K = '
              f'{K}:', '', head, rule]
    for name, est in summ['ranking_by_alpha'][K].items():
      lines.append(f'| {name.replace("-", " − ")} | ' + ' | '.join(
          _f(e) for e in est) + ' |')
    lines += ['', f'Scratch-equivalent steps of mean-pooled K = {K} (each '
              'seed on its own K-from-scratch curve) and the cost advantage '
              'E / uptraining steps:', '', '| α (steps) | E per seed | E | advantage | ρ |',
              '|---|---|---|---|---|']
    for r in summ['compute'][K]:
      lines.append(f'| {r["alpha_steps"] / S:g} ({r["alpha_steps"]}) | '
                   + ', '.join(f'{e:.0f}' for e in r['E'])
                   + f' | {_f(r["equivalent"], ".0f")} | '
                   f'{_f(r["advantage"], ".2f")} | '
                   f'{_f(r["retained"], ".3f")} |')
    lines.append('')
  lines += ['### From scratch: held-out loss per seed', '',
            '| K | step ' + str(S) + ' | step ' +
            str(summ['gap'][plan['kv_heads'][0]]['end_step']) + ' |',
            '|---|---|---|']
  for K in [N, *plan['kv_heads']]:
    steps, curves = scratch_curve(lm, K)
    at_s = int(np.argmin(np.abs(steps - S)))
    lines.append(f'| {K}{" (MHA)" if K == N else ""} | '
                 + ', '.join(f'{v:.4f}' for v in curves[:, at_s]) + ' | '
                 + ', '.join(f'{v:.4f}' for v in curves[:, -1]) + ' |')
  lines += ['', '### Recall arm: steps to accuracy ≥ '
            f'{summ["recall"]["target"]} per seed (— : not within the budget)',
            '', '| arm | k of n | steps per seed |', '|---|---|---|']
  for name, c in summ['recall']['arms'].items():
    lines.append(f'| {name.replace("_", " ")} uptrained | {c["k"]} of '
                 f'{c["n"]} | ' + ', '.join(
                     '—' if s is None else str(s) for s in c['steps']) + ' |')
  for K, c in summ['recall']['scratch'].items():
    lines.append(f'| K={K} from scratch | {c["k"]} of {c["n"]} | ' + ', '.join(
        '—' if s is None else str(s) for s in c['steps']) + ' |')
  return lines + _mla_tables(results, summ)


def _mla_tables(results: dict, summ: dict) -> list[str]:
  """Per K: MLA and mean-pooled GQA at equal cache bytes by alpha, their
  paired difference, MLA's scratch-equivalent steps on GQA-K's curve."""
  if 'mla' not in summ:
    return []
  plan = results['lm']['plan']
  S, a_steps = plan['steps'], plan['alpha_steps']
  head = ('| | α=0 | ' + ' | '.join(f'α={s / S:g} ({s})' for s in a_steps)
          + ' |')
  rule = '|---|' + '---|' * (len(a_steps) + 1)
  lines = []
  for K, r in summ['mla']['by_K'].items():
    c = r['conversion']
    lines += ['', f'### MHA → MLA at K = {K}\'s cache bytes (kv_lora_rank '
              f'{c["kv_lora_rank"]} + {c["qk_rope_head_dim"]} RoPE dims, '
              f'{c["kv_bytes_per_token"]:g} bytes/token) against MHA → '
              f'mean-pooled K = {K} ({c["gqa_kv_bytes_per_token"]:g}), fresh '
              'Adam: held-out loss, mean [95% interval]', '', head, rule,
              '| MLA | ' + ' | '.join(_f(e, '.4f') for e in r['mla']) + ' |',
              f'| mean-pooled GQA K={K} | ' + ' | '.join(
                  _f(e, '.4f') for e in r['gqa']) + ' |',
              '| MLA − GQA (paired) | ' + ' | '.join(
                  _f(e) for e in r['minus_gqa']) + ' |',
              '| its detectable difference | ' + ' | '.join(
                  _detectable(e).removeprefix('detectable ')
                  for e in r['minus_gqa']) + ' |',
              '| E of MLA on GQA K=' + str(K) + ' from scratch | — | '
              + ' | '.join(_f(row['equivalent'], '.0f')
                           for row in r['compute']) + ' |']
  return lines


# --- task scores (--tasks) ---------------------------------------------------

def task_arms(lm: dict) -> dict[str, tuple[dict, str]]:
  """{table: ({arm: {seed: task scores}}, the reference arm)}: the
  conversions at each alpha scored, against the identity control; K from
  scratch against MHA."""
  tasks, plan = lm['tasks'], lm['plan']
  N = plan['num_heads']
  tables = {}
  for step in sorted({r['step'] for r in tasks['runs']}):
    arms = {}
    for r in tasks['runs']:
      if r['step'] == step:
        label = ('identity (control)' if r['method'] == 'identity' else
                 f'{r["method"]} K={r["K"]}')
        arms.setdefault(label, {})[r['seed']] = r['scores']
    alpha = plan['alphas'][plan['alpha_steps'].index(step)]
    tables[f'uptrained α = {alpha:g} ({step} steps)'] = (
        arms, 'identity (control)')
  scratch = {}
  for r in tasks['scratch']:
    scratch.setdefault('MHA' if r['K'] == N else f'K={r["K"]}', {})[
        r['seed']] = r['scores']
  if scratch:
    step = tasks['scratch'][0]['step']
    tables[f'from scratch, step {step}'] = (scratch, 'MHA')
  return tables


REPLAY_EQUAL = 1e-3  # nats: a replay this close is the run's state.


def task_lines(results: dict) -> list[str]:
  """The report's task scores (--tasks): what was scored, the source's
  scores, and per table each arm by seed and paired against its
  reference."""
  lm = results['lm']
  if 'tasks' not in lm:
    return []
  tasks = lm['tasks']
  replays = [r for r in tasks['runs'] if 'replay_loss' in r]
  worst = max((abs(r['replay_loss'] - r['run_loss']) for r in replays),
              default=0.0)
  lines = [
      '## Task scores (lm-evaluation-harness)', '',
      'Scored as `python -m evaluation.evaluate` scores a workdir (lm_eval\'s '
      '`gqa-lab` model; each command in tasks/**/results.json) on '
      + ', '.join(f'{t} ({n} documents)' for t, n in
                  tasks['documents'].items())
      + ': the source (seed 0), each fresh-Adam conversion (the identity '
      'control, mean, first, random) at the paper\'s α and at the '
      'largest, and MHA and each K from scratch at their end; per seed. '
      'The pooled-Adam arms are not scored (their question, the optimizer '
      'start, is read on held-out loss). An uptraining run keeps only its '
      'last checkpoint, so the paper\'s α is a replay of the run ended '
      f'there: its held-out loss differs from the run\'s by at most '
      f'{worst:.1e} nats' + (
          ' (**not** the run\'s state: read its scores as a rerun\'s)'
          if worst > REPLAY_EQUAL else '') + '. Intervals are over seeds (what training varies), '
      'not over documents (lm_eval\'s stderr, in those results.json).', '',
      'The source: ' + '; '.join(
          f'{task} {metric} {value:.4g}'
          for task, metrics in tasks['source'].items()
          for metric, value in metrics.items()) + '.']
  for title, (arms, reference) in task_arms(lm).items():
    lines += ['', f'### {title}', '',
              *task_scores.lines(arms, reference, tasks['higher_is_better'])]
  return lines


# --- plots -------------------------------------------------------------------

def _pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def _band(ax, runs: list[dict], label: str, ls: str):
  """The runs' seed-mean loss along their curve and the seeds' range."""
  steps = [p['step'] for p in runs[0]['curve']]
  y = np.array([[p['loss'] for p in r['curve']] for r in runs])
  line, = ax.plot(steps, y.mean(0), ls=ls, label=label)
  ax.fill_between(steps, y.min(0), y.max(0), color=line.get_color(),
                  alpha=0.15)


def plot_curves(out: pathlib.Path, results: dict):
  """Held-out loss along the uptraining runs: seed means, the seeds' range."""
  plt = _pyplot()
  lm, plan = results['lm'], results['lm']['plan']
  N, kv = plan['num_heads'], plan['kv_heads']
  fig, axes = plt.subplots(1, len(kv), squeeze=False, sharey=True,
                           figsize=(5.5 * len(kv), 4))
  for j, K in enumerate(kv):
    ax = axes[0, j]
    for method, start in [*((m, 'fresh') for m in UP_METHODS),
                          ('identity', 'pooled'), ('mean', 'pooled')]:
      k = N if method == 'identity' else K
      _band(ax, [r for r in lm['runs'] if (r['method'], r['K'], r['start'])
                 == (method, k, start)], f'{method}, {start} Adam',
            '-' if start == 'fresh' else '--')
    if 'mla' in lm:
      _band(ax, [r for r in lm['mla']['runs'] if r['K'] == K],
            f'MLA at K={K}\'s cache bytes, fresh Adam', '-.')
    ax.axhline(lm['source']['loss'], color='gray', lw=1, ls=':',
               label='source (MHA)')
    ax.set(title=f'MHA → K={K}', xlabel='uptraining step',
           ylabel='held-out loss (nats/token)', yscale='log')
  axes[0, 0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / 'curves.png', dpi=110)
  plt.close(fig)


def plot_compute(out: pathlib.Path, results: dict, summ: dict):
  """From-scratch curves of MHA and K, and each mean-pooled uptrained loss
  at the source's steps plus its uptraining's, mapped to its E."""
  plt = _pyplot()
  lm, plan = results['lm'], results['lm']['plan']
  N, S, kv = plan['num_heads'], plan['steps'], plan['kv_heads']
  fig, axes = plt.subplots(1, len(kv), squeeze=False, sharey=True,
                           figsize=(5.5 * len(kv), 4))
  for j, K in enumerate(kv):
    ax = axes[0, j]
    for k, name in ((N, 'MHA'), (K, f'K={K}')):
      steps, curves = scratch_curve(lm, k)
      line, = ax.plot(steps, curves.mean(0), label=f'{name} from scratch')
      ax.fill_between(steps, curves.min(0), curves.max(0),
                      color=line.get_color(), alpha=0.2)
    up = losses(lm, 'mean', K).mean(0)[1:]
    xs = [S + a for a in plan['alpha_steps']]
    ax.plot(xs, up, 'k*', label='mean-pooled, uptrained (at S + αS)')
    for x, y, r in zip(xs, up, summ['compute'][K]):
      e = r['equivalent']['mean']
      if math.isfinite(e):
        ax.plot([e, x], [y, y], color='k', lw=0.6, ls=':')
    if 'mla' in summ:  # On the same curve: GQA-K's, of equal cache bytes.
      mla = summ['mla']['by_K'][K]
      ys = [e['mean'] for e in mla['mla'][1:]]
      ax.plot(xs, ys, 'r^', label=f'MLA at K={K}\'s bytes, uptrained (E '
              f'on K={K}\'s curve)')
      for x, y, r in zip(xs, ys, mla['compute']):
        if math.isfinite(r['equivalent']['mean']):
          ax.plot([r['equivalent']['mean'], x], [y, y], color='r', lw=0.6,
                  ls=':')
    ax.set(title=f'K={K}: scratch-equivalent steps', xlabel='training step',
           ylabel='held-out loss (nats/token)', yscale='log')
  axes[0, 0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / 'compute.png', dpi=110)
  plt.close(fig)


def plot_recall(out: pathlib.Path, results: dict):
  """Recall accuracy while uptraining each conversion, and from scratch."""
  plt = _pyplot()
  recall = results['recall']
  fig, (up, sc) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  groups = {}
  for r in recall['runs'] + recall.get('mla', {}).get('runs', []):
    groups.setdefault(f'{r["method"]} K={r["K"]}', []).append(r)
  for i, (name, runs) in enumerate(groups.items()):
    for j, r in enumerate(runs):  # Each ends where it reached the target.
      up.plot([p['step'] for p in r['curve']],
              [p['accuracy'] for p in r['curve']], color=f'C{i}', lw=1,
              label=name if not j else None)
  for r in recall['scratch']:
    sc.plot([p['step'] for p in r['curve']],
            [p['accuracy'] for p in r['curve']], lw=1,
            label=f'K={r["K"]}, seed {r["seed"]}')
  for ax, title, x in ((up, 'after conversion', 'uptraining step'),
                       (sc, 'from scratch', 'step')):
    ax.axhline(recall['plan']['target'], color='gray', ls=':', lw=1)
    ax.set(title=f'Recall probe: {title}', xlabel=x,
           ylabel='held-out answer accuracy')
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / 'recall.png', dpi=110)
  plt.close(fig)


def made(prov: dict) -> str:
  """Where the runs were trained (the command, its commit, the machine;
  the earlier passes into the same --out whose finished runs it reused,
  and each run's own record of its commit, where results.json has them;
  a note) and, apart, where this report was rebuilt."""
  m = prov.get('machine')
  text = (f'Runs trained by `{prov["command"]}` at commit {prov["commit"]} '
          f'(--out {prov["out"]}) on ' + (
              provenance.describe(m) if m else
              'a machine the results do not record'))
  if prov.get('earlier'):
    text += (', reusing the finished runs of the earlier pass'
             + 'es' * (len(prov['earlier']) > 1) + ' into that --out ('
             + '; '.join(f'`{e["command"]}` at commit {e["commit"]}' + (
                 f' on {provenance.describe(e["machine"])}'
                 if e.get('machine') else '') for e in prov['earlier'])
             + ') and training the rest')
  if prov.get('trained'):
    text += (f' (by each run\'s own record: {prov["trained"]}' + (
        '; a run with no record was trained before runs recorded their '
        'commit' if 'no record' in prov['trained'] else '') + ')')
  if 'rebuilt' in prov:
    r = prov['rebuilt']
    text += (f'; statistics and reading rebuilt by `{r["command"]}` at '
             f'commit {r["commit"]}' + (
                 f' on {provenance.describe(r["machine"])}'
                 if 'machine' in r else ''))
  return text + '.' + (f' {prov["note"]}' if prov.get('note') else '')


def text(results: dict) -> str:
  """report.md: a function of results.json alone (the summary recomputed,
  the provenance as saved), so that --report_only rebuilds it identically."""
  summ = summary(results)
  prov, plan = results['provenance'], results['lm']['plan']
  lines = [
      '# Uptraining MHA to GQA/MQA (Ainslie et al. 2023): claims as the '
      'paper states them, with controls', '',
      made(prov), '', f'LM source {plan["steps"]} steps; targets K = '
      f'{", ".join(map(str, plan["kv_heads"]))}; seeds '
      f'{", ".join(map(str, plan["seeds"]))}; uptraining evaluated at α = '
      + ', '.join(f'{s / plan["steps"]:g}' for s in plan['alpha_steps'])
      + ' of the source\'s steps, one run per (conversion, seed). '
      + prov['statistics'], '', '## Reading', '', *reading(results, summ), '',
      '![uptraining curves](curves.png)', '',
      '![scratch-equivalent steps](compute.png)', '',
      '![recall arm](recall.png)', '', '## Tables', '',
      *tables(results, summ), '', *task_lines(results), '']
  return '\n'.join(lines)


def write(out: pathlib.Path, results: dict):
  """OUT/report.md and its plots; prints the reading."""
  report = text(results)
  (out / 'report.md').write_text(report)
  summ = summary(results)
  plot_curves(out, results)
  plot_compute(out, results, summ)
  plot_recall(out, results)
  print(report[:report.index('![uptraining curves](curves.png)')])
  print(f'wrote {out / "report.md"}, curves.png, compute.png, recall.png')
