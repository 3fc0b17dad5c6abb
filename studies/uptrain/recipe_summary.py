"""The recipe study's statistics: `summary(results)` derives every number
its report states from the per-run losses in results.json.

The unit of replication is the source (one uptraining seed each, shared
by the control and GQA: their data order). Claims 1 and 3 are read as in
the replicated study, against the margin NEAR fixed in advance: a cell
(part, recipe, alpha) is the per-source difference of the uptrained
mean-pooled GQA from the control (claim 1, both by the same recipe) or
from GQA trained from scratch for S(1 + alpha) steps (claim 3), minus
NEAR; `stats.decide` reads it after Holm over its family (FAMILIES,
fixed before the runs): 'reproduced' when claimed below the margin,
'not reproduced' when claimed beyond it, else the decision's words. A claim is
reproduced in a part if a recipe reproduces it at the paper's alpha, and
"not reproduced at this scale" only if every recipe is claimed beyond
the margin there.
"""

from __future__ import annotations

import math

import numpy as np

from studies import stats
from studies.uptrain.common import per_doubling
from studies.uptrain.design import NEAR

# The Holm families, fixed in advance (issue #60). Each is corrected on
# its own; a cell outside them is reported, not judged.
FAMILIES = {
    'sweep_claim1': 'claim 1 in the sweep: every recipe at every alpha',
    'sweep_claim3': 'claim 3 in the sweep: every recipe at every alpha',
    'carried_claim1': 'claim 1 under the carried recipe, at each shorter '
                      'source length',
    'carried_claim3': 'claim 3 under the carried recipe, at each shorter '
                      'source length',
    'trends': 'the per-doubling trends of claims 1 and 3 under the carried '
              'recipe (every source length, the sweep\'s included)',
    'panel_claim1': 'claim 1 in the long-context panel: every recipe',
    'panel_claim3': 'claim 3 in the long-context panel: every recipe',
    'negative': 'the negative control: GQA before uptraining (its '
                'conversion) minus the control, at every source length '
                'and the panel, must be claimed beyond the margin (where '
                'it is not, that length\'s claim cells are held back: a gate '
                'added after a fresh trial, which no published cell meets)',
}


def _key(recipe: dict) -> tuple:
  return (recipe['rate'], recipe['schedule'])


def name(recipe: dict) -> str:
  """'cosine 3e-4' (the report's name of a recipe)."""
  return f'{recipe["schedule"]} {recipe["rate"]:g}'


def read(source: dict, arm: str, recipe: dict, alpha: float) -> float:
  """ARM's loss ('control' or 'gqa') by RECIPE after alpha x S steps."""
  return next(p['loss'] for r in source['runs']
              if r['arm'] == arm and _key(r) == _key(recipe)
              for p in r['reads'] if p['alpha'] == alpha)


def at_step0(source: dict, arm: str) -> float:
  """ARM's conversion's loss before uptraining (one for every recipe)."""
  return next(r['curve'][0]['loss'] for r in source['runs']
              if r['arm'] == arm)


def scratch(source: dict, alpha: float) -> float:
  return next(c['loss'] for c in source['scratch'] if c['alpha'] == alpha)


def recipes_of(sources: list[dict]) -> list[dict]:
  """The recipes the sources were uptrained by, in the design's order."""
  seen = {}
  for r in sources[0]['runs']:
    seen.setdefault(_key(r), {'rate': r['rate'], 'schedule': r['schedule']})
  return list(seen.values())


def alphas_of(sources: list[dict], recipe: dict) -> list[float]:
  return sorted({p['alpha'] for r in sources[0]['runs']
                 if _key(r) == _key(recipe) for p in r['reads']})


def difference(values) -> dict:
  """A per-source difference: its Estimate, the p of it against NEAR (a
  two-sided t test of values - NEAR), its detectable effect and values."""
  values = [float(v) for v in values]
  est = stats.mean(values)
  return {**est.as_dict(), 'values': values,
          'p': stats.p_value([v - NEAR for v in values]),
          'detectable': stats.detectable(est.sd, est.n)}


CLAIM = ('reproduced', 'not reproduced')  # Within, beyond the margin.
# The negative control must be claimed beyond the margin.
NEGATIVE = ('within the margin: the control fails', 'beyond the margin')


def near_outcome(cell: dict, words: tuple = CLAIM) -> str:
  """A cell's reading against the margin after Holm (cell['holm']):
  words[0] when claimed below NEAR, words[1] when claimed beyond it,
  else `stats.decision`'s words (not claimed, and why)."""
  decision = stats.decision(stats.shifted(cell, NEAR), rejected=cell['holm'],
                            withheld=not cell.get('gate', True))
  if decision.verdict == 'resolved':
    return words[0] if cell['mean'] < NEAR else words[1]
  return decision.words


def holm(cells: list[dict], words: tuple = CLAIM,
         gate: dict | None = None) -> list[dict]:
  """CELLS (one family) with Holm's outcome and their reading; GATE
  {source length: whether its negative control passed} withholds a
  length's cells where it did not (the setup did not see a gap there)."""
  rejected = stats.holm([c['p'] for c in cells])
  out = [{**c, 'holm': r, **({'gate': gate[c['steps']]} if gate else {})}
         for c, r in zip(cells, rejected)]
  return [{**c, 'outcome': near_outcome(c, words)} for c in out]


def cells(sources: list[dict], recipes: list[dict], claim: str) -> list[dict]:
  """Claim 1 ('control') or 3 ('scratch') per (recipe, alpha) over
  SOURCES: GQA's loss minus the reference's, per source."""
  out = []
  for recipe in recipes:
    for alpha in alphas_of(sources, recipe):
      gqa = [read(s, 'gqa', recipe, alpha) for s in sources]
      ref = [read(s, 'control', recipe, alpha) if claim == 'control'
             else scratch(s, alpha) for s in sources]
      out.append({'recipe': recipe, 'alpha': alpha, 'steps':
                  sources[0]['steps'], **difference(np.subtract(gqa, ref))})
  return out


def claim_verdict(family: list[dict], alpha: float) -> str:
  """A claim in one part at ALPHA over its recipes: reproduced if some
  recipe reproduces it; not reproduced at this scale only if every recipe
  is 'not reproduced'; else undecided (every cell's reading
  is in the report)."""
  at = [c for c in family if c['alpha'] == alpha]
  good = [name(c['recipe']) for c in at if c['outcome'] == 'reproduced']
  if good:
    return 'reproduced under ' + ', '.join(good)
  if all(c['outcome'] == 'not reproduced' for c in at):
    return (f'not reproduced at this scale under any of the grid\'s '
            f'{len(at)} recipes')
  beyond = [name(c['recipe']) for c in at if c['outcome'] == 'not reproduced']
  return (f'undecided: no recipe in the grid reproduces it; "not '
          f'reproduced" by '
          f'{len(beyond)} of {len(at)}' + (f' ({", ".join(beyond)})'
                                           if beyond else ''))


def best(sources: list[dict], arm: str, alpha: float) -> dict:
  """ARM's recipe of lowest mean loss at ALPHA over SOURCES, and its loss."""
  rows = [(float(np.mean([read(s, arm, r, alpha) for s in sources])), r)
          for r in recipes_of(sources) if alpha in alphas_of(sources, r)]
  loss, recipe = min(rows, key=lambda x: x[0])
  return {'recipe': recipe, 'loss': loss}


def corrected(family: list[dict], alpha: float | None = None) -> dict:
  """What Holm's first step asks of a FAMILY of m cells (at ALPHA only,
  if given, among them): the |t| it needs (5%/m, two-sided), the smallest
  difference from the margin each cell detects with 80% power there, and
  the power of reading 'reproduced' at a true difference of 0 (the
  margin's whole width), at each cell's sd."""
  m = len(family)
  level = 1 - (1 - stats.LEVEL) / m
  cells = [c for c in family if alpha is None or c['alpha'] == alpha]
  n = cells[0]['n']
  return {'m': m, 't': stats.t_quantile(n, level),
          'detectable': [stats.detectable(c['sd'], c['n'], level=level)
                         for c in cells],
          'power_at_0': [stats.t_test_power(NEAR * math.sqrt(c['n']) / c['sd'],
                                            c['n'], level=level)
                         for c in cells]}


def uncorrected(family: list[dict], alpha: float) -> dict:
  """A secondary reading, chosen after the runs: the claim 'not near the
  control under every recipe' as an intersection-union test (each recipe's
  cell at 5%, no correction); how many of the recipes' cells at ALPHA are
  decided beyond the margin that way, and the lowest interval bound."""
  at = [c for c in family if c['alpha'] == alpha]
  beyond = [c for c in at if near_outcome({**c, 'holm': None}) ==
            'not reproduced']
  return {'beyond': len(beyond), 'of': len(at),
          'lowest': min(c['low'] for c in at)}


def best_against_best(sources: list[dict], alpha: float) -> dict:
  """GQA by its best recipe minus the control by its own, per source
  (each arm at its best: a reading beside the recipe-matched claim 1)."""
  g, c = (best(sources, arm, alpha)['recipe'] for arm in ('gqa', 'control'))
  return stats.mean([read(s, 'gqa', g, alpha) - read(s, 'control', c, alpha)
                     for s in sources]).as_dict()


def drift(sources: list[dict]) -> list[dict]:
  """The control's loss minus its source's, per (recipe, alpha)."""
  return [{'recipe': r, 'alpha': a, **stats.mean(
      [read(s, 'control', r, a) - s['source']['loss'] for s in sources]
  ).as_dict()} for r in recipes_of(sources) for a in alphas_of(sources, r)]


def slope(by_length: dict, claim: str, recipe: dict, alpha: float) -> dict:
  """Claim 1's or 3's difference against log2 S, a least-squares slope per
  source seed (sources of every length share seeds), then over seeds."""
  slopes = per_doubling({S: list(zip(
      [s['seed'] for s in sources],
      next(c for c in cells(sources, [recipe], claim)
           if c['alpha'] == alpha)['values']))
                         for S, sources in by_length.items()})
  est = stats.mean(slopes)
  return {**est.as_dict(), 'values': slopes, 'p': stats.p_value(slopes),
          'detectable': stats.detectable(est.sd, est.n)}


def _negative(parts: dict) -> list[dict]:
  """Per source length (and the panel): GQA's conversion (step 0) minus
  the control's, which uptraining exists to close: beyond the margin."""
  out = []
  for part, sources in parts.items():
    for S in sorted({s['steps'] for s in sources}):
      group = [s for s in sources if s['steps'] == S]
      out.append({'part': part, 'steps': S, **difference(
          [at_step0(s, 'gqa') - at_step0(s, 'control') for s in group])})
  return holm(out, NEGATIVE)


def _probe(probe: list[dict], sweep: list[dict], grid_best: dict,
           alpha: float) -> list[dict]:
  """The probe's recipes (above the grid; a diagnostic, no Holm family,
  no verdict): claims 1 and 3 per recipe, and its GQA minus the grid's
  best GQA recipe, per source."""
  out = []
  for recipe in recipes_of(probe):
    gqa = [read(s, 'gqa', recipe, alpha) for s in probe]
    out.append({'recipe': recipe, 'claim1': difference(np.subtract(
        gqa, [read(s, 'control', recipe, alpha) for s in probe])),
                'claim3': difference(np.subtract(
                    gqa, [scratch(s, alpha) for s in probe])),
                'vs_grid': difference(np.subtract(gqa, [read(
                    s, 'gqa', grid_best['recipe'], alpha) for s in sweep]))})
  return out


def _reproduction(results: dict) -> list[dict]:
  """This study's sources and PUBLISHED-recipe runs at the paper's alpha
  against the replicated study's published ones (same S, seed, recipe)."""
  ref = results.get('reference') or {}
  published = results['plan']['published']
  parts = results['parts']
  rows = []
  for p in ref.get('sources', []):
    s = next(x for x in parts['sweep'] + parts['carried']
             if (x['steps'], x['seed']) == (p['steps'], p['seed']))
    row = {'steps': p['steps'], 'seed': p['seed'],
           'source': s['source']['loss'] - p['source']}
    if any(_key(r) == _key(published) for r in s['runs']):
      alpha = results['plan']['paper_alpha']
      row.update(control=read(s, 'control', published, alpha) - p['control'],
                 gqa=read(s, 'gqa', published, alpha) - p['gqa'])
    rows.append(row)
  return rows


def summary(results: dict) -> dict:
  """Every number the report states."""
  plan, parts = results['plan'], results['parts']
  alpha = plan['paper_alpha']
  sweep, panel = parts['sweep'], parts['panel']
  carried = {S: [s for s in parts['carried'] if s['steps'] == S]
             for S in plan['carried_steps']}
  carried_recipe = recipes_of(parts['carried'])[0]
  out = {'families': FAMILIES}
  out['negative'] = _negative({'sweep': sweep, 'carried': parts['carried'],
                               'panel': panel})
  gate = {part: {c['steps']: c['outcome'] == NEGATIVE[1]
                 for c in out['negative'] if c['part'] == part}
          for part in ('sweep', 'carried', 'panel')}
  for part, sources in (('sweep', sweep), ('panel', panel)):
    for claim, ref in (('claim1', 'control'), ('claim3', 'scratch')):
      out[f'{part}_{claim}'] = holm(cells(sources, recipes_of(sources), ref),
                                    gate=gate[part])
    out[f'{part}_best'] = {arm: best(sources, arm, alpha)
                           for arm in ('gqa', 'control')}
    out[f'{part}_drift'] = drift(sources)
    out[f'{part}_verdict'] = {claim: claim_verdict(out[f'{part}_{claim}'],
                                                   alpha)
                              for claim in ('claim1', 'claim3')}
    out[f'{part}_holm_needs'] = {
        claim: corrected(out[f'{part}_{claim}'], alpha)
        for claim in ('claim1', 'claim3')}
    out[f'{part}_uncorrected'] = {
        claim: uncorrected(out[f'{part}_{claim}'], alpha)
        for claim in ('claim1', 'claim3')}
    out[f'{part}_best_against_best'] = best_against_best(sources, alpha)
    # A positive control (a diagnostic, not a family): the control minus
    # its source, read against the margin, uncorrected: can the test say
    # 'within the margin' where the difference is small?
    within = [difference([read(s, 'control', d['recipe'], d['alpha'])
                          - s['source']['loss'] for s in sources])
              for d in out[f'{part}_drift']]
    out[f'{part}_positive'] = {
        'within': sum(near_outcome({**c, 'holm': None}) == 'reproduced'
                      for c in within), 'of': len(within)}
  out['carried_recipe'] = carried_recipe
  for claim, ref in (('claim1', 'control'), ('claim3', 'scratch')):
    out[f'carried_{claim}'] = holm([c for S in carried for c in cells(
        carried[S], [carried_recipe], ref)], gate=gate['carried'])
  lengths = {**carried, plan['sweep_steps']: sweep}
  out['carried_means'] = {
      claim: {S: float(next(c for c in cells(v, [carried_recipe], ref)
                            if c['alpha'] == alpha)['mean'])
              for S, v in sorted(lengths.items())}
      for claim, ref in (('claim1', 'control'), ('claim3', 'scratch'))}
  trends = [{'claim': claim, **slope(lengths, ref, carried_recipe, alpha)}
            for claim, ref in (('claim1', 'control'), ('claim3', 'scratch'))]
  rejected = stats.holm([t['p'] for t in trends])
  out['trends'] = [{**t, 'holm': r,
                    'verdict': stats.decision(t, rejected=r).words}
                   for t, r in zip(trends, rejected)]
  if parts.get('probe'):
    out['probe'] = _probe(parts['probe'], sweep, out['sweep_best']['gqa'],
                          alpha)
  out['reproduction'] = _reproduction(results)
  return out
