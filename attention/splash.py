"""TPU splash attention (Pallas): flash attention with GQA native, no K/V copies.

`jax.experimental.pallas.ops.tpu.splash_attention` takes one sequence's query
[N, T, H] and key/value [K, S, H] with N % K == 0, and maps query head n to KV
head n // (N // K), our order; it skips blocks its mask hides and recomputes
probabilities in its backward kernels. Here it is vmapped over the batch and,
under a mesh that splits heads over 'tensor', run per shard with `shard_map`
(a Mosaic kernel cannot be partitioned by XLA).

What it takes, and `supports` checks: causal (bottom-right aligned for T < S,
as everywhere here), full, or a local window, and a logits soft cap; no
other mask; T and S multiples of 128 (the block sizes are the largest of
512, 256, 128 that divide them); otherwise `attention.core` uses the dense
einsum. On CPU it runs in Pallas's interpret mode, which the tests use.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as kernel_lib)
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as mask_lib)
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

BLOCKS = (512, 256, 128)  # Tried in this order; the TPU's tiles are 128.
HEADS_AXIS = 'tensor'  # The mesh axis that splits attention heads, if any.


def block_size(length: int) -> int | None:
  """The largest of BLOCKS dividing `length`, or None."""
  return next((b for b in BLOCKS if length % b == 0), None)


def supports(T: int, S: int, *, mask, is_causal: bool) -> str | None:
  """None if splash can take the call, else why not (for the error message)."""
  if mask is not None:
    return 'an explicit mask (use is_causal and local_window)'
  if block_size(T) is None or block_size(S) is None:
    return f'T={T} and S={S} must be multiples of {BLOCKS[-1]}'
  if is_causal and T > S:
    return f'is_causal with T={T} > S={S}'
  return None


@functools.lru_cache(maxsize=64)
def _kernel(N: int, T: int, S: int, is_causal: bool, local_window, soft_cap,
            interpret: bool):
  """The splash kernel for one sequence: q [N, T, H], k/v [K, S, H]."""
  offset = S - T  # Bottom-right alignment: query i sits at position S - T + i.
  if local_window is not None:
    right = 0 if is_causal else local_window - 1
    head_mask = mask_lib.LocalMask((T, S), (local_window - 1, right), offset)
  elif is_causal:
    head_mask = mask_lib.CausalMask((T, S), offset=offset)
  else:
    head_mask = mask_lib.FullMask((T, S))
  bq, bkv = block_size(T), block_size(S)
  blocks = kernel_lib.BlockSizes(
      block_q=bq, block_kv=bkv, block_kv_compute=bkv,
      block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
      block_q_dq=bq, block_kv_dq=bkv)
  # Concrete mask tables even when first built inside a jit trace, so the
  # cached kernel holds no tracer of that trace.
  with jax.ensure_compile_time_eval():
    return kernel_lib.make_splash_mha(
        mask=mask_lib.MultiHeadMask([head_mask] * N), block_sizes=blocks,
        head_shards=1, q_seq_shards=1, attn_logits_soft_cap=soft_cap,
        interpret=interpret)


def splash_attention(query, key, value, *, is_causal: bool, scale: float,
                     local_window: int | None = None,
                     logits_soft_cap: float | None = None,
                     interpret: bool = False):
  """query [B, T, N, H], key/value [B, S, K, H] -> [B, T, N, H].

  Under a mesh of several devices (`jax.set_mesh`), each shard runs the
  kernel on its rows of the batch (split over the axes other than 'tensor')
  and its N / tensor query heads with the KV heads they use: its own
  K / tensor when tensor divides K, else the one replicated KV head its
  query heads share. XLA cannot partition a Mosaic kernel itself.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return _attend(query, key, value, is_causal, scale, local_window,
                   logits_soft_cap, interpret, kv_start=None)
  return _sharded(query, key, value, mesh, is_causal=is_causal, scale=scale,
                  local_window=local_window, logits_soft_cap=logits_soft_cap,
                  interpret=interpret)


def can_shard(N: int, K: int, tensor: int) -> bool:
  """Whether each 'tensor' shard's query heads have whole KV heads of their own."""
  if N % tensor:
    return False
  local = N // tensor  # Query heads per shard.
  G = N // K
  return K % tensor == 0 or G % local == 0


def _sharded(query, key, value, mesh, **options):
  N, K = query.shape[2], key.shape[2]
  tensor = mesh.shape.get(HEADS_AXIS, 1)
  if not can_shard(N, K, tensor):
    raise ValueError(
        f"implementation='splash' under mesh.tensor={tensor}: N={N} query "
        f'heads and K={K} KV heads do not split into whole groups per shard; '
        'use a tensor size that divides K, or one for which N / tensor '
        'divides N / K')
  batch = tuple(a for a in mesh.axis_names if a != HEADS_AXIS) or None
  if batch and query.shape[0] % math.prod(mesh.shape[a] for a in batch):
    batch = None  # A batch these axes cannot split (decoding one sequence).
  kv_split = K % tensor == 0
  heads = HEADS_AXIS if HEADS_AXIS in mesh.axis_names else None
  q_spec = P(batch, None, heads, None)
  kv_spec = P(batch, None, heads if kv_split else None, None)

  def per_shard(q_BTnH, k_BSkH, v_BSkH):
    kv_start = None
    if not kv_split:  # All K heads are here; take the one this shard uses.
      first_head = jax.lax.axis_index(HEADS_AXIS) * q_BTnH.shape[2]
      kv_start = first_head // (N // K)
    return _attend(q_BTnH, k_BSkH, v_BSkH, kv_start=kv_start, **options)

  return jax.shard_map(per_shard, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                       out_specs=q_spec, check_vma=False)(query, key, value)


def _attend(query, key, value, is_causal, scale, local_window,
            logits_soft_cap, interpret, kv_start):
  B, T, N, H = query.shape
  S = key.shape[1]
  if kv_start is not None:  # One KV head for all of this shard's query heads.
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, kv_start, 1, axis=2)
    key, value = take(key), take(value)
  kernel = _kernel(N, T, S, is_causal, local_window, logits_soft_cap,
                   interpret)
  # The kernel does not scale; scaling q first scales the logits exactly as
  # the dense path does, before the soft cap.
  q_BNTH = (query * jnp.asarray(scale, query.dtype)).transpose(0, 2, 1, 3)
  heads_major = lambda x_BSKH: x_BSKH.transpose(0, 2, 1, 3)
  out_BNTH = jax.vmap(kernel)(q_BNTH, heads_major(key), heads_major(value))
  return out_BNTH.transpose(0, 2, 1, 3).astype(query.dtype)
