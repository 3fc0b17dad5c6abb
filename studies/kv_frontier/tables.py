"""The frontier's report.md, a function of frontier.json alone (so that
--report_only rebuilds it byte for byte): where it was made, the
convention, the reading (`reading`) and each panel's tables; and `write`:
frontier.json (analysed again), report.md and frontier.png."""

from __future__ import annotations

import math
import pathlib

from studies import report, stats, study
from studies.kv_frontier import analysis, plot
from studies.kv_frontier.design import RETRIEVES
from studies.kv_frontier.reading import holm_family, reading


def write(out: pathlib.Path, result: dict):
  """DIR/frontier.json (each panel analysed again from its per-seed
  values), DIR/report.md (`text`) and DIR/frontier.png."""
  for panel in result['panels'].values():
    panel['analysis'] = analysis.analyse(panel['models'],
                                         panel.get('families', []))
  (out / 'frontier.json').write_text(study.to_json(result))
  (out / 'report.md').write_text(text(result))
  plot.plot(result, out / 'frontier.png')


def rebuild(out: pathlib.Path, module: str):
  """--report_only: the per-seed values as measured (OUT/frontier.json);
  the statistics and the reading as this commit makes them, the rebuild
  recorded beside the command that measured (as `python -m MODULE`)."""
  result = study.saved(out / 'frontier.json')
  report.record_rebuild(result['provenance'], module, out)
  write(out, result)


def _made(result: dict) -> str:
  """Where and how long it ran, what kind of run it was, and its note."""
  prov = result['provenance']
  flags = prov['command'].split()
  return (
      f'Made by {report.command_at(prov, out=True)}: '
      f'{result["minutes"]:.1f} minutes, '
      f'{result.get("cpu_minutes", math.nan):.1f} minutes of CPU time '
      '(what the wall time is at most on an idle machine).'
      + (' A `--quick` run: the recall panel alone, at fewer steps than '
         'the default and without the conversion: too short for '
         'retrieval to be learnt.' if '--quick' in flags else '')
      + (' A subset of the default grid (`--variants`), with the '
         'conversions of any source it holds; the default grid\'s runs '
         'are published apart.' if any(w.startswith('--variants')
                                        for w in flags) else '')
      + (f' Runs trained: {study.describe_runs(prov["runs"])}.'
         if prov.get('runs') else f' Runs trained: {prov["trained"]}.'
         if prov.get('trained') else '')
      + (f' {prov["note"]}' if prov.get('note') else ''))


def text(result: dict) -> str:
  """report.md from frontier.json alone: where it was made (and rebuilt),
  the convention, the reading (`reading`: from the numbers, every verdict
  `stats.decision`'s words) and each panel's tables."""
  lines = ['# The KV-memory frontier on a task where the cache matters', '',
           _made(result), '',
           *report.rebuilt_lines(result['provenance'], 'frontier.json'),
           stats.CONVENTION, '',
           'Bytes: the decode cache per token of context at max_len '
           '(`model.kv_bytes_per_token`: every layer that owns a cache, local '
           'layers their window, int8 with its float32 scale per token and '
           'K/V head). NLL and accuracy: the scored targets of the loop\'s '
           'held-out batches, read through the decode cache (float or int8, '
           'the whole row prefilled); KL: from the float cache\'s next-token '
           'distribution to the int8 cache\'s.', '', *reading(result)]
  for name, panel in result['panels'].items():
    lines += panel_lines(name, panel)
  return report.document(lines) + '\n![frontier](frontier.png)\n'


def panel_lines(name: str, panel: dict) -> list[str]:
  """A panel's section: its setting, the control, then each table."""
  a, models = panel['analysis'], panel['models']
  first = 'first' in models[0]['seeds']['float']
  return [*report.section(f'{name}: {panel["task"]}'),
          f'`configs/{panel["config"]}.py`, {panel["layers"]} layers, '
          f'local layers (L) of {panel["window"]} keys; {panel["steps"]} '
          f'steps; seeds {panel["seeds"]}.', '',
          *_control(a['control'], models), *_equal_bytes(a, first),
          *_zadouri(a, first), *_families(a, first), *_main_effects(a),
          *_conversions(a, models, first),
          *_below_detectable(a), *_int8(a, models), *_frontier(a, models),
          '']


def _ci(d: dict, spec: str = '+.4f') -> str:
  return report.interval(d, spec)


def _control(c: dict | None, models: list[dict]) -> list[str]:
  if not c:
    return []
  acc, nll = c['diff']['accuracy'], c['diff']['nll']
  ref = next(m for m in models if m['variant'] == c['reference'])
  line = (
      f'**Negative control.** All-local {c["control"]} against all-global '
      f'{c["reference"]}: NLL {_ci(nll)}, answer accuracy '
      f'{_ci(acc, "+.3f")} (control minus reference). '
      + (f'The control is worse on NLL ({stats.decision(nll).words}): the '
         'setup sees attention.' if c['sees_attention'] else
         f'**The control is not worse on NLL ({stats.decision(nll).words}): '
         'the setup is blind to '
         'attention, and nothing below can be read as an effect of the '
         'cache.**'))
  if 'first' in ref['seeds']['float']:
    first = stats.mean(ref['seeds']['float']['first'])
    line += (
        f' The reference\'s first-query accuracy (retrieval by content '
        f'alone) is {first:.3f}: '
        + ('it retrieves by content.' if first.mean >= RETRIEVES else
           'it has not learnt retrieval by content at this budget; what '
           'separates it from the control is what reaching the pairs '
           'gives (the row\'s values, and crossing out those already '
           'asked for), which also needs the cache.'))
  return [line, '']


def _first(d: dict, first: bool) -> list[str]:
  """The first query's difference, as a cell, on the recall probe."""
  return [_ci(d['first'], '+.3f')] if first else []


def _equal_bytes(a: dict, first: bool) -> list[str]:
  if not a['equal_bytes']:
    return []
  mark = lambda d: (f' ({stats.decision(d).words})'
                    if stats.decide(d) == 'resolved' else '')
  return ['**Equal bytes** (layouts holding the same float bytes per '
          'token: GQA-2 with CLA2 minus MQA, and MLA, GLA or GTA at those '
          'bytes minus each; paired by seed, uncorrected; "detectable": '
          'the smallest NLL difference these seeds find with 80% power):',
          '', *report.table(
              ['pair', 'bytes/token', 'ΔNLL', 'Δaccuracy',
               *(['Δfirst query'] if first else []), 'detectable ΔNLL'],
              ([f'{e["a"]} − {e["b"]}',
                f'{e["kv_bytes_per_token"]["float"]:,.0f}',
                _ci(e['diff']['nll']) + mark(e['diff']['nll']),
                _ci(e['diff']['accuracy'], '+.3f'), *_first(e['diff'], first),
                f'{e["diff"]["nll"]["detectable"]:.4f}']
               for e in a['equal_bytes'])), '']


def _verdict(d: dict) -> str:
  """'verdict (detectable)' of an NLL difference."""
  return f'{stats.decision(d).words} ({d["detectable"]:.4f})'


def _zadouri(a: dict, first: bool) -> list[str]:
  if not a.get('same_heads'):
    return []
  return ['**Zadouri et al.\'s pairs** (GTA minus GQA with the same K/V '
          'heads, GLA minus MLA with the same latent; paired by seed, '
          'uncorrected):', '', *report.table(
              ['pair', 'bytes ratio', 'ΔNLL', 'ΔNLL verdict (detectable)',
               'Δaccuracy', *(['Δfirst query'] if first else [])],
              ([f'{e["a"]} − {e["b"]}', f'{e["bytes_ratio"]:.3f}',
                _ci(e['diff']['nll']), _verdict(e['diff']['nll']),
                _ci(e['diff']['accuracy'], '+.3f'), *_first(e['diff'], first)]
               for e in a['same_heads'])), '']


def _arms(e: dict, key: str, spec: str = ',') -> str:
  """'a vs b' of a family pair's two arms' KEY ('?' for a record written
  before it was kept)."""
  cell = lambda v: '?' if v is None else f'{v:{spec}}'
  return f'{cell(e[f"{key}_a"])} vs {cell(e[f"{key}_b"])}'


def _families(a: dict, first: bool) -> list[str]:
  """Each family fixed in the design (TPA's): its claim, then a row a pair:
  both arms' query heads, parameters and bytes, the NLL difference with
  Holm's decision and `stats.decision`'s words."""
  lines = []
  for f in a.get('families', []):
    if not f['pairs']:
      continue
    lines += [f'**{f["name"]}** (a minus b, paired by seed; the family '
              f'fixed in the design before any run, {holm_family(f["pairs"])}'
              f'; H0: no difference). {f["claim"]}', '', *report.table(
                  ['pair', 'query heads', 'parameters', 'bytes/token',
                   'ΔNLL', 'Holm', 'ΔNLL verdict (detectable)', 'Δaccuracy',
                   *(['Δfirst query'] if first else [])],
                  ([f'{e["a"]} − {e["b"]}', _arms(e, 'num_heads', 'd'),
                    _arms(e, 'params'),
                    f'{_arms(e, "bytes", ",.0f")} '
                    f'({e["bytes_a"] / e["bytes_b"]:.2f}x)',
                    _ci(e['diff']['nll']),
                    'rejects H0' if e['holm'] else 'does not reject H0',
                    f'{stats.decision(e["diff"]["nll"], rejected=e["holm"]).words} '
                    f'({e["diff"]["nll"]["detectable"]:.4f})',
                    _ci(e['diff']['accuracy'], '+.3f'),
                    *_first(e['diff'], first)]
                   for e in f['pairs'])), '']
  return lines


def _main_effects(a: dict) -> list[str]:
  if not a['main_effects']:
    return []
  family = len(a['main_effects'])
  return ['**Main effects** (per seed, the mean difference over every '
          'pair of models differing in that factor alone; '
          + (f'Holm over the family of {family} NLL effects; H0: no '
             'effect' if family > 1 else
             'a family of 1, uncorrected; H0: no effect') + '):', '',
          *report.table(
              ['factor', 'pairs', 'ΔNLL', 'Holm' if family > 1 else 'test',
               'ΔNLL verdict', 'Δaccuracy', 'detectable ΔNLL'],
              ([e['factor'], e['pairs'], _ci(e['nll']),
                'rejects H0' if e['holm'] else 'does not reject H0',
                stats.decision(e['nll'], rejected=e['holm']).words,
                _ci(e['accuracy'], '+.3f'), f'{e["nll"]["detectable"]:.4f}']
               for e in a['main_effects'])), '']


def _conversions(a: dict, models: list[dict], first: bool) -> list[str]:
  if not a.get('conversions'):
    return []
  nbytes = {m['variant']: m['kv_bytes_per_token']['float'] for m in models}
  return ['**Conversions into MLA** (`train.convert --to_mla`: the '
          "source's K/V projections factorised jointly by SVD into the "
          "latent; converted minus source, paired by seed, as converted "
          'and after the uptraining recipe\'s steps; no control for the '
          'source training as many more steps itself, and uncorrected):',
          '', *report.table(
              ['model', 'bytes/token', 'ΔNLL', 'ΔNLL verdict (detectable)',
               'Δaccuracy', *(['Δfirst query'] if first else [])],
              ([e['model'],
                f'{nbytes[e["source"]]:,.0f} → {nbytes[e["model"]]:,.0f}',
                _ci(e['diff']['nll']), _verdict(e['diff']['nll']),
                _ci(e['diff']['accuracy'], '+.3f'), *_first(e['diff'], first)]
               for e in a['conversions'])), '']


def _below_detectable(a: dict) -> list[str]:
  """The comparisons whose NLL difference is not resolved, and the smallest
  difference the seeds could have found."""
  unresolved = [(f'{e["a"]} − {e["b"]}', e['diff']['nll'], None)
                for e in a['equal_bytes']] + [
                    (e['factor'], e['nll'], e['holm'])
                    for e in a['main_effects']] + [
                        (f'{e["a"]} − {e["b"]}', e['diff']['nll'], e['holm'])
                        for f in a.get('families', []) for e in f['pairs']]
  unresolved = [(n, d, stats.decision(d, rejected=holm))
                for n, d, holm in unresolved]
  unresolved = [(n, d, w.words) for n, d, w in unresolved
                if w.verdict != 'resolved']
  if not unresolved:
    return []
  return ['The rest on NLL, with what the seeds reach: ' + '; '.join(
      f'{n} ({words}): the interval allows differences up to '
      f'{max(abs(d["low"]), abs(d["high"])):.4f}; these seeds detect '
      f'{d["detectable"]:.4f} with 80% power' for n, d, words in unresolved)
          + '.', '']


def _int8(a: dict, models: list[dict]) -> list[str]:
  deltas = {e['variant']: e for e in a['int8']}
  return ['**int8 cache** (int8 minus float, paired by seed, for every '
          'model; no training: the same weights read through the other '
          'cache):', '', *report.table(
              ['model', 'bytes/token float → int8', 'ΔNLL', 'KL (nats)',
               'Δaccuracy'],
              ([m['variant'],
                f'{m["kv_bytes_per_token"]["float"]:,.0f} → '
                f'{m["kv_bytes_per_token"]["int8"]:,.0f}',
                _ci(deltas[m['variant']]['delta']['nll'], '+.5f'),
                _ci(deltas[m['variant']]['kl'], '.2e'),
                _ci(deltas[m['variant']]['delta']['accuracy'], '+.4f')]
               for m in models))]


def _retrieving(first: list[float]) -> str:
  """'k/n': how many seeds retrieve by content (all or nothing: counted)."""
  return f'{sum(f >= RETRIEVES for f in first)}/{len(first)}'


def _frontier(a: dict, models: list[dict]) -> list[str]:
  """The frontier, and every point (each model through each cache) with
  its bytes and values over seeds, most bytes first."""
  on = set(a['frontier'])
  excluded = a.get('frontier_excludes')
  first = 'first' in models[0]['seeds']['float']
  rows = [[p['variant'], p['cache'], f'{p["kv_bytes_per_token"]:,.0f}',
           report.mean_sd(p['nll']), report.mean_sd(p['accuracy'], '.3f'),
           *([f'{report.mean_sd(p["first"], ".3f")} '
              f'({_retrieving(p["first"])})'] if first else []),
           'yes' if p['name'] in on else '']
          for p in sorted(analysis.points(models),
                          key=lambda p: -p['kv_bytes_per_token'])]
  return ['', '**Frontier** (a point whose NLL is lower, by '
          '`stats.decide`, than every point with fewer bytes, and not higher '
          'than any with as few; one not lower than a cheaper point is off '
          'it' + (
              f'; the negative control {excluded} is left out, as a '
              'control, not a design' if excluded else '') + '): '
          + ', '.join(a['frontier']) + '.', '', *report.table(
              ['model', 'cache', 'bytes/token', 'NLL (mean ± sd)', 'accuracy',
               *([f'first query (seeds ≥ {RETRIEVES})'] if first else []),
               'frontier'], rows)]
