"""Trains MHA, GQA and MQA on the same data and budget, and writes a report.

  python -m scripts.compare --out=out/compare [--quick] [--kv_heads=8,2,1]
      [--seeds=1] [--equal_params] [--steps=N] [--config=gqa_small]

Each variant (and seed) trains with train.main's loop into OUT/K{k}_s{seed};
then one decode step per variant is timed (batch 16, context 256, see
scripts/timing.py). OUT/report.md gets the table (num_kv_heads,
parameters, KV bytes per token, held-out loss and bits per byte, training and
decode tokens/s, mean ± spread over seeds) and the plots beside it: loss
against step and against training time, training throughput, decode
throughput with its roofline (the lower of the bandwidth and FLOP bounds). --equal_params widens the MLP of
variants with fewer K/V heads to MHA's parameter count (as Shazeer 2019 did).
--quick: 120 steps per variant (README, Results, has its run times).
--config=recall runs the recall probe instead (see configs/recall.py); the
table then adds each variant's first-query accuracy (pure retrieval).
--report_only rebuilds the report from the runs already in --out.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

from scripts import study, timing
from train import checkpoint, config_lib, data, flops, loop, progress
from train.cli import exit_on_user_error
from train import model as model_lib
from train.model import Transformer
from train.metrics import read_metrics

DECODE_BATCH, DECODE_CONTEXT = 16, 256


def variant_config(base, K, seed, steps, equal_params):
  config = config_lib.load(base)
  m = config.model
  if equal_params:
    m.mlp_dim = flops.equal_params_mlp_dim(m.mlp_dim, m.num_heads, K,
                                           m.head_dim)
  m.num_kv_heads = K
  config.seed = seed
  if steps:
    config.train.update(steps=steps, eval_every=max(steps // 3, 1),
                        checkpoint_every=steps,
                        warmup_steps=min(config.train.warmup_steps, steps // 4))
  return config


def main():
  parser = study.parser(__doc__, config='gqa_small', kv_heads=[8, 2, 1],
                        seeds=1, report_only='the runs already in --out',
                        helps=dict(steps="default: the config's",
                                   quick='120 steps each'))
  parser.add_argument('--equal_params', action='store_true')
  args = parser.parse_args()
  steps = 120 if args.quick and not args.steps else args.steps
  out = pathlib.Path(args.out)
  configs = {(K, seed): variant_config(args.config, K, seed, steps,
                                       args.equal_params)
             for K in args.kv_heads for seed in range(args.seeds)}
  for config in configs.values():  # Refused before anything trains.
    config_lib.validate(config, batch_shards=1)
  runs = []
  todo = list(configs.items()) if args.report_only else progress.runs(
      list(configs.items()), lambda c: f'num_kv_heads={c[0][0]} seed={c[0][1]}')
  for (K, seed), config in todo:
    workdir = out / f'K{K}_s{seed}'
    if args.report_only:
      record = study.saved(workdir / 'final.json')
    else:
      record = loop.train_and_evaluate(config, str(workdir))
    if config.data.task == 'recall':
      record['accuracy_by_query'] = recall_accuracy_by_query(workdir)
    runs.append(dict(K=K, seed=seed, config=config, record=record,
                     metrics=read_metrics(workdir)))
  decode = {}
  for K in sorted({r['K'] for r in runs}):
    mc = config_lib.model_config(next(r['config'] for r in runs if r['K'] == K))
    decode[K] = DECODE_BATCH / timing.decode_step_seconds(
        mc, DECODE_BATCH, DECODE_CONTEXT, repeats=5)
    print(f'decode K={K}: {decode[K]:,.0f} tokens/s', flush=True)
  bandwidth = timing.read_bandwidth(5)
  write_report(out, runs, decode, bandwidth, args)
  print(f'wrote {out}/report.md')


def recall_accuracy_by_query(workdir, rows: int = 512) -> list[float]:
  """Held-out answer accuracy of the j-th query, j = 1..P, for a recall run.

  The first query is the pure retrieval test: later ones can be guessed
  partly by crossing out values already asked for.
  """
  mc, params, config = checkpoint.load_workdir(str(workdir))
  task = data.load('', val_fraction=0.1, seq_len=config.data.seq_len,
                   task='recall', recall_pairs=config.data.recall_pairs,
                   recall_gap=config.data.recall_gap,
                   vocab_size=mc.vocab_size)
  tokens = task.batch('val', seed=0, step=0, batch_size=rows,
                      seq_len=config.data.seq_len, stream=1)
  logits = Transformer(mc).apply({'params': params}, tokens[:, :-1])
  return task.accuracy_by_query(logits.argmax(-1), tokens).tolist()


def _spread(values):
  values = np.asarray(values, float)
  if np.isnan(values).all():
    return '-'  # Not measured: bits/byte of non-text data, or older runs.
  if len(values) == 1:
    return f'{values[0]:.3f}'
  return f'{values.mean():.3f} ± {values.std(ddof=1):.3f}'


def write_report(out, runs, decode, bandwidth, args):
  """report.md (the command, a reading, the table), loss.png and
  throughput.png in OUT."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  rows = _rows(runs, decode, bandwidth)
  (out / 'report.md').write_text('\n'.join(
      _report_lines(runs, rows, bandwidth, args)))
  _plot_loss(out / 'loss.png', runs)
  _plot_throughput(out / 'throughput.png', rows)


def _rows(runs, decode, bandwidth) -> list[dict]:
  """One row a variant (K): its size, its losses over seeds, its speeds."""
  rows = []
  for K in sorted({r['K'] for r in runs}, reverse=True):
    mine = [r for r in runs if r['K'] == K]
    c = mine[0]['config']
    mc = config_lib.model_config(c)
    record = lambda key, default=np.nan: _spread(
        [r['record'].get(key, default) for r in mine])
    rows.append(dict(
        K=K, params=model_lib.num_params(mc),
        kv=model_lib.kv_bytes_per_token(mc), mlp=c.model.mlp_dim,
        loss=record('eval_loss'), bpb=record('eval_bpb'),
        accuracy=record('eval_accuracy'),
        first=_spread([r['record'].get('accuracy_by_query', [np.nan])[0]
                       for r in mine]),
        mean_loss=np.mean([r['record']['eval_loss'] for r in mine]),
        train=np.mean([np.median([m['tokens_per_sec'] for m in r['metrics']])
                       for r in mine]),
        decode=decode[K],
        roofline=flops.decode_roofline_tokens_per_sec(
            mc, DECODE_BATCH, DECODE_CONTEXT, bandwidth,
            flops.peak_flops()[0])['roofline']))
  return rows


def _reading(rows, seeds: int) -> str:
  """Two sentences on what the table says, from its numbers."""
  best = min(rows, key=lambda r: r['mean_loss'])
  worst = max(rows, key=lambda r: r['mean_loss'])
  fastest = max(rows, key=lambda r: r['decode'])
  slowest = min(rows, key=lambda r: r['decode'])
  gap = worst['mean_loss'] - best['mean_loss']
  return (f'Held-out loss is lowest for K={best["K"]} and highest for '
          f'K={worst["K"]}, {gap:.3f} nats apart'
          + (' (compare with the ± over seeds).' if seeds > 1 else
             ' (one seed: rerun with --seeds=3 to see the spread).')
          + f' Decoding is fastest with K={fastest["K"]}, '
          f'{fastest["decode"] / slowest["decode"]:.1f}x K={slowest["K"]}.')


def _report_lines(runs, rows, bandwidth, args) -> list[str]:
  c = runs[0]['config']
  recall = c.data.task == 'recall'
  lines = [
      '# Comparing MHA, GQA and MQA', '',
      f'Made by `python -m scripts.compare {" ".join(sys.argv[1:])}`: '
      f'{c.model.num_layers} layers, d_model {c.model.d_model}, '
      f'{c.model.num_heads} query heads of {c.model.head_dim}; '
      f'{c.train.steps} steps of {c.train.batch_size} x {c.data.seq_len} '
      f'tokens each, {args.seeds} seed(s) per variant'
      + (', MLP widened to equal parameters' if args.equal_params else '')
      + f'. Compute dtype {c.model.dtype}. Decode: batch {DECODE_BATCH}, '
      f'context {DECODE_CONTEXT}; '
      f'read bandwidth {bandwidth / 1e9:.1f} GB/s.', '',
      _reading(rows, args.seeds), '',
      (f'Data: the recall probe, {c.data.recall_pairs} key-value pairs per '
       'row; accuracy counts the answers only.' if recall else
       f'Data: {c.data.path or "the embedded stdlib corpus"} (bytes).'), '',
      '| num_kv_heads | params | mlp_dim | KV bytes/token | held-out '
      'loss (nats) | bits/byte | next-token accuracy | '
      + ('first-query accuracy | ' if recall else '')
      + 'train tok/s | decode tok/s | decode roofline tok/s |',
      '|---' * (10 + recall) + '|']
  for r in rows:
    lines.append(f'| {r["K"]} | {r["params"]:,} | {r["mlp"]} | {r["kv"]:,.0f} | '
                 f'{r["loss"]} | {r["bpb"]} | {r["accuracy"]} | '
                 + (f'{r["first"]} | ' if recall else '')
                 + f'{r["train"]:,.0f} | {r["decode"]:,.0f} | '
                 f'{r["roofline"]:,.0f} |')
  if recall:  # Later queries can be guessed by crossing out; not the first.
    lines += ['', 'Answer accuracy by query (1st ... last):', '']
    for r in rows:
      by_query = np.mean([run['record']['accuracy_by_query'] for run in runs
                          if run['K'] == r['K']], axis=0)
      lines.append(f'- K={r["K"]}: ' + ' '.join(f'{a:.2f}' for a in by_query))
  return lines + ['', '![loss](loss.png)', '', '![throughput](throughput.png)',
                  '']


def _plot_loss(path, runs):
  """Training loss (mean over seeds) and held-out loss with its seed band,
  against step; the held-out loss of the last half, zoomed."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (by_step, zoom) = plt.subplots(1, 2, figsize=(11, 4))
  for i, K in enumerate(sorted({r['K'] for r in runs}, reverse=True)):
    mine = [r for r in runs if r['K'] == K]
    steps = [m['step'] for m in mine[0]['metrics']]
    train = np.mean([[m['loss'] for m in r['metrics']] for r in mine], 0)
    by_step.plot(steps, train, color=f'C{i}', alpha=0.4)
    evals = [[m for m in r['metrics'] if 'eval_loss' in m] for r in mine]
    at = [m['step'] for m in evals[0]]
    held = np.array([[m['eval_loss'] for m in e] for e in evals])
    for ax in (by_step, zoom):
      ax.plot(at, held.mean(0), 'o-', color=f'C{i}', label=f'K={K}')
      if len(mine) > 1:
        ax.fill_between(at, held.min(0), held.max(0), color=f'C{i}',
                        alpha=0.2)
  last = max(m['step'] for r in runs for m in r['metrics'])
  zoom.set_xlim(last / 2, last * 1.02)
  zoom.autoscale(axis='y')
  by_step.set(xlabel='step', ylabel='loss (nats/token)',
              title='train (faint) and held-out loss, band: seeds')
  zoom.set(xlabel='step', ylabel='held-out loss (nats/token)',
           title='held-out loss, second half')
  by_step.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def _plot_throughput(path, rows):
  """Training tokens/s (bars), decode tokens/s and its roofline (points on
  a log axis)."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (train_ax, decode_ax) = plt.subplots(1, 2, figsize=(11, 4))
  names = [f'K={r["K"]}' for r in rows]
  train_ax.bar(names, [r['train'] for r in rows], color='C0')
  train_ax.set(ylabel='tokens/s', title='training throughput')
  decode_ax.plot(names, [r['decode'] for r in rows], 'o', color='C1',
                 markersize=10, label='measured')
  decode_ax.plot(names, [r['roofline'] for r in rows], 'k_', markersize=30,
                 mew=2, label='roofline (bytes or FLOPs, the lower)')
  decode_ax.set(ylabel='tokens/s (log)', yscale='log',
                title=f'decode (batch {DECODE_BATCH}, context '
                      f'{DECODE_CONTEXT})')
  decode_ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)

if __name__ == '__main__':
  exit_on_user_error(main)
