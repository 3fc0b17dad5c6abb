"""The comparison's report.md, a function of results.json alone (so that
--report_only rebuilds it byte for byte), and `write`: results.json,
report.md and the plots."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from studies import report, stats, study, task_scores
from studies.compare import analysis, plots


def write(out: pathlib.Path, result: dict):
  """OUT/results.json (`analysis.analyse`d), OUT/report.md (`text`) and
  the plots (loss.png only where results.json holds the training
  curves)."""
  analysis.analyse(result)
  (out / 'results.json').write_text(study.to_json(result))
  (out / 'report.md').write_text(text(result))
  if has_curves(result):
    plots.loss(out / 'loss.png', result)
  plots.throughput(out / 'throughput.png', rows(result))


def rebuild(out: pathlib.Path, module: str):
  """--report_only: OUT/results.json's values as saved, read again by this
  commit (the rebuild recorded beside the command that measured, as
  `python -m MODULE ...`), and written (`write`)."""
  result = study.saved(out / 'results.json')
  report.record_rebuild(result['provenance'], module, out)
  write(out, result)


def has_curves(result) -> bool:
  return all('curve' in s for v in result['variants'] for s in v['seeds'])


def rows(result) -> list[dict]:
  """One row a variant (K): its size, its losses over seeds, its speeds."""
  found = []
  for v in sorted(result['variants'], key=lambda v: -v['K']):
    seeds = v['seeds']
    spread = lambda key: report.mean_sd([s.get(key, math.nan) for s in seeds],
                                        '.3f')
    found.append(dict(
        K=v['K'], params=v['params'], kv=v['kv_bytes_per_token'],
        mlp=v['mlp_dim'], loss=spread('eval_loss'), bpb=spread('eval_bpb'),
        accuracy=spread('eval_accuracy'),
        first=report.mean_sd([s.get('accuracy_by_query', [math.nan])[0]
                              for s in seeds], '.3f'),
        train=np.mean([s['train_tokens_per_sec'] for s in seeds]),
        decode=v['decode_tokens_per_sec'],
        roofline=v['decode_roofline_tokens_per_sec']))
  return found


def reading(rows_, found, control=None) -> str:
  """What the negative control shows, each paired difference with
  `stats.decision`'s words, then decoding; from the numbers."""
  parts = ['Negative control (a model without context): ' + (
      f'{control["reading"]}.' if control else
      'left out (--no_control, or one seed): nothing shows that these '
      'seeds can '
      'see what attention does.')]
  if found:
    est = [stats.as_estimate(c['difference']) for c in found]
    parts.append(
        f'Each variant minus K={found[0]["reference_K"]}, by studies/'
        'stats.py\'s rule: ' + '; '.join(
            f'K={c["K"]} {d.mean:+.3f} nats, {stats.decision(d).words}'
            + (f' (detectable: {c["detectable"]:.3f})' if d.n > 1 else '')
            for c, d in zip(found, est)) + '.'
        + ('' if est[0].n > 1 else ' Rerun with --seeds=3 or more.'))
  if len(rows_) > 1:
    fastest = max(rows_, key=lambda r: r['decode'])
    slowest = min(rows_, key=lambda r: r['decode'])
    parts.append(f'Decoding is fastest with K={fastest["K"]}, '
                 f'{fastest["decode"] / slowest["decode"]:.1f}x '
                 f'K={slowest["K"]}.')
  return ' '.join(parts)


def made(prov: dict) -> str:
  """Where the runs were trained (each run's record, `runs`, or the
  sentence an older results.json saved, `trained`) and where results.json
  was written (the decode timed), as results.json records them, and its
  note."""
  where = report.command_at(prov)
  trained = (study.describe_runs(prov['runs']) if prov.get('runs')
             else prov.get('trained'))
  return ((f'Runs trained by {trained}; decode timed and '
           f'results.json written by {where}.' if trained else
           f'Made by {where}.')
          + (f' {prov["note"]}' if prov.get('note') else ''))


def _settings_line(result) -> str:
  s, d = result.get('settings'), result['decode']
  decode = (f'Decode: batch {d["batch"]}, context {d["context"]}, the cache '
            'updated in place as train.sample runs it (studies/timing.py); '
            f'read bandwidth {d["read_bandwidth"] / 1e9:.1f} GB/s. Every '
            'value by seed, and the comparisons: results.json.')
  if not s:
    return ('Settings (layers, width, heads, steps, batch, sequence length, '
            'compute dtype, data): not in this results.json (written before '
            'scripts.compare saved them); the command above names them. '
            + decode)
  return (f'{s["num_layers"]} layers, d_model {s["d_model"]}, '
          f'{s["num_heads"]} query heads of {s["head_dim"]}; '
          f'{s["steps"]} steps of {s["batch_size"]} x {s["seq_len"]} '
          f'tokens each, {s["seeds"]} seed(s) per variant'
          + (', MLP widened to equal parameters' if s['equal_params'] else '')
          + f'. Compute dtype {s["dtype"]}. ' + decode
          + (f' {s["note"]}' if s.get('note') else ''))


def _data_line(s) -> str:
  if not s:
    return ('Data: not in this results.json (written before scripts.compare '
            'saved its settings).')
  if s['task'] == 'recall':
    return (f'Data: the recall probe, {s["recall_pairs"]} key-value pairs '
            'per row; accuracy counts the answers only.')
  return (f'Data: {s["data_path"] or "the embedded stdlib corpus"} '
          f'({s["unit"]}s; every loss is nats per {s["unit"]}).')


def _variants_table(result, recall: bool) -> list[str]:
  """One row a variant: size, losses, speeds (and first-query accuracy on
  the recall probe)."""
  head = ['num_kv_heads', 'params', 'mlp_dim', 'KV bytes/token',
          'held-out loss (nats)', 'bits/byte', 'next-token accuracy',
          *(['first-query accuracy'] if recall else []), 'train tok/s',
          'decode tok/s', 'decode roofline tok/s']
  return report.table(head, (
      [r['K'], f'{r["params"]:,}', r['mlp'], f'{r["kv"]:,.0f}', r['loss'],
       r['bpb'], r['accuracy'], *([r['first']] if recall else []),
       f'{r["train"]:,.0f}', f'{r["decode"]:,.0f}', f'{r["roofline"]:,.0f}']
      for r in rows(result)))


def text(result: dict) -> str:
  """report.md: a function of results.json alone (`analysis.analyse`d), so
  that --report_only rebuilds it identically."""
  prov, s = result['provenance'], result.get('settings')
  recall = bool(s) and s['task'] == 'recall'
  lines = [
      '# Comparing MHA, GQA and MQA', '', made(prov), '',
      *report.rebuilt_lines(prov, 'results.json'),
      _settings_line(result), '',
      reading(rows(result), result['comparisons'], result.get('control')),
      '', _data_line(s), '', f'Statistics: {stats.CONVENTION}', '',
      *_variants_table(result, recall),
      '', *_paired_lines(result), *_control_lines(result['control']),
      *_aa_lines(result['aa']), *_task_lines(result)]
  if recall:  # Later queries can be guessed by crossing out; not the first.
    lines += ['', 'Answer accuracy by query (1st ... last):', '']
    for v in sorted(result['variants'], key=lambda v: -v['K']):
      by_query = np.mean([s['accuracy_by_query'] for s in v['seeds']], axis=0)
      lines.append(f'- K={v["K"]}: ' + ' '.join(f'{a:.2f}' for a in by_query))
  if not has_curves(result):
    lines += ['', 'Training curves: not in this results.json (written before '
              'scripts.compare saved them), so --report_only does not draw '
              'loss.png; the loss.png beside this report was drawn from the '
              'run folders by the command that wrote results.json.']
  return report.document(lines + [
      '', report.figure('loss', 'loss.png'), '',
      report.figure('throughput', 'throughput.png'), ''])


def _paired_lines(result) -> list[str]:
  """Held-out loss by seed, and each variant minus the reference: the
  paired mean with its interval, the detectable difference, the verdict."""
  found = result['comparisons']
  if not found:
    return []
  losses = analysis.losses_of(result)
  kvs = sorted(losses, reverse=True)
  seeds = sorted({seed for by_seed in losses.values() for seed in by_seed})
  reference = found[0]['reference_K']
  s = result.get('settings') or {}
  lines = ['Held-out loss (nats) by seed:', '', *report.table(
      ['seed', *(f'K={K}' for K in kvs)],
      ([seed, *(f'{losses[K][seed]:.4f}' if seed in losses[K] else '-'
                for K in kvs)] for seed in seeds))]
  shazeer = not s.get('equal_params', True) and reference == kvs[0]
  lines += ['', f'Paired by seed (a seed fixes the data order), each variant '
            f'minus K={reference} (positive: worse than it); verdicts '
            'against the papers only where the seeds can tell'
            + (' (Shazeer compared at equal parameters: --equal_params)'
               if shazeer else '') + ':', '']
  rows_ = []
  for c in found:
    d = stats.as_estimate(c['difference'])
    rows_.append([c['K'], f'{d:+.4f}', f'{d.sd:.4f}' if d.n > 1 else '-',
                  report.number(c['detectable']), c['verdict']])
  return lines + report.table(['K', 'difference (nats) [95% interval]',
                               'sd of differences', 'detectable', 'verdict'],
                              rows_)


def _aa_lines(aa) -> list[str]:
  """The A/A control's paired difference and what its sd says."""
  if not aa:
    return []
  d = stats.as_estimate(aa['difference'])
  return ['', f'A/A control: K={aa["K"]} again, the same seeds, its K/V '
          'projections initialised from another seed (held-out loss by '
          'seed: ' + ', '.join(f'{a:.4f}' for a in aa['losses'])
          + f'), minus K={aa["K"]}: {d:+.4f}, sd {d.sd:.4f}, detectable '
          + report.number(aa['detectable']) + f'. Reading: {aa["reading"]}.']


def _control_lines(control) -> list[str]:
  """The negative control's paired difference, as the variants' are."""
  if not control:
    return []
  d = stats.as_estimate(control['difference'])
  seeds = ', '.join(f'{a:.4f}' for a in control['losses'])
  return ['', f'Negative control: K={control["K"]} with every layer '
          'attending to its own token only (a window of 1 key: no '
          f'context), the same seeds (held-out loss by seed: {seeds}), '
          f'minus K={control["K"]}:', '', *report.table(
              ['arm', 'difference (nats) [95% interval]', 'sd of differences',
               'detectable', 'reading'],
              [['no context', f'{d:+.4f}', f'{d.sd:.4f}' if d.n > 1 else '-',
                report.number(control['detectable']),
                control['reading']]])]


def _task_lines(result) -> list[str]:
  """The task scores' tables (--tasks), beside held-out loss."""
  if 'tasks' not in result:
    return []
  tasks = result['tasks']
  arms, reference = analysis.task_arms(result)
  return ['', *report.section('Task scores (lm-evaluation-harness)', 3),
          f'Each run\'s final checkpoint scored on '
          f'{", ".join(tasks["settings"]["tasks"])} as '
          '`python -m evaluation.evaluate` scores a workdir (lm_eval\'s '
          '`gqa-lab` model; each command in tasks/K*_s*/results.json), '
          'documents a task: ' + ', '.join(
              f'{t} {n}' for t, n in tasks['documents'].items())
          + '. Intervals are over seeds (what training varies), not over '
          'documents (lm_eval\'s stderr, in those results.json).', '',
          *task_scores.lines(arms, reference, tasks['higher_is_better'])]
