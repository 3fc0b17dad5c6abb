"""Serving throughput against K at one KV-memory budget: continuous batching
over the paged cache, with one-request-at-a-time `train.sample` beside it.

  python -m scripts.bench_serve [--config=gqa_small] [--kv_heads=8,2,1]
      [--kv_memory=4MiB] [--slots=32] [--requests=32] [--page_size=16]
      [--prompt_len=8,96] [--output_len=8,64] [--seed=0] [--out=DIR]

The trace: --requests requests, all arriving at the start (an offline
batch); prompt and output lengths drawn uniformly from the inclusive ranges
--prompt_len and --output_len with numpy's generator seeded by --seed; the
prompt tokens uniform over the vocabulary. Each K gets a random model
(speed does not depend on the weights) and the same trace, served by
`serve.engine.Engine` in --slots slots over --kv_memory bytes of pages: with
fewer K/V heads a page holds more tokens' worth of memory, so more sequences
fit in flight. Reported per K: tokens/s, sequences in flight (mean over the
decode steps), the pool's high-water mark, and each request's time to first
token and per-token latency (medians). Compiling is done before timing
(a warm-up pass over the same trace).

The peer, in the same run and process, taking turns by K: the same requests
one at a time through `train.sample.generate` (its prefill and `lax.scan`
decode), each shape compiled before the clock starts.
Writes serve.json, report.md and serve.png under --out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from serve import engine as engine_lib, pages
from train import config_lib, loop, sample
from train.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       int_list, positive_int)
from train.errors import UserError
from train.model import Transformer


def main():
  parser = ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', default='gqa_small')
  parser.add_argument('--kv_heads', type=int_list, default=[8, 2, 1])
  parser.add_argument('--kv_memory', default='4MiB')
  parser.add_argument('--slots', type=positive_int, default=32)
  parser.add_argument('--requests', type=positive_int, default=32)
  parser.add_argument('--page_size', type=positive_int, default=16)
  parser.add_argument('--prompt_len', type=int_list, default=[8, 96])
  parser.add_argument('--output_len', type=int_list, default=[8, 64])
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default='out/serve')
  args = parser.parse_args()
  check_output_dir(args.out)
  kv_memory = pages.parse_bytes(args.kv_memory)
  config = config_lib.load(args.config)
  for K in args.kv_heads:  # Every bad setting refused before any run.
    config.model.num_kv_heads = K
    config_lib.validate(config, batch_shards=1)
  trace = make_trace(args, config.model.vocab_size, config.model.max_len)
  rows = []
  for K in args.kv_heads:
    config.model.num_kv_heads = K
    mc = config_lib.model_config(config)
    params = nn.unbox(loop.init_params(Transformer(mc), seed=0))
    row = serve(mc, params, trace, kv_memory, args)
    row |= one_at_a_time(mc, params, trace)
    row['batching_speedup'] = (row['tokens_per_sec'] /
                               row['alone_tokens_per_sec'])
    print(f'K={K}: {row["tokens_per_sec"]:,.1f} tokens/s, '
          f'{row["mean_in_flight"]:.1f} in flight (high-water '
          f'{row["high_water_pages"]}/{row["usable_pages"]} pages); one at a '
          f'time {row["alone_tokens_per_sec"]:,.1f} tokens/s '
          f'({row["batching_speedup"]:.2f}x)', flush=True)
    rows.append(row)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results = {'command': 'python -m scripts.bench_serve ' + ' '.join(
      sys.argv[1:]), 'date': time.strftime('%Y-%m-%d'), 'rows': rows,
             'trace': {'requests': args.requests, 'prompt_len': args.prompt_len,
                       'output_len': args.output_len, 'seed': args.seed}}
  (out / 'serve.json').write_text(json.dumps(results, indent=1))
  (out / 'report.md').write_text(report(results, args))
  plot(rows, out / 'serve.png')
  print(f'wrote {out}/serve.json, report.md and serve.png')


def make_trace(args, vocab_size: int, max_len: int) -> list:
  """[(prompt tokens, output length)], seeded; lengths uniform in range."""
  for name in ('prompt_len', 'output_len'):
    value = getattr(args, name)
    if len(value) != 2 or value[0] > value[1]:
      raise UserError(f'--{name}={",".join(map(str, value))} must be LOW,HIGH '
                      'with LOW <= HIGH')
  if args.prompt_len[1] + args.output_len[1] > max_len:
    raise UserError(f'--prompt_len and --output_len reach '
                    f'{args.prompt_len[1] + args.output_len[1]} tokens, past '
                    f'model.max_len ({max_len}); lower their highs')
  rng = np.random.default_rng(args.seed)
  return [(rng.integers(0, vocab_size, rng.integers(
      args.prompt_len[0], args.prompt_len[1] + 1)).astype(np.int32),
           int(rng.integers(args.output_len[0], args.output_len[1] + 1)))
          for _ in range(args.requests)]


def serve(mc, params, trace, kv_memory: int, args) -> dict:
  """The trace through the engine (compiled first): its numbers."""
  served = engine_lib.Engine(mc, params, kv_memory=kv_memory,
                             page_size=args.page_size, slots=args.slots)
  requests = [engine_lib.Request(i, p, new) for i, (p, new) in
              enumerate(trace)]
  list(served.run(requests))  # Compiles every prefill and batch size used.
  results = list(served.run(requests))
  s = served.stats
  refused = [r.error for r in results if r.error]
  if refused:
    raise UserError(f'K={mc.num_kv_heads}: {len(refused)} requests refused '
                    f'({refused[0]}); raise --kv_memory')
  return {
      'num_kv_heads': mc.num_kv_heads, 'page_bytes': s.page_bytes,
      'usable_pages': s.usable_pages, 'high_water_pages': s.high_water_pages,
      'tokens': s.tokens, 'seconds': s.seconds,
      'tokens_per_sec': s.tokens / s.seconds,
      'mean_in_flight': s.mean_in_flight,
      'time_to_first_token_s': float(np.median(
          [r.time_to_first_token_s for r in results])),
      'per_token_s': float(np.median(
          [r.per_token_s for r in results if r.per_token_s is not None]))}


def one_at_a_time(mc, params, trace) -> dict:
  """The trace one request after another through train.sample.generate, each
  shape compiled before the clock starts."""
  compiled, calls = {}, []
  for i, (prompt, new) in enumerate(trace):
    args = (params, jnp.asarray(prompt)[None], jax.random.key(i))
    shape = (len(prompt), new)
    if shape not in compiled:
      model = Transformer(dataclasses.replace(mc, max_len=sum(shape)),
                          decode=True)
      compiled[shape] = jax.jit(functools.partial(
          sample.generate, model=model, max_new_tokens=new, temperature=0.0,
          top_k=0)).lower(*args).compile()
    calls.append((compiled[shape], args))
  start = time.perf_counter()
  for fn, args in calls:
    np.asarray(fn(*args))
  seconds = time.perf_counter() - start
  tokens = sum(new for _, new in trace)
  return {'alone_seconds': seconds, 'alone_tokens_per_sec': tokens / seconds}


def report(results, args) -> str:
  lines = [
      '# Serving throughput against K at one KV-memory budget', '',
      f'`{results["command"]}` on {results["date"]}. Trace: '
      f'{args.requests} requests at once, prompt lengths uniform in '
      f'{args.prompt_len[0]}..{args.prompt_len[1]}, outputs in '
      f'{args.output_len[0]}..{args.output_len[1]} tokens (seed {args.seed}); '
      f'{args.slots} slots, --kv_memory={args.kv_memory}, pages of '
      f'{args.page_size} tokens. Compile time excluded. Speeds are from one '
      'run on a machine that may be shared: read the ratios within the run, '
      'not the absolute numbers.', '',
      '| K | page bytes | pages | high-water | in flight | tokens/s | '
      'time to first token | per-token latency | one at a time | '
      'batching speedup |', '|---|---|---|---|---|---|---|---|---|---|']
  for r in results['rows']:
    lines.append(
        f'| {r["num_kv_heads"]} | {r["page_bytes"]:,} | {r["usable_pages"]} '
        f'| {r["high_water_pages"]} | {r["mean_in_flight"]:.1f} | '
        f'{r["tokens_per_sec"]:,.1f} | {r["time_to_first_token_s"]:.2f} s | '
        f'{1e3 * r["per_token_s"]:.1f} ms | '
        f'{r["alone_tokens_per_sec"]:,.1f} tokens/s | '
        f'{r["batching_speedup"]:.2f}x |')
  return '\n'.join(lines) + '\n\n![tokens/s against K](serve.png)\n'


def plot(rows, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(5, 3.5))
  labels = [f'K={r["num_kv_heads"]}\n{r["mean_in_flight"]:.1f} in flight'
            for r in rows]
  x = np.arange(len(rows))
  ax.bar(x - 0.2, [r['tokens_per_sec'] for r in rows], 0.4,
         label='continuous batching')
  ax.bar(x + 0.2, [r['alone_tokens_per_sec'] for r in rows], 0.4,
         label='one at a time (train.sample)')
  ax.set_xticks(x, labels)
  ax.set_ylabel('tokens/s')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == '__main__':
  exit_on_user_error(main)
