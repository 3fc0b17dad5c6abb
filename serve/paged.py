"""The model's forward pass over a paged KV cache (the device side).

The cache is a pool of P pages per layer that owns K/V (not those sharing
another's, kv_share), each page `page_size` (p) consecutive positions of one
sequence for all K heads, stored as `attention.layer.Options.cache_spec`
stores P sequences of p tokens: keys [P·K, H, p], values [P·K, p, H], and
for int8 caches the float32 scales [P·K, p]. Page j of every layer belongs
to the same sequence. A sequence's page table [M] lists its pages in
position order (M = max pages per sequence, ceil(max_len / p)); position t
is at page_table[t // p], offset t % p. Page 0 is never handed out: unused
page-table entries and idle slots point at it, so their writes land there
and nothing reads them.

The network is `train.model.Transformer` itself: `forward` runs it with
flax's method interception replacing each attention layer's cache step by
`_paged_attention` (the layer's own projections, RoPE and grouped attention,
`attention.layer` and `attention.decode`), so no layer of the model is
written twice. Each slot of the batch has its own position (`lengths`), so
sequences at different points share one step.

Local layers keep the same pages as global ones and see their window through
the mask (a local layer's pages outside its window are not freed early).
Letters: B slots, T new tokens, M pages per sequence, p page size, P pages,
K KV heads, G = N / K, H head dim, S = M·p gathered positions.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention import Attention, decode, layer
from attention.core import attention_mask
from attention.rope import apply_rope
from train import model as model_lib

COLLECTION = 'pages'  # The flax collection holding each layer's pool.


def global_options(options: layer.Options) -> layer.Options:
  """A layer's options as its pages store them: every position kept (a
  local layer reads its window out of them through the mask)."""
  return dataclasses.replace(options, local_window=None)


def page_bytes(config: model_lib.ModelConfig, page_size: int) -> int:
  """Bytes of one page across all layers: the model's KV-cache bytes
  (`train.model.kv_cache_bytes`, the one count) for one sequence of
  page_size tokens, every layer keeping all of them."""
  every_global = dataclasses.replace(config, attention_pattern='G',
                                     local_window=None)
  return model_lib.kv_cache_bytes(every_global, 1, page_size)


def empty_pool(config: model_lib.ModelConfig, num_pages: int,
               page_size: int) -> dict:
  """{layer name: {'attention': its zeroed pool arrays}}, for the layers
  that own K/V:
  `cache_spec` of num_pages sequences of page_size tokens."""
  dtype = config.kv_cache_dtype or config.dtype
  pool = {}
  for i in range(config.num_layers):
    if config.shares_kv(i):
      continue
    spec = global_options(config.attention(i)).cache_spec(
        num_pages, page_size, dtype)
    pool[f'layers_{i}'] = {'attention': {
        name: jnp.zeros(s.shape, s.dtype) for name, s in spec.items()
        if name != 'cache_index'}}
  return pool


class Gathered(NamedTuple):
  """A layer's K/V gathered for the batch, handed to the layers that share
  it: keys [B·K, H, S], values [B·K, S, H], int8 scales [B·K, S] or None."""
  key: jax.Array
  value: jax.Array
  key_scale: jax.Array | None
  value_scale: jax.Array | None


def forward(model: model_lib.Transformer, params, pool: dict, tokens_BT,
            page_table_BM, lengths_B):
  """(logits [B, T, V] float32, the pool with the T tokens written).

  tokens_BT: each slot's next T tokens, at positions lengths_B + 0..T-1;
  page_table_BM: each slot's pages. The model must be unrolled
  (`train.model.unroll_layers`) and not rematerialised; learned position
  tables are not supported (their index is one for the batch).
  """
  B, T = tokens_BT.shape
  pos_BT = lengths_B[:, None] + jnp.arange(T)

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if not (isinstance(module, Attention) and context.method_name == '__call__'):
      return next_fun(*args, **kwargs)
    return _paged_attention(module, args[0], kwargs.get('shared'), pos_BT,
                            page_table_BM)

  with nn.intercept_methods(intercept):
    logits_BTV, mutated = model.apply(
        {'params': params, COLLECTION: pool}, tokens_BT, mutable=[COLLECTION])
  return logits_BTV, mutated[COLLECTION]


def _paged_attention(module: Attention, x_BTD, shared: Gathered | None,
                     pos_BT, page_table_BM):
  """What `attention.layer.apply` computes for one attention layer, its cache
  step paged: (out [B, T, D], the gathered K/V for the layers sharing them)."""
  options = module.options
  N, K, H = options.num_heads, options.num_kv_heads, options.head_dim
  B, T, D = x_BTD.shape
  params = dict(module.variables['params'])
  w = {name: p.astype(module.dtype) for name, p in params.items()}
  q_BTNH, k_BTKH, v_BTKH = layer._project(  # pylint: disable=protected-access
      options, params, w, x_BTD.astype(module.dtype), shared is not None)
  if options.use_rope:
    rope = lambda x: apply_rope(x, pos_BT, base=options.rope_base,
                                scaling=options.rope_scaling)
    q_BTNH = rope(q_BTNH)
    k_BTKH = None if k_BTKH is None else rope(k_BTKH)
  if shared is None:
    pool = {name: module.get_variable(COLLECTION, name)
            for name in ('cached_key', 'cached_value', 'key_scale',
                         'value_scale')
            if module.has_variable(COLLECTION, name)}
    pool = _write(pool, k_BTKH, v_BTKH, pos_BT, page_table_BM)
    for name, value in pool.items():
      module.put_variable(COLLECTION, name, value)
    shared = _gather(pool, page_table_BM, K)
  S = shared.value.shape[1]
  # Position s of the gathered pages is position s of the sequence.
  visible_BTS = attention_mask(pos_BT, jnp.arange(S), is_causal=True,
                               local_window=options.local_window)
  out_BTNH = decode.heads_major_attention(
      q_BTNH, shared.key, shared.value, visible_BTS[:, None],
      scale=options.scale, logits_soft_cap=options.logits_soft_cap,
      key_scale_ZS=shared.key_scale, value_scale_ZS=shared.value_scale)
  out_XD = out_BTNH.reshape(B * T, N * H) @ w['out'].reshape(N * H, D)
  return out_XD.reshape(B, T, D), shared


def _write(pool: dict, k_BTKH, v_BTKH, pos_BT, page_table_BM) -> dict:
  """The pool with each slot's T new keys and values at their pages and
  offsets (int8 with their scales, as `attention.layer` stores them)."""
  B, T, K, H = k_BTKH.shape
  p = pool['cached_value'].shape[1]
  P = pool['cached_value'].shape[0] // K
  page_BT = jnp.take_along_axis(page_table_BM, pos_BT // p, axis=1,
                                mode='clip')
  at_BT = pos_BT % p
  keys_PKHp = pool['cached_key'].reshape(P, K, H, p)
  values_PKpH = pool['cached_value'].reshape(P, K, p, H)
  if 'key_scale' in pool:
    k_BTKH, k_scale_BTK = layer.quantize(k_BTKH, axis=3)
    v_BTKH, v_scale_BTK = layer.quantize(v_BTKH, axis=3)
    scales = {
        'key_scale': pool['key_scale'].reshape(P, K, p).at[
            page_BT, :, at_BT].set(k_scale_BTK).reshape(P * K, p),
        'value_scale': pool['value_scale'].reshape(P, K, p).at[
            page_BT, :, at_BT].set(v_scale_BTK).reshape(P * K, p)}
  else:
    scales = {}
  # Advanced indices split by a slice put their [B, T] first: [B, T, K, H].
  keys_PKHp = keys_PKHp.at[page_BT, :, :, at_BT].set(
      k_BTKH.astype(keys_PKHp.dtype))
  values_PKpH = values_PKpH.at[page_BT, :, at_BT, :].set(
      v_BTKH.astype(values_PKpH.dtype))
  return {'cached_key': keys_PKHp.reshape(P * K, H, p),
          'cached_value': values_PKpH.reshape(P * K, p, H), **scales}


def _gather(pool: dict, page_table_BM, K: int) -> Gathered:
  """Each slot's pages, K heads each (never one per query head), in the
  heads-major layout `attention.decode.heads_major_attention` reads."""
  B, M = page_table_BM.shape
  PK, p, H = pool['cached_value'].shape
  P = PK // K
  keys_BMKHp = pool['cached_key'].reshape(P, K, H, p)[page_table_BM]
  values_BMKpH = pool['cached_value'].reshape(P, K, p, H)[page_table_BM]
  keys_ZHS = keys_BMKHp.transpose(0, 2, 3, 1, 4).reshape(B * K, H, M * p)
  values_ZSH = values_BMKpH.transpose(0, 2, 1, 3, 4).reshape(B * K, M * p, H)
  scales = [None, None]
  if 'key_scale' in pool:
    scales = [pool[name].reshape(P, K, p)[page_table_BM].transpose(
        0, 2, 1, 3).reshape(B * K, M * p)
              for name in ('key_scale', 'value_scale')]
  return Gathered(keys_ZHS, values_ZSH, *scales)


def serving_model(config: model_lib.ModelConfig, params, kv_cache_dtype=None
                  ) -> tuple[model_lib.Transformer, dict]:
  """(the model as `forward` runs it, its parameters): layers unrolled, no
  rematerialisation, kv_cache_dtype if given."""
  config = dataclasses.replace(
      config, remat=False,
      kv_cache_dtype=kv_cache_dtype or config.kv_cache_dtype)
  return model_lib.unroll_layers(model_lib.Transformer(config), params)
