"""What both designs of the uptraining study read alike: the steps a
from-scratch curve needs to reach a loss (claim 3), an estimate as the
single-source report writes it, claim 2's verdict over its family of
orderings, and where the runs were trained (the report's provenance)."""

from __future__ import annotations

import math

import numpy as np

from studies import report, stats


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


def per_doubling(by_length: dict) -> list[float]:
  """Per source seed, the least-squares slope of a per-source value
  against log2 S (per doubling of the source's length), over the lengths
  that seed has (sources of every length share seeds); BY_LENGTH: {S:
  [(seed, value), ...]}. Seeds with one length give none."""
  per_seed = {}
  for S, pairs in by_length.items():
    for seed, v in pairs:
      per_seed.setdefault(seed, []).append((math.log2(S), v))
  return [float(np.polyfit(*zip(*pts), 1)[0]) for pts in per_seed.values()
          if len(pts) > 1]


def estimate(est: dict, spec: str = '+.4f') -> str:
  """'mean [low, high]' of an Estimate dict over seeds; for steps some
  seeds never reached (censored), the bound and the count."""
  if est.get('censored'):
    if math.isinf(est['low']):
      return f'beyond the scratch curve (all {est["n"]} seeds)'
    return (f'≥ {est["low"]:{spec.lstrip("+")}} ({est["censored"]} of '
            f'{est["n"]} seeds beyond the scratch curve)')
  return report.interval(est, spec)


def detectable(est: dict) -> str:
  d = est.get('detectable', math.inf)
  return (f'detectable {d:.4f} nats' if math.isfinite(d) else
          'nothing detectable: no spread over seeds')


def _pair_outcome(c: dict) -> str:
  """One claimed ordering (better < worse: a negative difference), read
  after Holm by `stats.decision`: reproduced, contradicted (resolved the
  other way) or its words with the reason ('not claimed: failed Holm')."""
  decided = stats.decision(c, rejected=c['holm'])
  if decided.verdict == 'resolved':
    return 'reproduced' if c['mean'] < 0 else 'contradicted'
  return decided.words


def ranking_verdict(family: list[dict], K: int) -> str:
  """Claim 2 for K: reproduced if every ordering is, contradicted if one is
  resolved the other way, otherwise not reproduced (each ordering named
  with `_pair_outcome`'s words)."""
  cells = [c for c in family if c['K'] == K]
  outcomes = [_pair_outcome(c) for c in cells]
  if all(o == 'reproduced' for o in outcomes):
    return 'reproduced'
  label = ('contradicted' if 'contradicted' in outcomes else
           'not reproduced')
  return label + ' (' + '; '.join(
      f'{c["better"]} < {c["worse"]}: {o}'
      for c, o in zip(cells, outcomes)) + ')'


def made(prov: dict) -> str:
  """Where the runs were trained (the command, its commit, the machine;
  the earlier passes into the same --out whose finished runs it reused,
  and each run's own record of its commit, where results.json has them;
  a note) and, apart, where this report was rebuilt."""
  text = 'Runs trained by ' + report.command_at(
      prov, out=True, unknown='a machine the results do not record')
  if prov.get('earlier'):
    text += (', reusing the finished runs of the earlier pass'
             + 'es' * (len(prov['earlier']) > 1) + ' into that --out ('
             + '; '.join(map(report.command_at, prov['earlier']))
             + ') and training the rest')
  if prov.get('trained'):
    text += (f' (by each run\'s own record: {prov["trained"]}' + (
        '; a run with no record was trained before runs recorded their '
        'commit' if 'no record' in prov['trained'] else '') + ')')
  if 'rebuilt' in prov:
    text += ('; statistics and reading rebuilt by '
             + report.command_at(prov['rebuilt']))
  return text + '.' + (f' {prov["note"]}' if prov.get('note') else '')
