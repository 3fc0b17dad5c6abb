"""Attention benchmark: ours against the peers a researcher would otherwise use.

  python -m scripts.bench_attention [--json=out.json] [--markdown=BENCHMARKS.md]
                                    [--repeats=5] [--lengths=512,2048]

Peers, timed in this process on this machine (medians of --repeats runs after
a warm-up, taking turns round by round so that all see the same machine load):
  torch     torch.nn.functional.scaled_dot_product_attention(is_causal=True,
            enable_gqa=True), if torch is installed (pip install -e '.[bench]')
  jax.nn    jax.nn.dot_product_attention (implementation 'xla'; 'cudnn' on GPU)
  repeat    the seeds' method: jnp.repeat K/V to N heads, then MHA einsums
  ours      attention.dot_product_attention, implementation chosen by it

Training shapes: causal, batch 8, length 512 and 2048, 8 heads, head_dim 64,
num_kv_heads 8/4/2/1 (float32 on CPU, bfloat16 on GPU): forward, and forward
+ backward. Decode shapes: one query token against a [B, S, K, H] cache, batch
32, cache 2048, 16 heads, head_dim 64, num_kv_heads 16/4/1: time, KV bytes read
per second, and that as a fraction of the read bandwidth measured in this run.
"""

from __future__ import annotations

import json
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from attention import dot_product_attention
from studies import report, timing
from studies.timing import median_times, read_bandwidth, read_test
from infra.cli import ArgumentParser, exit_on_user_error, int_list, positive_int


def repeat_kv_attention(q, k, v, is_causal=True):
  """The seeds' method: K/V copied to every query head, then plain MHA."""
  G = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  logits = jnp.einsum('BTNH,BSNH->BNTS', q, k).astype(jnp.float32)
  logits *= q.shape[-1] ** -0.5
  T, S = q.shape[1], k.shape[1]
  if is_causal:
    mask = jnp.arange(S)[None, :] <= jnp.arange(S - T, S)[:, None]
    logits = jnp.where(mask, logits, -1e30)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum('BNTS,BSNH->BTNH', probs, v)


def jax_peers(on_gpu):
  impl = 'cudnn' if on_gpu else 'xla'
  return {
      'ours': lambda q, k, v: dot_product_attention(q, k, v, is_causal=True),
      'jax.nn': lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation=impl),
      'repeat': repeat_kv_attention,
  }


def torch_peer():
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def make(q, k, v, backward):
    # torch wants [B, N, T, H]; converted once, outside the timing.
    tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32).transpose(
        0, 2, 1, 3).copy()).requires_grad_(backward) for x in (q, k, v))

    def run():
      out = sdpa(tq, tk, tv, is_causal=True, enable_gqa=True)
      if backward:
        out.backward(torch.ones_like(out))
      return None
    return run
  return make, torch.__version__


def bench_training(args, on_gpu, dtype, torch_make):
  rows = []
  B, N, H = 8, 8, 64
  for T in args.lengths:
    for K in (8, 4, 2, 1):
      keys = jax.random.split(jax.random.key(0), 3)
      q = jax.random.normal(keys[0], (B, T, N, H), dtype)
      k = jax.random.normal(keys[1], (B, T, K, H), dtype)
      v = jax.random.normal(keys[2], (B, T, K, H), dtype)
      for mode in ('fwd', 'fwd+bwd'):
        row = {'shape': 'train', 'T': T, 'K': K, 'mode': mode}
        contestants = {}
        for name, fn in jax_peers(on_gpu).items():
          if mode == 'fwd':
            run = jax.jit(fn)
          else:
            run = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(
                q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
          try:
            jax.block_until_ready(run(q, k, v))
          except Exception as e:  # pylint: disable=broad-except
            if name == 'ours':
              raise  # Our own contestant must run; a peer may refuse.
            row[name] = None  # e.g. cuDNN refuses the shape.
            print(f'  {name} T={T} K={K} {mode}: {type(e).__name__}: {e}'
                  [:200])
            continue
          contestants[name] = lambda run=run: run(q, k, v)
          if mode == 'fwd+bwd' and name in ('ours', 'repeat'):
            row[f'{name}_peak_bytes'] = peak_bytes(run, q, k, v)
        if torch_make and not on_gpu:
          contestants['torch'] = torch_make(q, k, v, mode != 'fwd')
        row.update(median_times(contestants, args.repeats))
        peers = [row[p] for p in ('torch', 'jax.nn', 'repeat')
                 if row.get(p) is not None]
        row['ours/best_peer'] = row['ours'] / min(peers)
        rows.append(row)
        print(format_row(row), flush=True)
  return rows


def peak_bytes(run, *xs):
  analysis = run.lower(*xs).compile().memory_analysis()
  return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def bench_decode(args, dtype, env):
  """One query token against the cache, timed in turns with the read test."""
  rows = []
  B, S, N, H = 32, 2048, 16, 64
  contestants, kv_bytes = {}, {}
  for K in (16, 4, 1):
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (B, 1, N, H), dtype)
    k = jax.random.normal(keys[1], (B, S, K, H), dtype)
    v = jax.random.normal(keys[2], (B, S, K, H), dtype)
    run = jax.jit(lambda q, k, v: dot_product_attention(q, k, v,
                                                        is_causal=True))
    contestants[K] = lambda run=run, q=q, k=k, v=v: run(q, k, v)
    kv_bytes[K] = k.nbytes + v.nbytes
  read_bytes, contestants['read'] = read_test()
  times = median_times(contestants, args.repeats)
  bandwidth = read_bytes / times.pop('read')
  env['read_bandwidth_GBps'] = bandwidth / 1e9
  for K, seconds in times.items():
    rows.append({'shape': 'decode', 'K': K, 'seconds': seconds,
                 'kv_bytes': kv_bytes[K],
                 'bytes_per_sec': kv_bytes[K] / seconds,
                 'fraction_of_bandwidth': kv_bytes[K] / seconds / bandwidth,
                 'speedup_vs_mha': times[16] / seconds})
    row = rows[-1]
    print(f'decode B={B} S={S} N={N} K={K:>2}: '
          f'{seconds * 1e3:8.2f} ms  {row["bytes_per_sec"] / 1e9:6.1f} '
          f'GB/s = {100 * row["fraction_of_bandwidth"]:5.1f}% of read '
          f'bandwidth  {row["speedup_vs_mha"]:5.1f}x MHA', flush=True)
  return rows


def format_row(row):
  ms = lambda x: '     -' if x is None else f'{x * 1e3:8.1f}'
  return (f'T={row["T"]:>5} K={row["K"]} {row["mode"]:>8}: ours '
          f'{ms(row["ours"])}  torch {ms(row.get("torch"))}  jax.nn '
          f'{ms(row["jax.nn"])}  repeat {ms(row["repeat"])} ms   '
          f'ours/best peer {row["ours/best_peer"]:.2f}')


def main():
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--json', help='also write the results here')
  parser.add_argument('--repeats', type=positive_int, default=5)
  parser.add_argument('--lengths', type=int_list, default=[512, 2048])
  parser.add_argument('--markdown', help='write the results as this file')
  parser.add_argument('--skip_decode', action='store_true')
  args = parser.parse_args()

  on_gpu = jax.default_backend() == 'gpu'
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  torch = torch_peer()
  torch_make, torch_version = torch if torch else (None, None)
  env = {'machine': f'{platform.processor() or platform.machine()}, '
                    f'{jax.devices()[0].device_kind}',
         'jax': jax.__version__, 'torch': torch_version,
         'dtype': jnp.dtype(dtype).name}
  print(json.dumps(env))
  rows = bench_training(args, on_gpu, dtype, torch_make)
  if args.skip_decode:
    env['read_bandwidth_GBps'] = read_bandwidth(args.repeats) / 1e9
  else:
    rows += bench_decode(args, dtype, env)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'env': env, 'rows': rows}, f, indent=1)
  if args.markdown:  # Its sections only; the rest of the file stays.
    for title, body in markdown(env, rows, ' '.join(sys.argv[1:])).items():
      timing.replace_section(args.markdown, title, body)


TRAIN_SECTION = 'Training shapes (causal; B=8, N=8, H=64)'
DECODE_SECTION = ('Decode shapes (one query token; B=32, S=2048, N=16, H=64, '
                  '[B, S, K, H] cache)')


def markdown(env, rows, argv) -> dict[str, str]:
  """BENCHMARKS.md's sections (title -> body) that this run measured."""
  ms = lambda x: '-' if x is None else f'{x * 1e3:.1f}'
  written = (
      'Written by `python -m scripts.bench_attention ' + argv + '` '
      f'on {time.strftime("%Y-%m-%d")}: {env["machine"]}, jax {env["jax"]}, '
      f'torch {env["torch"]}, {env["dtype"]}, {jax.device_count()} device(s), '
      f'measured read bandwidth {env["read_bandwidth_GBps"]:.1f} GB/s. '
      'Medians; every column of a row measured in the same run, the '
      'contestants taking turns.')
  train = report.table(
      ['T', 'K', 'pass', 'ours ms', 'torch SDPA ms', 'jax.nn ms',
       'repeat-K/V ms', 'ours / best peer', 'peak bytes ours',
       'peak bytes repeat'],
      ([r['T'], r['K'], r['mode'], ms(r['ours']), ms(r.get('torch')),
        ms(r['jax.nn']), ms(r['repeat']), f'{r["ours/best_peer"]:.2f}',
        *(f'{r[p] / 2**20:.0f} MiB' if p in r else '-'
          for p in ('ours_peak_bytes', 'repeat_peak_bytes'))]
       for r in rows if r['shape'] == 'train'))
  sections = {TRAIN_SECTION: '\n'.join([written, '', *train])}
  decode = [r for r in rows if r['shape'] == 'decode']
  if decode:
    sections[DECODE_SECTION] = '\n'.join([written, '', *report.table(
        ['K', 'ms', 'KV GB/s', 'of read bandwidth', 'speed-up vs MHA'],
        ([r['K'], f'{r["seconds"] * 1e3:.2f}',
          f'{r["bytes_per_sec"] / 1e9:.1f}',
          f'{100 * r["fraction_of_bandwidth"]:.0f}%',
          f'{r["speedup_vs_mha"]:.1f}x'] for r in decode))])
  return sections


if __name__ == '__main__':
  exit_on_user_error(main)
