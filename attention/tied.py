"""Grouped-tied attention (GTA; Zadouri, Strauss & Dao 2025) as pure functions.

`attention.layer.apply` hands a layer here when its options set tie_kv.
Letters (with those of `attention.core`: B, T, S, N, K, G, H, D, Z = B·K):

  Y  qk_rope_head_dim, the RoPE key shared by every head (0 without RoPE)
  I  H - Y, the features of a tied state that serve as its head's key
     without position (MLA's I and Y, `attention.latent`, mean the same)
  R  G·T, the query rows of one KV head (decoding, as `attention.decode`)

  params  query [D, N, H] (a head's features [:I] meet the tied state's,
          [I:] are turned by RoPE and meet the RoPE key), kv [D, K, H] (the
          tied states), rope_key [D, Y] (none when Y = 0), out [N, H, D]. A
          layer sharing another's K/V (kv_share) has query and out only.
  cache   cached_tied [B·K, S, H], cached_rope_key [B, S, Y] (none when
          Y = 0); int8: tied_scale [B·K, S] and rope_key_scale [B, S] float32.

KV head k keeps one tied state t_k of H numbers per token: its value is t_k
and its key [t_k[:I], RoPE(r)], where r is one RoPE key of Y features
shared by all heads. Query head n attends with KV head n // G. So a token
costs K·H + Y cached numbers per layer, (K·H + Y) / (2·K·H) of grouped-query
attention's with the same K. Without RoPE (Y = 0) the key is the whole
tied state. RoPE turns the queries' last Y features and the shared key
with a Y-wide RoPE, or, for a model converted from a RoPE model
(`train.convert.to_gta`), at the source's frequencies `rope_pairs` (as MLA's:
`latent.rope_frequencies`).

The full pass (training, any pass without a cache) builds each KV head's
key [B, S, K, H] and runs `dot_product_attention` with the tied states as
values: K keys per token, never one per query head. Decoding
(`tied_attention`) builds no key: a logit is q_nope·t[:I] + q_rope·r and an
output Σ_s p_s t_s, two grouped matmuls over a [.., K, G, ..] view of the
queries whose cache operand is the same [S, H] tied matrix, read where it
lies (XLA reads it once per matmul). On the CPU, `attend_cached` runs a C++
kernel instead (`attention.cpu_kernel.tied_attention`) that reads each
block of tied states once for both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention import cpu_kernel, kv_cache, latent, numerics
from attention.core import dot_product_attention
from attention.rope import apply_rope

Array = jax.Array

# Grouped-query options that tying refuses: GTA has its own projections.
_NOT_TIED = ('fused_qkv', 'qkv_bias', 'qk_norm')
# MLA's options that mean nothing to GTA (qk_rope_head_dim and rope_pairs
# are shared).
_MLA_ONLY = ('q_lora_rank', 'qk_nope_head_dim', 'v_head_dim')


def resolve(options) -> None:
  """Fills qk_rope_head_dim when tie_kv is set and it is None (head_dim / 2
  with use_rope, else 0) and raises ValueError, naming the field and the
  fix, for a combination GTA cannot take. Nothing to do without tie_kv."""
  if not isinstance(options.tie_kv, bool):
    raise ValueError(f'tie_kv={options.tie_kv!r} must be True or False')
  if not options.tie_kv:
    return
  if options.kv_lora_rank == 0:  # 0 means None (not MLA), as for MLA.
    object.__setattr__(options, 'kv_lora_rank', None)
  if options.qk_rope_head_dim is None:
    object.__setattr__(options, 'qk_rope_head_dim',
                       options.head_dim // 2 if options.use_rope else 0)
  problem = _problem(options)
  if problem:
    raise ValueError(problem)


def _problem(o) -> str | None:
  """What GTA cannot take in options `o`, and what to do, or None."""
  if o.kv_lora_rank is not None:
    return (f'kv_lora_rank={o.kv_lora_rank!r} with tie_kv=True: a layer is '
            'either multi-head latent attention or grouped-tied; set '
            'kv_lora_rank=None, or tie_kv=False')
  for name in _NOT_TIED:
    if getattr(o, name):
      return (f'{name}=True with tie_kv=True: grouped-tied attention has its '
              f'own projections (kv, rope_key); set {name}=False')
  if o.latent_groups != 1:
    return (f'latent_groups={o.latent_groups!r} with tie_kv=True: an MLA '
            '(GLA) field, grouped-tied attention has no latent; set '
            'latent_groups=1')
  for name in _MLA_ONLY:
    if getattr(o, name) is not None:
      return (f'{name}={getattr(o, name)!r} with tie_kv=True: an MLA field; '
              f'unset it (None)')
  H, Y = o.head_dim, o.qk_rope_head_dim
  if not isinstance(Y, int) or isinstance(Y, bool):
    return f'qk_rope_head_dim={Y!r} must be an integer with tie_kv=True'
  if o.use_rope and not (0 < Y < H and Y % 2 == 0):
    return (f'qk_rope_head_dim={Y} with tie_kv=True and use_rope=True: the '
            'shared RoPE key needs an even width between 0 and head_dim='
            f'{H}, both excluded; set it (None: head_dim / 2 = {H // 2})')
  if not o.use_rope and Y:
    return (f'qk_rope_head_dim={Y} with tie_kv=True and use_rope=False: '
            'nothing turns the RoPE key; set qk_rope_head_dim=0 (or None), '
            'or use_rope=True')
  pairs = o.rope_pairs
  if pairs is not None and (len(pairs) != Y // 2 or not all(
      isinstance(p, int) and 0 <= p < H // 2 for p in pairs)):
    return (f'rope_pairs={list(pairs)} must list qk_rope_head_dim / 2 = '
            f'{Y // 2} frequency indices from 0 to head_dim / 2 - 1 = '
            f'{H // 2 - 1}; leave it to train.convert --to_gta')
  return None


def param_shapes(options, d_model: int, *, shared_kv: bool = False
                 ) -> dict[str, tuple[int, ...]]:
  """Parameter name -> shape (the module docstring's table)."""
  D, N, K = d_model, options.num_heads, options.num_kv_heads
  H, Y = options.head_dim, options.qk_rope_head_dim
  shapes = {'query': (D, N, H)}
  if not shared_kv:
    shapes |= {'kv': (D, K, H)}
    if Y:
      shapes |= {'rope_key': (D, Y)}
  return {**shapes, 'out': (N, H, D)}


def project(options, params, w, x_BTD, pos_bT, shared: bool
            ) -> tuple[Array, dict[str, Array]]:
  """`attention.layer.apply`'s projections for a GTA layer: (queries
  [B, T, N, H], their last Y features turned by RoPE; the cache entries of
  the new tokens: tied states [B, T, K, H] and the turned RoPE key
  [B, T, 1, Y]; none when shared)."""
  del params  # No norms: every weight is read in the compute dtype, w.
  B, T, D = x_BTD.shape
  N, K, H = options.num_heads, options.num_kv_heads, options.head_dim
  Y = options.qk_rope_head_dim
  # Plain [X, D] x [D, E·H] matmuls, X = B·T (see layer.project).
  x_XD = x_BTD.reshape(B * T, D)
  rope = lambda x: apply_rope(x, pos_bT, base=options.rope_base,
                              scaling=options.rope_scaling,
                              frequencies=latent.rope_frequencies(options))
  q_BTNH = (x_XD @ w['query'].reshape(D, -1)).reshape(B, T, N, H)
  if Y:
    q_BTNH = jnp.concatenate([q_BTNH[..., :H - Y], rope(q_BTNH[..., H - Y:])],
                             axis=-1)
  if shared:
    return q_BTNH, {}
  new = {'cached_tied': (x_XD @ w['kv'].reshape(D, -1)).reshape(B, T, K, H)}
  if Y:  # One head, shared.
    new['cached_rope_key'] = rope((x_XD @ w['rope_key']).reshape(B, T, 1, Y))
  return q_BTNH, new


def keys(tied_BSKH: Array, rope_key_BS1Y: Array | None) -> Array:
  """[B, S, K, H]: KV head k's keys, [t_k[:I], r], from the tied states and
  the (turned) shared RoPE key (None: Y = 0, the key is the tied state)."""
  if rope_key_BS1Y is None:
    return tied_BSKH
  B, S, K, H = tied_BSKH.shape
  Y = rope_key_BS1Y.shape[-1]
  r_BSKY = jnp.broadcast_to(rope_key_BS1Y.astype(tied_BSKH.dtype), (B, S, K, Y))
  return jnp.concatenate([tied_BSKH[..., :H - Y], r_BSKY], axis=-1)


def attend(options, w, q_BTNH, kv, mask) -> Array:
  """The full pass: [B, T, N, H], against each KV head's keys (`keys`) and
  its tied states as values."""
  del w
  return dot_product_attention(
      q_BTNH, keys(kv.key, kv.value), kv.key, mask=mask,
      is_causal=options.is_causal, scale=options.scale,
      local_window=options.local_window,
      logits_soft_cap=options.logits_soft_cap)


def attend_cached(options, w, q_BTNH, kv, visible) -> Array:
  """Against the cache: [B, T, N, H]. Per platform lowered for: on the CPU,
  where it takes the call (`cpu_kernel.refusal`), the C++ kernel, which
  reads each block of tied states once for both products (a paged pool in
  place); elsewhere `tied_attention` (a paged cache's rows gathered first).
  JAX's TPU paged kernel does not take a tied cache
  (`paged.kernel_refusal`)."""
  del w
  def jax_path():
    rows = kv_cache.gathered(kv, options)
    return tied_attention(
        q_BTNH, rows.key, rows.value, visible,
        rope_dim=options.qk_rope_head_dim, scale=options.scale,
        logits_soft_cap=options.logits_soft_cap,
        tied_scale_ZS=rows.key_scale, rope_key_scale_BS=rows.value_scale)
  if cpu_kernel.refusal(options, kv, visible) is not None:
    return jax_path()
  return jax.lax.platform_dependent(
      cpu=lambda: cpu_kernel.tied_attention(options, q_BTNH, kv, visible),
      default=jax_path)


def tied_attention(q_BTNH, tied_ZSH, rope_key_BSY, visible, *, rope_dim: int,
                   scale: float, logits_soft_cap: float | None,
                   tied_scale_ZS=None, rope_key_scale_BS=None) -> Array:
  """[B, T, N, H]: T queries (their last rope_dim = Y features turned)
  against S cached tied states [Z, S, H] (Z = B·K) and RoPE keys [B, S, Y]
  (None when Y = 0), read as stored (int8 with their float32 scales
  [Z, S] and [B, S], which multiply the [.., S] logits and
  probabilities); visible: boolean broadcastable to [B, N, T, S] (True =
  attend), or None.
  """
  B, T, N, H = q_BTNH.shape
  Z, S, _ = tied_ZSH.shape
  K, Y = Z // B, rope_dim
  G, I = N // K, H - Y
  q_ZRH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(
      Z, G * T, H)
  # q_nope·t[:I] as the query with its RoPE features zeroed against the
  # whole tied state: the cache is the matmul's operand as it lies, with
  # no [.., :I] slice of it to copy.
  nope_ZRH = jnp.where(jnp.arange(H) < I, q_ZRH, jnp.zeros((), q_ZRH.dtype))
  logits_ZRS = _matmul(nope_ZRH, tied_ZSH, contract=2)
  if tied_scale_ZS is not None:
    logits_ZRS = logits_ZRS * tied_scale_ZS[:, None, :]
  if Y:  # Per batch row, all K·R query rows against the one RoPE key.
    rope_ZRS = _matmul(q_ZRH[..., I:].reshape(B, K * G * T, Y), rope_key_BSY,
                       contract=2).reshape(Z, G * T, S)
    if rope_key_scale_BS is not None:  # A row's scales, for each KV head.
      rope_ZRS = rope_ZRS * jnp.repeat(rope_key_scale_BS, K, axis=0)[:, None]
    logits_ZRS = logits_ZRS + rope_ZRS
  logits_BKGTS = numerics.soft_cap(logits_ZRS * scale, logits_soft_cap
                                   ).reshape(B, K, G, T, S)
  mask_BKGTS = None if visible is None else numerics.grouped_mask(visible, K)
  probs_ZRS = numerics.masked_softmax(logits_BKGTS, mask_BKGTS).reshape(
      Z, G * T, S)
  if tied_scale_ZS is not None:
    probs_ZRS = probs_ZRS * tied_scale_ZS[:, None, :]
  out_ZRH = _matmul(probs_ZRS.astype(q_BTNH.dtype), tied_ZSH, contract=1)
  out_BTNH = out_ZRH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4)
  return out_BTNH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def _matmul(a_ZRC, b_ZSC, contract: int):
  """Per row z, [R, C] x the cache [S, C] as stored: contract=2, its
  features (-> [Z, R, S]), or [R, S] x [S, C], contract=1, its slots (->
  [Z, R, C]); float32, the cache in its own dtype (as `attention.decode`)."""
  return jax.lax.dot_general(a_ZRC, b_ZSC, (((2,), (contract,)), ((0,), (0,))),
                             preferred_element_type=jnp.float32)
