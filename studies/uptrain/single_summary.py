"""The single-source design's statistics: `summary(results)` derives every
number its report states from the per-seed results (saved in results.json
beside them). Statistics are `studies.stats`'s: differences paired by seed
with 95% t intervals, Holm's correction over the comparisons read together.

Scratch-equivalent steps E: the steps the same seed's from-scratch curve of
the same K needs to reach a loss (paired by seed; the seed-mean curve only
for a seed without a scratch run, named in the report;
`common.equivalent_steps`). An uptrained run that spent a = alpha x S steps
on a source of S steps is worth E scratch steps:
  cost advantage  E / a        (claim 3 as the paper frames it: the marginal
                                cost of a K model given an MHA checkpoint)
  retained compute rho = (E - a) / S  (the source's steps the result keeps)
A loss below the whole scratch curve is censored: E > its last step.

The MLA arm (`_mla`, results from before it have none): MHA -> MLA at
GQA-K's cache bytes minus MHA -> mean-pooled K, paired by seed at each
alpha (alpha 0: the two conversions, one measurement each), Holm over K at
the paper's alpha; its E read on GQA-K's scratch curve (no MLA is trained
from scratch, so E is what an equal-cache GQA model needs to match it).
"""

from __future__ import annotations

import math

import numpy as np

from studies import stats, task_scores
from studies.uptrain.common import equivalent_steps
from studies.uptrain.design import MLA

UP_METHODS = ('identity', 'mean', 'first', 'random')
PAPER_COLUMN = 3  # alpha = 0.05 among [0, 0.0125, 0.025, 0.05, ...].


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
  paper = plan['alphas'].index(plan['paper_alpha']) + 1
  assert paper == PAPER_COLUMN, plan['alphas']
  out = {**_control(lm), 'gap': _gaps(lm),
         # Claim 1: mean-pooled minus the control, per alpha.
         'near': {K: [_paired(losses(lm, 'mean', K)[:, i],
                              losses(lm, 'identity', plan['num_heads'])[:, i])
                      for i in range(1, len(plan['alpha_steps']) + 1)]
                  for K in plan['kv_heads']},
         **_ranking(lm), **_compute(lm), 'start': _start(lm)}
  out['gate'] = _gate(out)
  out['recall'] = _recall(results['recall'])
  if 'tasks' in lm:
    out['tasks'] = {name: task_scores.comparisons(arms, reference)
                    for name, (arms, reference) in task_arms(lm).items()}
  if 'mla' in lm:  # Studies run before the MLA arm have none.
    out['mla'] = _mla(lm)
  return out


def _control(lm: dict) -> dict:
  """The identity control's drift from the source at every alpha, and
  how far its conversion (alpha 0) is from the source."""
  source = lm['source']['loss']
  control = losses(lm, 'identity', lm['plan']['num_heads'])
  return {'control_drift': [
      {'alpha_steps': s, **stats.mean(control[:, i + 1] - source).as_dict(),
       'values': (control[:, i + 1] - source).tolist()}
      for i, s in enumerate(lm['plan']['alpha_steps'])],
          'control_exact': float(np.abs(control[:, 0] - source).max())}


def _at_source_steps(lm: dict) -> int:
  """The column of a from-scratch curve at the source's steps S."""
  mha_steps, _ = scratch_curve(lm, lm['plan']['num_heads'])
  return int(np.argmin(np.abs(mha_steps - lm['plan']['steps'])))


def _gaps(lm: dict) -> dict:
  """The MHA-K gap from scratch, paired by seed, at the end and at S."""
  mha_steps, mha = scratch_curve(lm, lm['plan']['num_heads'])
  at_s = _at_source_steps(lm)
  gaps = {}
  for K in lm['plan']['kv_heads']:
    _, k_curve = scratch_curve(lm, K)
    gaps[K] = {'end': _paired(k_curve[:, -1], mha[:, -1]),
               'at_source_steps': _paired(k_curve[:, at_s], mha[:, at_s]),
               'end_step': int(mha_steps[-1])}
  return gaps


def _ranking(lm: dict) -> dict:
  """Claim 2 at the paper's alpha (one Holm family over K and both
  pairs), and each pair at every alpha."""
  plan, family = lm['plan'], []
  for K in plan['kv_heads']:
    for better, worse in (('mean', 'first'), ('first', 'random')):
      family.append({'K': K, 'better': better, 'worse': worse, **_paired(
          losses(lm, better, K)[:, PAPER_COLUMN],
          losses(lm, worse, K)[:, PAPER_COLUMN])})
  return {'ranking': _with_holm(family), 'ranking_by_alpha': {K: {
      f'{b}-{w}': [stats.paired(losses(lm, b, K)[:, i],
                                losses(lm, w, K)[:, i]).as_dict()
                   for i in range(len(plan['alpha_steps']) + 1)]
      for b, w in (('mean', 'first'), ('first', 'random'))}
                                               for K in plan['kv_heads']}}


def _compute(lm: dict) -> dict:
  """Claim 3: scratch-equivalent steps of the mean-pooled runs, each
  seed's uptrained loss on the same seed's scratch curve (paired by seed;
  the seed-mean curve only for a seed without a scratch run), and the
  paper's framing of the cost: alpha = 0.05 of uptraining in place of
  training K separately, how far above K trained S steps from scratch the
  uptrained model sits (paired by seed)."""
  at_s = _at_source_steps(lm)
  out = {'compute': {}, 'compute_unpaired': {}, 'above_scratch': {}}
  for K in lm['plan']['kv_heads']:
    out['compute'][K], out['compute_unpaired'][K] = _equivalents(
        lm, K, losses(lm, 'mean', K), seeds(lm, 'mean', K))
    _, k_curve = scratch_curve(lm, K)
    own = dict(zip(scratch_seeds(lm, K), k_curve[:, at_s]))
    up_seeds = seeds(lm, 'mean', K)
    if all(s in own for s in up_seeds):
      out['above_scratch'][K] = _paired(
          losses(lm, 'mean', K)[:, PAPER_COLUMN], [own[s] for s in up_seeds])
  return out


def _start(lm: dict) -> list[dict]:
  """The optimizer start: pooled minus fresh, one Holm family at 0.05."""
  plan, start = lm['plan'], []
  for method, K in [('identity', plan['num_heads'])] + [
      ('mean', K) for K in plan['kv_heads']]:
    pooled, fresh = losses(lm, method, K, 'pooled'), losses(lm, method, K)
    start.append({'method': method, 'K': K, **_paired(
        pooled[:, PAPER_COLUMN], fresh[:, PAPER_COLUMN]), 'by_alpha': [
            stats.paired(pooled[:, i], fresh[:, i]).as_dict()
            for i in range(1, len(plan['alpha_steps']) + 1)]})
  return _with_holm(start)


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
