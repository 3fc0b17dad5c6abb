"""The KV-memory frontier: GQA beside local layers, cross-layer sharing and
int8 caches, compared at equal bytes.

  python -m scripts.kv_frontier --out=DIR [--quick] [--config=gqa_small]
      [--kv_heads=8,2,1] [--seeds=2] [--steps=60] [--window=64]
      [--local_pattern=LLGG]

Trains every combination of K/V heads (MHA, GQA, MQA), layer pattern (all
global 'G', or --local_pattern: local and global pairs 'LLGG' with a
--window-key local attention) and K/V sharing (kv_share 1, or 2: pairs of layers share one K/V,
CLA2) with `train.main`'s loop, per seed, into DIR/runs/. Each model is then
read with two decode caches: float (its held-out loss, the loop's evaluator)
and int8 (the same evaluator on the logits the int8 cache gives,
`loop.evaluate_workdir(through_cache=True)`). Its cost is the cache's bytes
per token of context at the decode context max_len (`model.kv_bytes_per_token`),
and its decode speed is timed (batch 16, the cache filled to max_len - 8).

The accuracy column is the evaluator's next-token accuracy; with
--config=recall (2 layers: --local_pattern=LG, or LL to share K/V) it is the
recall probe's answer accuracy.

Writes DIR/frontier.json, DIR/report.md (the table, the Pareto frontier:
the points no other point beats on both bytes and loss) and DIR/frontier.png
(loss and decode tokens/s against bytes per token). A rerun reuses finished
runs; --report_only rebuilds the report from DIR/frontier.json. --quick: the
MHA reference (all global, no sharing) and MQA with every pattern and
sharing, one seed, 15 steps (6.7 minutes here).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import sys
import time

import numpy as np

from scripts import study, timing
from train import config_lib, loop
from train import model as model_lib
from train.cli import check_output_dir, exit_on_user_error, positive_int

SHARES = (1, 2)
CACHES = ('float', 'int8')
DECODE_BATCH = 16


@dataclasses.dataclass(frozen=True)
class Variant:
  K: int
  pattern: str
  share: int

  @property
  def name(self) -> str:
    return f'K{self.K}_{self.pattern}_share{self.share}'


def variant_config(base: str, v: Variant, seed: int, steps: int,
                   window: int):
  config = config_lib.load(base)
  config.model.update(num_kv_heads=v.K, attention_pattern=v.pattern,
                      local_window=window if 'L' in v.pattern else None,
                      kv_share=v.share)
  config.seed = seed
  config.train.update(steps=steps, eval_every=steps, checkpoint_every=steps,
                      log_every=max(1, steps // 10),
                      warmup_steps=min(config.train.warmup_steps, steps // 4))
  return config


def main():
  parser = study.parser(__doc__, config='gqa_small',
                        report_only='frontier.json in --out')
  parser.add_argument('--window', type=positive_int, default=64)
  parser.add_argument('--local_pattern', default='LLGG',
                      help="the pattern compared with all-global 'G'")
  parser.add_argument('--repeats', type=positive_int, default=None,
                      help='timed decode runs per variant (median; 3, --quick 2)')
  args = parser.parse_args()
  check_output_dir(args.out)
  out = pathlib.Path(args.out)
  if args.report_only:
    result = study.saved(out / 'frontier.json')
    write(out, result, ('G', result.get('local_pattern', 'LLGG')))
    return
  num_heads = config_lib.load(args.config).model.num_heads
  kv_heads = args.kv_heads or (
      [1] if args.quick else
      sorted({num_heads, max(1, num_heads // 4), 1}, reverse=True))
  seeds = range(1, 1 + (args.seeds or (1 if args.quick else 2)))
  steps = args.steps or (15 if args.quick else 60)
  patterns = ('G', args.local_pattern)
  variants = [Variant(*v) for v in itertools.product(kv_heads, patterns,
                                                     SHARES)]
  if args.quick and not args.kv_heads:
    variants.insert(0, Variant(num_heads, 'G', 1))  # The MHA reference.
  for v in variants:  # Every bad setting refused before any training.
    config_lib.validate(variant_config(args.config, v, 1, steps, args.window),
                        batch_shards=1)
  start = time.perf_counter()
  repeats = args.repeats or (2 if args.quick else 3)
  rows = [measure(out, args.config, v, seeds, steps, args.window, repeats)
          for v in variants]
  result = {'argv': sys.argv[1:], 'config': args.config, 'steps': steps,
            'seeds': list(seeds),
            'window': args.window, 'local_pattern': args.local_pattern,
            'rows': rows, 'minutes': (time.perf_counter() - start) / 60}
  write(out, result, patterns)
  print(f'wrote {out}/report.md, frontier.json and frontier.png '
        f'({result["minutes"]:.1f} min)')


def write(out: pathlib.Path, result: dict, patterns):
  mark_frontier(result['rows'])
  (out / 'frontier.json').write_text(json.dumps(result, indent=1))
  (out / 'report.md').write_text(report(result))
  plot(result['rows'], patterns, out / 'frontier.png')


def measure(out: pathlib.Path, base: str, v: Variant, seeds, steps: int,
            window: int, repeats: int) -> list[dict]:
  """One row per cache: loss and accuracy over seeds, bytes, decode speed."""
  losses = {cache: [] for cache in CACHES}
  accuracies = {cache: [] for cache in CACHES}
  for seed in seeds:
    config = variant_config(base, v, seed, steps, window)
    workdir = out / 'runs' / f'{v.name}_s{seed}'
    print(f'=== {v.name}, seed {seed}', flush=True)
    record = study.train(config, workdir, workdir / 'log.txt')
    int8 = loop.evaluate_workdir(str(workdir), through_cache=True,
                                 kv_cache_dtype='int8')
    for cache, r in (('float', record), ('int8', int8)):
      losses[cache].append(r['eval_loss'])
      accuracies[cache].append(r['eval_accuracy'])
  rows = []
  for cache in CACHES:
    mc = config_lib.model_config(config)
    mc = dataclasses.replace(mc, kv_cache_dtype=None if cache == 'float'
                             else cache)
    seconds = timing.decode_step_seconds(mc, DECODE_BATCH, mc.max_len - 8,
                                         repeats)
    rows.append(dict(
        variant=v.name, num_kv_heads=v.K, attention_pattern=v.pattern,
        kv_share=v.share, cache=cache,
        kv_bytes_per_token=model_lib.kv_bytes_per_token(mc),
        loss=float(np.mean(losses[cache])), losses=losses[cache],
        loss_spread=float(np.ptp(losses[cache])),
        accuracy=float(np.mean(accuracies[cache])),
        decode_tokens_per_sec=DECODE_BATCH / seconds))
    print(f'{v.name} {cache}: {rows[-1]["kv_bytes_per_token"]:,.0f} B/token, '
          f'loss {rows[-1]["loss"]:.4f}, '
          f'{rows[-1]["decode_tokens_per_sec"]:,.0f} tokens/s', flush=True)
  return rows


def mark_frontier(rows_by_variant: list[list[dict]]):
  """Sets 'pareto' on every row: no other row has fewer or equal bytes and
  a lower loss (or equal loss and fewer bytes)."""
  rows = [r for rs in rows_by_variant for r in rs]
  for r in rows:
    r['pareto'] = not any(
        o is not r and o['kv_bytes_per_token'] <= r['kv_bytes_per_token']
        and o['loss'] <= r['loss'] and (
            o['kv_bytes_per_token'] < r['kv_bytes_per_token']
            or o['loss'] < r['loss'])
        for o in rows)


def report(result: dict) -> str:
  """report.md: the command, the reading, what was measured, the table."""
  rows = sorted((r for rs in result['rows'] for r in rs),
                key=lambda r: r['kv_bytes_per_token'])
  mc_line = (f'`{result["config"]}` with each variant\'s K, layer pattern '
             f'(L: {result["window"]}-key local attention) and K/V sharing; '
             f'{result["steps"]} steps, seeds {result["seeds"]}')
  command = ('python -m scripts.kv_frontier ' + ' '.join(
      result.get('argv', ['(its arguments were not saved)'])))
  lines = ['# The KV-memory frontier', '', f'Made by `{command}`.', '',
           *_reading(rows), '',
           f'Models: {mc_line}. Bytes: the decode cache per token of context '
           'at max_len (`model.kv_bytes_per_token`: every layer that owns a '
           'cache, local layers their window, int8 with its float32 scale '
           'per token and KV head). Loss: held-out nats/token, the training '
           'loop\'s evaluator; for int8, on the logits the int8 cache gives. '
           f'Decode: tokens/s at batch {DECODE_BATCH}, the cache filled to '
           f'max_len - 8, this machine. Took {result["minutes"]:.1f} min.', '',
           '| variant | cache | bytes/token | loss (spread) | accuracy | '
           'decode tokens/s | frontier |', '|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(
        f'| {r["variant"]} | {r["cache"]} | {r["kv_bytes_per_token"]:,.0f} | '
        f'{r["loss"]:.4f} ({r["loss_spread"]:.4f}) | {r["accuracy"]:.3f} | '
        f'{r["decode_tokens_per_sec"]:,.0f} | {"yes" if r["pareto"] else ""} |')
  return '\n'.join(lines) + '\n'


def _reading(rows) -> list[str]:
  """What the table says: the frontier, whether the loss separates the
  variants, what int8 costs."""
  frontier = [r for r in rows if r['pareto']]
  losses = [r['loss'] for r in rows]
  spread = float(np.mean([r['loss_spread'] for r in rows]))
  by_key = {(r['variant'], r['cache']): r for r in rows}
  names = sorted({r['variant'] for r in rows})
  deltas = [by_key[n, 'int8']['loss'] - by_key[n, 'float']['loss']
            for n in names]
  shares = [by_key[n, 'int8']['kv_bytes_per_token']
            / by_key[n, 'float']['kv_bytes_per_token'] for n in names]
  return [
      'On the frontier, from the most bytes to the fewest: '
      + ', '.join(f'{r["variant"]} ({r["cache"]})'
                  for r in reversed(frontier)) + '. '
      f'All {len(rows)} points lie within {max(losses) - min(losses):.4f} '
      f'nats of each other, against a mean spread over seeds of '
      f'{spread:.4f}: '
      + ('the loss does not separate the variants at this budget, so '
         'the frontier is set by the bytes alone (a null result; more '
         '--steps and --seeds resolve smaller differences).'
         if max(losses) - min(losses) < 2 * spread else
         'the differences are larger than the seeds\' spread.'),
      '',
      f'An int8 cache holds {min(shares):.0%}-{max(shares):.0%} of the float '
      f'cache\'s bytes and changes the held-out loss by {min(deltas):+.4f} to '
      f'{max(deltas):+.4f} nats (the seed spreads below say whether that is '
      'more than noise).']


def plot(rows_by_variant, patterns, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = [r for rs in rows_by_variant for r in rs]
  fig, (ax, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
  colors = {kind: f'C{i}' for i, kind in enumerate(
      itertools.product(patterns, SHARES))}
  for r in rows:
    color = colors[r['attention_pattern'], r['kv_share']]
    marker = 'o' if r['cache'] == 'float' else 's'
    face = color if r['cache'] == 'float' else 'none'
    for axis, y in ((ax, r['loss']), (speed, r['decode_tokens_per_sec'])):
      axis.scatter(r['kv_bytes_per_token'], y, marker=marker,
                   facecolors=face, edgecolors=color, s=40)
    ax.annotate(f'K{r["num_kv_heads"]}', (r['kv_bytes_per_token'], r['loss']),
                fontsize=7, xytext=(3, 3), textcoords='offset points')
  frontier = sorted((r for r in rows if r['pareto']),
                    key=lambda r: r['kv_bytes_per_token'])
  ax.plot([r['kv_bytes_per_token'] for r in frontier],
          [r['loss'] for r in frontier], 'k--', lw=1, label='Pareto frontier')
  for (pattern, share), color in colors.items():
    ax.scatter([], [], color=color, label=f'{pattern}, kv_share {share}')
  ax.scatter([], [], marker='s', facecolors='none', edgecolors='k',
             label='int8 cache (hollow)')
  ax.set(xscale='log', xlabel='KV cache bytes per token (at max_len)',
         ylabel='held-out loss (nats/token)', title='quality against bytes')
  ax.legend(fontsize=7)
  speed.set(xscale='log', yscale='log',
            xlabel='KV cache bytes per token (at max_len)',
            ylabel=f'decode tokens/s (batch {DECODE_BATCH})',
            title='decode speed against bytes')
  fig.tight_layout()
  fig.savefig(path, dpi=100)


if __name__ == '__main__':
  exit_on_user_error(main)
