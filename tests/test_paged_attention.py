"""Attention over the paged KV cache (`attention.kv_cache.PagedCache`,
`attention.paged`, `serve.runner`) on each platform, proven
on a CPU host as `tests/test_accelerators.py` proves splash attention: JAX's
TPU paged-attention kernel runs here in Pallas's TPU interpret mode against
the gather path (which `tests/test_serve.py` holds equal to `train.sample`),
and the serving decode step, exported for 'tpu', holds the kernel where it
applies and the gather path where it does not; for 'cuda', the gather path."""

import math
import re

import chex
import flax.linen as nn
import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import pytest

from attention import decode, kv_cache, layer
from attention import paged as paged_kernel
from configs import tiny
from serve import runner as paged
from tests import hlo
from lm import config_lib
from train import loop
from lm.model import Transformer

KERNEL = 'tpu_custom_call'  # How a Pallas TPU (Mosaic) kernel is lowered.
B, N, H, P, p = 3, 8, 128, 12, 16  # H and p: sizes the kernel takes.
# Ragged: a slot inside its second page, one at the end of its last, one at
# position 0 (a single key); unused entries point at page 0.
TABLE_BM = jnp.array([[3, 7, 1, 0], [2, 4, 6, 8], [11, 0, 0, 0]], jnp.int32)
POS_BT = jnp.array([[20], [63], [0]], jnp.int32)


def _paged_kv(pool: dict) -> kv_cache.KV:
  """What a paged step's queries at POS_BT attend to: the pool's rows."""
  M = TABLE_BM.shape[1]
  return kv_cache.KV(None, None, positions_S=jnp.arange(M * p),
                     query_positions=POS_BT,
                     paged=kv_cache.PagedCache(pool, TABLE_BM, POS_BT[:, 0]))


def _gathered_attention(options, q_BTNH, kv):
  """The gather path: the rows gathered, then the dense cache's attention."""
  rows = kv_cache.gathered(kv, options)
  visible = kv_cache.cached_visibility(options, kv, None, q_BTNH.shape[0])
  return decode.heads_major_attention(
      q_BTNH, rows.key, rows.value, visible, scale=options.scale,
      logits_soft_cap=options.logits_soft_cap)


def _pool(*arrays) -> dict:
  return dict(zip(('cached_key', 'cached_value', 'key_scale', 'value_scale'),
                  arrays))


@pytest.mark.slow
@pytest.mark.parametrize('K, soft_cap', [(2, None), (1, 5.0)],
                         ids=['gqa', 'mqa_soft_cap'])  # G = 4 and 8: the
# kernel's two query layouts (G a multiple of 8 or not).
def test_the_kernel_in_interpret_mode_matches_the_gather_path(K, soft_cap):
  options = layer.Options(num_heads=N, num_kv_heads=K, head_dim=H,
                          logits_soft_cap=soft_cap)
  keys = jax.random.split(jax.random.key(K), 3)
  q_BTNH = jax.random.normal(keys[0], (B, 1, N, H), jnp.bfloat16)
  pool = _pool(*(jax.random.normal(k, (K, P, p, H), jnp.bfloat16)
                 for k in keys[1:]))
  assert paged_kernel.kernel_refusal(options, 1, pool) is None
  with pltpu.force_tpu_interpret_mode():
    kernel = paged_kernel.kernel_attention(options, q_BTNH, _paged_kv(pool))
  gathered = _gathered_attention(options, q_BTNH, _paged_kv(pool))
  chex.assert_shape(kernel, (B, 1, N, H))
  # bfloat16 outputs of magnitude ~3: a few units in their last place.
  chex.assert_trees_all_close(kernel.astype(jnp.float32),
                              gathered.astype(jnp.float32), atol=2e-2)


def test_what_the_kernel_refuses_is_named_and_its_blocks_divide_the_table():
  options = layer.Options(num_heads=N, num_kv_heads=2, head_dim=H)
  pages = _pool(*[jnp.zeros((2, P, p, H), jnp.bfloat16)] * 2)
  refusal = paged_kernel.kernel_refusal
  assert refusal(options, 1, pages) is None
  for why, args in [
      ('16 new tokens', (options, 16, pages)),
      ('a local window', (layer.Options(num_heads=N, num_kv_heads=2,
                                        head_dim=H, local_window=8), 1,
                          pages)),
      ('int8 pages', (options, 1, pages | {
          'key_scale': jnp.zeros((2, P, p)),
          'value_scale': jnp.zeros((2, P, p))})),
      ('head_dim=64', (options, 1, _pool(
          *[jnp.zeros((2, P, p, 64), jnp.bfloat16)] * 2))),
      ('page_size=8', (options, 1, _pool(
          *[jnp.zeros((2, P, 8, H), jnp.bfloat16)] * 2)))]:
    assert refusal(*args).startswith(why)
  # A float32 page of 8 positions fills a tile.
  assert refusal(options, 1, _pool(
      *[jnp.zeros((2, P, 8, H), jnp.float32)] * 2)) is None
  assert paged_kernel.pages_per_block(64, 16) == 32  # 512 positions.
  assert paged_kernel.pages_per_block(6, 16) == 6
  assert paged_kernel.pages_per_block(7, 128) == 1  # Only 1 divides 7 within 512.


def _serving(**model):
  """A random tiny serving model: by default the kernel's head dim, in
  bfloat16."""
  config = tiny.get_config()
  config.model.update({**dict(num_heads=4, head_dim=H, max_len=64,
                             dtype='bfloat16', param_dtype='bfloat16'),
                       **model})
  mc = config_lib.model_config(config)
  return paged.serving_model(mc, nn.unbox(loop.init_params(Transformer(mc),
                                                           0)))


def _page_gathers(module_text: str, M: int) -> int:
  """How many gathers read [.., M, p, H] pages of a pool."""
  return sum(f'x{M}x{p}x{H}x' in line for line in module_text.splitlines()
             if 'stablehlo.gather' in line)


@pytest.mark.slow
@pytest.mark.parametrize('model, T, gathering', [
    (dict(num_kv_heads=2), 1, 0),
    # A local owner gathers; the global layer sharing its pages runs the kernel.
    (dict(num_kv_heads=1, attention_pattern='LG', local_window=8,
          kv_share=2), 1, 1),
    (dict(num_kv_heads=2, kv_cache_dtype='int8'), 1, 2),
    (dict(num_kv_heads=2), p, 2)],  # Prefill: a page of new tokens.
    ids=['gqa', 'mqa_local_global_shared', 'int8_falls_back',
         'prefill_falls_back'])
def test_the_serving_step_lowers_for_tpu_with_the_paged_kernel_and_for_cuda(
    model, T, gathering):
  """The decode step's model call (`serve.engine`'s step) as exported; of
  its two layers, `gathering` take the gather path."""
  serving, params = _serving(**model)
  M = 4  # 64 positions in pages of 16.
  pool = paged.empty_pool(serving.config, 9, p)
  step = lambda params, pool, tokens, table, lengths: paged.forward(
      serving, params, pool, tokens, table, lengths)
  args = (params, pool, jnp.zeros((B, T), jnp.int32),
          jnp.zeros((B, M), jnp.int32), jnp.zeros((B,), jnp.int32))
  tpu = hlo.lowered(step, *args, platform='tpu')
  assert (KERNEL in tpu) == (gathering < 2)
  # The kernel reads the pool in place: a layer it serves gathers nothing;
  # one it does not gathers its keys and values.
  assert _page_gathers(tpu, M) == 2 * gathering
  # Nor is the pool transposed, broadcast or converted for it.
  pool_size = pool['layers_0']['attention']['cached_value'].size
  assert bool(hlo.big_shapes(tpu, pool_size)) == (gathering > 0)
  cuda = hlo.lowered(step, *args, platform='cuda')
  assert KERNEL not in cuda and _page_gathers(cuda, M) >= 2  # The control.
  assert hlo.big_shapes(cuda, pool_size)  # The gathered pages, transposed.


@pytest.mark.slow
@pytest.mark.parametrize('model', [
    dict(attention='mla', num_kv_heads=4), dict(attention='gta',
                                                num_kv_heads=2)],
    ids=['mla', 'gta'])
def test_other_layouts_lower_for_tpu_without_the_paged_kernel(model):
  """The kernel reads per-head keys and values: only grouped-query attention
  asks it (`attention.grouped`); a latent or tied pool is gathered. The
  control: the 'gqa' step above, at the same sizes, holds the kernel."""
  serving, params = _serving(**model)
  pool = paged.empty_pool(serving.config, 9, p)
  step = lambda params, pool, tokens, table, lengths: paged.forward(
      serving, params, pool, tokens, table, lengths)
  tpu = hlo.lowered(step, params, pool, jnp.zeros((B, 1), jnp.int32),
                    jnp.zeros((B, 4), jnp.int32), jnp.zeros((B,), jnp.int32),
                    platform='tpu')
  assert 'stablehlo.gather' in tpu and KERNEL not in tpu


@pytest.mark.slow
def test_the_gather_path_writes_the_pool_in_place_and_copies_none_of_it():
  """Compiled for this CPU, the step's only pool-sized float arrays are its
  inputs and the in-place scatters of the new tokens."""
  serving, params = _serving(num_kv_heads=2, head_dim=8, dtype='float32',
                             param_dtype='float32')
  pool = paged.empty_pool(serving.config, 61, 8)  # 61: no other array's size.
  size = pool['layers_0']['attention']['cached_key'].size
  args = (params, pool, jnp.zeros((B, 1), jnp.int32),
          jnp.zeros((B, 8), jnp.int32), jnp.zeros((B,), jnp.int32))
  step = lambda params, pool, tokens, table, lengths: paged.forward(
      serving, params, pool, tokens, table, lengths)

  def pool_sized(donate):
    text = jax.jit(step, donate_argnums=(1,) if donate else ()).lower(
        *args).compile().as_text()
    return [(name, op) for name, dims, op in re.findall(
        r'%([\w.\-]+) = f32\[([\d,]+)\]\{[\d,]*\} ([\w\-]+)\(', text)
            if math.prod(map(int, dims.split(','))) == size
            and op != 'parameter' and 'scatter' not in name + op]

  assert pool_sized(donate=True) == []
  # The control: a pool not donated is copied before the scatter.
  assert pool_sized(donate=False)
