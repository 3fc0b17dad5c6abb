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
          That is grouped-query attention's layout (`attention.grouped`,
          the default); another layout (`Options.layout`, `attention.layout`)
          has its own parameters and cache entries: multi-head latent
          attention (`attention.latent`), grouped-tied (`attention.tied`).

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

That is the dense cache (`attention.kv_cache.DenseCache`); the same step
reads and writes a paged pool (`PagedCache`, the serving engine's) by
gathering each row's pages into this layout, or, lowering for TPU, by JAX's
paged-attention kernel (`attention.paged`); lowering for the CPU, by a C++
kernel (`attention.cpu_kernel`) that reads either cache where it lies, a
paged pool through its page tables, when it is built. A causal local layer
keeps only its window: slot s holds the latest position p with p % w == s (a
ring buffer), so its cache is w/max_len the size. An int8 cache stores each
token's K and V per KV head as int8 times one float32 scale (symmetric,
absmax/127); the matmuls read the int8 arrays and the scales multiply the
[G, S] logits and probabilities, so no float copy of the cache is made.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

# The built-in layouts register themselves on import (`attention.layout`),
# grouped-query attention first, then in the order they were added.
from attention import grouped, kv_cache, latent, tied  # pylint: disable=unused-import
from attention import tensor_product  # pylint: disable=unused-import
from attention.kv_cache import KV
from attention.layout import Layout
from attention.rope import RopeScaling

Array = jax.Array
KVCacheDtype = Literal['float32', 'bfloat16', 'int8']
KV_CACHE_DTYPES = KVCacheDtype.__args__


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
  # How the layer caches K/V and attends (`attention.layout`): grouped-query
  # attention by default (num_kv_heads is its knob), or another registered
  # layout with its own settings, e.g. `latent.MLA(kv_lora_rank=64)`.
  layout: Layout = grouped.GQA()

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
    if not isinstance(self.layout, Layout):
      raise ValueError(f'layout={self.layout!r} must be an attention.layout.'
                       'Layout, e.g. attention.latent.MLA(kv_lora_rank=64)')
    # The layout with its defaults filled in from these options (or a
    # ValueError naming what it cannot take).
    object.__setattr__(self, 'layout', self.layout.resolve(self))

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
    """The logits' multiplier: query_pre_attn_scalar (None: H; the layout
    may say otherwise, MLA's query width) ** -0.5."""
    return self.layout.scale(self)

  def param_shapes(self, d_model: int, *, shared_kv: bool = False
                   ) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape; shared_kv: the layer reads another layer's
    K/V (cross-layer sharing) and has only the query's and output's."""
    return self.layout.param_shapes(self, d_model, shared_kv=shared_kv)

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
    """The dense cache's arrays for `batch` sequences of up to max_len
    tokens (`attention.kv_cache.dense_spec`); dtype: the compute dtype
    (stored unless kv_cache_dtype says otherwise)."""
    return kv_cache.dense_spec(self, batch, max_len, dtype)

  def cache_names(self) -> tuple[str, ...]:
    """The names of the dense cache's arrays: the layout's entries, their
    int8 scales (kv_cache_dtype='int8' only) and cache_index."""
    return tuple(self.cache_spec(1, 1, jnp.float32))


def apply(options: Options, params: dict[str, Array], x_BTD: Array, *,
          mask: Array | None = None,
          cache: dict[str, Array] | kv_cache.DenseCache | kv_cache.PagedCache
          | None = None,
          shared: KV | None = None, dtype: Any = jnp.float32
          ) -> tuple[Array, dict[str, Array] | None, KV]:
  """Self-attention of x_BTD [B, T, D]; (out [B, T, D], the updated cache
  arrays, the K/V attended to).

  The one attention step of every path: the projections, RoPE at the
  tokens' positions, the cache's write and read, the attention and the
  output projection, whatever the layout (`options.layout`: grouped-query,
  latent, tied, ..., which computes the projections and the attention).
  Where K/V live is the cache strategy's
  (`attention.kv_cache`): none (a full pass: the T tokens attend to each
  other), a `DenseCache` (or its arrays as a dict: one position for every
  row, a ring buffer for a causal local layer) or a `PagedCache` (a page
  table and a position per row). With `shared` (what another layer's
  `apply` returned), the queries attend to those keys and values at their
  positions: this layer has no K/V parameters and no cache.
  mask: True = attend, a key-padding [B, S] or anything broadcastable to
  [B, N, T, S] (S = T, or max_len with a dense cache).
  """
  B, T, D = x_BTD.shape
  if isinstance(cache, dict):
    cache = kv_cache.DenseCache(cache)
  if shared is not None:
    pos_bT = shared.query_positions
  elif cache is not None:
    pos_bT = cache.positions(T)
  else:
    pos_bT = jnp.arange(T)[None]
  w = {name: p.astype(dtype) for name, p in params.items()}
  kind = options.layout
  queries, new = kind.project(options, params, w, x_BTD.astype(dtype),
                              pos_bT, shared is not None)
  arrays = None
  if shared is not None:
    kv = shared
  elif cache is None:
    kv = KV(*kv_cache.fields(new, options), query_positions=pos_bT)
  else:
    arrays, kv = cache.write(options, new)
  if kv.positions_S is None:  # A full pass.
    out_BTX = kind.attend(options, w, queries, kv, mask)
  else:
    visible = kv_cache.cached_visibility(options, kv, mask, B)
    out_BTX = kind.attend_cached(options, w, queries, kv, visible)
    # Under jit an overflowing write is clamped onto the last slots; make
    # that visible as NaN rather than silently attending to the wrong
    # tokens.
    out_BTX = jnp.where(kv.overflow, jnp.nan, out_BTX)
  out_XD = out_BTX.reshape(B * T, -1) @ w['out'].reshape(-1, D)
  return out_XD.reshape(B, T, D), arrays, kv


def kv_cache_bytes(options: Options, batch: int, length: int, dtype) -> int:
  """Bytes of one layer's KV cache for `batch` sequences of `length` tokens
  (max_len): its arrays (cache_spec), the index not counted."""
  spec = options.cache_spec(batch, length, dtype)
  return sum(s.size * s.dtype.itemsize for name, s in spec.items()
             if name != 'cache_index')
