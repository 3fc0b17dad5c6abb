"""What the frontier reads from its per-seed values: the negative control,
the equal-bytes pairs, Zadouri et al.'s pairs, the conversions against
their sources, the main effects of the GQA grid (Holm), the panel's
families of pairs fixed in the design (Holm within each: TPA's), int8
against float for every model, and the frontier. Pure functions of the
model records (as `measure` writes them, or a test makes them up); every
verdict is `stats.decide`'s."""

from __future__ import annotations

import dataclasses

import numpy as np

from studies import stats
from studies.kv_frontier.design import (CACHES, CONTROL, EQUAL_BYTES,
                                        REFERENCE, grouped_query, point,
                                        zadouri_partner)


def points(models: list[dict]) -> list[dict]:
  """Every model through each cache: a point of (bytes, per-seed NLL)."""
  return [dict(name=f'{m["variant"]} {cache}', variant=m['variant'],
               cache=cache, kv_bytes_per_token=m['kv_bytes_per_token'][cache],
               **m['seeds'][cache]) for m in models for cache in CACHES]


def _compare(a: dict, b: dict, cache: str = 'float') -> dict:
  """a - b, paired by seed, for each metric both have; with the smallest
  difference the seeds could detect."""
  out = {}
  for metric in a['seeds'][cache]:
    d = stats.paired(a['seeds'][cache][metric], b['seeds'][cache][metric])
    out[metric] = {**d.as_dict(), 'resolved': stats.decide(d) == 'resolved',
                   'detectable': stats.detectable(d.sd, d.n)}
  return out


def analyse(models: list[dict], declared: list[dict] = ()) -> dict:
  """The negative control, the equal-bytes pairs, the main effects (Holm),
  the DECLARED families (`design.Family.record`'s, as frontier.json holds
  them), int8 against float per model, and the frontier."""
  # Conversions are points of the frontier, compared with their source;
  # not layouts of the grid.
  designs = [m for m in models if 'source' not in m]
  by_name = {m['variant']: m for m in designs}
  by_point = {point(m): m for m in designs}
  names = {m['variant']: m for m in models}
  return {
      'control': control(by_name),
      'equal_bytes': equal_bytes(models, designs, by_name),
      # The factors of the GQA grid; MLA, GLA and GTA layouts are not
      # levels of them.
      'main_effects': main_effects({p: m for p, m in by_point.items()
                                    if grouped_query(p)}),
      'int8': [int8(m) for m in models],
      # The negative control is not a design anyone would choose: it is
      # left out of the frontier (neither on it nor a point the others
      # must beat).
      'frontier': frontier(points([m for m in models
                                   if m['variant'] != CONTROL.name])),
      'frontier_excludes': CONTROL.name,
      'conversions': [
          dict(model=m['variant'], source=m['source'],
               uptrain_steps=m['uptrain_steps'],
               diff=_compare(m, names[m['source']]))
          for m in models if m.get('source') in names],
      'same_heads': same_heads(designs, by_point),
      'families': [family(f, by_name) for f in declared]}


def control(by_name: dict) -> dict | None:
  """The negative control (all-local) minus its reference (all-global),
  and whether the setup sees attention: the control resolved worse."""
  control_, reference = by_name.get(CONTROL.name), by_name.get(REFERENCE.name)
  if not (control_ and reference):
    return None
  diff = _compare(control_, reference)
  return dict(control=control_['variant'], reference=reference['variant'],
              diff=diff, sees_attention=bool(
                  diff['nll']['resolved'] and diff['nll']['mean'] > 0))


def equal_bytes(models: list[dict], designs: list[dict], by_name: dict
                ) -> list[dict]:
  """In each pattern but all-local: GQA-2 with CLA2 minus MQA, and each
  other layout (MLA, GLA, GTA; no sharing) holding MQA's float bytes
  minus each of them, paired by seed."""
  out = []
  for pattern in sorted({m['attention_pattern'] for m in models} - {'L'}):
    gqa, mqa = (by_name.get(dataclasses.replace(v, pattern=pattern).name)
                for v in EQUAL_BYTES)
    pairs = [(gqa, mqa)] + [
        (m, other) for m in designs
        if not grouped_query(point(m)) and m['attention_pattern'] == pattern
        and m['kv_share'] == 1 and mqa
        and m['kv_bytes_per_token']['float']
        == mqa['kv_bytes_per_token']['float'] for other in (mqa, gqa)]
    for a, b in pairs:
      if not (a and b):
        continue
      # Equal float caches (int8's scales differ: one per token and K/V
      # head, MLA's one per token, GLA's one per group, GTA's one per tied
      # head and one for the RoPE key).
      if a['kv_bytes_per_token']['float'] != b['kv_bytes_per_token'][
          'float']:
        raise ValueError(f'{a["variant"]} and {b["variant"]} differ in bytes:'
                         f' {a["kv_bytes_per_token"]}, '
                         f'{b["kv_bytes_per_token"]}')
      out.append(dict(a=a['variant'], b=b['variant'],
                      kv_bytes_per_token=a['kv_bytes_per_token'],
                      diff=_compare(a, b)))
  return out


def int8(m: dict) -> dict:
  """A model's int8 cache minus its float cache, paired by seed (the
  same weights), and the KL between their predictions over seeds."""
  per_cache = m['seeds']
  delta = {metric: stats.paired(per_cache['int8'][metric],
                                per_cache['float'][metric]).as_dict()
           for metric in per_cache['float']}
  return dict(variant=m['variant'], delta=delta,
              kl=stats.mean(m['kl']).as_dict())


def same_heads(designs: list[dict], by_point: dict) -> list[dict]:
  """Zadouri et al.'s pairs (`design.zadouri_partner`), paired by seed:
  GTA with K heads minus GQA with the same K, pattern and sharing (their
  claim: GQA's quality at about half its cache), and GLA minus MLA of the
  same latent and RoPE key (their claim: MLA's quality, the same bytes),
  where both were trained."""
  out = []
  for m in designs:
    other = by_point.get(zadouri_partner(point(m)))
    if other:
      out.append(dict(a=m['variant'], b=other['variant'],
                      bytes_ratio=m['kv_bytes_per_token']['float']
                      / other['kv_bytes_per_token']['float'],
                      diff=_compare(m, other)))
  return out


def family(declared: dict, by_name: dict) -> dict:
  """A declared family's pairs (a minus b, paired by seed), each with both
  arms' query heads, parameters and float bytes per token, and the p of
  its NLL difference; Holm's correction over the family's NLL p values
  ('holm': whether it rejects no difference). A pair an arm of which was
  not trained is left out (`Family.record` cuts to the trained ones)."""
  pairs = []
  for a_name, b_name in declared['pairs']:
    a, b = by_name.get(a_name), by_name.get(b_name)
    if not (a and b):
      continue
    pairs.append(dict(
        a=a_name, b=b_name, **{f'{key}_{side}': m.get(key) for key in (
            'num_heads', 'params') for side, m in (('a', a), ('b', b))},
        bytes_a=a['kv_bytes_per_token']['float'],
        bytes_b=b['kv_bytes_per_token']['float'], diff=_compare(a, b),
        p=stats.p_value(np.subtract(a['seeds']['float']['nll'],
                                    b['seeds']['float']['nll']))))
  for pair, rejected in zip(pairs, stats.holm([e['p'] for e in pairs])):
    pair['holm'] = bool(rejected)
  return dict(name=declared['name'], claim=declared['claim'], pairs=pairs)


def main_effects(by: dict) -> list[dict]:
  """Each factor's effect on the float NLL and accuracy: per seed, the mean
  of the differences over every pair of models that differ in that factor
  alone; Holm's correction over the family (all factors' NLL effects).
  by: {Point: model} of the GQA grid."""
  factors = [('LLGG vs G', 1, ('LLGG', 'G')), ('kv_share 2 vs 1', 2, (2, 1))]
  kv_heads = sorted({p.K for p in by}, reverse=True)
  for K in kv_heads[1:]:
    factors.append((f'K={K} vs K={kv_heads[0]}', 0, (K, kv_heads[0])))
  effects = []
  for name, axis, (level, base) in factors:
    pairs = [(m, by[other]) for p, m in by.items() if p[axis] == level
             and (other := p[:axis] + (base,) + p[axis + 1:]) in by]
    if pairs:
      effects.append({'factor': name, 'pairs': len(pairs),
                      **{metric: _effect(pairs, metric)
                         for metric in ('nll', 'accuracy')}})
  for effect, rejected in zip(effects, stats.holm(
      [e['nll']['p'] for e in effects])):
    effect['holm'] = bool(rejected)
  return effects


def _effect(pairs: list[tuple[dict, dict]], metric: str) -> dict:
  """Per seed, the mean over PAIRS of a - b in the float cache's METRIC;
  its estimate over seeds, verdict, detectable effect and p."""
  per_seed = np.mean([np.subtract(a['seeds']['float'][metric],
                                  b['seeds']['float'][metric])
                      for a, b in pairs], axis=0)
  e = stats.mean(per_seed)
  return {**e.as_dict(), 'resolved': stats.decide(e) == 'resolved',
          'detectable': stats.detectable(e.sd, e.n),
          'p': stats.p_value(per_seed)}


def frontier(pts: list[dict]) -> list[str]:
  """The points (names) whose NLL is resolved lower, paired by seed, than
  that of every point with fewer bytes per token, and not resolved higher
  than any point with as few; cheapest first. Resolved: `stats.decide`'s
  (the interval excludes 0 and the difference is at least what the seeds
  detect)."""
  on = []
  for p in sorted(pts, key=lambda p: p['kv_bytes_per_token']):
    beats = lambda o, p=p: _Decided(stats.paired(o['nll'], p['nll']))
    cheaper = [o for o in pts if o['kv_bytes_per_token']
               < p['kv_bytes_per_token']]
    same = [o for o in pts if o is not p
            and o['kv_bytes_per_token'] == p['kv_bytes_per_token']]
    if all(beats(o).resolved and beats(o).mean > 0 for o in cheaper) and (
        not any(beats(o).resolved and beats(o).mean < 0 for o in same)):
      on.append(p['name'])
  return on


class _Decided:
  """A paired difference whose `resolved` is `stats.decide`'s."""

  def __init__(self, est: stats.Estimate):
    self.mean = est.mean
    self.resolved = stats.decide(est) == 'resolved'
