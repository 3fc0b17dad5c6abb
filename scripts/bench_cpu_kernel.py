"""The CPU decode kernel against the pure-JAX path: one layer's decode step.

  python -m scripts.bench_cpu_kernel [--layout=paged|dense] [--kv_heads=8,2,1]
      [--batch=128] [--context=1024] [--fill=1.0] [--repeats=7]
      [--tied | --latent]

One attention layer's step (`attention.layer.apply`: N=8, H=64, D=512,
float32, one new token per row) against a cache of --context positions per
row, compiled twice: with the C++ kernel (`attention.cpu_kernel`) and by the
pure-JAX path (`cpu_kernel.disabled`), then timed taking turns. paged: the
serving engine's pool, pages of 16 shuffled in the pool (as an engine's
are after a while), rows holding from fill/2 to fill of the context (drawn
per row: an engine's rows differ); dense: `attention.Attention`'s cache,
every row holding fill of it. --tied: a grouped-tied (GTA) layer
(`attention.tied`, a shared RoPE key of H/2 = 32), whose kernel reads each
tied state once where the JAX path's two matmuls read it twice. --latent: a
multi-head latent attention layer (`attention.latent`, a latent of 2·H =
128 and a RoPE key of H/2 = 32, absorbed), --kv_heads naming its latent
groups (1: MLA, 2: GLA-2; default 1,2), whose kernel reads each latent once
for the logits and the weighted sum. Prints one line per K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attention import cpu_kernel, kv_cache, layer
from attention.grouped import GQA
from attention.latent import MLA
from attention.tied import GTA
from studies import timing
from infra.cli import (ArgumentParser, exit_on_user_error, int_list,
                       positive_int)
from infra.errors import UserError

N, H, D, PAGE = 8, 64, 512, 16


def layer_options(kind: str, K: int) -> layer.Options:
  """The benchmarked layer: grouped-query attention with K KV heads, GTA
  with K tied heads, or MLA with a latent of 2·H in K groups."""
  if kind == 'latent':
    return layer.Options(num_heads=N, num_kv_heads=N, head_dim=H,
                         layout=MLA(kv_lora_rank=2 * H, latent_groups=K))
  return layer.Options(num_heads=N, num_kv_heads=K, head_dim=H,
                       layout=GTA() if kind == 'tied' else GQA())


def contestants(layout: str, K: int, batch: int, context: int, fill: float,
                seed: int = 0, kind: str = 'grouped') -> dict:
  """{'kernel', 'jax'}: callables running the same step (of a `kind`
  layer: `layer_options`), each returning its output [B, 1, D]."""
  options = layer_options(kind, K)
  rng = np.random.default_rng(seed)
  normal = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  params = {name: normal(shape) * shape[0] ** -0.5
            for name, shape in options.param_shapes(D).items()}
  x_B1D = normal((batch, 1, D))
  held = max(1, int(fill * context)) - 1  # Positions before the new token.
  if layout == 'paged':
    M = context // PAGE
    arrays = {name: normal(s.shape) for name, s in kv_cache.paged_spec(
        options, 1 + batch * M, PAGE, jnp.float32).items()}
    table_BM = jnp.asarray(1 + rng.permutation(batch * M).reshape(batch, M),
                           jnp.int32)
    lengths_B = jnp.asarray(rng.integers(held // 2, held + 1, batch))
    cache = lambda arrays: kv_cache.PagedCache(arrays, table_BM, lengths_B)
  else:
    arrays = {name: normal(s.shape) for name, s in options.cache_spec(
        batch, context, jnp.float32).items() if name != 'cache_index'}
    arrays['cache_index'] = jnp.int32(held)
    cache = lambda arrays: arrays

  def compiled():  # A fresh function: traced, so the path chosen now.
    step = lambda params, arrays, x_B1D: layer.apply(
        options, params, x_B1D, cache=cache(arrays))[0]
    return jax.jit(step).lower(params, arrays, x_B1D).compile()

  kernel = compiled()
  with cpu_kernel.disabled():
    pure_jax = compiled()
  return {'kernel': lambda: kernel(params, arrays, x_B1D),
          'jax': lambda: pure_jax(params, arrays, x_B1D)}


def main():
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--layout', choices=('paged', 'dense'), default='paged')
  parser.add_argument('--kv_heads', type=int_list,
                      help='default 8,2,1 (--latent: the groups, 1,2)')
  parser.add_argument('--batch', type=positive_int, default=128)
  parser.add_argument('--context', type=positive_int, default=1024)
  parser.add_argument('--fill', type=float, default=1.0)
  parser.add_argument('--repeats', type=positive_int, default=7)
  kinds = parser.add_mutually_exclusive_group()
  kinds.add_argument('--tied', action='store_true',
                     help='a grouped-tied (GTA) layer')
  kinds.add_argument('--latent', action='store_true',
                     help='a multi-head latent (MLA, GLA) layer')
  args = parser.parse_args()
  kind = 'tied' if args.tied else 'latent' if args.latent else 'grouped'
  kv_heads = args.kv_heads or ([1, 2] if args.latent else [8, 2, 1])
  if not cpu_kernel.available():
    raise UserError('the CPU kernel is not built: pip install -e . (or python '
                    'setup.py build_ext --inplace) with a C++ compiler')
  if not 0 < args.fill <= 1:
    raise UserError(f'--fill={args.fill}: give a fraction in (0, 1]')
  if args.layout == 'paged' and args.context % PAGE:
    raise UserError(f'--context={args.context}: give a multiple of the page '
                    f'size, {PAGE}')
  for K in kv_heads:
    if N % K:
      raise UserError(f'--kv_heads={K}: the layer has N={N} query heads; '
                      f'give divisors of {N}')
  for K in kv_heads:
    times = timing.median_times(
        contestants(args.layout, K, args.batch, args.context, args.fill,
                    kind=kind),
        args.repeats)
    name = {'grouped': '', 'tied': 'GTA ', 'latent': 'MLA '}[kind]
    print(f'{name}{args.layout} K={K} batch={args.batch} '
          f'context={args.context} fill={args.fill}: '
          f'pure-JAX path {times["jax"] * 1e3:.2f} ms, '
          f'kernel {times["kernel"] * 1e3:.2f} ms, '
          f'{times["jax"] / times["kernel"]:.2f}x', flush=True)


if __name__ == '__main__':
  exit_on_user_error(main)
