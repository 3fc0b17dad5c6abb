"""The attention layer as one pure function: projections, RoPE, KV cache, attention.

Both module APIs are thin shells over `apply`: `attention.Attention` (linen)
and `attention.nnx.Attention` (NNX) own the parameters and the cache and call
it, so they compute the same thing from the same arrays. Names and shapes,
shared by both (D model width; the letters of `attention.core`):

  params  query [D, N, H], key [D, K, H], value [D, K, H], out [N, H, D]
          (fused_qkv: qkv [D, N + 2K, H] in place of the first three)
          qkv_bias: query_bias [N, H], key_bias and value_bias [K, H]
          (fused: qkv_bias [N + 2K, H]); qk_norm: query_norm, key_norm [H]
  cache   cached_key [B·K, H, S], cached_value [B·K, S, H]; cache_index
          int32; kv_cache_dtype='int8': key_scale and value_scale [B·K, S]
          float32. S = max_len, or the window w for causal local attention.
          Multi-head latent attention (kv_lora_rank set) has its own
          parameters and a latent cache: `attention.latent`.

The cache is heads-major (Z = B·K rows, one per batch row and KV head, as
MaxText's and the TPU kernels' [B, K, S, H] with its first two axes as one):
each KV head's positions are one contiguous matrix, and a decoded token's
attention is, per row, the group's [G, H] queries times the [H, S] keys, then
the [G, S] probabilities times the [S, H] values: two batched matmuls that
read the cache where it lies, with their operands in the layout the CPU's
matmul kernels take without repacking (keys stored [S, H], the matmul
repacked them every step: 416 tokens/s against 911 for K=2 at batch 256,
gqa_small shapes, context 2048; commit 00b62d1). Writing a token updates both
in place (a test checks the compiled step for copies).

A causal local layer keeps only its window: slot s holds the latest position
p with p % w == s (a ring buffer), so its cache is w/max_len the size. An
int8 cache stores each token's K and V per KV head as int8 times one float32
scale (symmetric, absmax/127); the matmuls read the int8 arrays and the
scales multiply the [G, S] logits and probabilities, so no float copy of the
cache is made.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from attention import decode, latent, numerics
from attention.core import as_4d_mask, attention_mask, dot_product_attention
from attention.rope import RopeScaling, apply_rope

Array = jax.Array
KVCacheDtype = Literal['float32', 'bfloat16', 'int8']
KV_CACHE_DTYPES = KVCacheDtype.__args__
CACHE_NAMES = ('cached_key', 'cached_value', 'key_scale', 'value_scale',
               # Multi-head latent attention's (`attention.latent`).
               'cached_latent', 'cached_rope_key', 'latent_scale',
               'rope_key_scale',
               'cache_index')  # The scales: int8 caches only.


@dataclasses.dataclass(frozen=True)
class Options:
  """What the layer computes, apart from its arrays: the one declaration of
  the attention options and their defaults, which both module shells take
  (the linen `attention.Attention` as fields of its own, generated from
  these)."""
  num_heads: int  # N, query heads.
  num_kv_heads: int | None = None  # K, key/value heads; None: N (MHA).
  head_dim: int = 64  # H.
  is_causal: bool = True  # False: bidirectional.
  use_rope: bool = True  # Rotary position embeddings on Q and K.
  rope_base: float = 10_000.0  # RoPE's wavelength base.
  local_window: int | None = None  # Sliding window w; None: global.
  logits_soft_cap: float | None = None  # c·tanh(logits / c) (Gemma 2).
  # Logits are q·k times query_pre_attn_scalar ** -0.5; None: head_dim
  # (Gemma 2/3 set it, e.g. d_model / num_heads for Gemma 2 27B).
  query_pre_attn_scalar: float | None = None
  fused_qkv: bool = False  # One [D, N + 2K, H] input projection, not three.
  qkv_bias: bool = False  # Biases on the Q/K/V projections (Qwen2).
  # RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3), with
  # norm_eps, multiplying by norm_scale_offset + weight.
  qk_norm: bool = False
  norm_eps: float = 1e-6
  norm_scale_offset: float = 1.0
  # RoPE frequency scaling for long contexts ('linear', 'llama3'), or None.
  rope_scaling: RopeScaling | None = None
  # How the decode cache stores K and V: None (the compute dtype),
  # 'float32', 'bfloat16', or 'int8' (a float32 scale per token and KV
  # head); a decode-time choice, the full pass is unaffected.
  kv_cache_dtype: KVCacheDtype | None = None
  # Multi-head latent attention (DeepSeek-V2/V3, `attention.latent`), named
  # as DeepSeek's configs: a kv_lora_rank-wide latent (0 or None: not MLA),
  # an optional q_lora_rank query latent, a qk_rope_head_dim RoPE key shared
  # by the heads, per-head qk_nope_head_dim keys and v_head_dim values (None:
  # head_dim; RoPE dims None: head_dim / 2 with use_rope, else 0).
  kv_lora_rank: int | None = None
  q_lora_rank: int | None = None
  qk_rope_head_dim: int | None = None
  qk_nope_head_dim: int | None = None
  v_head_dim: int | None = None
  # MLA's RMSNorm of the latent (DeepSeek's kv_a_layernorm); a checkpoint
  # converted into MLA has none (an RMSNorm is not linear).
  latent_norm: bool = True
  # MLA converted from a RoPE model (train.to_mla): RoPE pair j of the
  # RoPE key and queries turns at frequency rope_pairs[j] of a head_dim-wide
  # RoPE (pairs kept from the source's); None: a qk_rope_head_dim-wide RoPE.
  rope_pairs: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.num_kv_heads is None:  # As for the modules: None means N (MHA).
      object.__setattr__(self, 'num_kv_heads', self.num_heads)
    N, K = self.num_heads, self.num_kv_heads
    if K < 1 or N % K:
      raise ValueError(
          f'num_heads={N} must be a multiple of num_kv_heads={K}; pick '
          f'num_kv_heads from the divisors of {N}')
    if self.kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
      raise ValueError(f'kv_cache_dtype={self.kv_cache_dtype!r}; use None '
                       f'(the compute dtype) or one of {KV_CACHE_DTYPES}')
    latent.resolve(self)

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

  @property
  def scale(self) -> float:
    """The logits' multiplier: query_pre_attn_scalar (or H; MLA: the
    query's qk_nope_head_dim + qk_rope_head_dim) ** -0.5."""
    if self.kv_lora_rank:
      return latent.scale(self)
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def param_shapes(self, d_model: int, *, shared_kv: bool = False
                   ) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape; shared_kv: the layer reads another layer's
    K/V (cross-layer sharing) and has only the query's and output's."""
    if self.kv_lora_rank:
      return latent.param_shapes(self, d_model, shared_kv=shared_kv)
    D, N, K, H = d_model, self.num_heads, self.num_kv_heads, self.head_dim
    if shared_kv:
      heads = {'query': N}
    elif self.fused_qkv:
      heads = {'qkv': N + 2 * K}
    else:
      heads = {'query': N, 'key': K, 'value': K}
    shapes = {name: (D, E, H) for name, E in heads.items()}
    if self.qkv_bias:
      shapes |= {f'{name}_bias': (E, H) for name, E in heads.items()}
    if self.qk_norm:
      shapes |= {'query_norm': (H,)}
      if not shared_kv:
        shapes |= {'key_norm': (H,)}
    return {**shapes, 'out': (N, H, D)}

  def param_init(self, name: str, kernel_init):
    """The initialiser of parameter `name`: kernels `kernel_init`, biases
    zero, norm weights the identity."""
    if name.endswith('_bias'):
      return jax.nn.initializers.zeros
    if name.endswith('_norm'):
      return jax.nn.initializers.constant(1.0 - self.norm_scale_offset)
    return kernel_init

  def cache_length(self, max_len: int) -> int:
    """S, the cache's slots: the window of a causal local layer (a ring
    buffer), else max_len."""
    if self.is_causal and self.local_window is not None:
      return min(self.local_window, max_len)
    return max_len

  def cache_spec(self, batch: int, max_len: int, dtype: Any
                 ) -> dict[str, jax.ShapeDtypeStruct]:
    """The cache's arrays for `batch` sequences of up to max_len tokens;
    dtype: the compute dtype (stored unless kv_cache_dtype says otherwise)."""
    if self.kv_lora_rank:
      return latent.cache_spec(self, batch, max_len, dtype)
    Z, H, S = batch * self.num_kv_heads, self.head_dim, self.cache_length(
        max_len)
    stored = jnp.dtype(self.kv_cache_dtype or dtype)
    spec = {'cached_key': ((Z, H, S), stored),
            'cached_value': ((Z, S, H), stored)}
    if self.kv_cache_dtype == 'int8':
      spec |= {'key_scale': ((Z, S), jnp.float32),
               'value_scale': ((Z, S), jnp.float32)}
    spec['cache_index'] = ((), jnp.int32)
    return {name: jax.ShapeDtypeStruct(shape, kind)
            for name, (shape, kind) in spec.items()}


class KV(NamedTuple):
  """The keys and values one layer's queries attended to; a layer sharing
  them (cross-layer attention) attends to the same.

  Full pass: key and value [B, S, K, H]. Decoding: the cache's arrays
  (keys [Z, H, S], values [Z, S, H], int8 scales [Z, S] or None) with each
  slot's position (-1: empty) and `start`, the position of the first new
  token.
  """
  key: Array
  value: Array
  key_scale: Array | None = None
  value_scale: Array | None = None
  positions_S: Array | None = None  # None: a full pass.
  start: Array | int = 0
  overflow: Array | bool = False  # The write ran past the cache's end.


def apply(options: Options, params: dict[str, Array], x_BTD: Array, *,
          mask: Array | None = None, cache: dict[str, Array] | None = None,
          shared: KV | None = None, dtype: Any = jnp.float32
          ) -> tuple[Array, dict[str, Array] | None, KV]:
  """Self-attention of x_BTD [B, T, D]; (out [B, T, D], the updated cache,
  the K/V attended to).

  With a cache (decoding), the T tokens are written at `cache_index` and
  attend to everything cached so far; without one, to each other. With
  `shared` (what another layer's `apply` returned), the queries attend to
  those keys and values: this layer has no K/V parameters and no cache.
  mask: True = attend, a key-padding [B, S] or anything broadcastable to
  [B, N, T, S] (S = T, or max_len with a cache).
  """
  if options.kv_lora_rank:
    return latent.apply(options, params, x_BTD, mask=mask, cache=cache,
                        shared=shared, dtype=dtype)
  N, H = options.num_heads, options.head_dim
  B, T, D = x_BTD.shape
  w = {name: p.astype(dtype) for name, p in params.items()}
  q_BTNH, k_BTKH, v_BTKH = project(options, params, w, x_BTD.astype(dtype),
                                   shared is not None)
  if shared is not None:
    start = shared.start
  else:
    start = 0 if cache is None else cache['cache_index']
  pos_T = start + jnp.arange(T)
  if options.use_rope:
    rope = lambda x: apply_rope(x, pos_T, base=options.rope_base,
                                scaling=options.rope_scaling)
    q_BTNH = rope(q_BTNH)
    k_BTKH = None if k_BTKH is None else rope(k_BTKH)

  if shared is not None:
    kv = shared
  elif cache is None:
    kv = KV(k_BTKH, v_BTKH)
  else:
    cache, kv = _write_cache(options, cache, k_BTKH, v_BTKH)
  if kv.positions_S is None:  # A full pass.
    out_BTNH = dot_product_attention(
        q_BTNH, kv.key, kv.value, mask=mask, is_causal=options.is_causal,
        scale=options.scale, local_window=options.local_window,
        logits_soft_cap=options.logits_soft_cap)
  else:
    out_BTNH = _attend_cached(options, q_BTNH, kv, pos_T, mask)
  out_XD = out_BTNH.reshape(B * T, N * H) @ w['out'].reshape(N * H, D)
  return out_XD.reshape(B, T, D), cache, kv


def project(options: Options, params: dict[str, Array], w: dict[str, Array],
            x_BTD: Array, shared: bool
            ) -> tuple[Array, Array | None, Array | None]:
  """The layer's input projections of x_BTD [B, T, D]: (queries
  [B, T, N, H], keys and values [B, T, K, H], or None when `shared`, a
  layer reading another's K/V), biased and QK-normed as the options say,
  RoPE not applied (it needs the positions: the caller's). w: the parameters
  in the compute dtype (the norms' weights are read from `params`, in
  float32). `apply` and the paged cache's step (`serve.paged`) both call it,
  so the projections are written once."""
  N, K, H = options.num_heads, options.num_kv_heads, options.head_dim
  B, T, D = x_BTD.shape
  # The projections as plain [X, D] x [D, E·H] matmuls, tokens as one axis
  # X = B·T and heads with their features as one: XLA's CPU matmuls contract
  # or keep two axes (B and T, or E and H) at about half the speed.
  x_XD = x_BTD.reshape(B * T, D)

  def dense(name):
    y_XEH = (x_XD @ w[name].reshape(D, -1)).reshape(B * T, -1, H)
    if options.qkv_bias:
      y_XEH = y_XEH + w[f'{name}_bias']
    return y_XEH.reshape(B, T, -1, H)

  if shared:
    q_BTNH, k_BTKH, v_BTKH = dense('query'), None, None
  elif options.fused_qkv:
    qkv_BTEH = dense('qkv')  # E = N + 2K.
    q_BTNH, k_BTKH, v_BTKH = jnp.split(qkv_BTEH, [N, N + K], axis=2)
  else:
    q_BTNH, k_BTKH, v_BTKH = dense('query'), dense('key'), dense('value')
  if options.qk_norm:
    q_BTNH = _rms_norm(q_BTNH, params['query_norm'], options)
    if k_BTKH is not None:
      k_BTKH = _rms_norm(k_BTKH, params['key_norm'], options)
  return q_BTNH, k_BTKH, v_BTKH


def _attend_cached(options: Options, q_BTNH, kv: KV, pos_T, mask):
  """The T queries at positions pos_T against the cached slots of `kv`."""
  visible = cached_visibility(options, kv, pos_T, mask, q_BTNH.shape[0])
  out_BTNH = decode.heads_major_attention(
      q_BTNH, kv.key, kv.value, visible, scale=options.scale,
      logits_soft_cap=options.logits_soft_cap, key_scale_ZS=kv.key_scale,
      value_scale_ZS=kv.value_scale)
  # Under jit an overflowing write is clamped onto the last slots; make that
  # visible as NaN rather than silently attending to the wrong tokens.
  return jnp.where(kv.overflow, jnp.nan, out_BTNH)


def cached_visibility(options: Options, kv: KV, pos_T, mask, B: int):
  """[B or 1, 1 or N, T, S]: which cached slots of `kv` each of the T
  queries at positions pos_T sees (True = attend)."""
  T = pos_T.shape[0]
  S = kv.positions_S.shape[0]
  k_pos_S = kv.positions_S
  # Positions decide what each query sees; empty slots are hidden.
  visible_TS = jnp.broadcast_to(k_pos_S[None, :] >= 0, (T, S))
  structural_TS = attention_mask(pos_T, k_pos_S, is_causal=options.is_causal,
                                 local_window=options.local_window)
  if structural_TS is not None:
    visible_TS &= structural_TS
  visible = visible_TS[None, None]
  if mask is not None:
    # A mask over positions (max_len): each slot takes its position's.
    mask = as_4d_mask(mask, B, mask.shape[-1])
    if mask.shape[-1] > 1:
      mask = jnp.take(mask, jnp.maximum(k_pos_S, 0), axis=-1)
    visible = mask & visible
  return visible


def _is_ring(options: Options, S: int) -> bool:
  """Whether a cache of S slots is a local layer's ring buffer."""
  return options.is_causal and options.local_window == S


def _rms_norm(x_BTEH, weight_H, options: Options):
  """RMSNorm over each head's H features, in float32."""
  return numerics.rms_norm(x_BTEH, weight_H, eps=options.norm_eps,
                           offset=options.norm_scale_offset)


def slot_positions(end, S: int) -> Array:
  """[S]: the position each slot holds once positions 0..end-1 are written
  (slot s: the latest p < end with p % S == s), -1 where none is."""
  s = jnp.arange(S)
  p = end - 1 - jnp.mod(end - 1 - s, S)
  return jnp.where(p >= 0, p, -1)


def _write_cache(options: Options, cache, k_BTKH, v_BTKH
                 ) -> tuple[dict[str, Array], KV]:
  """(the cache with T positions written at its index, in place; what the
  new tokens attend to)."""
  B, T, K, H = k_BTKH.shape
  S = cache['cached_value'].shape[1]
  shapes = {name: cache[name].shape for name in ('cached_key', 'cached_value')}
  if shapes != {'cached_key': (B * K, H, S), 'cached_value': (B * K, S, H)}:
    raise ValueError(
        f'decode step gives K/V {(B, T, K, H)} but the cache holds keys '
        f"{shapes['cached_key']} = [B·K, H, S] and values "
        f"{shapes['cached_value']} = [B·K, S, H]; init the cache with "
        'the same batch size and heads')
  new = _stored(cache, k_BTKH.transpose(0, 2, 3, 1).reshape(B * K, H, T),
                v_BTKH.transpose(0, 2, 1, 3).reshape(B * K, T, H))
  return write_slots(options, cache, new, _AXES)


def write_slots(options: Options, cache, new: dict[str, Array],
                axes: dict[str, int]) -> tuple[dict[str, Array], KV]:
  """(the cache with the T new positions of each array in `new` written at
  its index along that array's position axis (`axes`, whose names are in the
  order of KV's fields), in place; what the new tokens attend to)."""
  first = next(iter(axes))
  start = cache['cache_index']
  S = cache[first].shape[axes[first]]
  T = new[first].shape[axes[first]]
  ring = _is_ring(options, S)
  if not ring:
    _check_capacity(start, T, S)
  overflow = False if ring else start + T > S
  if ring and T > 1:
    # Later tokens of the chunk would overwrite keys its earlier queries
    # still see: they attend to the old slots and the chunk, then the last
    # min(T, S) tokens are written.
    kv = KV(*(jnp.concatenate([cache[name], new[name]], axis=axis)
              if name in cache else None
              for name, axis in axes.items()),
            positions_S=jnp.concatenate([slot_positions(start, S),
                                         start + jnp.arange(T)]),
            start=start, overflow=overflow)
    keep = min(T, S)
    slots = jnp.mod(start + T - keep + jnp.arange(keep), S)
    written = {name: _scatter(cache[name], new[name], slots, axis)
               for name, axis in axes.items() if name in cache}
  else:
    at = jnp.mod(start, S) if ring else start  # T == 1 in a ring.
    written = {name: jax.lax.dynamic_update_slice_in_dim(
        cache[name], new[name], at, axis)
               for name, axis in axes.items() if name in cache}
    kv = None
  cache = {**written, 'cache_index': start + T}
  if kv is None:
    kv = KV(*(cache.get(name) for name in axes),
            positions_S=slot_positions(start + T, S), start=start,
            overflow=overflow)
  return cache, kv


# The cache's arrays, in the order of KV's fields, and their position axis.
_AXES = {'cached_key': 2, 'cached_value': 1, 'key_scale': 1, 'value_scale': 1}


def _stored(cache, keys_ZHT, values_ZTH) -> dict[str, Array]:
  """The new tokens as the cache stores them: its dtype, or int8 with a
  float32 scale per token and KV head."""
  if 'key_scale' not in cache:
    return {'cached_key': keys_ZHT.astype(cache['cached_key'].dtype),
            'cached_value': values_ZTH.astype(cache['cached_value'].dtype)}
  keys, key_scale = quantize(keys_ZHT, axis=1)
  values, value_scale = quantize(values_ZTH, axis=2)
  return {'cached_key': keys, 'cached_value': values, 'key_scale': key_scale,
          'value_scale': value_scale}


def quantize(x, axis: int) -> tuple[Array, Array]:
  """(int8 x / scale, scale): symmetric, one float32 scale (absmax / 127)
  per slice along `axis` (a token's H features), which is dropped."""
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
  return q, jnp.squeeze(scale, axis)


def _scatter(array, new, slots, axis: int):
  """array with new's last len(slots) positions along `axis` at `slots`."""
  new = jax.lax.slice_in_dim(new, new.shape[axis] - slots.shape[0],
                             new.shape[axis], axis=axis)
  index = (slice(None),) * axis + (slots,)
  return array.at[index].set(new)


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
  """Bytes of one layer's KV cache for `batch` sequences of `length` tokens
  (max_len): its arrays (cache_spec), the index not counted."""
  spec = options.cache_spec(batch, length, dtype)
  return sum(s.size * s.dtype.itemsize for name, s in spec.items()
             if name != 'cache_index')
