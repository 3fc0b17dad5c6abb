"""The recall sweep: the recall probe trained for every num_kv_heads K
against the head dimension H (`python -m scripts.recall_sweep`, whose
docstring is the study's manual). Each cell's seeds are trained by
`train.main`'s loop (`studies.study.train`), stopped once every query is
answered; their first-query accuracy (retrieval alone) is read, and each K
is compared with the most K/V heads, paired by seed on whether the seed
learnt retrieval (all or nothing: counted). report.md is a function of
sweep.json alone, so --report_only rebuilds it byte for byte."""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time

import jax
import numpy as np

from infra import progress, provenance
from infra.errors import UserError
from lm import config_lib, data
from lm import model as model_lib
from lm.model import Transformer
from studies import report, stats, study

COMMAND = 'scripts.recall_sweep'  # The entry point, as provenance names it.
SOLVED = 0.99  # Every query at least this: the run stops.
REACHED = 0.95  # First-query accuracy counted as "learned" for the step count.
EVAL_ROWS = 512


def cell_config(base: str, K: int, H: int, seed: int, steps: int,
                d_model: int | None, eval_every: int):
  config = config_lib.load(base)
  config.model.update(num_kv_heads=K, head_dim=H)
  if d_model:
    config.model.update(d_model=d_model, mlp_dim=2 * d_model)
  config.seed = seed
  # A constant learning rate after warmup: the step budget does not change
  # the schedule, so a longer sweep only adds steps to the same runs.
  config.train.update(steps=steps, checkpoint_every=steps,
                      min_learning_rate_ratio=1.0, eval_every=eval_every,
                      warmup_steps=min(config.train.warmup_steps, steps // 4))
  return config


def run_dir(out: pathlib.Path, config) -> pathlib.Path:
  m = config.model
  return out / 'runs' / f'K{m.num_kv_heads}_H{m.head_dim}_s{config.seed}'


def _write_json(path: pathlib.Path, value):
  """Written whole or not at all: a kill leaves the previous version."""
  temporary = path.with_suffix('.tmp')
  temporary.write_text(json.dumps(value))
  os.replace(temporary, path)


def train_cell(configs, out: pathlib.Path, say=print) -> list[dict]:
  """Trains each config (one cell: the seeds of one K and H) with
  `train.main`'s loop in its run_dir, each until it answers every query or
  runs out of steps (a finished run of the same settings is reused);
  returns per seed its history of held-out accuracy by query."""
  mc = config_lib.model_config(configs[0])
  model = Transformer(mc)
  dc = configs[0].data
  task = data.load('', val_fraction=0.0, seq_len=dc.seq_len, task='recall',
                   recall_pairs=dc.recall_pairs, recall_gap=dc.recall_gap,
                   vocab_size=mc.vocab_size)
  predict = jax.jit(lambda params, tokens: model.apply(
      {'params': params}, tokens).argmax(-1))
  held_out = task.batch('val', seed=0, step=0, batch_size=EVAL_ROWS,
                        seq_len=dc.seq_len, stream=1)
  results = []
  for config in configs:
    workdir = run_dir(out, config)
    saved = workdir / 'history.json'
    # Evaluations of an earlier, interrupted attempt: those after the step it
    # resumes from are dropped as this one evaluates them again.
    history = json.loads(saved.read_text()) if saved.exists() else []
    start = time.perf_counter()

    def on_eval(step, params, record, history=history, saved=saved):
      by_query = task.accuracy_by_query(predict(params, held_out[:, :-1]),
                                        held_out)
      history[:] = [h for h in history if h['step'] < step]
      history.append(dict(step=step, loss=record['loss'],
                          first=float(by_query[0]),
                          mean=float(by_query.mean()),
                          by_query=by_query.round(4).tolist()))
      _write_json(saved, history)  # Before final.json: a reuse finds it.
      return by_query.min() >= SOLVED

    reused = study.finished(workdir)
    study.train(config, workdir, workdir / 'log.txt', on_eval=on_eval)
    if not history:
      raise UserError(f'{workdir} holds a finished run without its '
                      f'history.json; delete {workdir} to train it again')
    last = history[-1]
    reached = next((h['step'] for h in history if h['first'] >= REACHED), None)
    results.append(dict(seed=config.seed, steps=last['step'], reused=reused,
                        seconds=None if reused else
                        time.perf_counter() - start,
                        first=last['first'], mean=last['mean'],
                        by_query=last['by_query'], reached=reached,
                        history=history))
    say(f'K={mc.num_kv_heads} H={mc.head_dim} seed={config.seed}: '
        f'first-query accuracy {last["first"]:.3f} (all queries '
        f'{last["mean"]:.3f}) after {last["step"]} steps, '
        + ('reused from an earlier run' if reused else
           f'{results[-1]["seconds"]:.0f} s'), flush=True)
  return results


def learning_curve(runs) -> tuple[list[int], list[float]]:
  """Steps and the seeds' mean first-query accuracy at each evaluation; a run
  stopped early (solved) keeps its last accuracy."""
  longest = max(runs, key=lambda r: len(r['history']))['history']
  steps = [h['step'] for h in longest]
  at = lambda run, i: run['history'][min(i, len(run['history']) - 1)]['first']
  return steps, [float(np.mean([at(r, i) for r in runs]))
                 for i in range(len(steps))]


def _first(cell: dict) -> list[float]:
  """A cell's first-query accuracy, one a seed."""
  return [r['first'] for r in cell['runs']]


def learnt(run: dict) -> int:
  """1 if the run reached REACHED on the first query (it learnt retrieval),
  else 0: all or nothing, so a cell's seeds are counted."""
  return int(run['reached'] is not None)


def comparisons(cell, kvs, dims) -> list[dict]:
  """At each head size H, each K against the most K/V heads (kvs[0]),
  paired by seed (the same seed: the same data order) on `learnt`: the
  counts, the paired difference of the 0/1 outcomes (a `stats.Estimate`),
  what the seeds detect, and `stats.decision`'s words."""
  found = []
  for H in dims:
    base = {r['seed']: learnt(r) for r in cell[kvs[0], H]['runs']}
    for K in kvs[1:]:
      mine = {r['seed']: learnt(r) for r in cell[K, H]['runs']}
      seeds = sorted(mine.keys() & base.keys())
      d = stats.paired([mine[s] for s in seeds], [base[s] for s in seeds])
      found.append(dict(H=H, K=K, reference=kvs[0], seeds=seeds,
                        learnt=sum(mine[s] for s in seeds),
                        reference_learnt=sum(base[s] for s in seeds),
                        difference=d,
                        detectable=stats.detectable(d.sd, d.n),
                        verdict=stats.decision(d).words))
  return found


def _reading(cell, kvs, dims) -> str:
  """The table's range, then what the paired counts let it say: every
  verdict `stats.decide`'s."""
  means = {key: np.mean(_first(c)) for key, c in cell.items()}
  (K_lo, H_lo), (K_hi, H_hi) = (min(means, key=means.get),
                                max(means, key=means.get))
  by_h = ', '.join(f'H={H}: {min(means[K, H] for K in kvs):.2f}-'
                   f'{max(means[K, H] for K in kvs):.2f}' for H in dims)
  text = (f'First-query accuracy runs from {means[K_lo, H_lo]:.2f} '
          f'(K={K_lo}, H={H_lo}) to {means[K_hi, H_hi]:.2f} (K={K_hi}, '
          f'H={H_hi}); over K at each head size, {by_h}.')
  found = comparisons(cell, kvs, dims)
  if not found:
    return text + ' One K: nothing to compare.'
  resolved = [c for c in found if stats.decide(c['difference']) == 'resolved']
  return text + (
      f' Against K={kvs[0]}, paired by seed on whether each seed learnt '
      'retrieval (the table below): ' + (
          '; '.join(f'K={c["K"]} at H={c["H"]} '
                    f'{"more" if c["difference"].mean > 0 else "fewer"} '
                    f'seeds learnt ({c["verdict"]})' for c in resolved)
          + '; no other difference is claimed.' if resolved else
          'no difference of K is claimed at any head size (' + ', '.join(
              f'{sum(c["verdict"] == v for c in found)} {v}'
              for v in dict.fromkeys(c['verdict'] for c in found))
          + '): an effect of K smaller than what these seeds detect is '
          'not excluded.'))


def _comparison_lines(cell, kvs, dims) -> list[str]:
  """The paired counts' table, one row a (H, K)."""
  found = comparisons(cell, kvs, dims)
  if not found:
    return []
  rows = []
  for c in found:
    d, n = c['difference'], len(c['seeds'])
    rows.append([c['H'], c['K'],
                 f'{c["learnt"]}/{n} / {c["reference_learnt"]}/{n}',
                 f'{d:+.2f}', report.number(c['detectable'], '.2f'),
                 c['verdict']])
  return ['', f'Each K against K={kvs[0]} at each head size, paired by seed '
          f'on whether the seed learnt retrieval (first-query accuracy ≥ '
          f'{REACHED}: 1, else 0; all or nothing, so counted k of n): the '
          'difference of the two arms\' outcomes over seeds, its 95% '
          'interval, the smallest difference these seeds detect and '
          '`stats.decision`\'s words.', '', *report.table(
              ['head_dim H', 'K', f'learnt (K / K={kvs[0]})',
               'difference [95% interval]', 'detectable', 'verdict'], rows)]


def _accuracy_table(cell, kvs, dims) -> list[str]:
  """First-query accuracy per (H, K), its seeds that learnt and their
  median step; the KV bytes per token in the last row."""
  rows = []
  for H in dims:
    row = [H]
    for K in kvs:
      runs = cell[K, H]['runs']
      reached = [r['reached'] for r in runs if r['reached'] is not None]
      median = f', step {int(np.median(reached))}' if reached else ''
      row.append(f'{report.mean_sd(_first(cell[K, H]), ".2f")} '
                 f'({len(reached)}/{len(runs)}{median})')
    rows.append(row)
  rows.append(['KV bytes/token at H=' + ', '.join(map(str, dims))] + [
      ', '.join(f'{cell[K, H]["kv_bytes"]:,.0f}' for H in dims) for K in kvs])
  return report.table(['head_dim H', *(f'K={K}' for K in kvs)], rows)


def report_lines(cell, kvs, dims, meta) -> list[str]:
  """report.md's lines: a function of sweep.json (CELL, META) alone."""
  return [
      '# Recall against num_kv_heads', '',
      f'Made by `python -m {COMMAND} {" ".join(meta["argv"])}`: '
      f'{meta["description"]}; {meta["model"]}. At most {meta["steps"]} '
      f'steps of {meta["batch_size"]} rows per run (stopped once every query '
      f'is at ≥ {SOLVED}), {meta["seeds"]} seeds per cell, '
      f'{meta["minutes"]:.1f} minutes in all'
      + (f'; commit {meta["provenance"]["commit"]} on '
         f'{report.machine(meta["provenance"])}' if 'provenance' in meta else
         '; the run recorded neither its commit nor its machine')
      + '.' + (f' {meta["note"]}' if meta.get('note') else ''),
      '', *report.rebuilt_lines(meta, 'sweep.json'),
      f'Statistics: {stats.CONVENTION}', '',
      _reading(cell, kvs, dims), '',
      'First-query accuracy (retrieval alone; chance 1/P = '
      f'{1 / meta["pairs"]:.3f}), mean ± sd over seeds; in brackets how '
      f'many seeds reached {REACHED} on it, and their median step. KV cache '
      'bytes per token (float32, all layers) in the last row.', '',
      *_accuracy_table(cell, kvs, dims), *_comparison_lines(cell, kvs, dims),
      '', report.figure('recall', 'recall.png'), '']


def write_report(out: pathlib.Path, cells: list[dict], meta: dict):
  """OUT/report.md (`report_lines`) and recall.png."""
  kvs = sorted({c['K'] for c in cells}, reverse=True)
  dims = sorted({c['H'] for c in cells}, reverse=True)
  cell = {(c['K'], c['H']): c for c in cells}
  (out / 'report.md').write_text(report.document(
      report_lines(cell, kvs, dims, meta)))
  _plot(out / 'recall.png', cell, kvs, dims)


def rebuild(out: pathlib.Path):
  """--report_only: the runs as OUT/sweep.json saved them; the statistics
  and the reading as this commit makes them, the rebuild recorded beside
  the run (meta)."""
  sweep = study.saved(out / 'sweep.json')
  report.record_rebuild(sweep['meta'], COMMAND, out)
  (out / 'sweep.json').write_text(study.to_json(sweep))
  write_report(out, sweep['cells'], sweep['meta'])


def _plot(path, cell, kvs, dims):
  """Accuracy by (K, H), against KV bytes (error bars: the seeds' sd,
  clipped to [0, 1]), and learning curves."""
  plt = report.pyplot()
  fig, (heat, curves, learning) = plt.subplots(1, 3, figsize=(16, 4))
  means = np.array([[np.mean(_first(cell[K, H])) for K in kvs] for H in dims])
  image = heat.imshow(means, vmin=0, vmax=1, cmap='viridis')
  for i in range(len(dims)):
    for j in range(len(kvs)):
      heat.text(j, i, f'{means[i, j]:.2f}', ha='center', va='center',
                color='w' if means[i, j] < 0.6 else 'k')
  heat.set(xticks=range(len(kvs)), xticklabels=[f'K={K}' for K in kvs],
           yticks=range(len(dims)), yticklabels=[f'H={H}' for H in dims],
           title='first-query accuracy (mean over seeds)')
  fig.colorbar(image, ax=heat)
  for i, H in enumerate(dims):
    kv_bytes = [cell[K, H]['kv_bytes'] for K in kvs]
    mean = np.array([np.mean(_first(cell[K, H])) for K in kvs])
    sd = np.array([np.std(_first(cell[K, H]), ddof=1) if len(
        cell[K, H]['runs']) > 1 else 0.0 for K in kvs])
    curves.errorbar(kv_bytes, mean, fmt='o-', color=f'C{i}', capsize=3,
                    label=f'H={H}', yerr=[np.minimum(sd, mean),
                                          np.minimum(sd, 1 - mean)])
  all_bytes = sorted({c['kv_bytes'] for c in cell.values()})
  curves.set(xscale='log',
             xlabel='KV cache bytes per token (float32, all layers)',
             ylabel='first-query accuracy', ylim=(0, 1.05),
             title='accuracy against KV memory')
  curves.set_xticks(all_bytes, [f'{b:,}' for b in all_bytes])
  curves.minorticks_off()
  curves.legend()
  for i, K in enumerate(kvs):
    for H, style in zip(dims, ('-', '--', ':', '-.') * len(dims)):
      steps, mean = learning_curve(cell[K, H]['runs'])
      learning.plot(steps, mean, style, color=f'C{i}', label=f'K={K} H={H}')
  learning.set(xlabel='step', ylabel='first-query accuracy (mean of seeds)',
               ylim=(0, 1.05), title='learning curves')
  learning.legend(fontsize=7, ncol=2)
  report.save(fig, path)


def plan(args) -> dict[tuple[int, int], list]:
  """{(K, H): one config a seed} of the cells the flags ask for, each
  refused, if bad, before any trains."""
  base = config_lib.load(args.config)
  if base.data.task != 'recall':
    raise UserError(f"--config={args.config} trains data.task="
                    f"'{base.data.task}'; the sweep needs a recall config "
                    '(--config=recall)')
  N = base.model.num_heads
  kvs = args.kv_heads or sorted({N, max(N // 2, 1), max(N // 4, 1), 1},
                                reverse=True)
  dims = args.head_dims or ([16] if args.quick else [16, 8])
  steps = args.steps or (500 if args.quick else 1200)
  if args.d_model < 0:
    raise UserError(f'--d_model={args.d_model}; use a width >= 1, or 0 for '
                    "the config's")
  configs = {(K, H): [cell_config(args.config, K, H, s, steps, args.d_model,
                                  min(args.eval_every, steps))
                      for s in range(args.seeds)] for K in kvs for H in dims}
  for cell in configs.values():
    for config in cell:
      config_lib.validate(config, batch_shards=1)
      study.check_reusable(config, run_dir(pathlib.Path(args.out), config))
  return configs


def run(args) -> dict:
  """Every cell the flags ask for (`plan`) trained (or reused), then
  OUT/sweep.json (the runs, the settings and provenance: `meta`),
  report.md and recall.png. Returns meta."""
  configs = plan(args)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  # The commit as the command starts: the code that runs.
  prov = provenance.record(COMMAND, out, statistics=stats.CONVENTION)
  start, cells = time.perf_counter(), []
  for (K, H), cell in progress.runs(
      list(configs.items()), lambda c: f'cell K={c[0][0]} H={c[0][1]}, '
      f'{len(c[1])} seed(s)', reused=lambda c: all(
          study.finished(run_dir(out, config)) for config in c[1])):
    mc = config_lib.model_config(cell[0])
    cells.append(dict(K=K, H=H, runs=train_cell(cell, out),
                      kv_bytes=model_lib.kv_bytes_per_token(mc)))
  c = next(iter(configs.values()))[0]
  m = c.model
  meta = dict(argv=sys.argv[1:], provenance=provenance.ended(prov),
              minutes=(time.perf_counter() - start) / 60,
              description=task_description(c), pairs=c.data.recall_pairs,
              model=(f'{m.num_layers} layers, d_model {m.d_model}, MLP '
                     f'{m.mlp_dim}, {m.num_heads} query heads'),
              steps=c.train.steps, batch_size=c.train.batch_size,
              seeds=args.seeds)
  (out / 'sweep.json').write_text(study.to_json(dict(meta=meta, cells=cells)))
  write_report(out, cells, meta)
  return meta


def task_description(config) -> str:
  return data.load('', val_fraction=0.0, seq_len=config.data.seq_len,
                   task='recall', recall_pairs=config.data.recall_pairs,
                   recall_gap=config.data.recall_gap,
                   vocab_size=config.model.vocab_size).description
