"""Decode throughput per variant against the roofline, and against PyTorch.

  python -m scripts.bench_decode [--config=gqa_small]
      [--variants=K8,K2,K1,GTA2,GTA1,MLA48,GLA48g2,TPA2,TPAKV2 |
       --kv_heads=8,2,1]
      [--batches=1,16,256] [--contexts=256,2048] [--out=DIR]
      [--kv_cache_dtype=bfloat16|int8] [--equal_params]
      [--markdown=BENCHMARKS.md] [--llama_cpp]
  python -m scripts.bench_decode --layer [--kv_heads=16,4,1]
      [--batches=16,256] [--contexts=2048] [--out=DIR]

--variants names the layouts, each the config with its attention changed:
K<k> grouped-query attention with k K/V heads (MHA at the config's heads, MQA
at 1; --kv_heads=8,2,1 means K8,K2,K1), GTA<k> grouped-tied attention with k
tied heads (model.attention='gta', `attention.tied`), MLA<a> multi-head
latent attention with a latent of a (model.attention='mla',
model.mla.kv_lora_rank, `attention.latent`), GLA<a>g<g> MLA's latent in g
groups (model.mla.latent_groups), TPA<r> tensor product attention with keys
and values of rank r (model.attention='tpa', model.tpa.k_rank and v_rank,
`attention.tensor_product`; queries at its default rank, T6's 6), TPAKV<r>
the same with per-head queries (model.tpa.q_rank=0, the paper's
TPA-KV-only); the RoPE key of GTA, MLA and GLA is the layout's default
(head_dim / 2). On gqa_small TPA2 caches 2·2·(8 + 32) = 160 numbers a token
and layer, between GQA-2's 128 and MHA's 512.
On gqa_small (N=8, H=32) the default holds MHA, GQA-2, MQA, GTA at 2 and 1
heads (80 and 48 numbers a token and layer), and MLA and GLA-2 at MQA's 64.
Its grid is batches 1,16,256 and contexts 256,2048, trimmed from the K-only
default's (--kv_heads: 1,16,64,256 x 256,1024,2048) so that seven variants
cost about what three did: 42 cells against 36, in one rough pair of runs
on a loaded 2-core machine 1.3x the CPU time (4.0 against 3.0 minutes) and
no more wall time (10 against 11 minutes).

For each variant, batch and context, times decoding with the whole model
(all layers) against a KV cache filled to `context`, in a jitted `lax.scan`
as `train.sample` does, taking turns with a 1 GiB read for --repeats rounds
(so that the bandwidth a cell is held to is measured under the same load as
the cell), and reports tokens/s (median, min and max over the rounds), the
KV cache's bytes (in all,
and per token: `lm.model.kv_bytes_per_token`), the attention's
arithmetic intensity (its scores' and mix's FLOPs per byte of cache read,
`lm.flops.attention_decode_intensity`), and the roofline: the tokens/s
that reading the cache once per token at the machine's measured read
bandwidth would allow (weights are read once per step as well, and are
included), and the fraction of it reached; also the FLOP roofline, the
tokens/s at the device's peak FLOP/s (`lm.flops.peak_flops`), which on
a CPU comes close where the intensity is high: GQA's G query heads share
each cached key and value, G/2 FLOPs per float32 byte of cache; GTA's
tied state serves both, up to G; MLA's latent serves N heads twice, up to
N, and GLA's N/g (g groups); against the CPU's ~6 FLOPs per byte of
bandwidth. Then, per batch and context, the layouts ranked by KV bytes per
token beside their ranking by tokens/s, and each pair where fewer bytes
decode slower beyond the noise (the fastest round below the other's
slowest). --markdown keeps a section per VM kind (`vm_kind`: CPU model
name, family, vector extension), whose header names the CPU, its vector
flags, the commit and the load average. Writes decode.json and decode.png
under --out.
--equal_params widens the MLP of variants with fewer K/V heads to the
config's parameter count, as `scripts.compare --equal_params` trains them
(GQA variants only).

--llama_cpp: beside each GQA row, llama.cpp decoding the same model
(`studies.llama_cpp_peer`: exported as GGUF at the same weight dtype, in
its own process on as many threads as JAX uses, each sequence in its own
KV stream filled to the same context, the cache in the same dtype), taking
turns with ours; its tokens/s and ours over it. llama.cpp computes SwiGLU
MLPs only, so with --llama_cpp every variant, ours too, is the config with
model.mlp_activation='silu' (the same FLOPs as GELU's). GTA, MLA and GLA
rows have no llama.cpp peer ('-').

--layer: one attention layer's decode step (N=16, H=64, D=1024, float32),
`attention.layer.apply` with its cache as `attention.Attention(decode=True)`
runs it, twice: as users get it (on the CPU, the C++ decode kernel,
`attention.cpu_kernel`, where it is built) and by the pure-JAX path
(`cpu_kernel.disabled`); against the same step in PyTorch eager: the same
projections and RoPE, a preallocated [B, K, S, H] cache written in place,
and SDPA (`enable_gqa`) over the filled prefix; all from the same weights
and cache (a test checks they agree), in this process, taking turns. The
cache is filled to `context` - 8 and every timed step writes the same slot.
Ours is also held to the step's roofline (its weights and cache read once at
the bandwidth of a 1 GiB read timed in the same rounds, or its FLOPs at the
peak). Writes decode_layer.json under --out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention import cpu_kernel, layer
from studies import llama_cpp_peer, report, stats, timing
from studies.variants import GRAMMAR, Variant, variant_list
from infra import provenance
from lm import config_lib, flops
from train import loop
from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       int_list, positive_int)
from lm import model as model_lib
from infra.errors import UserError, pip_install


def main():
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--config', help='default gqa_small (not with --layer)')
  parser.add_argument('--layer', action='store_true',
                      help='one attention layer against PyTorch')
  parser.add_argument('--variants', type=variant_list,
                      help=f'{GRAMMAR}; default {",".join(DEFAULT_VARIANTS)} '
                      '(not with --layer)')
  parser.add_argument('--kv_heads', type=int_list,
                      help='K<k> variants: 8,2,1 is --variants=K8,K2,K1; '
                      'with --layer (default 16,4,1) the layer\'s K')
  parser.add_argument('--batches', type=int_list,
                      help='default 1,16,256 (1,16,64,256 with --kv_heads); '
                      'with --layer 16,256')
  parser.add_argument('--contexts', type=int_list,
                      help='default 256,2048 (256,1024,2048 with '
                      '--kv_heads); with --layer 2048')
  parser.add_argument('--repeats', type=positive_int, default=5)
  parser.add_argument('--kv_cache_dtype', choices=layer.KV_CACHE_DTYPES,
                      help="the cache's storage (default: the config's)")
  parser.add_argument('--equal_params', action='store_true',
                      help="widen the MLP to the config's parameters, as "
                      'scripts.compare --equal_params does')
  parser.add_argument('--llama_cpp', action='store_true',
                      help='llama.cpp decoding the same GQA models beside '
                      'ours (studies.llama_cpp_peer; the model with SwiGLU)')
  parser.add_argument('--out', default='out/decode')
  parser.add_argument('--markdown', help='write the table as a section of '
                      f'this file ("{MODEL_SECTION}", or with --layer '
                      f'"{LAYER_SECTION}")')
  args = parser.parse_args()
  check_output_dir(args.out)
  if args.layer:
    return main_layer(args)
  args.config = args.config or 'gqa_small'
  if args.kv_heads and args.variants:
    raise UserError('--kv_heads and --variants: give one (--kv_heads=8,2,1 '
                    'is --variants=K8,K2,K1)')
  if args.kv_heads:  # The K-only run, and its grid, as before --variants.
    variants = [Variant.parse(f'K{K}') for K in args.kv_heads]
    grid = [1, 16, 64, 256], [256, 1024, 2048]
  else:
    variants = args.variants or [Variant.parse(v) for v in DEFAULT_VARIANTS]
    grid = [1, 16, 256], [256, 2048]
  if args.llama_cpp:
    llama_cpp_peer.check_installed()
  results = run(args.config, variants, args.batches or grid[0],
                args.contexts or grid[1], args.repeats, args.kv_cache_dtype,
                args.equal_params, args.llama_cpp)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  results['provenance'] = provenance.record('scripts.bench_decode', out,
                                           statistics=stats.CONVENTION)
  (out / 'decode.json').write_text(json.dumps(results, indent=1))
  plot(results, out / 'decode.png')
  print(f'wrote {out}/decode.json and decode.png')
  if args.markdown:
    timing.replace_section(args.markdown,
                           f'{MODEL_SECTION} ({vm_kind(results["machine"])})',
                           model_markdown(results, args))


MODEL_SECTION = 'Decoding with the whole model: against the roofline'
DEFAULT_VARIANTS = ('K8', 'K2', 'K1', 'GTA2', 'GTA1', 'MLA48', 'GLA48g2')


def vm_kind(m: dict) -> str:
  """A VM kind's name, which a section of the markdown is kept per: the CPU
  model name, family and widest vector extension ('AMD EPYC, family 26,
  AVX-512')."""
  family = '' if m.get('family') is None else f', family {m["family"]}'
  vectors = ('AVX-512' if m.get('avx512f') else 'AVX2' if m.get('avx2')
             else 'no AVX2')
  return f'{m["cpu"]}{family}, {vectors}'


def model_markdown(results, args) -> str:
  """The rows at each batch and context, against the roofline: the lower
  of the bandwidth and FLOP bounds, max(bytes / bandwidth, FLOPs / peak);
  then each batch's ranking by bytes beside its ranking by speed."""
  m = results['machine']
  peer = any('llama_cpp_tokens_per_sec' in r for r in results['rows'])
  lines = [
      f'Written by `python -m scripts.bench_decode {" ".join(sys.argv[1:])}` '
      f'on {time.strftime("%Y-%m-%d")} at {results["commit"]} on '
      f'{provenance.describe(m)}; vector flags: '
      f'{", ".join(m["vector_flags"] or ["not recorded"])}; load average '
      f'{results["load"][0]:.2f} at the start, {results["load"][1]:.2f} at '
      f'the end (config {args.config}, float32; peak '
      f'{results["peak_flops"] / 1e9:,.0f} GFLOP/s, {results["peak_source"]}, '
      'the peak MFU uses). Each cell: the decode step and a 1 GiB read taking '
      f'turns, {args.repeats} rounds; tokens/s median (min-max over the '
      'rounds); the read bandwidth is the median of that cell\'s reads '
      f'(over the run {results["bandwidth"] / 1e9:.1f} GB/s). Tokens/s '
      'bounds: the weights and the KV cache read once per step at that '
      "bandwidth, and the step's FLOPs at the peak; the roofline is the "
      'lower of the two, and the share is of it. Variants: K<k> GQA with k '
      'K/V heads, GTA<k> grouped-tied with k, MLA<a> a latent of a, '
      'GLA<a>g<g> in g groups, TPA<r> tensor product attention with K/V of '
      'rank r (TPAKV<r>: per-head queries); K is model.num_kv_heads (MLA\'s '
      'and TPA\'s: the query heads). KV bytes per token: all layers\' '
      '(`lm.model.kv_bytes_per_token`); attention FLOPs per KV byte: a '
      "decode step's scores and mix over the cache bytes they read "
      '(`lm.flops.attention_decode_intensity`).' + (
          LLAMA_CAPTION.format(cpu=provenance.describe(m),
                               llama_cpp=results.get('llama_cpp', '?'),
                               wait=results.get('wait_policy') or 'default')
          if peer else ''), '',
      *report.table(MODEL_COLUMNS + LLAMA_COLUMNS * peer,
                    [_model_cells(r, peer) for r in results['rows']])]
  for ranked in rankings(results['rows']):
    lines += ['', *ranking_markdown(ranked)]
  return '\n'.join(lines)


MODEL_COLUMNS = ('variant', 'K', 'batch', 'context', 'tokens/s (min-max)',
                 'KV bytes per token', 'KV cache',
                 'attention FLOPs per KV byte', 'read GB/s',
                 'bandwidth bound', 'FLOP bound', 'share of the roofline')
LLAMA_COLUMNS = ('llama.cpp tokens/s', 'ours / llama.cpp')


def _model_cells(r: dict, peer: bool) -> list:
  """A row of model_markdown's table; llama.cpp's '-' where it has none."""
  cells = [r['variant'], r['num_kv_heads'], r['batch'], r['context'],
           f'{r["tokens_per_sec"]:,.0f} ({r["tokens_per_sec_min"]:,.0f}-'
           f'{r["tokens_per_sec_max"]:,.0f})',
           f'{r["kv_bytes_per_token"]:,.0f}',
           f'{r["kv_bytes"] / 2**20:,.0f} MiB',
           f'{r["attention_flops_per_kv_byte"]:.2f}',
           f'{r["bandwidth"] / 1e9:.1f}',
           f'{r["bandwidth_roofline_tokens_per_sec"]:,.0f}',
           f'{r["compute_roofline_tokens_per_sec"]:,.0f}',
           f'{100 * r["fraction_of_roofline"]:.0f}%']
  if not peer:
    return cells
  if 'llama_cpp_tokens_per_sec' not in r:
    return cells + ['-', '-']
  return cells + [f'{r["llama_cpp_tokens_per_sec"]:,.0f}',
                  f'{r["ours_over_llama_cpp"]:.2f}']


LLAMA_CAPTION = (
    ' llama.cpp: the same model (SwiGLU, model.mlp_activation=silu, ours '
    'too) as GGUF at the same weight dtype, llama-cpp-python {llama_cpp} in '
    'a process of its own on the same threads, each sequence in its own KV '
    'stream (kv_unified off) of the same dtype filled to the context, '
    'taking turns with ours (`studies.llama_cpp_peer`; OMP_WAIT_POLICY '
    '{wait}); CPU: {cpu}.')


def rankings(rows) -> list[dict]:
  """Per batch and context: {'batch', 'context', 'by_bytes' (the variants,
  fewest KV bytes per token first), 'by_speed' (fastest median first),
  'inversions' [(fewer, more)]: each pair where the variant with fewer bytes
  decodes slower than the one with more beyond the noise, its fastest round
  below the other's slowest}."""
  out = []
  for batch, context in dict.fromkeys((r['batch'], r['context'])
                                      for r in rows):
    cell = [r for r in rows if (r['batch'], r['context']) == (batch, context)]
    inversions = [(a['variant'], b['variant']) for a in cell for b in cell
                  if a['kv_bytes_per_token'] < b['kv_bytes_per_token']
                  and a['tokens_per_sec_max'] < b['tokens_per_sec_min']]
    out.append(dict(
        batch=batch, context=context,
        by_bytes=[r['variant'] for r in sorted(
            cell, key=lambda r: r['kv_bytes_per_token'])],
        by_speed=[r['variant'] for r in sorted(
            cell, key=lambda r: -r['tokens_per_sec'])],
        inversions=inversions))
  return out


def ranking_markdown(ranked: dict) -> list[str]:
  """A ranking's table (bytes beside speed) and its verdict."""
  lines = [f'Batch {ranked["batch"]}, context {ranked["context"]}: the '
           'layouts ranked by KV bytes per token (fewest first) and by '
           'tokens/s (fastest first).', '',
           *report.table(('rank', 'by bytes', 'by tokens/s'),
                         [(i + 1, a, b) for i, (a, b) in enumerate(
                             zip(ranked['by_bytes'], ranked['by_speed']))])]
  found = ranked['inversions']
  lines += ['', 'Fewer bytes slower beyond the noise (its fastest round below '
            "the other's slowest): " + (', '.join(
                f'{a} slower than {b}' for a, b in found) if found else
                'none') + '.']
  return lines


def run(config_name, variants, batches, contexts, repeats,
        kv_cache_dtype=None, equal_params=False, llama_cpp=False):
  """{'bandwidth', 'peak_flops', 'peak_source', 'machine', 'commit',
  'load', 'rows'}: a row per variant (a Variant, or an int k for K<k>),
  batch and context (`measure`); llama_cpp: with llama.cpp's tokens/s
  beside the GQA rows (the config with SwiGLU)."""
  variants = [v if isinstance(v, Variant) else Variant.parse(f'K{v}')
              for v in variants]
  if equal_params and not all(v.is_gqa for v in variants):
    others = ','.join(v.name for v in variants if not v.is_gqa)
    raise UserError(f'--equal_params with --variants={others}: it widens '
                    'the MLP by the K/V weights GQA drops (scripts.compare '
                    "--equal_params's rule); give only K<k> variants, or "
                    'drop --equal_params')
  config = config_lib.load(config_name)
  if kv_cache_dtype:
    config.model.kv_cache_dtype = kv_cache_dtype
  if llama_cpp:  # The MLP llama.cpp computes, for ours as well.
    config.model.mlp_activation = 'silu'
  mlp_dim = config.model.mlp_dim

  def set_variant(v):
    v.apply_to(config.model)
    if equal_params:
      config.model.mlp_dim = flops.equal_params_mlp_dim(
          mlp_dim, config.model.num_heads, config.model.num_kv_heads,
          config.model.head_dim)

  for v in variants:  # Every bad setting refused before any measurement.
    set_variant(v)
    try:
      config_lib.validate(config, batch_shards=1)
    except UserError as e:
      raise UserError(f'--variants={v.name}: {e}') from None
  machine, load = provenance.machine(), [os.getloadavg()[0]]
  peak, peak_source = flops.peak_flops()
  read = timing.read_test()
  rows = []
  print(f'{provenance.describe(machine)}; peak {peak / 1e9:,.0f} GFLOP/s '
        f'({peak_source}); load average {load[0]:.2f}')
  print(f'{"variant":>8} {"batch":>6} {"context":>8} {"tokens/s":>10} '
        f'{"min-max":>15} {"KV B/tok":>9} {"GB/s":>5} {"bytes bound":>12} '
        f'{"FLOP bound":>11} {"of the lower":>12}')
  for v in variants:
    set_variant(v)
    mc = config_lib.model_config(config)
    with contextlib.ExitStack() as stack:
      peer = stack.enter_context(llama_cpp_peer.started(
          config, _params(mc, max(contexts) + STEPS))) if (
              llama_cpp and v.is_gqa) else None
      for batch in batches:
        for context in contexts:
          row = measure(v.name, mc, batch, context, repeats, read, peak, peer)
          rows.append(row)
          print_row(row)
  load.append(os.getloadavg()[0])
  return {'bandwidth': float(np.median([r['bandwidth'] for r in rows])),
          'peak_flops': peak, 'peak_source': peak_source, 'machine': machine,
          'commit': provenance.commit(), 'load': load, 'rows': rows,
          **({'llama_cpp': llama_cpp_peer.version(),
              'wait_policy': llama_cpp_peer.wait_policy()}
             if llama_cpp else {})}


STEPS = timing.DECODE_STEPS  # Tokens a timed call decodes.


def _params(mc, max_len: int):
  """The random parameters `timing.decode_steps` decodes with (seed 0)."""
  mc = dataclasses.replace(mc, max_len=max_len)
  return nn.unbox(loop.init_params(model_lib.Transformer(mc), seed=0))


def measure(name, mc, batch, context, repeats, read, peak, peer=None
            ) -> dict:
  """One cell's row: `STEPS` tokens decoded with the whole model against a
  cache filled to `context` (`timing.decode_steps`), taking turns with
  `read` (timing.read_test's (bytes, fn)) and, given a llama.cpp `peer`,
  with it, for `repeats` rounds; tokens/s median, min and max over the
  rounds; the bandwidth of that cell's reads and the roofline at it."""
  options = mc.attention(0)  # The layers' layouts are the same.
  read_bytes, read_fn = read
  self_timed = {}
  if peer is not None:
    peer.decode_setup(batch, context, STEPS,
                      np.dtype(mc.kv_cache_dtype or mc.dtype).name)
    self_timed['llama.cpp'] = lambda: peer.decode_round() * STEPS
  times = timing.all_times({'decode': timing.decode_steps(mc, batch, context,
                                                          STEPS),
                            'read': read_fn}, repeats, self_timed)
  tokens = sorted(batch * STEPS / t for t in times['decode'])
  bandwidth = read_bytes / float(np.median(times['read']))
  bound = flops.decode_roofline_tokens_per_sec(mc, batch, context, bandwidth,
                                               peak)
  median = float(np.median(tokens))
  row = dict(variant=name, num_kv_heads=mc.num_kv_heads,
             attention=options.layout.name,
             layout=dataclasses.asdict(options.layout), mlp_dim=mc.mlp_dim,
             batch=batch, context=context, tokens_per_sec=median,
             tokens_per_sec_min=tokens[0], tokens_per_sec_max=tokens[-1],
             kv_bytes=model_lib.kv_cache_bytes(mc, batch, context),
             kv_bytes_per_token=model_lib.kv_bytes_per_token(
                 dataclasses.replace(mc, max_len=context)),
             attention_flops_per_kv_byte=flops.attention_decode_intensity(
                 options, mc.dtype),
             bandwidth=bandwidth,
             bandwidth_roofline_tokens_per_sec=bound['bandwidth'],
             compute_roofline_tokens_per_sec=bound['compute'],
             roofline_tokens_per_sec=bound['roofline'],
             fraction_of_roofline=median / bound['roofline'])
  if peer is not None:
    theirs = float(np.median(times['llama.cpp']))
    row.update(llama_cpp_tokens_per_sec=batch * STEPS / theirs,
               ours_over_llama_cpp=median / (batch * STEPS / theirs))
  return row


def print_row(row):
  """A row as `run` prints it, under its header."""
  peer = row.get('llama_cpp_tokens_per_sec')
  print(f'{row["variant"]:>8} {row["batch"]:>6} {row["context"]:>8} '
        f'{row["tokens_per_sec"]:>10,.0f} '
        f'{row["tokens_per_sec_min"]:>7,.0f}-'
        f'{row["tokens_per_sec_max"]:<7,.0f} '
        f'{row["kv_bytes_per_token"]:>9,.0f} '
        f'{row["bandwidth"] / 1e9:>5.1f} '
        f'{row["bandwidth_roofline_tokens_per_sec"]:>12,.0f} '
        f'{row["compute_roofline_tokens_per_sec"]:>11,.0f} '
        f'{100 * row["fraction_of_roofline"]:>11.0f}%' + (
            '' if peer is None else
            f'  llama.cpp {peer:>9,.0f} tokens/s, ours/llama.cpp '
            f'{row["ours_over_llama_cpp"]:.2f}'), flush=True)


# One attention layer against PyTorch (--layer).

LAYER_SECTION = 'Decode step of one attention layer: ours against PyTorch'
N, H, D = 16, 64, 1024  # The layer's heads, head dim and model width.
STEPS_LEFT = 8  # Free slots after the filled prefix.


def main_layer(args):
  kv_heads = args.kv_heads or [16, 4, 1]
  batches, contexts = args.batches or [16, 256], args.contexts or [2048]
  given = [f'--{name}' for name in ('config', 'variants', 'kv_cache_dtype',
                                     'equal_params', 'llama_cpp')
           if getattr(args, name)]
  if given:
    raise UserError(f'{" and ".join(given)}: not used with --layer (one '
                    f'float32 layer, N={N}, H={H}, D={D}); drop it')
  for K in kv_heads:
    if N % K:
      raise UserError(f'--kv_heads={K}: the layer has N={N} query heads; '
                      f'give divisors of {N}')
  if min(contexts) <= STEPS_LEFT:
    raise UserError(f'--contexts={min(contexts)}: give more than '
                    f'{STEPS_LEFT} positions')
  torch = _torch()
  peak, _ = flops.peak_flops()
  read = timing.read_test()
  machine, load = provenance.machine(), [os.getloadavg()[0]]
  rows = []
  for batch in batches:
    for context in contexts:
      for K in kv_heads:
        rows.append(measure_layer(K, batch, context, args.repeats, read, peak))
        r = rows[-1]
        print(f'K={K:>2} batch={batch:>4} context={context}: ours '
              f'{r["ours_seconds"] * 1e3:7.2f} ms ('
              f'{100 * r["fraction_of_roofline"]:.0f}% of the roofline)  '
              f'pure-JAX path {r["ours_jax_seconds"] * 1e3:7.2f} ms  torch '
              f'{r["torch_seconds"] * 1e3:7.2f} ms  ours/torch '
              f'{r["ours_over_torch"]:.2f}', flush=True)
  load.append(os.getloadavg()[0])
  env = {'jax': jax.__version__, 'torch': torch.__version__,
         'torch_threads': torch.get_num_threads(),
         'cpu_kernel': (jax.default_backend() == 'cpu'
                        and cpu_kernel.available()),
         'date': time.strftime('%Y-%m-%d'), 'machine': machine, 'load': load,
         'commit': provenance.commit(), 'peak_flops': peak}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'decode_layer.json').write_text(
      json.dumps({'env': env, 'rows': rows, 'provenance': provenance.record(
          'scripts.bench_decode', out, statistics=stats.CONVENTION)}, indent=1))
  print(f'wrote {out}/decode_layer.json')
  if args.markdown:
    timing.replace_section(args.markdown,
                           f'{LAYER_SECTION} ({vm_kind(machine)})',
                           layer_markdown(env, rows, args))


def measure_layer(K, batch, context, repeats, read, peak) -> dict:
  """One cell of --layer: ours, ours by the pure-JAX path and PyTorch
  taking turns with `read` (timing.read_test's (bytes, fn)); each one's
  median seconds (ours' min and max too), and ours against the roofline of
  the step: its weights and cache read once at the bandwidth of the cell's
  reads, or its FLOPs at `peak`, whichever takes longer."""
  contestants = layer_contestants(K, batch, context)
  read_bytes, contestants['read'] = read
  times = timing.all_times(contestants, repeats)
  del contestants  # The caches, before the next ones are built.
  median = {name: float(np.median(t)) for name, t in times.items()}
  options = layer.Options(num_heads=N, num_kv_heads=K, head_dim=H)
  step_bytes = (layer.kv_cache_bytes(options, batch, context, jnp.float32)
                + 4 * sum(int(np.prod(shape)) for shape in
                          options.param_shapes(D).values()))
  bandwidth = read_bytes / median['read']
  step_flops = batch * options.layout.flops_per_token(
      options, D, context - STEPS_LEFT + 1, shares_kv=False, absorbed=True)
  roofline = max(step_bytes / bandwidth, step_flops / peak)
  return dict(num_kv_heads=K, batch=batch, context=context,
              ours_seconds=median['ours'], ours_min_seconds=min(times['ours']),
              ours_max_seconds=max(times['ours']),
              ours_jax_seconds=median['ours_jax'],
              torch_seconds=median['torch'],
              ours_over_torch=median['ours'] / median['torch'],
              bandwidth=bandwidth, step_bytes=step_bytes,
              step_flops=step_flops, roofline_seconds=roofline,
              fraction_of_roofline=roofline / median['ours'])


def _torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise UserError(f'--layer needs PyTorch: {pip_install("bench")}'
                    ) from None
  return torch


def layer_inputs(K: int, batch: int, context: int, seed: int = 0):
  """(options, params, cache, x [B, 1, D]): random weights, a cache of
  `context` slots filled to context - STEPS_LEFT, one token's input."""
  options = layer.Options(num_heads=N, num_kv_heads=K, head_dim=H)
  rng = np.random.default_rng(seed)
  normal = lambda shape: rng.standard_normal(shape, np.float32)
  params = {name: jnp.asarray(normal(shape) * shape[0] ** -0.5)
            for name, shape in options.param_shapes(D).items()}
  cache = {name: jnp.asarray(normal(spec.shape)) for name, spec in
           options.cache_spec(batch, context, jnp.float32).items()
           if name != 'cache_index'}
  cache['cache_index'] = jnp.int32(context - STEPS_LEFT)
  return options, params, cache, jnp.asarray(normal((batch, 1, D)))


def layer_contestants(K: int, batch: int, context: int) -> dict:
  """{'ours', 'ours_jax', 'torch'}: callables running one decode step each
  (ours as users get it, ours by the pure-JAX path, PyTorch's), on the same
  weights and cache; each returns its output [B, 1, D]."""
  options, params, cache, x = layer_inputs(K, batch, context)
  theirs = torch_layer_step(options, params, cache, x)
  ours = ours_layer_step(options, params, cache, x)
  with cpu_kernel.disabled():
    ours_jax = ours_layer_step(options, params, cache, x)
  return {'ours': ours, 'ours_jax': ours_jax, 'torch': theirs}


def ours_layer_step(options, params, cache, x_B1D):
  """`attention.layer.apply` on a decode cache, jitted with the cache
  donated (written in place, as `train.sample` keeps it) and compiled here,
  so that the path chosen now is the one timed; every call writes the same
  slot."""
  def step(params, cache, x_B1D):
    out_B1D, new, _ = layer.apply(options, params, x_B1D, cache=cache)
    return out_B1D, {**new, 'cache_index': cache['cache_index']}

  state = {'cache': jax.tree.map(jnp.copy, cache)}
  run = jax.jit(step, donate_argnums=1).lower(params, state['cache'],
                                              x_B1D).compile()

  def go():
    out_B1D, state['cache'] = run(params, state['cache'], x_B1D)
    return out_B1D
  return go


def torch_layer_step(options, params, cache, x_B1D):
  """The same step in PyTorch eager, as one would write it: [B, K, S, H]
  caches written in place, SDPA over the filled prefix."""
  torch = _torch()
  F = torch.nn.functional
  K = options.num_kv_heads
  Z, S, _ = cache['cached_value'].shape
  B = Z // K
  as_t = lambda a: torch.from_numpy(np.array(a, np.float32))
  w = {name: as_t(params[name]).reshape(D, -1) if name != 'out'
       else as_t(params[name]).reshape(N * H, D)
       for name in ('query', 'key', 'value', 'out')}
  cache_k = as_t(cache['cached_key']).reshape(B, K, H, S).transpose(
      2, 3).contiguous()
  cache_v = as_t(cache['cached_value']).reshape(B, K, S, H)
  x = as_t(x_B1D)
  t = int(cache['cache_index'])
  inv_freq = 1.0 / options.rope_base ** (torch.arange(0, H, 2).float() / H)
  cos, sin = (t * inv_freq).cos(), (t * inv_freq).sin()

  def rope(q):
    q1, q2 = q.chunk(2, dim=-1)
    return torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)

  heads = lambda y, n: y.view(B, 1, n, H).transpose(1, 2)  # [B, n, 1, H]

  def go():
    with torch.inference_mode():
      q = rope(heads(x @ w['query'], N))
      cache_k[:, :, t:t + 1] = rope(heads(x @ w['key'], K))
      cache_v[:, :, t:t + 1] = heads(x @ w['value'], K)
      o = F.scaled_dot_product_attention(
          q, cache_k[:, :, :t + 1], cache_v[:, :, :t + 1],
          scale=options.scale, enable_gqa=K != N)
      return o.transpose(1, 2).reshape(B, 1, N * H) @ w['out']
  return go


def layer_markdown(env, rows, args) -> str:
  argv = ' '.join(sys.argv[1:])
  kernel = ('the C++ decode kernel (`attention.cpu_kernel`)'
            if env['cpu_kernel'] else 'no C++ decode kernel (not built)')
  m = env['machine']
  lines = [
      f'Written by `python -m scripts.bench_decode {argv}` on {env["date"]} '
      f'at {env["commit"]} on {provenance.describe(m)}; vector flags: '
      f'{", ".join(m["vector_flags"] or ["not recorded"])}; load average '
      f'{env["load"][0]:.2f} at the start, {env["load"][1]:.2f} at the end: '
      f'jax {env["jax"]}, torch {env["torch"]} ({env["torch_threads"]} '
      f'threads), float32; one layer, N={N}, H={H}, D={D}, one token per '
      'step against a cache filled to context - 8. Ours as users get it, '
      f'here with {kernel}, and by the pure-JAX path. Medians of '
      f'{args.repeats} steps (ours: min-max), the three and a 1 GiB read '
      'taking turns in one process; the roofline: the step\'s weights and '
      'cache read once at the bandwidth of those reads, or its FLOPs at the '
      f'peak ({env["peak_flops"] / 1e9:,.0f} GFLOP/s), whichever is slower.',
      '', *report.table(
          ('K', 'batch', 'context', 'ours ms (min-max)',
           'share of the roofline', 'read GB/s', 'pure-JAX path ms',
           'PyTorch ms', 'ours / PyTorch'),
          [(r['num_kv_heads'], r['batch'], r['context'],
            f'{r["ours_seconds"] * 1e3:.2f} '
            f'({r["ours_min_seconds"] * 1e3:.2f}-'
            f'{r["ours_max_seconds"] * 1e3:.2f})',
            f'{100 * r["fraction_of_roofline"]:.0f}%',
            f'{r["bandwidth"] / 1e9:.1f}',
            f'{r["ours_jax_seconds"] * 1e3:.2f}',
            f'{r["torch_seconds"] * 1e3:.2f}', f'{r["ours_over_torch"]:.2f}')
           for r in rows])]
  return '\n'.join(lines)


def plot(results, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = results['rows']
  contexts = sorted({r['context'] for r in rows})
  fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4),
                           squeeze=False)
  variants = list(dict.fromkeys(r['variant'] for r in rows))  # In order.
  for ax, context in zip(axes[0], contexts):
    for i, name in enumerate(variants):
      sel = [r for r in rows if r['context'] == context
             and r['variant'] == name]
      b = [r['batch'] for r in sel]
      color = f'C{i % 10}'
      ax.plot(b, [r['tokens_per_sec'] for r in sel], 'o-', color=color,
              label=name)
      ax.plot(b, [r['roofline_tokens_per_sec'] for r in sel], '--',
              color=color)
    ax.set(xscale='log', yscale='log', xlabel='batch',
           ylabel='decoded tokens/s',
           title=f'context {context} (dashed: the roofline)')
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


if __name__ == '__main__':
  exit_on_user_error(main)
