"""What the comparison reads from its per-seed values: each variant against
the reference (MHA when it ran), paired by seed, with the verdict on the
papers' claims; the negative control (a model without context) and the A/A
control (the reference with its K/V initialisation redrawn); the task
scores' paired differences. Pure functions of results.json's values, so
--report_only reads them again the same way; every verdict is
`stats.decide`'s."""

from __future__ import annotations

from studies import stats, task_scores
from studies.compare.design import reference_K

# The margins the verdicts use, fixed in advance. Neither is a paper's claim
# as the paper frames it: Shazeer's MQA cost (2019, Tables 1, 3) is
# log-perplexity per subword token or word piece at equal parameters, not
# nats per token of this data; Ainslie et al.'s GQA "close to MHA" (2023) is
# about models uptrained from MHA (studies/uptrain tests that).
SHAZEER_MQA_COST = (0.010, 0.015)  # MQA - MHA, Shazeer's numbers as a margin.
NEAR_MHA = 0.02  # This lab's "GQA near MHA" for models trained from scratch.


def comparisons(losses: dict, num_heads: int | None,
                per: str = 'byte') -> list[dict]:
  """Each variant's held-out loss against the reference's, paired by seed.

  losses: {K: {seed: held-out loss}}. The reference is MHA (K = num_heads)
  when it ran, else the variant with the most K/V heads (then no paper's
  claim is tested; nor when num_heads is None, not recorded). One dict per
  other variant: K, the reference's K, both arms' per-seed losses, the
  paired difference K - reference (a `stats.Estimate`), the smallest
  difference its seeds detect (`stats.detectable` of the differences' sd)
  and the verdict on the paper's claim (`verdict`), in nats per `per`.
  """
  kvs = sorted(losses, reverse=True)
  reference = reference_K(kvs, num_heads)
  base = losses[reference]
  found = []
  for K in kvs:
    if K == reference:
      continue
    mine = losses[K]
    seeds = sorted(mine.keys() & base.keys())
    a, b = [mine[s] for s in seeds], [base[s] for s in seeds]
    difference = stats.paired(a, b)
    detectable = stats.detectable(difference.sd, difference.n)
    found.append(dict(
        K=K, reference_K=reference, seeds=seeds, losses=a,
        reference_losses=b, difference=difference, detectable=detectable,
        verdict=verdict(K, reference, num_heads, difference, detectable,
                        per)))
  return found


def _paired_arm(arm: dict, losses: dict) -> tuple:
  """(K, seeds, the arm's losses, the reference's) over the seeds both
  have: a control arm as results.json holds it ({'K', 'seeds', 'losses'})
  against variant K's losses ({K: {seed: loss}})."""
  K = arm['K']
  mine = dict(zip(arm['seeds'], arm['losses']))
  base = losses.get(K, {})
  seeds = sorted(mine.keys() & base.keys())
  return K, seeds, [mine[s] for s in seeds], [base[s] for s in seeds]


def control_check(arm: dict | None, losses: dict) -> dict | None:
  """The negative control against the reference, paired by seed. arm: the
  control as results.json holds it ({'K', 'seeds', 'losses'}; None without
  one); losses: {K: {seed: loss}} of the variants. K (the reference's),
  seeds, both arms' losses, the difference control - reference (a
  `stats.Estimate`), its detectable effect, whether the setup sees it
  (`seen`: `stats.decide` resolves it, and worse) and the reading."""
  if not arm:
    return None
  K, seeds, a, b = _paired_arm(arm, losses)
  d = stats.paired(a, b)
  detectable = stats.detectable(d.sd, d.n)
  decided = stats.decide(d)
  seen = decided == 'resolved' and d.mean > 0
  if decided == 'one seed':
    reading = ('one seed: the control cannot be tested, so nothing is '
               'claimed (rerun with --seeds=3 or more)')
  elif decided == 'equal on all seeds':
    reading = (f'equal on all {d.n} seeds ({d.mean:+.3f} nats): no '
               'interval, so the control is not counted as seen')
  elif seen:
    reading = (f'the setup sees attention: without context the held-out '
               f'loss is {d.mean:+.3f} nats worse over {d.n} seeds, '
               f'{stats.decision(d).words}')
  elif decided == 'resolved':
    reading = (f'BETTER without context ({d.mean:+.3f} nats, '
               f'{stats.decision(d).words}): '
               f'K={K} does not use its context (too few steps, or a bug), '
               'so no difference below can be interpreted')
  else:
    reading = (f'{stats.decision(d).words} ({d.n} seeds detect '
               f'{detectable:.3f} nats): '
               'these seeds and this evaluation cannot tell a model '
               f'without context from K={K}, so an unresolved difference '
               'between the variants says nothing about K')
  return dict(K=K, seeds=seeds, losses=a, reference_losses=b, difference=d,
              detectable=detectable, seen=seen, reading=reading)


def seeds_to_detect(sd: float, effect: float, most: int = 100) -> int | None:
  """The fewest seeds whose paired test detects `effect` (80% power) at
  this sd; None if more than `most`."""
  return next((n for n in range(2, most + 1)
               if stats.detectable(sd, n) <= effect), None)


def verdict(K: int, reference: int, num_heads: int | None, d: stats.Estimate,
            detectable: float, per: str = 'byte') -> str:
  """What difference d (K - MHA, nats per `per`) lets the report say, by
  `stats.decide`. K = 1: the difference alone; Shazeer's MQA cost is
  log-perplexity per subword token at equal parameters, another unit, so it
  is named and never compared with a loss per byte (nor with another
  tokenizer's tokens). 1 < K < N: against this lab's margin NEAR_MHA, in
  this loss's own unit: agrees when the interval lies within it (both edges
  resolved inside), disagrees when resolved beyond it, otherwise cannot
  resolve it, with the seeds that would."""
  if num_heads is None:
    return (f'results.json does not record the query heads, so whether '
            f'K={reference} is MHA is unknown: no paper\'s claim is tested')
  if reference != num_heads:
    return (f'the reference is K={reference}, not MHA (K={num_heads}): no '
            "paper's claim is tested")
  decided = stats.decide(d)
  if decided in ('one seed', 'equal on all seeds'):
    return (f'{stats.decision(d).words}: no interval (rerun with --seeds=3 '
            'or more)')
  more = lambda effect: (
      f'; about {n} seeds would detect {effect:.3f}'
      if (n := seeds_to_detect(d.sd, effect)) else '')
  if K == 1:
    low, high = SHAZEER_MQA_COST
    return (f'MQA minus MHA {d.mean:+.3f} nats per {per}: '
            f'{stats.decision(d).words} '
            f'(detectable {detectable:.3f}). Shazeer\'s MQA cost '
            f'({low:.3f}-{high:.3f} nats) is per subword token at equal '
            f'parameters, another unit: not compared')
  paper = (f'GQA near MHA (within ±{NEAR_MHA} nats per {per}, this lab\'s '
           'margin; Ainslie et al.\'s claim is about uptrained models)')
  above, below = (stats.decide(stats.shifted(d, m))
                  for m in (NEAR_MHA, -NEAR_MHA))
  if (above == 'resolved' and d.mean > NEAR_MHA) or (
      below == 'resolved' and d.mean < -NEAR_MHA):
    return f'farther from MHA than ±{NEAR_MHA} nats: disagrees with {paper}'
  if (above == 'resolved' and d.mean < NEAR_MHA and below == 'resolved'
      and d.mean > -NEAR_MHA):
    return f'agrees with {paper}: the interval lies within it'
  return (f'cannot resolve {paper}: {d.n} seeds detect {detectable:.3f} '
          'nats or more' + more(NEAR_MHA))


def _aa_spread(d: stats.Estimate, variants: list) -> str:
  """The A/A sd against each variant's paired sd (`variants`: (K, its
  difference's Estimate)), as a ratio with its 95% F interval, and what
  the intervals allow: with few seeds, 'consistent with' at most."""
  if not (d.n > 1 and d.sd > 0):
    return ' against the variants\' paired sd: no spread to compare'
  ratios = [(K, e, stats.sd_ratio(d.sd, d.n, e.sd, e.n)) for K, e in variants]
  holds = all(lo <= 1 <= hi for _, _, (_, lo, hi) in ratios)
  return (' against the variants\' paired sd (A/A sd / the variant\'s, 95% '
          'F interval): ' + ', '.join(
              f'K={K} {e.sd:.4f} ({r:.2f} [{lo:.2f}, {hi:.2f}])'
              for K, e, (r, lo, hi) in ratios) + ': ' + (
                  'consistent with a redraw alone making that much of their '
                  'spread (every interval holds 1; these seeds cannot say '
                  'that it does)' if holds else
                  'a ratio\'s interval excludes 1: the redraw alone does not '
                  'make their spread'))


def aa_check(arm: dict | None, losses: dict, found) -> dict | None:
  """The A/A control against the reference, paired by seed (arm and
  losses as `control_check` takes them): the difference A/A - reference,
  its sd beside each variant's paired sd (`found`: `comparisons`), and the
  reading (`stats.decide`: an A/A difference should not be resolved); None
  without A/A runs."""
  if not arm:
    return None
  K, seeds, a, b = _paired_arm(arm, losses)
  d = stats.paired(a, b)
  decided = stats.decide(d)
  variants = [(c['K'], stats.as_estimate(c['difference'])) for c in found
              if stats.as_estimate(c['difference']).n > 1]
  reading = (
      f'the reference with only its K/V initialisation redrawn differs by '
      f'{d.mean:+.4f} nats ({stats.decision(d).words}), sd {d.sd:.4f} over '
      'seeds' + (_aa_spread(d, variants) if variants else
                 '; no other variant ran beside it here, so there is no '
                 'paired sd of a variant to set it against')
      + ('; so the K/V initialisation alone moves the loss beyond '
         'what the seeds detect, and a variant\'s difference of that size '
         'says nothing about K' if decided == 'resolved' else ''))
  return dict(K=K, seeds=seeds, losses=a, reference_losses=b, difference=d,
              detectable=stats.detectable(d.sd, d.n), verdict=decided,
              reading=reading)


def losses_of(result) -> dict:
  """{K: {seed: held-out loss}} of the variants in results.json."""
  return {v['K']: {s['seed']: s['eval_loss'] for s in v['seeds']}
          for v in result['variants']}


def _saved(found: dict) -> dict:
  """A comparison or control as results.json holds it (the Estimate as a
  dict)."""
  return found and {**found, 'difference': stats.as_estimate(
      found['difference']).as_dict()}


def analyse(result: dict) -> dict:
  """RESULT (results.json, as `runs.results` makes it or as saved) with what is
  read from its values, made again from them: the comparisons against the
  reference, the negative and A/A controls, the task scores' comparisons.
  Every verdict is `stats.decide`'s (through `verdict`, `control_check`,
  `aa_check`); nothing is taken from an earlier reading."""
  s = result.get('settings') or {}
  losses = losses_of(result)
  found = comparisons(losses, s.get('num_heads'),
                      s.get('unit', '(unit not recorded)'))
  result['comparisons'] = [_saved(c) for c in found]
  result['control'] = _saved(control_check(result.get('control'), losses))
  result['aa'] = _saved(aa_check(result.get('aa'), losses, found))
  if 'tasks' in result:
    arms, reference = task_arms(result)
    result['tasks']['comparisons'] = task_scores.comparisons(arms, reference)
  return result


def task_arms(result) -> tuple[dict, str]:
  """({'K=k': {seed: task scores}}, the reference's label): the reference
  as `comparisons` picks it, MHA when it ran."""
  kvs = sorted((v['K'] for v in result['variants']), reverse=True)
  num_heads = (result.get('settings') or {}).get('num_heads')
  arms = {f'K={v["K"]}': {s['seed']: s['tasks'] for s in v['seeds']}
          for v in sorted(result['variants'], key=lambda v: -v['K'])}
  return arms, f'K={reference_K(kvs, num_heads)}'
