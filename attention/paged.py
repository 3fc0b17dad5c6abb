"""JAX's Pallas paged-attention kernel (TPU) on a `kv_cache.PagedCache`.

Grouped-query attention (`attention.grouped`; the kernel reads per-head
keys and values, no other layout's entries) reads a paged pool with it
where lowering for TPU
(`jax.lax.platform_dependent`, not the host's backend) and the kernel takes
the call; elsewhere, and for what `kernel_refusal` names, the pool's rows
are gathered into the dense layout (`kv_cache.gathered`). The kernel takes
one query per row, the causal mask as a length and a logits soft cap; it
cannot take several new tokens (prefill), a local window (it masks by length
only), int8 pages (it wants a scale per element [K, P, p, H] of absmax /
127.5: broadcasting our per-token scales would copy 4·H bytes per token every
step, four times the int8 pages themselves), a head dim
that is not a multiple of 128 (the TPU's lane width) or a page of fewer
positions than a TPU tile of its dtype has rows (8 for float32, 16 for
bfloat16).
"""

from __future__ import annotations

import jax
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
import jax.numpy as jnp

BLOCK_POSITIONS = 512  # Positions the kernel attends to per block, at most.
LANES = 128  # The TPU's vector width: the kernel's head dim is a multiple.


def kernel_refusal(options, T: int, pool: dict) -> str | None:
  """None if the kernel can take this grouped-query layer's step (T new
  tokens per row, the pool's arrays), else why not. Other layouts' entries
  (a latent, tied states) it cannot read; they do not ask it."""
  p, H = pool['cached_value'].shape[2:]
  dtype = pool['cached_value'].dtype
  rows = 32 // dtype.itemsize  # A TPU tile's rows (8 x 128 words).
  if T != 1:
    return f'{T} new tokens per row (the kernel takes one)'
  if options.local_window is not None:
    return 'a local window (the kernel masks by length only)'
  if 'key_scale' in pool:
    return 'int8 pages (the kernel wants a scale per element)'
  if H % LANES:
    return f'head_dim={H} (the kernel needs a multiple of {LANES})'
  if p % rows:
    return (f'page_size={p} (a {dtype} page needs a multiple of {rows} '
            'positions)')
  return None


def pages_per_block(M: int, p: int) -> int:
  """The kernel's pages per compute block: the most that divide M (which
  it requires) within BLOCK_POSITIONS positions, at least one."""
  return max(d for d in range(1, M + 1)
             if M % d == 0 and (d == 1 or d * p <= BLOCK_POSITIONS))


def kernel_attention(options, q_BTNH, kv):
  """[B, 1, N, H]: each row's query against its pages (kv.paged), by the
  kernel (T = 1, global, float pages). It maps query head n to KV head
  n // G, our order, and attends to positions < length: the row's own
  position + 1. Megacore is left off: the kernel may hang when it is set on
  a chip without it."""
  cache = kv.paged
  table_BM = cache.page_table_BM
  M, p = table_BM.shape[1], cache.arrays['cached_value'].shape[2]
  # The kernel does not scale; scaling q first scales the logits exactly as
  # the gather path does, before the soft cap.
  q_BNH = q_BTNH[:, 0] * jnp.asarray(options.scale, q_BTNH.dtype)
  out_BNH = paged_attention(
      q_BNH, cache.arrays['cached_key'], cache.arrays['cached_value'],
      (kv.query_positions[:, 0] + 1).astype(jnp.int32),
      table_BM.astype(jnp.int32),
      attn_logits_soft_cap=options.logits_soft_cap,
      pages_per_compute_block=pages_per_block(M, p))
  return out_BNH[:, None].astype(q_BTNH.dtype)
