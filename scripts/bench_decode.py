"""Decode throughput per variant against the memory-bandwidth roofline.

  python -m scripts.bench_decode [--config=gqa_small] [--kv_heads=8,2,1]
      [--batches=1,16,64,256] [--contexts=256,1024,2048] [--out=DIR]
      [--kv_cache_dtype=bfloat16|int8]

For each num_kv_heads, batch and context, times decoding with the whole model
(all layers) against a KV cache filled to `context`, in a jitted `lax.scan`
as `train.sample` does, and reports tokens/s, KV-cache bytes, and the
roofline: the tokens/s that reading the cache once per token at the machine's
measured read bandwidth would allow (weights are read once per step as well,
and are included), and the fraction of it reached; also the FLOP roofline,
the tokens/s at the device's peak FLOP/s (`train.flops.peak_flops`), which on
a CPU comes close for the grouped variants: G query heads share each cached
key, G/2 FLOPs per float32 byte of cache, against the CPU's ~6 FLOPs per byte
of bandwidth. Writes decode.json and decode.png under --out.
"""

from __future__ import annotations

import json
import pathlib

from attention import layer
from scripts import timing
from train import config_lib, flops
from train.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       int_list, positive_int)
from train import model as model_lib


def main():
  parser = ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='gqa_small')
  parser.add_argument('--kv_heads', type=int_list, default=[8, 2, 1])
  parser.add_argument('--batches', type=int_list, default=[1, 16, 64, 256])
  parser.add_argument('--contexts', type=int_list, default=[256, 1024, 2048])
  parser.add_argument('--repeats', type=positive_int, default=5)
  parser.add_argument('--kv_cache_dtype', choices=layer.KV_CACHE_DTYPES,
                      help="the cache's storage (default: the config's)")
  parser.add_argument('--out', default='out/decode')
  args = parser.parse_args()
  check_output_dir(args.out)
  results = run(args.config, args.kv_heads, args.batches, args.contexts,
                args.repeats, args.kv_cache_dtype)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'decode.json').write_text(json.dumps(results, indent=1))
  plot(results, out / 'decode.png')
  print(f'wrote {out}/decode.json and decode.png')


def run(config_name, kv_heads, batches, contexts, repeats,
        kv_cache_dtype=None):
  config = config_lib.load(config_name)
  if kv_cache_dtype:
    config.model.kv_cache_dtype = kv_cache_dtype
  for K in kv_heads:  # Every bad setting refused before any measurement.
    config.model.num_kv_heads = K
    config_lib.validate(config, batch_shards=1)
  bandwidth = timing.read_bandwidth(repeats)
  peak, peak_source = flops.peak_flops()
  rows = []
  print(f'read bandwidth {bandwidth / 1e9:.1f} GB/s; peak {peak / 1e9:,.0f} '
        f'GFLOP/s ({peak_source})')
  print(f'{"K":>3} {"batch":>6} {"context":>8} {"tokens/s":>10} '
        f'{"KV MiB":>8} {"bytes bound":>12} {"FLOP bound":>11} '
        f'{"of the lower":>12}')
  for K in kv_heads:
    config.model.num_kv_heads = K
    mc = config_lib.model_config(config)
    for batch in batches:
      for context in contexts:
        seconds = timing.decode_step_seconds(mc, batch, context, repeats)
        kv_bytes = model_lib.kv_cache_bytes(mc, batch, context)
        bound = flops.decode_roofline_tokens_per_sec(mc, batch, context,
                                                     bandwidth, peak)
        row = dict(num_kv_heads=K, batch=batch, context=context,
                   tokens_per_sec=batch / seconds, kv_bytes=kv_bytes,
                   bandwidth_roofline_tokens_per_sec=bound['bandwidth'],
                   compute_roofline_tokens_per_sec=bound['compute'],
                   roofline_tokens_per_sec=bound['roofline'],
                   fraction_of_roofline=batch / seconds / bound['roofline'])
        rows.append(row)
        print(f'{K:>3} {batch:>6} {context:>8} {row["tokens_per_sec"]:>10,.0f}'
              f' {kv_bytes / 2**20:>8.1f} {bound["bandwidth"]:>12,.0f} '
              f'{bound["compute"]:>11,.0f} '
              f'{100 * row["fraction_of_roofline"]:>11.0f}%', flush=True)
  return {'bandwidth': bandwidth, 'peak_flops': peak,
          'peak_source': peak_source, 'rows': rows}


def plot(results, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = results['rows']
  contexts = sorted({r['context'] for r in rows})
  fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4),
                           squeeze=False)
  for ax, context in zip(axes[0], contexts):
    for i, K in enumerate(sorted({r['num_kv_heads'] for r in rows},
                                 reverse=True)):
      sel = [r for r in rows if r['context'] == context
             and r['num_kv_heads'] == K]
      b = [r['batch'] for r in sel]
      color = f'C{i}'
      ax.plot(b, [r['tokens_per_sec'] for r in sel], 'o-', color=color,
              label=f'K={K} measured')
      ax.plot(b, [r['roofline_tokens_per_sec'] for r in sel], '--',
              color=color, label=f'K={K} roofline')
    ax.set(xscale='log', yscale='log', xlabel='batch',
           ylabel='decoded tokens/s', title=f'context {context}')
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


if __name__ == '__main__':
  exit_on_user_error(main)
