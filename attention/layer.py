"""The attention layer as one pure function: projections, RoPE, KV cache, attention.

Both module APIs are thin shells over `apply`: `attention.Attention` (linen)
and `attention.nnx.Attention` (NNX) own the parameters and the cache and call
it, so they compute the same thing from the same arrays. Names and shapes,
shared by both (D model width; the letters of `attention.core`):

  params  query [D, N, H], key [D, K, H], value [D, K, H], out [N, H, D]
          (fused_qkv: qkv [D, N + 2K, H] in place of the first three)
          qkv_bias: query_bias [N, H], key_bias and value_bias [K, H]
          (fused: qkv_bias [N + 2K, H]); qk_norm: query_norm, key_norm [H]
  cache   cached_key [B·K, H, max_len], cached_value [B·K, max_len, H];
          cache_index int32

The cache is heads-major (Z = B·K rows, one per batch row and KV head, as
MaxText's and the TPU kernels' [B, K, S, H] with its first two axes as one):
each KV head's positions are one contiguous matrix, and a decoded token's
attention is, per row, the group's [G, H] queries times the [H, S] keys, then
the [G, S] probabilities times the [S, H] values: two batched matmuls that
read the cache where it lies, with their operands in the layout the CPU's
matmul kernels take without repacking (keys stored [H, S]: 1.5-1.8x faster
decoding for K < N than [S, H]; BENCHMARKS.md). Writing a token updates both
in place (a test checks the compiled step for copies). The token-major
[B, S, K, H] layout made XLA copy the cache at every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from attention import decode
from attention.core import as_4d_mask, attention_mask, dot_product_attention
from attention.rope import RopeScaling, apply_rope

Array = jax.Array
CACHE_NAMES = ('cached_key', 'cached_value', 'cache_index')


@dataclasses.dataclass(frozen=True)
class Options:
  """What the layer computes, apart from its arrays: the one declaration of
  the attention options and their defaults, which both module shells take
  (see `attention.Attention` for what each means)."""
  num_heads: int
  num_kv_heads: int | None = None  # None: N (MHA).
  head_dim: int = 64
  is_causal: bool = True
  use_rope: bool = True
  rope_base: float = 10_000.0
  local_window: int | None = None
  logits_soft_cap: float | None = None
  fused_qkv: bool = False
  qkv_bias: bool = False  # Biases on the Q/K/V projections (Qwen2).
  qk_norm: bool = False  # RMSNorm of each query and key head (Qwen3).
  norm_eps: float = 1e-6  # Of qk_norm.
  norm_scale_offset: float = 1.0  # qk_norm multiplies by offset + weight.
  rope_scaling: RopeScaling | None = None

  def __post_init__(self):
    if self.num_kv_heads is None:  # As for the modules: None means N (MHA).
      object.__setattr__(self, 'num_kv_heads', self.num_heads)
    N, K = self.num_heads, self.num_kv_heads
    if K < 1 or N % K:
      raise ValueError(
          f'num_heads={N} must be a multiple of num_kv_heads={K}; pick '
          f'num_kv_heads from the divisors of {N}')

  @classmethod
  def of(cls, source, **given) -> 'Options':
    """The options read from `source` (a module or a model config), but for
    those `given`; one that `source` lacks is an error, so that a renamed
    field cannot fall back to its default unnoticed."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in given]
    missing = [name for name in names if not hasattr(source, name)]
    if missing:
      raise TypeError(f'{type(source).__name__} has no field '
                      f'{", ".join(missing)} of attention.layer.Options; add '
                      'it, or pass it to Options.of')
    return cls(**{name: getattr(source, name) for name in names}, **given)

  def param_shapes(self, d_model: int) -> dict[str, tuple[int, ...]]:
    D, N, K, H = d_model, self.num_heads, self.num_kv_heads, self.head_dim
    heads = {'qkv': N + 2 * K} if self.fused_qkv else {
        'query': N, 'key': K, 'value': K}
    shapes = {name: (D, E, H) for name, E in heads.items()}
    if self.qkv_bias:
      shapes |= {f'{name}_bias': (E, H) for name, E in heads.items()}
    if self.qk_norm:
      shapes |= {'query_norm': (H,), 'key_norm': (H,)}
    return {**shapes, 'out': (N, H, D)}

  def param_init(self, name: str, kernel_init):
    """The initialiser of parameter `name`: kernels `kernel_init`, biases
    zero, norm weights the identity."""
    if name.endswith('_bias'):
      return jax.nn.initializers.zeros
    if name.endswith('_norm'):
      return jax.nn.initializers.constant(1.0 - self.norm_scale_offset)
    return kernel_init

  def cache_shapes(self, batch: int, max_len: int) -> dict[str, tuple]:
    Z, H = batch * self.num_kv_heads, self.head_dim
    return {'cached_key': (Z, H, max_len), 'cached_value': (Z, max_len, H),
            'cache_index': ()}


def apply(options: Options, params: dict[str, Array], x_BTD: Array, *,
          mask: Array | None = None, cache: dict[str, Array] | None = None,
          dtype: Any = jnp.float32) -> tuple[Array, dict[str, Array] | None]:
  """Self-attention of x_BTD [B, T, D]; (out [B, T, D], the updated cache).

  With a cache (decoding), the T tokens are written at `cache_index` and
  attend to everything cached so far; without one, to each other.
  mask: True = attend, a key-padding [B, S] or anything broadcastable to
  [B, N, T, S] (S = T, or max_len with a cache).
  """
  N, K = options.num_heads, options.num_kv_heads
  B, T, D = x_BTD.shape
  w = {name: p.astype(dtype) for name, p in params.items()}
  # The projections as plain [X, D] x [D, E·H] matmuls, tokens as one axis
  # X = B·T and heads with their features as one: XLA's CPU matmuls contract
  # or keep two axes (B and T, or E and H) at about half the speed.
  x_XD = x_BTD.astype(dtype).reshape(B * T, D)
  H = options.head_dim

  def project(name):
    y_XEH = (x_XD @ w[name].reshape(D, -1)).reshape(B * T, -1, H)
    if options.qkv_bias:
      y_XEH = y_XEH + w[f'{name}_bias']
    return y_XEH.reshape(B, T, -1, H)

  if options.fused_qkv:
    qkv_BTEH = project('qkv')  # E = N + 2K.
    q_BTNH, k_BTKH, v_BTKH = jnp.split(qkv_BTEH, [N, N + K], axis=2)
  else:
    q_BTNH, k_BTKH, v_BTKH = project('query'), project('key'), project('value')
  if options.qk_norm:
    q_BTNH = _rms_norm(q_BTNH, params['query_norm'], options)
    k_BTKH = _rms_norm(k_BTKH, params['key_norm'], options)

  start = 0 if cache is None else cache['cache_index']
  pos_T = start + jnp.arange(T)
  if options.use_rope:
    rope = lambda x: apply_rope(x, pos_T, base=options.rope_base,
                                scaling=options.rope_scaling)
    q_BTNH, k_BTKH = rope(q_BTNH), rope(k_BTKH)

  if cache is None:
    out_BTNH = dot_product_attention(
        q_BTNH, k_BTKH, v_BTKH, mask=mask, is_causal=options.is_causal,
        local_window=options.local_window,
        logits_soft_cap=options.logits_soft_cap)
  else:
    cache = _write_cache(cache, k_BTKH, v_BTKH)
    max_len = cache['cached_value'].shape[1]
    # S = max_len cached positions; positions decide what each query sees,
    # and slots not written yet are hidden.
    k_pos_S = jnp.arange(max_len)
    visible_TS = k_pos_S[None, :] < start + T
    structural_TS = attention_mask(pos_T, k_pos_S, is_causal=options.is_causal,
                                   local_window=options.local_window)
    if structural_TS is not None:
      visible_TS &= structural_TS
    visible = visible_TS[None, None]
    if mask is not None:
      visible = as_4d_mask(mask, B, max_len) & visible
    out_BTNH = decode.heads_major_attention(
        q_BTNH, cache['cached_key'], cache['cached_value'], visible,
        scale=options.head_dim**-0.5, logits_soft_cap=options.logits_soft_cap)
    # Under jit an overflowing write is clamped onto the last slots; make that
    # visible as NaN rather than silently attending to the wrong tokens.
    out_BTNH = jnp.where(start + T > max_len, jnp.nan, out_BTNH)
  out_XD = out_BTNH.reshape(B * T, N * H) @ w['out'].reshape(N * H, D)
  return out_XD.reshape(B, T, D), cache


def _rms_norm(x_BTEH, weight_H, options: Options):
  """RMSNorm over each head's H features, in float32."""
  x = x_BTEH.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True)
                        + options.norm_eps)
  scale_H = options.norm_scale_offset + weight_H.astype(jnp.float32)
  return (x * scale_H).astype(x_BTEH.dtype)


def _write_cache(cache, k_BTKH, v_BTKH):
  """The cache with T positions written at its index, in place."""
  B, T, K, H = k_BTKH.shape
  start = cache['cache_index']
  shapes = {name: cache[name].shape for name in ('cached_key', 'cached_value')}
  max_len = shapes['cached_value'][1]
  if shapes != {'cached_key': (B * K, H, max_len),
                'cached_value': (B * K, max_len, H)}:
    raise ValueError(
        f'decode step gives K/V {(B, T, K, H)} but the cache holds keys '
        f"{shapes['cached_key']} = [B·K, H, max_len] and values "
        f"{shapes['cached_value']} = [B·K, max_len, H]; init the cache with "
        'the same batch size and heads')
  _check_capacity(start, T, max_len)
  keys_ZHT = k_BTKH.transpose(0, 2, 3, 1).reshape(B * K, H, T)
  values_ZTH = v_BTKH.transpose(0, 2, 1, 3).reshape(B * K, T, H)
  write = lambda c, x, at: jax.lax.dynamic_update_slice(c, x.astype(c.dtype),
                                                         at)
  return {'cached_key': write(cache['cached_key'], keys_ZHT, (0, 0, start)),
          'cached_value': write(cache['cached_value'], values_ZTH,
                                (0, start, 0)),
          'cache_index': start + T}


def _check_capacity(index, T, max_len):
  """Raises when the cache index is concrete (eager use) and would overflow."""
  try:
    index = int(index)
  except jax.errors.ConcretizationTypeError:
    return  # Under jit: `apply` returns NaN for the overflowing step.
  if index + T > max_len:
    raise ValueError(
        f'KV cache overflow: writing {T} token(s) at position {index} exceeds '
        f'max_len={max_len}; init the cache with a longer [B, max_len, D] input')


def kv_cache_bytes(options: Options, batch: int, length: int, dtype) -> int:
  """Bytes of one layer's KV cache: 2 (K and V) x B x length x K x H."""
  return (2 * batch * length * options.num_kv_heads * options.head_dim
          * jnp.dtype(dtype).itemsize)
