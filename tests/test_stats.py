"""The studies' statistics (studies/stats.py) against scipy and simulation."""

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from studies import stats


def test_paired_is_the_t_interval_of_the_per_seed_differences():
  a = np.array([2.31, 2.25, 2.40, 2.28])
  b = np.array([2.20, 2.21, 2.30, 2.22])
  d = stats.paired(a, b)
  ci = scipy_stats.ttest_1samp(a - b, 0.0).confidence_interval(0.95)
  np.testing.assert_allclose([d.low, d.high], [ci.low, ci.high], rtol=1e-12)
  assert d.mean == pytest.approx(float((a - b).mean()))
  assert d.resolved  # Every seed has a > b.
  # Unpaired, the same arms overlap: pairing is what resolves the difference.
  assert stats.mean(a).low < stats.mean(b).high


def test_one_seed_claims_nothing():
  d = stats.paired([1.0], [0.5])
  assert d.n == 1 and not d.resolved and math.isinf(d.high)
  assert stats.detectable(0.01, 1) == math.inf
  assert format(d) == '0.5000 (1 seed)'


def test_unpaired_lengths_and_non_finite_values_are_refused():
  with pytest.raises(ValueError, match='one value per seed'):
    stats.paired([1.0, 2.0], [1.0])
  with pytest.raises(ValueError, match='non-finite'):
    stats.mean([1.0, float('nan')])


@pytest.mark.parametrize('n, nc, central', [(3, 5.65, 5.36), (4, 4.256, 4.161),
                                             (5, 3.761, 3.717)])
def test_detectable_is_the_noncentral_t_s_80_percent_power(n, nc, central):
  # The referee's numbers (issue 60): the central-t sum t_{.975} + t_{.8}
  # (the old rule) is the second column, about 77% power at n = 3.
  sd = 0.02
  effect = stats.detectable(sd, n)
  assert effect * math.sqrt(n) / sd == pytest.approx(nc, abs=5e-3)
  crit = scipy_stats.t.ppf(0.975, n - 1)
  old = crit + scipy_stats.t.ppf(0.8, n - 1)
  assert old == pytest.approx(central, abs=5e-3)
  # Power at the returned effect, by scipy's noncentral t cdf: 0.80.
  def nct_power(x):
    return (scipy_stats.nct.sf(crit, n - 1, x)
            + scipy_stats.nct.cdf(-crit, n - 1, x))
  assert nct_power(effect * math.sqrt(n) / sd) == pytest.approx(0.8, abs=1e-6)
  assert nct_power(old) < 0.8 - 1e-3  # The old rule fell short.


@pytest.mark.slow
@pytest.mark.parametrize('n', [3, 5])
def test_a_difference_of_the_detectable_size_is_found_80_percent_of_the_time(n):
  sd = 0.02
  effect = stats.detectable(sd, n)
  rng = np.random.default_rng(0)
  draws = rng.normal(effect, sd, (20_000, n))
  found = np.mean([stats.paired(d, np.zeros(n)).resolved for d in draws])
  assert found == pytest.approx(0.8, abs=0.015)  # 5 binomial sds.
  # And half the effect is found far less often: the number means something.
  half = rng.normal(effect / 2, sd, (4000, n))
  assert np.mean([stats.paired(d, np.zeros(n)).resolved for d in half]) < 0.45


def test_power_is_finite_where_scipy_s_nct_is_not():
  # scipy's nct gives NaN near (df 1, nc 12.7) and (df 2, nc 8.6), where
  # the power is needed; the integral does not.
  for n, nc in ((2, 12.7062), (3, 8.6053)):
    assert 0.5 < stats.t_test_power(nc, n) < 1
  assert stats.t_test_power(0.0, 3) == pytest.approx(0.05, abs=1e-9)
  assert math.isfinite(stats.detectable(1.0, 2))
  assert stats.t_test_power(stats.detectable(1.0, 2) * math.sqrt(2), 2
                            ) == pytest.approx(0.8, abs=1e-6)


def test_holm_steps_down_and_stops_at_the_first_failure():
  assert stats.holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
  assert stats.holm([0.001, 0.2]) == [True, False]
  assert stats.holm([0.04]) == [True]


def test_ratio_resamples_seeds_together():
  a = np.array([2.0, 4.0, 6.0])
  r = stats.ratio(a, a / 2)  # Every seed's ratio is 2: no spread to find.
  assert (r.mean, r.low, r.high) == pytest.approx((2.0, 2.0, 2.0))
  noisy = stats.ratio([1.0, 1.3, 0.8, 1.1], [1.0, 1.0, 1.0, 1.0])
  assert noisy.low < noisy.mean < noisy.high


def test_values_equal_on_every_seed_have_no_interval_and_are_not_resolved():
  # A conversion of one source gives the same value on every seed: a
  # zero-width interval would make it look like a 3-seed result.
  d = stats.paired([2.7, 2.7, 2.7], [2.6, 2.6, 2.6])
  assert d.deterministic and d.sd == 0 and not d.resolved
  assert math.isinf(d.low) and math.isinf(d.high)
  assert format(d, '+.2f') == '+0.10 (equal on all 3 seeds)'
  assert stats.p_value([0.1, 0.1, 0.1]) == 1.0
  assert stats.p_value([0.0, 0.0]) == 1.0
  assert stats.detectable(0.0, 3) == math.inf
  assert not stats.holm([stats.p_value([0.1] * 3)])[0]
  assert not stats.mean([1.0, 1.1, 0.9]).deterministic  # Varied: an interval.


def test_the_convention_names_the_bootstrap_for_ratios():
  assert 'bootstrap' in stats.CONVENTION
  assert 'equal on all n seeds' in stats.CONVENTION


def test_decide_claims_nothing_below_the_detectable_effect():
  # The optimizer-start control of the single-source study: an interval that
  # excludes 0, but a mean (0.0006) below what its seeds detect (0.0007).
  est = stats.Estimate(-0.0006, 0.00035, 4, -0.0012, -0.0001)
  assert est.resolved and abs(est.mean) < stats.detectable(est.sd, est.n)
  assert stats.decide(est) == 'not claimed'
  assert stats.decide(est.as_dict()) == 'not claimed'  # As a report saves it.
  big = stats.paired([1.0, 1.1, 0.9, 1.05], [0.0, 0.0, 0.0, 0.0])
  assert stats.decide(big) == 'resolved'
  assert stats.decide(big, rejected=False) == 'not claimed'  # Holm kept it.
  assert stats.decide(stats.mean([0.1, -0.1, 0.05])) == 'not claimed'
  assert stats.decide(stats.mean([0.3, 0.3, 0.3])) == 'equal on all seeds'
  assert stats.decide(stats.mean([0.3])) == 'one seed'


def test_decision_gives_the_first_check_that_fails_as_the_reason():
  one = stats.decision(stats.mean([0.3]))
  assert (one.verdict, one.reason) == ('one seed', 'one seed')
  assert stats.decision(stats.mean([0.3] * 3)).words == (
      'not claimed: equal on all seeds')
  assert stats.decision(stats.mean([0.1, -0.1, 0.05])).words == (
      'not claimed: interval holds 0')
  below = stats.Estimate(-0.0006, 0.00035, 4, -0.0012, -0.0001)
  assert stats.decision(below, rejected=False).words == (
      'not claimed: below the detectable effect')
  # Issue 60: K=2 first - random at S = 400, |-0.2592| above its detectable
  # effect, interval excluding 0, is not claimed because Holm keeps it.
  est = stats.mean([-0.2734, -0.1976, -0.3067])
  assert est.resolved and abs(est.mean) > stats.detectable(est.sd, est.n)
  assert stats.decision(est).words == 'resolved'
  held = stats.decision(est, rejected=False)
  assert (held.verdict, held.words) == ('not claimed', 'not claimed: failed Holm')
  assert stats.decision(est, rejected=True, withheld=True).words == (
      'not claimed: withheld by the control gate')
  assert stats.decision(est, rejected=False, withheld=True).reason == (
      'failed Holm')
  assert stats.decision(est, rejected=True, withheld=False).reason is None
  assert {d.words for d in (one, held)} <= set(stats.WORDS)
  with pytest.raises(dataclasses.FrozenInstanceError):
    held.reason = None


def test_decide_is_decision_s_verdict():
  for values in ([0.3], [0.3] * 3, [0.1, -0.1, 0.05], [1.0, 1.1, 0.9]):
    for rejected in (None, True, False):
      e = stats.mean(values)
      assert stats.decide(e, rejected=rejected) == stats.decision(
          e, rejected=rejected).verdict


def test_the_convention_states_the_exact_power_rule():
  assert 'noncentral t' in stats.CONVENTION
  assert '5.65' in stats.CONVENTION


def test_shifted_reads_a_margin_as_a_difference():
  est = stats.mean([0.18, 0.17, 0.19, 0.18])
  assert stats.decide(stats.shifted(est, 0.02)) == 'resolved'
  assert stats.shifted(est, 0.02).low == pytest.approx(est.low - 0.02)
  assert stats.decide(stats.shifted(est, 0.18)) == 'not claimed'
