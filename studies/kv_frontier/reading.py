"""The frontier report's reading ('## What it shows'): what the tables show,
in sentences made from the numbers. Every verdict on a difference is
`stats.decision`'s words; a text that reads an outcome (the control seen or not,
seeds retrieving or not, a pair at the floor) is chosen by that outcome.
One function a bullet, each given the panel as `_Panel` holds it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from studies import report, stats
from studies.kv_frontier import analysis
from studies.kv_frontier.design import CONTROL, RETRIEVES, point


def reading(result: dict) -> list[str]:
  """'## What it shows': per panel, bullets from its analysis."""
  lines = [*report.section('What it shows'),
           'Made from frontier.json as the tables below are: every verdict '
           'and its reason are `stats.decision`\'s words, at the detectable '
           'effect the seeds give; the tables have every interval.', '']
  for name, panel in result['panels'].items():
    lines += report.bullets(panel_reading(name, panel))
  return lines + ['']


def decimals(d: dict) -> int:
  """Decimals that show a difference's interval half-width to two
  significant digits (at least 2; 4 without an interval)."""
  half = (d['high'] - d['low']) / 2
  if not (math.isfinite(half) and half > 0):
    return 4
  return max(2, 1 - math.floor(math.log10(half)))


def said(d: dict, unit: str = '', rejected: bool | None = None) -> str:
  """A difference with its interval, `stats.decision`'s words and what
  the seeds detect: '+0.05 [-0.16, +0.26] nats (not claimed: interval
  holds 0; detectable 0.26)'."""
  decided = stats.decision(d, rejected=rejected)
  text = report.interval(d, f'+.{decimals(d)}f') + unit
  if decided.verdict in ('equal on all seeds', 'one seed'):
    return text  # The interval says it: there is none.
  return f'{text} ({decided.words}; detectable {d["detectable"]:.2g})'


def holm_family(pairs: list) -> str:
  """How a family of PAIRS was corrected, in words."""
  return (f'Holm over the family of {len(pairs)} NLL differences'
          if len(pairs) > 1 else 'a family of 1, uncorrected')


def retrieves(m: dict) -> tuple[int, int]:
  """(seeds whose first-query accuracy is at least RETRIEVES, seeds)."""
  first = m['seeds']['float']['first']
  return sum(f >= RETRIEVES for f in first), len(first)


def _mean(m: dict, metric: str, cache: str = 'float') -> float:
  return float(np.mean(m['seeds'][cache][metric]))


@dataclasses.dataclass(frozen=True)
class _Panel:
  """A panel as the reading reads it: its record, its analysis, its
  models by name, the designs (every model but the negative control) and
  whether it has a first query (the recall probe)."""
  record: dict
  a: dict
  models: list
  by_name: dict
  designs: list
  first_query: bool

  @classmethod
  def of(cls, panel: dict) -> '_Panel':
    models = panel['models']
    return cls(panel, panel['analysis'], models,
               {m['variant']: m for m in models},
               [m for m in models if m['variant'] != CONTROL.name],
               'first' in models[0]['seeds']['float'])

  def layouts(self, pattern: str) -> list[dict]:
    """The designs of one kind of pattern ('G': all-global, 'L': with
    local layers), conversions left out."""
    return [m for m in self.designs if 'source' not in m and (
        m['attention_pattern'] == 'G' if pattern == 'G'
        else 'L' in m['attention_pattern'])]


# The head of each bullet: the panel's name, with its budget on the first.
HEAD = '{head}'


def panel_reading(name: str, panel: dict) -> list[str]:
  p = _Panel.of(panel)
  bullets = [*_control(p), *_retrieval(p), *_main_effects(p),
             *_equal_bytes(p), *_zadouri(p), *_families(p), *_conversions(p),
             *_int8(p), _frontier(p), *_wants(p)]
  heads = [f'**{name}** ({panel["steps"]} steps of `{panel["config"]}`)'] + [
      f'**{name}**'] * (len(bullets) - 1)
  return [b.replace(HEAD, h, 1) for b, h in zip(bullets, heads)]


def _control(p: _Panel) -> list[str]:
  control = p.a['control']
  if not control:
    return []
  nll, acc = control['diff']['nll'], control['diff']['accuracy']
  c = p.by_name[control['control']]
  return [
      f'{HEAD}, **the negative control**: all-local {control["control"]} '
      f'(every layer a window of {p.record["window"]} keys) minus all-global '
      f'{control["reference"]}: NLL {said(nll, " nats")}, accuracy '
      f'{said(acc)}; the control\'s NLL is {_mean(c, "nll"):.3f} and its '
      f'accuracy {_mean(c, "accuracy"):.3f}. ' + (
          f'The setup sees attention reaching the pairs (a '
          f'{nll["mean"]:.2f}-nat effect); that does not show that it can '
          'see an effect of K or of the cache\'s capacity, which may be far '
          'smaller.' if control['sees_attention'] else
          f'**The control is not worse on NLL ({stats.decision(nll).words}): '
          'the setup is blind to attention here, and nothing below can be read as an effect of '
          'the cache.**')]


def _retrieval(p: _Panel) -> list[str]:
  """Retrieval by content, counted k of n seeds (all or nothing), each
  seed near the rule named."""
  if not p.first_query:
    return []
  parts = []
  for m in p.designs:
    k, n = retrieves(m)
    near = [(s, f, acc) for s, f, acc in zip(
        p.record['seeds'], m['seeds']['float']['first'],
        m['seeds']['float']['accuracy']) if 0.5 <= f < RETRIEVES]
    parts.append(f'{m["variant"]} {k}/{n} (first query '
                 f'{_mean(m, "first"):.3f}, all answers '
                 f'{_mean(m, "accuracy"):.3f}' + ''.join(
                     f'; seed {s} at {f:.3f}, all answers {acc:.3f}, short '
                     f'of {RETRIEVES}' for s, f, acc in near) + ')')
  local, glob = p.layouts('L'), p.layouts('G')
  return [
      f'{HEAD}, **retrieval by content** (a seed retrieves when its '
      f'first-query accuracy is at least {RETRIEVES}: all or nothing, so '
      'counted, k of n seeds): ' + '; '.join(parts) + '.' + (
          ' The layouts with local layers retrieve on every seed and the '
          'all-global ones on none: a reading this run does not test is '
          f'that local layers of {p.record["window"]} keys make the '
          'previous-token half of the induction circuit easy to find; '
          'whether the all-global layouts only learn later, rather than '
          'hold less, is not tested either.'
          if local and glob and all(retrieves(m)[0] == retrieves(m)[1]
                                    for m in local)
          and not any(retrieves(m)[0] for m in glob) else '')]


def _main_effects(p: _Panel) -> list[str]:
  if not p.a['main_effects']:
    return []
  family = len(p.a['main_effects'])
  effects = []
  for e in p.a['main_effects']:
    text = f'{e["factor"]} {said(e["nll"], " nats", rejected=e["holm"])}'
    if e['factor'] == 'LLGG vs G':
      ratios = [m['kv_bytes_per_token']['float']
                / t['kv_bytes_per_token']['float']
                for m in p.designs for t in p.designs
                if m['attention_pattern'] == 'LLGG'
                and t['attention_pattern'] == 'G'
                and point(m)._replace(pattern='G') == point(t)]
      if ratios:
        text += f', LLGG at {report.share(ratios)} of G\'s bytes'
    effects.append(text)
  return [f'{HEAD}, **main effects on NLL** ('
          + (f'Holm over the family of {family}' if family > 1 else
             'a family of 1, uncorrected') + '): ' + '; '.join(effects) + '.']


def _equal_bytes_pair(p: _Panel, e: dict) -> str:
  """One equal-bytes pair: its differences, and (on the recall probe)
  whether both arms retrieve on every seed (at the floor) or a seed's arms
  split on retrieval."""
  x, y = p.by_name[e['a']], p.by_name[e['b']]
  text = (f'{e["a"]} − {e["b"]} at '
          f'{e["kv_bytes_per_token"]["float"]:,.0f} bytes/token: NLL '
          f'{said(e["diff"]["nll"], " nats")}, accuracy '
          f'{said(e["diff"]["accuracy"])}')
  if not p.first_query:
    return text
  if all(retrieves(m)[0] == retrieves(m)[1] for m in (x, y)):
    nlls = [_mean(m, 'nll') for m in (x, y)]
    return text + (f'; both retrieve on every seed (NLL '
                   f'{min(nlls):.4f}-{max(nlls):.4f}): at the floor, so the '
                   'pair cannot show a limit of the cache\'s capacity, and '
                   'nothing here tests Brandon et al.\'s capacity claim')
  if any(abs(f - g) >= 0.5 for f, g in zip(x['seeds']['float']['first'],
                                           y['seeds']['float']['first'])):
    return text + ('; on some seed one arm has jumped to retrieval and the '
                   'other not, so the per-seed differences are that jump '
                   'and the seeds detect only large effects')
  return text


def _equal_bytes(p: _Panel) -> list[str]:
  if not p.a['equal_bytes']:
    return []
  pairs = [_equal_bytes_pair(p, e) for e in p.a['equal_bytes']]
  claimed = [e for e in p.a['equal_bytes']
             if stats.decide(e['diff']['nll']) == 'resolved']
  return [f'{HEAD}, **equal bytes** (uncorrected): ' + '; '.join(
      pairs) + '. ' + (
      'On NLL nothing is claimed either way.' if not claimed else
      'Claimed on NLL: ' + '; '.join(
          f'{e["a"]} {"worse" if e["diff"]["nll"]["mean"] > 0 else "better"}'
          f' than {e["b"]}' for e in claimed) + '; no other pair.')]


def _zadouri(p: _Panel) -> list[str]:
  if not p.a.get('same_heads'):
    return []
  pairs = [f'{e["a"]} − {e["b"]} at {e["bytes_ratio"]:.0%} of its bytes: '
           f'NLL {said(e["diff"]["nll"], " nats")}'
           for e in p.a['same_heads']]
  return [
      f'{HEAD}, **Zadouri et al.\'s pairs** (GTA against GQA with as many '
      'K/V heads, their claim being GQA\'s quality at about half its '
      'cache; GLA against MLA of the same bytes, their claim being MLA\'s '
      'quality; uncorrected): ' + '; '.join(pairs) + '. A pair without a '
      'claim is not a match: it is a difference below what these seeds '
      'detect, in either direction. GTA with K heads and a RoPE key of Y '
      'caches (K·H + Y) / (2·K·H) of GQA-K\'s: about half for many heads, '
      'more with few (one head and Y = H/2: 75%).']


def _families(p: _Panel) -> list[str]:
  """Each family fixed in the design (TPA's): its pairs with Holm's
  verdicts, which are resolved which way, and what that says of the claim
  it tests (a pair resolved worse is against 'matches or beats'; one not
  claimed is not a match)."""
  bullets = []
  for f in p.a.get('families', []):
    if not f['pairs']:
      continue
    pairs = [f'{e["a"]} − {e["b"]} ({e["num_heads_a"]} and '
             f'{e["num_heads_b"]} query heads, '
             f'{e["bytes_a"] / e["bytes_b"]:.2f}x its bytes): NLL '
             f'{said(e["diff"]["nll"], " nats", rejected=e["holm"])}'
             for e in f['pairs']]
    resolved = [e for e in f['pairs'] if stats.decide(
        e['diff']['nll'], rejected=e['holm']) == 'resolved']
    claimed = [f'{word}: ' + ', '.join(
        f'{e["a"]} than {e["b"]}' for e in group) for word, group in (
            ('worse', [e for e in resolved if e['diff']['nll']['mean'] > 0]),
            ('better', [e for e in resolved if e['diff']['nll']['mean'] < 0]))
               if group]
    outcome = ('Claimed ' + '; claimed '.join(claimed) + (
        '; no other pair' if len(resolved) < len(f['pairs']) else '')
               + '.' if claimed else 'On NLL nothing is claimed either way.')
    bullets.append(
        f'{HEAD}, **{f["name"]}** ({holm_family(f["pairs"])}, fixed in the '
        'design before any run): ' + '; '.join(pairs) + f'. {outcome} '
        'A pair claimed worse is against "matches or beats" for that '
        f'baseline at this scale ({p.record["steps"]} steps of '
        f'`{p.record["config"]}`, not the paper\'s 124M-770M parameters); '
        'one without a claim is not a match either: a difference below what '
        'these seeds detect, in either direction.')
  return bullets


def _conversions(p: _Panel) -> list[str]:
  nbytes = {m['variant']: m['kv_bytes_per_token']['float'] for m in p.models}
  bullets = []
  for e in p.a.get('conversions', []):
    d = e['diff']['nll']
    bullets.append(
        f'{HEAD}, **{e["model"]}** minus its source {e["source"]} '
        f'({nbytes[e["source"]]:,.0f} → {nbytes[e["model"]]:,.0f} '
        f'bytes/token): NLL {said(d, " nats")}'
        + (f', after {e["uptrain_steps"]} steps of the conversion\'s '
           'uptraining recipe; uncorrected, and with no control for the '
           f'source itself training {e["uptrain_steps"]} more steps'
           if e['uptrain_steps'] else ', as converted (no training)')
        + ('. Without a claim it says neither that the conversion recovers '
           'past its source nor that it falls short of it.'
           if e['uptrain_steps'] and stats.decide(d) != 'resolved' else '.'))
  return bullets


def _int8(p: _Panel) -> list[str]:
  deltas = [e for e in p.a['int8'] if e['variant'] != CONTROL.name]
  if not deltas:
    return []
  nlls = [e['delta']['nll'] for e in deltas]
  verdicts = [stats.decision(d).words for d in nlls]
  counts = ', '.join(f'{verdicts.count(v)} {v}' for v in dict.fromkeys(
      verdicts))
  bound = max(max(abs(d['low']), abs(d['high'])) for d in nlls
              if math.isfinite(d['low']))
  ratios = [m['kv_bytes_per_token']['int8'] / m['kv_bytes_per_token'][
      'float'] for m in p.designs]
  resolved = [e['variant'] for e, d in zip(deltas, nlls)
              if stats.decide(d) == 'resolved']
  return [
      f'{HEAD}, **int8 cache** (every model'
      + (' but the control' if len(deltas) < len(p.a['int8']) else '')
      + '): '
      + (f'NLL differs for {", ".join(resolved)} ({counts}); '
         if resolved else f'no NLL difference from the float cache is '
         f'claimed ({counts}); ')
      + ('every interval contains 0 and ' if all(
          d['low'] <= 0 <= d['high'] for d in nlls) else '')
      + f'none reaches past ±{bound:.2g} nats; the KL from the float '
      f'cache\'s predictions is at most '
      f'{max(e["kl"]["mean"] for e in deltas):.1e} nats (a mean over '
      f'seeds); int8 caches hold {report.share(ratios)} of the float bytes.']


def _frontier(p: _Panel) -> str:
  """The frontier's points; those on it only for having nothing cheaper
  named as such."""
  on = p.a['frontier']
  pts = {q['name']: q for q in analysis.points(p.designs)}
  vacuous = [n for n in on if n in pts and not any(
      q['kv_bytes_per_token'] < pts[n]['kv_bytes_per_token']
      for q in pts.values())]
  why = (' on it only because no point'
         + (' but the control' if len(p.designs) < len(p.models) else '')
         + ' is cheaper, not by beating a cheaper one')
  return (f'{HEAD}, **frontier**: {", ".join(on) or "no point"}'
          + ((f',{why}' if vacuous == on else f'; {", ".join(vacuous)}{why}')
             if vacuous else '') + '.')


def _wants(p: _Panel) -> list[str]:
  """What would make the recall panel say more, where it says little:
  all-global seeds that do not retrieve, pairs at the floor."""
  if not p.first_query:
    return []
  floor = any(all(retrieves(p.by_name[e[k]])[0] == retrieves(
      p.by_name[e[k]])[1] for k in ('a', 'b')) for e in p.a['equal_bytes'])
  wants = (['steps enough that every all-global seed retrieves']
           if any(retrieves(m)[0] < retrieves(m)[1] for m in p.layouts('G'))
           else []) + (['more pairs per head or narrower heads, so that '
                        'capacity binds where every arm retrieves']
                       if floor else [])
  if not wants:
    return []
  return [f'{HEAD}, **what would make it say more**: '
          + ', and '.join(wants) + '.']
