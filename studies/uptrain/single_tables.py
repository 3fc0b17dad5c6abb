"""The single-source design's report.md, a function of results.json alone
(the summary recomputed, the provenance as saved: --report_only rebuilds
it byte for byte): where the runs were trained, the reading
(`single_reading`), the plots, the tables, the task scores; and `write`."""

from __future__ import annotations

import pathlib

import numpy as np

from studies import report, stats, task_scores
from studies.uptrain import single_plots
from studies.uptrain.common import detectable, estimate, made
from studies.uptrain.single_reading import reading
from studies.uptrain.single_summary import (UP_METHODS, losses, scratch_curve,
                                            summary, task_arms)
from train.convert import to_mla


def text(results: dict) -> str:
  """report.md: a function of results.json alone (the summary recomputed,
  the provenance as saved), so that --report_only rebuilds it identically."""
  summ = summary(results)
  prov, plan = results['provenance'], results['lm']['plan']
  return report.document([
      '# Uptraining MHA to GQA/MQA (Ainslie et al. 2023): claims as the '
      'paper states them, with controls', '',
      made(prov), '', f'LM source {plan["steps"]} steps; targets K = '
      f'{", ".join(map(str, plan["kv_heads"]))}; seeds '
      f'{", ".join(map(str, plan["seeds"]))}; uptraining evaluated at α = '
      + ', '.join(f'{s / plan["steps"]:g}' for s in plan['alpha_steps'])
      + ' of the source\'s steps, one run per (conversion, seed). '
      + prov['statistics'], '', *report.section('Reading'),
      *reading(results, summ), '',
      report.figure('uptraining curves', 'curves.png'), '',
      report.figure('scratch-equivalent steps', 'compute.png'), '',
      report.figure('recall arm', 'recall.png'), '',
      *report.section('Tables'), *tables(results, summ), '',
      *task_lines(results), ''])


def write(out: pathlib.Path, results: dict):
  """OUT/report.md and its plots; prints the reading."""
  text_ = text(results)
  (out / 'report.md').write_text(text_)
  summ = summary(results)
  single_plots.curves(out, results)
  single_plots.compute(out, results, summ)
  single_plots.recall(out, results)
  print(text_[:text_.index('![uptraining curves](curves.png)')])
  print(f'wrote {out / "report.md"}, curves.png, compute.png, recall.png')


def _alpha_head(plan: dict) -> list[str]:
  """The head of a table by alpha: the conversion (0), then each read."""
  S = plan['steps']
  return ['', 'α=0', *(f'α={s / S:g} ({s})' for s in plan['alpha_steps'])]


def _by_K(results: dict, summ: dict, K: int) -> list[str]:
  """MHA -> K: each conversion's held-out loss by alpha, the claimed
  orderings' paired differences, and the scratch-equivalent steps."""
  lm, plan = results['lm'], results['lm']['plan']
  N, S = plan['num_heads'], plan['steps']
  rows = []
  for method, start in [*((m, 'fresh') for m in UP_METHODS),
                        ('identity', 'pooled'), ('mean', 'pooled')]:
    k = N if method == 'identity' else K
    x = losses(lm, method, k, start)
    rows.append([f'{method}{" (control)" if k == N else ""}, {start} Adam',
                 *(report.interval(stats.mean(x[:, i]), '.4f')
                   for i in range(x.shape[1]))])
  return [
      *report.section(f'MHA → K = {K}: held-out loss, mean [95% interval] '
                      'over seeds', 3),
      *report.table(_alpha_head(plan), rows), '',
      f'Paired differences (negative: the first is better), K = {K}:', '',
      *report.table(_alpha_head(plan), (
          [name.replace('-', ' − '), *map(estimate, est)]
          for name, est in summ['ranking_by_alpha'][K].items())), '',
      f'Scratch-equivalent steps of mean-pooled K = {K} (each seed on its '
      'own K-from-scratch curve) and the cost advantage E / uptraining '
      'steps:', '', *report.table(
          ['α (steps)', 'E per seed', 'E', 'advantage', 'ρ'],
          ([f'{r["alpha_steps"] / S:g} ({r["alpha_steps"]})',
            ', '.join(f'{e:.0f}' for e in r['E']),
            estimate(r['equivalent'], '.0f'), estimate(r['advantage'], '.2f'),
            estimate(r['retained'], '.3f')] for r in summ['compute'][K])),
      '']


def tables(results: dict, summ: dict) -> list[str]:
  lm, plan = results['lm'], results['lm']['plan']
  N, S = plan['num_heads'], plan['steps']
  lines = [line for K in plan['kv_heads'] for line in _by_K(results, summ, K)]
  scratch = []
  for K in [N, *plan['kv_heads']]:
    steps, curves = scratch_curve(lm, K)
    at_s = int(np.argmin(np.abs(steps - S)))
    scratch.append([f'{K}{" (MHA)" if K == N else ""}',
                    ', '.join(f'{v:.4f}' for v in curves[:, at_s]),
                    ', '.join(f'{v:.4f}' for v in curves[:, -1])])
  steps = lambda c: ', '.join('—' if s is None else str(s)
                              for s in c['steps'])
  recall = summ['recall']
  return lines + [
      *report.section('From scratch: held-out loss per seed', 3),
      *report.table(['K', f'step {S}', 'step '
                     f'{summ["gap"][plan["kv_heads"][0]]["end_step"]}'],
                    scratch), '',
      *report.section('Recall arm: steps to accuracy ≥ '
                      f'{recall["target"]} per seed (— : not within the '
                      'budget)', 3),
      *report.table(['arm', 'k of n', 'steps per seed'], [
          *([f'{name.replace("_", " ")} uptrained', f'{c["k"]} of {c["n"]}',
             steps(c)] for name, c in recall['arms'].items()),
          *([f'K={K} from scratch', f'{c["k"]} of {c["n"]}', steps(c)]
            for K, c in recall['scratch'].items())]),
      *_mla_tables(results, summ)]


def _mla_tables(results: dict, summ: dict) -> list[str]:
  """Per K: MLA and mean-pooled GQA at equal cache bytes by alpha, their
  paired difference, MLA's scratch-equivalent steps on GQA-K's curve."""
  if 'mla' not in summ:
    return []
  plan = results['lm']['plan']
  lines = []
  for K, r in summ['mla']['by_K'].items():
    c = r['conversion']
    latent = to_mla.latent(c)
    lines += [
        '', *report.section(
            f'MHA → MLA at K = {K}\'s cache bytes (kv_lora_rank '
            f'{latent.width} + {latent.rope} RoPE dims, '
            f'{c["kv_bytes_per_token"]:g} bytes/token) against MHA → '
            f'mean-pooled K = {K} ({c["gqa_kv_bytes_per_token"]:g}), fresh '
            'Adam: held-out loss, mean [95% interval]', 3),
        *report.table(_alpha_head(plan), [
            ['MLA', *(estimate(e, '.4f') for e in r['mla'])],
            [f'mean-pooled GQA K={K}', *(estimate(e, '.4f')
                                         for e in r['gqa'])],
            ['MLA − GQA (paired)', *map(estimate, r['minus_gqa'])],
            ['its detectable difference', *(
                detectable(e).removeprefix('detectable ')
                for e in r['minus_gqa'])],
            [f'E of MLA on GQA K={K} from scratch', '—', *(
                estimate(row['equivalent'], '.0f') for row in r['compute'])]])]
  return lines


# --- task scores (--tasks) ---------------------------------------------------

REPLAY_EQUAL = 1e-3  # nats: a replay this close is the run's state.


def task_lines(results: dict) -> list[str]:
  """The report's task scores (--tasks): what was scored, the source's
  scores, and per table each arm by seed and paired against its
  reference."""
  lm = results['lm']
  if 'tasks' not in lm:
    return []
  tasks = lm['tasks']
  replays = [r for r in tasks['runs'] if 'replay_loss' in r]
  worst = max((abs(r['replay_loss'] - r['run_loss']) for r in replays),
              default=0.0)
  lines = [
      *report.section('Task scores (lm-evaluation-harness)'),
      'Scored as `python -m evaluation.evaluate` scores a workdir (lm_eval\'s '
      '`gqa-lab` model; each command in tasks/**/results.json) on '
      + ', '.join(f'{t} ({n} documents)' for t, n in
                  tasks['documents'].items())
      + ': the source (seed 0), each fresh-Adam conversion (the identity '
      'control, mean, first, random) at the paper\'s α and at the '
      'largest, and MHA and each K from scratch at their end; per seed. '
      'The pooled-Adam arms are not scored (their question, the optimizer '
      'start, is read on held-out loss). An uptraining run keeps only its '
      'last checkpoint, so the paper\'s α is a replay of the run ended '
      f'there: its held-out loss differs from the run\'s by at most '
      f'{worst:.1e} nats' + (
          ' (**not** the run\'s state: read its scores as a rerun\'s)'
          if worst > REPLAY_EQUAL else '') + '. Intervals are over seeds '
      '(what training varies), not over documents (lm_eval\'s stderr, in '
      'those results.json).', '',
      'The source: ' + '; '.join(
          f'{task} {metric} {value:.4g}'
          for task, metrics in tasks['source'].items()
          for metric, value in metrics.items()) + '.']
  for title, (arms, reference) in task_arms(lm).items():
    lines += ['', *report.section(title, 3),
              *task_scores.lines(arms, reference, tasks['higher_is_better'])]
  return lines
