"""Uptraining ablation (Ainslie et al. 2023, Fig. 4-5) at laptop scale.

  python -m scripts.uptrain_ablation --out=out/uptrain [--source=WORKDIR]
      [--num_kv_heads=1] [--alphas=0,0.05,0.1] [--source_steps=360]

Trains an MHA model (mha_small, or uses --source), converts it to
num_kv_heads by each method (mean-pooling the K/V heads of a group, taking the
first, random init), and uptrains each for a fraction alpha of the source's
steps. Prints and writes OUT/ablation.md: held-out loss per method and alpha,
and whether the paper's ordering (mean better than first better than random
before uptraining; the gap closing with alpha) holds here.
"""

from __future__ import annotations

import math
import pathlib

import jax
import numpy as np

from configs import mha_small
from train import checkpoint, config_lib, convert, data, loop, progress
from train.errors import (ArgumentParser, UserError, exit_on_user_error,
                          float_list, positive_int)
from train.model import Transformer

METHODS = ('mean', 'first', 'random')


def held_out_loss(workdir) -> float:
  """Held-out nats/token of WORKDIR's latest checkpoint, on train.main's
  evaluation batches."""
  mc, params, config = checkpoint.load_workdir(str(workdir))
  dataset = data.load(config.data.path, val_fraction=config.data.val_fraction,
                      seq_len=config.data.seq_len)
  model = Transformer(mc)
  loss = jax.jit(lambda p, b: loop.eval_step(p, b, model=model)[0])
  return float(np.mean([
      loss(params, data.batch(dataset.val, seed=0, step=i, stream=1,
                              batch_size=config.train.batch_size,
                              seq_len=config.data.seq_len))
      for i in range(config.train.eval_batches)]))


def main():
  parser = ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', required=True)
  parser.add_argument('--source', help='a trained MHA workdir')
  parser.add_argument('--source_steps', type=positive_int, default=None,
                      help='steps to train the source (default: the config)')
  parser.add_argument('--num_kv_heads', type=positive_int, default=1)
  parser.add_argument('--alphas', type=float_list, default=[0, 0.05, 0.1])
  args = parser.parse_args()
  out = pathlib.Path(args.out)
  source = pathlib.Path(args.source) if args.source else out / 'source'
  source_config = mha_small.get_config()
  if args.source_steps:
    source_config.train.steps = args.source_steps
  if args.source:  # Its config, checked before anything trains.
    source_config = checkpoint.load_workdir(str(source), '--source')[2]
  heads = source_config.model.num_heads
  if heads % args.num_kv_heads:
    raise UserError(f'--num_kv_heads={args.num_kv_heads} does not divide the '
                    f'source\'s {heads} query heads; pick a divisor of {heads}')
  config_lib.validate(source_config, batch_shards=1)
  if not args.source:
    print('=== training the MHA source', flush=True)
    loop.train_and_evaluate(source_config, str(source))
  _, _, source_config = checkpoint.load_workdir(str(source))
  results = {'source': held_out_loss(source)}
  alphas = args.alphas
  grid = [(method, alpha) for method in METHODS for alpha in alphas]
  for method, alpha in progress.runs(grid,
                                    lambda c: f'{c[0]}, alpha={c[1]:g}'):
    workdir = out / f'{method}_alpha{alpha:g}'
    convert.convert_workdir(str(source), str(workdir), args.num_kv_heads,
                            method)
    steps = round(alpha * source_config.train.steps)
    if steps:
      print(f'uptraining {steps} steps', flush=True)
      config = mha_small.get_config()
      config.update_from_flattened_dict({
          'model.num_kv_heads': args.num_kv_heads, 'train.steps': steps,
          'train.warmup_steps': max(1, steps // 10),
          'train.eval_every': steps, 'train.checkpoint_every': steps})
      loop.train_and_evaluate(config, str(workdir))
    results[(method, alpha)] = held_out_loss(workdir)
  write(out, results, alphas, args.num_kv_heads, source_config.train.steps)


def write(out, results, alphas, K, source_steps):
  bpb = lambda loss: loss / math.log(2)
  lines = [
      f'# Uptraining MHA -> {K} KV head(s)', '',
      f'Source: mha_small trained {source_steps} steps, held-out '
      f'{results["source"]:.4f} nats/token ({bpb(results["source"]):.3f} '
      'bits/byte). Held-out loss (nats/token) after conversion and '
      'uptraining for alpha x the source steps:', '',
      '| method | ' + ' | '.join(f'alpha={a:g}' for a in alphas) + ' |',
      '|---|' + '---|' * len(alphas)]
  for method in METHODS:
    lines.append(f'| {method} | ' + ' | '.join(
        f'{results[(method, a)]:.4f}' for a in alphas) + ' |')
  before = [results[(m, alphas[0])] for m in METHODS]
  ordered = before[0] < before[1] < before[2]
  gaps = [results[('random', a)] - results[('mean', a)] for a in alphas]
  lines += ['', f'Ordering mean < first < random at alpha={alphas[0]:g}: '
            f'{"holds" if ordered else "does not hold"} '
            f'({", ".join(f"{m} {b:.3f}" for m, b in zip(METHODS, before))}).',
            'Gap random - mean by alpha: ' + ', '.join(
                f'{a:g}: {g:+.3f}' for a, g in zip(alphas, gaps))
            + (' (closing).' if all(
                abs(b) <= abs(a) for a, b in zip(gaps, gaps[1:]))
               else ' (not monotonically closing).'), '']
  text = '\n'.join(lines)
  (out / 'ablation.md').write_text(text)
  print(text)


if __name__ == '__main__':
  exit_on_user_error(main)
