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
          parameters and a latent cache: `attention.latent`; grouped-tied
          attention (tie_kv) one tied K/V state per KV head and a shared
          RoPE key: `attention.tied`.

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

from attention import cpu_kernel, decode, kv_cache, latent, paged, tied
from attention.core import dot_product_attention
from attention.kv_cache import KV
from attention.rope import RopeScaling, apply_rope

Array = jax.Array
KVCacheDtype = Literal['float32', 'bfloat16', 'int8']
KV_CACHE_DTYPES = KVCacheDtype.__args__
CACHE_NAMES = ('cached_key', 'cached_value', 'key_scale', 'value_scale',
               # Multi-head latent attention's (`attention.latent`).
               'cached_latent', 'cached_rope_key', 'latent_scale',
               'rope_key_scale',
               # Grouped-tied attention's (`attention.tied`; with the RoPE
               # key's above).
               'cached_tied', 'tied_scale',
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
  # Grouped latent attention (GLA, Zadouri et al. 2025): the latent split
  # into latent_groups latents of kv_lora_rank / latent_groups features,
  # group g serving query heads [g·N/G, (g+1)·N/G); 1 is MLA.
  latent_groups: int = 1
  # MLA's RMSNorm of the latent (DeepSeek's kv_a_layernorm); a checkpoint
  # converted into MLA has none (an RMSNorm is not linear).
  latent_norm: bool = True
  # MLA converted from a RoPE model (train.convert.to_mla): RoPE pair j of the
  # RoPE key and queries turns at frequency rope_pairs[j] of a head_dim-wide
  # RoPE (pairs kept from the source's); None: a qk_rope_head_dim-wide RoPE.
  rope_pairs: tuple[int, ...] | None = None
  # Grouped-tied attention (GTA, `attention.tied`): per KV head one tied
  # state, the value and (its first head_dim - qk_rope_head_dim features)
  # the key, beside a qk_rope_head_dim RoPE key shared by the heads (None:
  # head_dim / 2 with use_rope, else 0; rope_pairs as MLA's).
  tie_kv: bool = False

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
    tied.resolve(self)  # Refuses tie_kv with MLA's kv_lora_rank.
    if not self.tie_kv:
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
    query's qk_nope_head_dim + qk_rope_head_dim; GTA: H) ** -0.5."""
    if self.kv_lora_rank:
      return latent.scale(self)
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def param_shapes(self, d_model: int, *, shared_kv: bool = False
                   ) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape; shared_kv: the layer reads another layer's
    K/V (cross-layer sharing) and has only the query's and output's."""
    if self.kv_lora_rank:
      return latent.param_shapes(self, d_model, shared_kv=shared_kv)
    if self.tie_kv:
      return tied.param_shapes(self, d_model, shared_kv=shared_kv)
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
    """The dense cache's arrays for `batch` sequences of up to max_len
    tokens (`attention.kv_cache.dense_spec`); dtype: the compute dtype
    (stored unless kv_cache_dtype says otherwise)."""
    return kv_cache.dense_spec(self, batch, max_len, dtype)


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
  output projection, for grouped-query, latent (MLA, `attention.latent`)
  and grouped-tied (GTA, `attention.tied`) layers alike. Where K/V live is the cache strategy's
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
  kind = latent if options.kv_lora_rank else tied if options.tie_kv else (
      _grouped)
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


class _grouped:  # pylint: disable=invalid-name
  """Grouped-query attention's parts of `apply` (MLA's: `attention.latent`,
  GTA's: `attention.tied`)."""

  @staticmethod
  def project(options: Options, params, w, x_BTD, pos_bT, shared: bool
              ) -> tuple[Array, dict[str, Array]]:
    """(queries [B, T, N, H] turned by RoPE, the cache entries of the new
    tokens: keys and values [B, T, K, H], RoPE'd keys; none when shared)."""
    q_BTNH, k_BTKH, v_BTKH = project(options, params, w, x_BTD, shared)
    if options.use_rope:
      rope = lambda x: apply_rope(x, pos_bT, base=options.rope_base,
                                  scaling=options.rope_scaling)
      q_BTNH = rope(q_BTNH)
      k_BTKH = None if k_BTKH is None else rope(k_BTKH)
    new = {} if shared else {'cached_key': k_BTKH, 'cached_value': v_BTKH}
    return q_BTNH, new

  @staticmethod
  def attend(options: Options, w, q_BTNH, kv: KV, mask) -> Array:
    """The full pass: [B, T, N, H]."""
    return dot_product_attention(
        q_BTNH, kv.key, kv.value, mask=mask, is_causal=options.is_causal,
        scale=options.scale, local_window=options.local_window,
        logits_soft_cap=options.logits_soft_cap)

  @staticmethod
  def attend_cached(options: Options, w, q_BTNH, kv: KV, visible) -> Array:
    """Against the cache: [B, T, N, H]. Per platform lowered for, where its
    kernel takes the call: on the CPU the C++ kernel (`attention.cpu_kernel`,
    a paged pool read in place), on TPU a paged pool's step by JAX's kernel
    (`attention.paged`); else the pure-JAX path, a paged cache's rows
    gathered first."""
    def jax_path():
      rows = kv_cache.gathered(kv, options)
      return decode.heads_major_attention(
          q_BTNH, rows.key, rows.value, visible, scale=options.scale,
          logits_soft_cap=options.logits_soft_cap,
          key_scale_ZS=rows.key_scale, value_scale_ZS=rows.value_scale)
    kernels = {}
    if cpu_kernel.refusal(options, kv, visible) is None:
      kernels['cpu'] = lambda: cpu_kernel.attention(options, q_BTNH, kv,
                                                    visible)
    if kv.paged is not None and not paged.kernel_refusal(
        options, q_BTNH.shape[1], kv.paged.arrays):
      kernels['tpu'] = lambda: paged.kernel_attention(options, q_BTNH, kv)
    if not kernels:
      return jax_path()
    return jax.lax.platform_dependent(**kernels, default=jax_path)


def project(options: Options, params: dict[str, Array], w: dict[str, Array],
            x_BTD: Array, shared: bool
            ) -> tuple[Array, Array | None, Array | None]:
  """The layer's input projections of x_BTD [B, T, D]: (queries
  [B, T, N, H], keys and values [B, T, K, H], or None when `shared`, a
  layer reading another's K/V), biased and QK-normed as the options say,
  RoPE not applied (it needs the positions: the caller's). w: the parameters
  in the compute dtype (the norms' weights are read from `params`, in
  float32)."""
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
    q_BTNH = kv_cache.head_rms_norm(q_BTNH, params['query_norm'], options)
    if k_BTKH is not None:
      k_BTKH = kv_cache.head_rms_norm(k_BTKH, params['key_norm'], options)
  return q_BTNH, k_BTKH, v_BTKH


def kv_cache_bytes(options: Options, batch: int, length: int, dtype) -> int:
  """Bytes of one layer's KV cache for `batch` sequences of `length` tokens
  (max_len): its arrays (cache_spec), the index not counted."""
  spec = options.cache_spec(batch, length, dtype)
  return sum(s.size * s.dtype.itemsize for name, s in spec.items()
             if name != 'cache_index')
