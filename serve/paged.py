"""The model's forward pass over a paged KV cache (the device side).

The cache is a pool of P pages per layer that owns K/V (not those sharing
another's, kv_share), each page `page_size` (p) consecutive positions of one
sequence for all K heads, in the layout of JAX's TPU paged-attention kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`), which both attention
paths below read in place: keys and values [K, P, p, H], and for int8 pages
the float32 scales [K, P, p] (one per token and KV head, as
`attention.layer.quantize` makes them). Page j of every layer belongs to the
same sequence. A sequence's page table [M] lists its pages in position order
(M = max pages per sequence, ceil(max_len / p)); position t is at
page_table[t // p], offset t % p. Page 0 is never handed out: unused
page-table entries and idle slots point at it, so their writes land there
and nothing reads them.

The network is `train.model.Transformer` itself: `forward` runs it with
flax's method interception replacing each attention layer's cache step by
`_paged_attention` (the layer's own projections, `attention.layer.project`,
RoPE and grouped attention), so no layer of the model is written twice.
Each slot of the batch has its own position (`lengths`), so sequences at
different points share one step.

Attention over the pages (`attend`) has two paths, chosen by the platform
being lowered for (`jax.lax.platform_dependent`), not the host's:

  tpu      the Pallas paged-attention kernel (`_kernel_attention`): each
           slot's query against its pages, fetched by DMA from the pool by
           page table and length; nothing gathered.
  others   the gather path (`_gathered_attention`): each slot's M pages
           gathered (a copy of the batch's pages, never of the pool) into
           the heads-major layout of `attention.decode.heads_major_attention`.

The kernel takes one query per slot, the causal mask as a length and a
logits soft cap; `kernel_refusal` names what it cannot take, and those calls
take the gather path on TPU too: several new tokens (prefill), a local
window (it has no window mask), int8 pages (it wants a scale per element
[K, P, p, H] of absmax / 127.5 and dequantizes to bfloat16: broadcasting our
per-token scales to that would copy 4·H bytes per token every step, four
times the int8 pages themselves), a head dim that is not a multiple of 128
(the TPU's lane width, which its blocks need to lower) and a page of fewer
positions than a TPU tile of its dtype has rows (8 for float32, 16 for
bfloat16).

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
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
import jax.numpy as jnp

from attention import Attention, decode, layer
from attention.core import attention_mask
from attention.rope import apply_rope
from train import model as model_lib

COLLECTION = 'pages'  # The flax collection holding each layer's pool.
BLOCK_POSITIONS = 512  # Positions the kernel attends to per block, at most.
LANES = 128  # The TPU's vector width: the kernel's head dim is a multiple.
# A layer's pool arrays, in the order of `Pages`' fields.
NAMES = ('cached_key', 'cached_value', 'key_scale', 'value_scale')


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


def pool_spec(options: layer.Options, num_pages: int, page_size: int, dtype
              ) -> dict[str, jax.ShapeDtypeStruct]:
  """One layer's pool: keys and values [K, P, p, H] in the cache's dtype
  (kv_cache_dtype, else `dtype`), int8 pages' float32 scales [K, P, p]; the
  arrays of `Options.cache_spec` for P sequences of p tokens, laid out as
  the TPU kernel reads them (so the same bytes)."""
  K, P, p, H = options.num_kv_heads, num_pages, page_size, options.head_dim
  stored = jnp.dtype(options.kv_cache_dtype or dtype)
  spec = {'cached_key': ((K, P, p, H), stored),
          'cached_value': ((K, P, p, H), stored)}
  if options.kv_cache_dtype == 'int8':
    spec |= {'key_scale': ((K, P, p), jnp.float32),
             'value_scale': ((K, P, p), jnp.float32)}
  return {name: jax.ShapeDtypeStruct(shape, kind)
          for name, (shape, kind) in spec.items()}


def empty_pool(config: model_lib.ModelConfig, num_pages: int,
               page_size: int) -> dict:
  """{layer name: {'attention': its zeroed pool arrays (`pool_spec`)}}, for
  the layers that own K/V."""
  dtype = config.kv_cache_dtype or config.dtype
  pool = {}
  for i in range(config.num_layers):
    if config.shares_kv(i):
      continue
    spec = pool_spec(global_options(config.attention(i)), num_pages,
                     page_size, dtype)
    pool[f'layers_{i}'] = {'attention': {
        name: jnp.zeros(s.shape, s.dtype) for name, s in spec.items()}}
  return pool


class Pages(NamedTuple):
  """A layer's pool once the step's tokens are written, handed to the
  layers that share it: keys and values [K, P, p, H], int8 scales
  [K, P, p] or None."""
  key: jax.Array
  value: jax.Array
  key_scale: jax.Array | None = None
  value_scale: jax.Array | None = None


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


def _paged_attention(module: Attention, x_BTD, shared: Pages | None,
                     pos_BT, page_table_BM):
  """What `attention.layer.apply` computes for one attention layer, its cache
  step paged: (out [B, T, D], the written pages for the layers sharing
  them)."""
  options = module.options
  N, H = options.num_heads, options.head_dim
  B, T, D = x_BTD.shape
  params = dict(module.variables['params'])
  w = {name: p.astype(module.dtype) for name, p in params.items()}
  q_BTNH, k_BTKH, v_BTKH = layer.project(
      options, params, w, x_BTD.astype(module.dtype), shared is not None)
  if options.use_rope:
    rope = lambda x: apply_rope(x, pos_BT, base=options.rope_base,
                                scaling=options.rope_scaling)
    q_BTNH = rope(q_BTNH)
    k_BTKH = None if k_BTKH is None else rope(k_BTKH)
  if shared is None:
    pool = {name: module.get_variable(COLLECTION, name) for name in NAMES
            if module.has_variable(COLLECTION, name)}
    pool = _write(pool, k_BTKH, v_BTKH, pos_BT, page_table_BM)
    for name, value in pool.items():
      module.put_variable(COLLECTION, name, value)
    shared = Pages(*(pool.get(name) for name in NAMES))
  out_BTNH = attend(options, q_BTNH, shared, pos_BT, page_table_BM)
  out_XD = out_BTNH.reshape(B * T, N * H) @ w['out'].reshape(N * H, D)
  return out_XD.reshape(B, T, D), shared


def _write(pool: dict, k_BTKH, v_BTKH, pos_BT, page_table_BM) -> dict:
  """The pool with each slot's T new keys and values at their pages and
  offsets, in place (int8 with their scales, as `attention.layer` stores
  them)."""
  p = pool['cached_value'].shape[2]
  page_BT = jnp.take_along_axis(page_table_BM, pos_BT // p, axis=1,
                                mode='clip')
  at_BT = pos_BT % p
  new = {'cached_key': k_BTKH, 'cached_value': v_BTKH}
  if 'key_scale' in pool:
    new['cached_key'], new['key_scale'] = layer.quantize(k_BTKH, axis=3)
    new['cached_value'], new['value_scale'] = layer.quantize(v_BTKH, axis=3)
  # Adjacent advanced indices keep their place: pool[:, page_BT, at_BT] is
  # [K, B, T, H] (scales [K, B, T]), the new tokens with K moved first.
  return {name: pool[name].at[:, page_BT, at_BT].set(
      jnp.moveaxis(x, 2, 0).astype(pool[name].dtype))
          for name, x in new.items()}


def kernel_refusal(options: layer.Options, T: int, pages: Pages) -> str | None:
  """None if the TPU paged-attention kernel can take this layer's step,
  else why not (that call takes the gather path on TPU too)."""
  p, H = pages.value.shape[2:]
  rows = 32 // pages.value.dtype.itemsize  # A TPU tile's rows (8 x 128 words).
  if T != 1:
    return f'{T} new tokens per slot (the kernel takes one)'
  if options.local_window is not None:
    return 'a local window (the kernel masks by length only)'
  if pages.key_scale is not None:
    return 'int8 pages (the kernel wants a scale per element)'
  if H % LANES:
    return f'head_dim={H} (the kernel needs a multiple of {LANES})'
  if p % rows:
    return (f'page_size={p} (a {pages.value.dtype} page needs a multiple of '
            f'{rows} positions)')
  return None


def attend(options: layer.Options, q_BTNH, pages: Pages, pos_BT,
           page_table_BM):
  """The T queries of each slot, at positions pos_BT, against its pages
  (positions up to its own; the layer's window, soft cap and scale) ->
  [B, T, N, H]: the Pallas kernel where lowering for TPU and it takes the
  call (`kernel_refusal`), else the gather path."""
  gather = lambda: _gathered_attention(options, q_BTNH, pages, pos_BT,
                                       page_table_BM)
  if kernel_refusal(options, q_BTNH.shape[1], pages):
    return gather()
  return jax.lax.platform_dependent(
      tpu=lambda: _kernel_attention(options, q_BTNH, pages, pos_BT,
                                    page_table_BM),
      default=gather)


def pages_per_block(M: int, p: int) -> int:
  """The kernel's pages per compute block: the most that divide M (which
  it requires) within BLOCK_POSITIONS positions, at least one."""
  return max(d for d in range(1, M + 1)
             if M % d == 0 and (d == 1 or d * p <= BLOCK_POSITIONS))


def _kernel_attention(options: layer.Options, q_BTNH, pages: Pages, pos_BT,
                      page_table_BM):
  """`attend` by JAX's Pallas paged-attention kernel (T = 1, global, float
  pages). It maps query head n to KV head n // G, our order, and attends to
  positions < length: a slot's own position + 1. Megacore is left off: the
  kernel may hang when it is set on a chip without it."""
  B, T, N, H = q_BTNH.shape
  M, p = page_table_BM.shape[1], pages.value.shape[2]
  # The kernel does not scale; scaling q first scales the logits exactly as
  # the gather path does, before the soft cap.
  q_BNH = q_BTNH[:, 0] * jnp.asarray(options.scale, q_BTNH.dtype)
  out_BNH = paged_attention(
      q_BNH, pages.key, pages.value, (pos_BT[:, 0] + 1).astype(jnp.int32),
      page_table_BM.astype(jnp.int32),
      attn_logits_soft_cap=options.logits_soft_cap,
      pages_per_compute_block=pages_per_block(M, p))
  return out_BNH[:, None].astype(q_BTNH.dtype)


def _gathered_attention(options: layer.Options, q_BTNH, pages: Pages, pos_BT,
                        page_table_BM):
  """`attend` by gathering each slot's pages: any T, window and pages."""
  gathered = _gather(pages, page_table_BM)
  S = gathered.value.shape[1]
  # Position s of the gathered pages is position s of the sequence.
  visible_BTS = attention_mask(pos_BT, jnp.arange(S), is_causal=True,
                               local_window=options.local_window)
  return decode.heads_major_attention(
      q_BTNH, gathered.key, gathered.value, visible_BTS[:, None],
      scale=options.scale, logits_soft_cap=options.logits_soft_cap,
      key_scale_ZS=gathered.key_scale, value_scale_ZS=gathered.value_scale)


def _gather(pages: Pages, page_table_BM) -> Pages:
  """Each slot's pages, K heads each (never one per query head), in the
  heads-major layout `attention.decode.heads_major_attention` reads: keys
  [B·K, H, S], values [B·K, S, H], scales [B·K, S] (Z = B·K rows). Only the
  batch's pages are read; the pool is indexed where it lies."""
  B, M = page_table_BM.shape
  K, _, p, H = pages.value.shape
  keys_KBMpH = pages.key[:, page_table_BM]
  values_KBMpH = pages.value[:, page_table_BM]
  keys_ZHS = keys_KBMpH.transpose(1, 0, 4, 2, 3).reshape(B * K, H, M * p)
  values_ZSH = values_KBMpH.transpose(1, 0, 2, 3, 4).reshape(B * K, M * p, H)
  scales = [None, None]
  if pages.key_scale is not None:
    scales = [s[:, page_table_BM].transpose(1, 0, 2, 3).reshape(B * K, M * p)
              for s in (pages.key_scale, pages.value_scale)]
  return Pages(keys_ZHS, values_ZSH, *scales)


def serving_model(config: model_lib.ModelConfig, params, kv_cache_dtype=None
                  ) -> tuple[model_lib.Transformer, dict]:
  """(the model as `forward` runs it, its parameters): layers unrolled, no
  rematerialisation, kv_cache_dtype if given."""
  config = dataclasses.replace(
      config, remat=False,
      kv_cache_dtype=kv_cache_dtype or config.kv_cache_dtype)
  return model_lib.unroll_layers(model_lib.Transformer(config), params)
