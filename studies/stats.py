"""The statistics every study reports with: one convention, stated once
(CONVENTION), used everywhere; a study's results JSON records it beside its
provenance (`infra.provenance.record(..., statistics=CONVENTION)`).

Seeds are the unit of replication. Two arms run with the same seeds share
their initialisation and data order, so a comparison is made on the per-seed
differences (`paired`), not on two means; its t interval and the smallest
difference the seeds could detect (`detectable`) come from the same sd. A
ratio of two paired arms (a speedup, a fraction recovered) gets a paired
bootstrap interval (`ratio`). Per-seed values that are all equal (a
quantity the seeds do not vary, such as a conversion of one source) are one
measurement, not a replicated one: no interval, never resolved. A family of comparisons read together is
corrected with Holm's method (`holm`).

`decide` applies the convention: every report's verdict on a difference is
its answer (resolved, not claimed, equal on all seeds, one seed), never a
reading written by hand. Where the replicated unit is not a seed (a
source-replicated study averages within each source and replicates over
sources), "seed" reads as that unit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

LEVEL = 0.95  # Two-sided confidence of every interval.
POWER = 0.8  # The power `detectable` is computed at.
CONVENTION = (
    'Dispersion is the sd over seeds (n - 1 in the denominator); every '
    'interval is a two-sided 95% t interval of a mean over seeds (a ratio\'s '
    'is a percentile bootstrap over seeds), and a '
    'difference between two arms is the mean of their per-seed differences '
    '(the same seed: the same data order, and the same initialisation of '
    'the weights both arms have in the same shape). "Detectable" is the '
    'smallest paired difference the seeds run would find with 80% power at '
    'the 5% level; nothing smaller is claimed. A value equal on every seed '
    'is given as "equal on all n seeds", without an interval (its sd is 0: '
    'a value the seeds do not vary, or one at a floor or ceiling on each), '
    'and is not counted as resolved. A difference is claimed (resolved) '
    'only when its interval excludes 0, it is at least its detectable '
    'effect, and, in a family, Holm\'s correction rejects it; otherwise it '
    'is "not claimed". Where sources, not seeds, are the unit of '
    'replication, read "seed" as "source": values are averaged within a '
    'source and the interval is over sources.')


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A mean over n seeds, its sd and its 95% interval [low, high]."""
  mean: float
  sd: float
  n: int
  low: float
  high: float

  @property
  def deterministic(self) -> bool:
    """Whether every seed gave the same value: nothing was replicated."""
    return self.n > 1 and self.sd == 0

  @property
  def resolved(self) -> bool:
    """Whether the interval excludes 0 (for a difference: a sign is known);
    never for one seed or a deterministic value (no interval)."""
    return (self.n > 1 and not self.deterministic
            and (self.low > 0 or self.high < 0))

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)

  def __format__(self, spec: str) -> str:
    spec = spec or '.4f'
    if self.n < 2:
      return f'{self.mean:{spec}} (1 seed)'
    if self.deterministic:
      return f'{self.mean:{spec}} (equal on all {self.n} seeds)'
    return f'{self.mean:{spec}} [{self.low:{spec}}, {self.high:{spec}}]'


def t_quantile(n: int, level: float = LEVEL) -> float:
  """The two-sided `level` quantile of Student's t with n - 1 degrees."""
  if n < 2:
    return math.inf
  return float(scipy_stats.t.ppf(0.5 + level / 2, n - 1))


def mean(values: Sequence[float]) -> Estimate:
  """Mean over seeds with its sd and t interval (infinite for one seed, and
  for values equal on every seed: sd 0, one measurement, no interval)."""
  x = np.asarray(values, np.float64)
  if x.ndim != 1 or not len(x):
    raise ValueError(f'expected a non-empty list of per-seed values, got {x!r}')
  if not np.all(np.isfinite(x)):
    raise ValueError(f'non-finite per-seed values {x.tolist()}')
  m = float(x.mean())
  if len(x) < 2:
    return Estimate(m, math.nan, 1, -math.inf, math.inf)
  if np.all(x == x[0]):  # Not x.std(): rounding can leave it at 1e-17.
    return Estimate(float(x[0]), 0.0, len(x), -math.inf, math.inf)
  sd = float(x.std(ddof=1))
  half = t_quantile(len(x)) * sd / math.sqrt(len(x))
  return Estimate(m, sd, len(x), m - half, m + half)


def paired(a: Sequence[float], b: Sequence[float]) -> Estimate:
  """a - b over seeds, a[i] and b[i] from the same seed."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    raise ValueError(f'paired arms need one value per seed each, got '
                     f'{len(a)} and {len(b)}')
  return mean(a - b)


def detectable(sd: float, n: int, *, level: float = LEVEL,
               power: float = POWER) -> float:
  """The smallest true mean difference a paired t test over n seeds, with
  per-seed differences of spread `sd`, detects with `power` at 1 - `level`:
  (t_{1-a/2} + t_{power}) sd / sqrt(n). Infinite below 2 seeds, and for sd
  0 (deterministic values: the seeds replicated nothing)."""
  if n < 2 or not math.isfinite(sd) or sd == 0:
    return math.inf
  t_power = float(scipy_stats.t.ppf(power, n - 1))
  return (t_quantile(n, level) + t_power) * sd / math.sqrt(n)


def p_value(values: Sequence[float]) -> float:
  """Two-sided p of a one-sample t test that the mean is 0 (paired diffs);
  1 for one seed or values equal on every seed (deterministic: a
  difference, if nonzero, measured once, and no test of it)."""
  x = np.asarray(values, np.float64)
  if len(x) < 2 or np.all(x == x[0]):
    return 1.0
  return float(scipy_stats.ttest_1samp(x, 0.0).pvalue)


def holm(p_values: Sequence[float], *, alpha: float = 1 - LEVEL
         ) -> list[bool]:
  """Which of a family of hypotheses Holm's step-down procedure rejects at
  family-wise error `alpha` (controls it for any dependence between them)."""
  order = np.argsort(p_values)
  rejected = [False] * len(p_values)
  for rank, i in enumerate(order):
    if p_values[i] > alpha / (len(p_values) - rank):
      break
    rejected[i] = True
  return rejected


def ratio(a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000,
          seed: int = 0) -> Estimate:
  """mean(a) / mean(b) over paired seeds, with a percentile bootstrap
  interval that resamples seeds (a[i] and b[i] together); sd is the
  bootstrap's. One seed gives an infinite interval."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape or a.ndim != 1 or not len(a):
    raise ValueError(f'ratio needs paired per-seed values, got {len(a)} and '
                     f'{len(b)}')
  point = float(a.mean() / b.mean())
  if len(a) < 2:
    return Estimate(point, math.nan, 1, -math.inf, math.inf)
  rows = np.random.default_rng(seed).integers(0, len(a), (resamples, len(a)))
  draws = a[rows].mean(1) / b[rows].mean(1)
  tail = (1 - LEVEL) / 2
  low, high = np.quantile(draws, [tail, 1 - tail])
  return Estimate(point, float(draws.std(ddof=1)), len(a), float(low),
                  float(high))


Verdict = Literal['resolved', 'not claimed', 'equal on all seeds', 'one seed']


def as_estimate(est: Estimate | Mapping) -> Estimate:
  """An Estimate, or one from its as_dict() (extra keys ignored)."""
  if isinstance(est, Estimate):
    return est
  return Estimate(*(float(est[k]) for k in ('mean', 'sd')), int(est['n']),
                  *(float(est[k]) for k in ('low', 'high')))


def decide(est: Estimate | Mapping, *, rejected: bool | None = None
           ) -> Verdict:
  """CONVENTION applied to a difference over seeds (or sources): 'one
  seed' (n = 1, no interval), 'equal on all seeds' (sd 0: one measurement),
  'resolved' when its interval excludes 0, |mean| is at least
  `detectable(sd, n)` and, in a Holm family, `rejected` is True; otherwise
  'not claimed' (the interval holds 0, or the effect is below what the
  seeds detect). The one place a verdict on a difference is made."""
  e = as_estimate(est)
  if e.n < 2:
    return 'one seed'
  if e.deterministic:
    return 'equal on all seeds'
  if rejected is False or not e.resolved:
    return 'not claimed'
  if abs(e.mean) < detectable(e.sd, e.n):
    return 'not claimed'
  return 'resolved'


def shifted(est: Estimate | Mapping, by: float) -> Estimate:
  """The estimate of (value - by): a margin or a null of 1 as a difference
  `decide` reads (the interval and sd move with it)."""
  e = as_estimate(est)
  return Estimate(e.mean - by, e.sd, e.n, e.low - by, e.high - by)
