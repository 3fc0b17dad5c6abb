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

`decision` applies the convention: every report's verdict on a difference
and its reason are its answer, written as its `words` ('resolved', or 'not
claimed: ' and the first check that failed), never a reading written by
hand; `decide` is its verdict alone. Where the replicated unit is not a seed (a
source-replicated study averages within each source and replicates over
sources), "seed" reads as that unit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Mapping, Sequence

import numpy as np
from scipy import integrate, optimize
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
    'smallest true mean difference that a two-sided paired t test at the 5% '
    'level over the n seeds run detects with 80% power, taking the observed '
    'sd of the differences as the true one (computed exactly from the '
    'noncentral t: |mean| at least 5.65 sd/sqrt(n) at n = 3, 4.26 at 4, '
    '3.76 at 5); nothing smaller is claimed. A value equal on every seed '
    'is given as "equal on all n seeds", without an interval (its sd is 0: '
    'a value the seeds do not vary, or one at a floor or ceiling on each), '
    'and is not counted as resolved. A difference is claimed (resolved) '
    'only when its interval excludes 0, it is at least its detectable '
    'effect, and, in a family, Holm\'s correction rejects it (and a control '
    'gate, where a study has one, passes); otherwise it is "not claimed", '
    'with the first of these that fails as its reason. Where sources, not '
    'seeds, are the unit of replication, read "seed" as "source": values are averaged within a '
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


def t_test_power(noncentrality: float, n: int, *, level: float = LEVEL) -> float:
  """The power of a two-sided one-sample t test at 1 - `level` over n
  seeds: P(|T| > t_crit) for T noncentral t with n - 1 degrees and that
  noncentrality (delta sqrt(n) / sd). Integrated over the chi-square of the
  sd, P(Z + nc > t_crit sqrt(V/df)) + P(Z + nc < -t_crit sqrt(V/df)),
  rather than scipy's nct.sf, which returns NaN at some (df, nc)."""
  df, crit = n - 1, t_quantile(n, level)

  def given_v(v):
    scale = crit * math.sqrt(v / df)
    return (scipy_stats.norm.cdf(noncentrality - scale)
            + scipy_stats.norm.cdf(-noncentrality - scale)
            ) * scipy_stats.chi2.pdf(v, df)
  return float(integrate.quad(given_v, 0, math.inf, epsabs=1e-13,
                              epsrel=1e-11, limit=200)[0])


def detectable(sd: float, n: int, *, level: float = LEVEL,
               power: float = POWER) -> float:
  """The smallest true mean difference that a two-sided paired t test at
  1 - `level` over n seeds detects with `power`, per-seed differences of
  spread `sd` (the observed sd taken as the true one): nc sd / sqrt(n), nc
  the noncentrality at which the noncentral t's power is `power` (5.65 at
  n = 3, 4.26 at 4, 3.76 at 5 for 80% at 5%; the central-t approximation
  t_{1-a/2} + t_power gives 5.36, 4.16, 3.72). Infinite below 2 seeds, and
  for sd 0 (deterministic values: the seeds replicated nothing)."""
  if n < 2 or not math.isfinite(sd) or sd == 0:
    return math.inf
  return _noncentrality(n, level, power) * sd / math.sqrt(n)


_nc_cache: dict = {}


def _noncentrality(n: int, level: float, target: float) -> float:
  """The noncentrality whose two-sided power is `target` (bracketed from 0,
  where the power is 1 - level, up by doubling; solved to 1e-12)."""
  key = (n, level, target)
  if key not in _nc_cache:
    high = t_quantile(n, level) + 1
    while t_test_power(high, n, level=level) < target:
      high *= 2
    _nc_cache[key] = optimize.brentq(
        lambda nc: t_test_power(nc, n, level=level) - target, 0.0, high,
        xtol=1e-12)
  return _nc_cache[key]


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
# Why a difference is not claimed: the first check of CONVENTION it fails,
# in this order (a difference withheld by the gate passed every other).
Reason = Literal['one seed', 'equal on all seeds', 'interval holds 0',
                 'below the detectable effect', 'failed Holm',
                 'withheld by the control gate']
REASONS: tuple[Reason, ...] = Reason.__args__


@dataclasses.dataclass(frozen=True)
class Decision:
  """CONVENTION's verdict on a difference and, when it is not resolved,
  the reason; `words` is how every report writes it."""
  verdict: Verdict
  reason: Reason | None = None

  @property
  def words(self) -> str:
    """'resolved', or 'not claimed: REASON' (for one seed and values equal
    on all seeds too: neither is a claim)."""
    return 'resolved' if self.reason is None else f'not claimed: {self.reason}'


# Every text `Decision.words` can be: a report's verdict is one of these.
WORDS: tuple[str, ...] = ('resolved', *(f'not claimed: {r}' for r in REASONS))


def as_estimate(est: Estimate | Mapping) -> Estimate:
  """An Estimate, or one from its as_dict() (extra keys ignored)."""
  if isinstance(est, Estimate):
    return est
  return Estimate(*(float(est[k]) for k in ('mean', 'sd')), int(est['n']),
                  *(float(est[k]) for k in ('low', 'high')))


def decision(est: Estimate | Mapping, *, rejected: bool | None = None,
             withheld: bool | None = None) -> Decision:
  """CONVENTION applied to a difference over seeds (or sources), the one
  place a verdict on a difference and its reason are made. Checked in
  order, the first that fails is the reason: n >= 2 ('one seed'), sd > 0
  ('equal on all seeds': one measurement), the interval excludes 0
  ('interval holds 0'), |mean| >= `detectable(sd, n)` ('below the
  detectable effect'), in a Holm family `rejected` ('failed Holm'), and
  where a control gate applies, not `withheld` ('withheld by the control
  gate': a difference the statistics would claim, on a setup whose control
  does not let it be read). All pass: 'resolved'."""
  e = as_estimate(est)
  if e.n < 2:
    return Decision('one seed', 'one seed')
  if e.deterministic:
    return Decision('equal on all seeds', 'equal on all seeds')
  for failed, reason in ((not e.resolved, 'interval holds 0'),
                         (abs(e.mean) < detectable(e.sd, e.n),
                          'below the detectable effect'),
                         (rejected is False, 'failed Holm'),
                         (bool(withheld), 'withheld by the control gate')):
    if failed:
      return Decision('not claimed', reason)
  return Decision('resolved')


def decide(est: Estimate | Mapping, *, rejected: bool | None = None
           ) -> Verdict:
  """`decision`'s verdict alone: 'one seed', 'equal on all seeds',
  'resolved' or 'not claimed'."""
  return decision(est, rejected=rejected).verdict


def sd_ratio(sd_a: float, n_a: int, sd_b: float, n_b: int, *,
             level: float = LEVEL) -> tuple[float, float, float]:
  """(sd_a / sd_b, and its two-sided `level` interval): the F interval of
  a ratio of two sample variances with n_a - 1 and n_b - 1 degrees,
  square-rooted (exact for independent normal samples; an A/A control
  and a variant paired against the same reference share it, so read it as
  approximate). At 5 seeds each it spans a factor of 3.1 either way."""
  r = sd_a / sd_b
  tail = (1 - level) / 2
  f_hi = float(scipy_stats.f.ppf(1 - tail, n_a - 1, n_b - 1))
  f_lo = float(scipy_stats.f.ppf(tail, n_a - 1, n_b - 1))
  return r, r / math.sqrt(f_hi), r / math.sqrt(f_lo)


def shifted(est: Estimate | Mapping, by: float) -> Estimate:
  """The estimate of (value - by): a margin or a null of 1 as a difference
  `decide` reads (the interval and sd move with it)."""
  e = as_estimate(est)
  return Estimate(e.mean - by, e.sd, e.n, e.low - by, e.high - by)
