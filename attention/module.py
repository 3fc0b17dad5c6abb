"""`Attention`: the Flax (linen) module around `dot_product_attention`.

One knob, `num_kv_heads` (K), selects the variant; the parameter shapes show it:

  query kernel  [D, N, H]        key and value kernels  [D, K, H]
  output kernel [N, H, D]        KV cache               [B, max_len, K·H] x 2

The cache is the [B, S, K, H] layout with each position's K heads side by side
as one K·H row. Stored 4-D, XLA fuses the one-token write with the reshape that
the decode matmul reads through, and so copies the whole cache, in every layer
at every step (a 5-10x slower decode); flat, the write happens in place and
attention reads the cache where it lies.

With `fused_qkv=True` the three input projections are one kernel [D, N + 2K, H]
(one matmul producing (N + 2K)·H features), split into Q, K and V by heads.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention.core import attention_mask, dot_product_attention
from attention.rope import apply_rope

Dtype = Any
default_kernel_init = nn.initializers.lecun_normal()


class Attention(nn.Module):
  """Self-attention with N query heads sharing K key/value heads.

  Attributes:
    num_heads: N, query heads.
    num_kv_heads: K, key/value heads; N must be a multiple. K = N is MHA,
      1 < K < N GQA, K = 1 MQA. None means N.
    head_dim: H.
    dtype: computation dtype (e.g. bfloat16 on GPU/TPU); logits and softmax
      stay float32.
    param_dtype: parameter dtype.
    is_causal: causal self-attention (the default); False for bidirectional.
    use_rope: rotary position embeddings on Q and K.
    rope_base: RoPE wavelength base.
    local_window: sliding-window size w, or None for global attention.
    logits_soft_cap: Gemma-2 style soft cap on the logits, or None.
    fused_qkv: one [D, N + 2K, H] input projection instead of three.
    partitioned: annotate the kernels with logical axis names (embed,
      q_heads, kv_heads, head_dim) for sharding with flax's partitioning
      rules; `init` then returns `nn.LogicallyPartitioned` boxes.
    decode: autoregressive decoding with a KV cache (flax's convention):
      `init` on a [B, max_len, D] input creates the cache in the 'cache'
      collection; each `apply(..., mutable=['cache'])` on the next token(s)
      appends them and attends to everything cached so far.
    kernel_init: initialiser of all kernels.
  """
  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int = 64
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  is_causal: bool = True
  use_rope: bool = True
  rope_base: float = 10_000.0
  local_window: int | None = None
  logits_soft_cap: float | None = None
  fused_qkv: bool = False
  partitioned: bool = False
  decode: bool = False
  kernel_init: nn.initializers.Initializer = default_kernel_init

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @nn.compact
  def __call__(self, x_BTD: jax.Array, mask: jax.Array | None = None
               ) -> jax.Array:
    """Attends x to itself.

    Args:
      x_BTD: [B, T, D] inputs.
      mask: optional boolean mask, True = attend: a key-padding mask [B, S] or
        anything broadcastable to [B, N, T, S], where S = T, or max_len when
        decoding. Combined with the causal and window masks.

    Returns:
      [B, T, D] in `dtype`.
    """
    N, K, H = self.num_heads, self.kv_heads, self.head_dim
    if K < 1 or N % K:
      raise ValueError(
          f'num_heads={N} must be a multiple of num_kv_heads={K}; pick '
          f'num_kv_heads from the divisors of {N}')
    D = x_BTD.shape[-1]
    x_BTD = x_BTD.astype(self.dtype)

    def kernel(name, shape, axes):
      init = self.kernel_init
      if self.partitioned:
        init = nn.with_logical_partitioning(init, axes)
      w = self.param(name, init, shape, self.param_dtype)
      return w.astype(self.dtype)

    if self.fused_qkv:
      w_DCH = kernel('qkv', (D, N + 2 * K, H),  # C = N + 2K heads.
                     ('embed', None, 'head_dim'))
      qkv_BTCH = jnp.einsum('BTD,DCH->BTCH', x_BTD, w_DCH)
      q_BTNH, k_BTKH, v_BTKH = jnp.split(qkv_BTCH, [N, N + K], axis=2)
    else:
      kv_axes = ('embed', 'kv_heads', 'head_dim')
      q_BTNH = jnp.einsum('BTD,DNH->BTNH', x_BTD, kernel(
          'query', (D, N, H), ('embed', 'q_heads', 'head_dim')))
      k_BTKH = jnp.einsum('BTD,DKH->BTKH', x_BTD,
                          kernel('key', (D, K, H), kv_axes))
      v_BTKH = jnp.einsum('BTD,DKH->BTKH', x_BTD,
                          kernel('value', (D, K, H), kv_axes))

    B, T = x_BTD.shape[:2]
    # `init` with decode=True creates the cache from the [B, max_len, D]
    # template and runs a plain pass; later calls append to it.
    appending = self.decode and self.has_variable('cache', 'cached_key')
    if self.decode:  # [B, max_len, K·H]: see the module docstring.
      cached_k = self.variable('cache', 'cached_key', jnp.zeros,
                               (B, T, K * H), k_BTKH.dtype)
      cached_v = self.variable('cache', 'cached_value', jnp.zeros,
                               (B, T, K * H), v_BTKH.dtype)
      cache_index = self.variable('cache', 'cache_index',
                                  lambda: jnp.array(0, jnp.int32))
    start = cache_index.value if appending else 0
    pos_T = start + jnp.arange(T)
    if self.use_rope:
      q_BTNH = apply_rope(q_BTNH, pos_T, base=self.rope_base)
      k_BTKH = apply_rope(k_BTKH, pos_T, base=self.rope_base)

    if not appending:
      out_BTNH = dot_product_attention(
          q_BTNH, k_BTKH, v_BTKH, mask=mask, is_causal=self.is_causal,
          local_window=self.local_window, logits_soft_cap=self.logits_soft_cap)
    else:
      cache_B, max_len, cache_C = cached_k.value.shape
      if (cache_B, cache_C) != (B, K * H):
        raise ValueError(
            f'decode step gives K/V {(B, T, K, H)} but the cache holds '
            f'{cached_k.value.shape} = [B, max_len, K·H]; init the cache with '
            'the same batch size and heads')
      _check_capacity(start, T, max_len)
      cached_k.value = jax.lax.dynamic_update_slice(
          cached_k.value, k_BTKH.reshape(B, T, K * H), (0, start, 0))
      cached_v.value = jax.lax.dynamic_update_slice(
          cached_v.value, v_BTKH.reshape(B, T, K * H), (0, start, 0))
      cache_index.value = start + T
      key_BSKH = cached_k.value.reshape(B, max_len, K, H)
      value_BSKH = cached_v.value.reshape(B, max_len, K, H)
      # S = max_len cached positions; positions decide what each query
      # sees, and slots not written yet are hidden.
      k_pos_S = jnp.arange(max_len)
      visible_TS = k_pos_S[None, :] < start + T
      structural_TS = attention_mask(pos_T, k_pos_S, is_causal=self.is_causal,
                                     local_window=self.local_window)
      if structural_TS is not None:
        visible_TS &= structural_TS
      visible = visible_TS[None, None]
      if mask is not None:
        visible = _as_4d(mask) & visible
      out_BTNH = dot_product_attention(
          q_BTNH, key_BSKH, value_BSKH, mask=visible,
          logits_soft_cap=self.logits_soft_cap)
      # Under jit an overflowing write is clamped onto the last slots; make
      # that visible as NaN rather than silently attending to the wrong tokens.
      out_BTNH = jnp.where(start + T > max_len, jnp.nan, out_BTNH)

    return jnp.einsum('BTNH,NHD->BTD', out_BTNH, kernel(
        'out', (N, H, D), ('q_heads', 'head_dim', 'embed')))

  def kv_cache_bytes(self, batch: int, length: int, dtype: Dtype = None) -> int:
    """Bytes of this layer's KV cache: 2 (K and V) x B x length x K x H."""
    itemsize = np.dtype(dtype or self.dtype).itemsize
    return 2 * batch * length * self.kv_heads * self.head_dim * itemsize

  def num_params(self, d_model: int) -> int:
    """Parameters of this layer for model width D: D·N·H + 2·D·K·H + N·H·D."""
    return d_model * self.head_dim * 2 * (self.num_heads + self.kv_heads)


def _as_4d(mask):
  mask = jnp.asarray(mask)
  if mask.ndim == 2:  # Key padding [B, S].
    return mask[:, None, None, :]
  return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def _check_capacity(index, T, max_len):
  """Raises when the cache index is concrete (eager use) and would overflow."""
  try:
    index = int(index)
  except jax.errors.ConcretizationTypeError:
    return  # Under jit: the NaN poisoning in `_update_cache` reports it.
  if index + T > max_len:
    raise ValueError(
        f'KV cache overflow: writing {T} token(s) at position {index} exceeds '
        f'max_len={max_len}; init the cache with a longer [B, max_len, D] input')
