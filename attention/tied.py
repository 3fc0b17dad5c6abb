"""Grouped-tied attention (GTA; Zadouri, Strauss & Dao 2025) as pure functions.

The layout 'gta' (`attention.layout`): `attention.layer.apply` hands a
layer here when its options' layout is a `GTA`.
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
(`train.convert --to_gta`), at the source's frequencies `rope_pairs` (as
MLA's: `rope.pair_frequencies`).

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

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from attention import cpu_kernel, kv_cache, numerics
from attention.core import dot_product_attention
from attention.layout import Layout, register
from attention.rope import apply_rope, pair_frequencies, pairs_problem

Array = jax.Array

# Grouped-query options that tying refuses: GTA has its own projections.
_NOT_TIED = ('fused_qkv', 'qkv_bias', 'qk_norm')


@register
@dataclasses.dataclass(frozen=True)
class GTA(Layout):
  """Grouped-tied attention's settings: qk_rope_head_dim (Y), the width of
  the RoPE key shared by every head (None: head_dim / 2 with RoPE, else 0),
  and rope_pairs, the source's RoPE frequencies of a converted model
  (`train.convert --to_gta`; as MLA's, `rope.pair_frequencies`). The KV
  heads are the layer's num_kv_heads."""
  name: ClassVar[str] = 'gta'
  logical_axes: ClassVar[dict] = {
      'query': ('embed', 'q_heads', 'head_dim'),
      'out': ('q_heads', 'head_dim', 'embed'),
      # The tied states, and the RoPE key shared by the heads (whole on
      # every shard, as head_dim).
      'kv': ('embed', 'kv_heads', 'head_dim'),
      'rope_key': ('embed', 'head_dim'),
  }
  qk_rope_head_dim: int | None = None
  rope_pairs: tuple[int, ...] | None = None

  def resolve(self, options) -> 'GTA':
    """Itself with qk_rope_head_dim filled in (None: head_dim / 2 with
    use_rope, else 0); ValueError, naming the field and the fix, for a
    combination GTA cannot take."""
    Y = self.qk_rope_head_dim
    if Y is None:
      Y = options.head_dim // 2 if options.use_rope else 0
    pairs = self.rope_pairs
    resolved = dataclasses.replace(
        self, qk_rope_head_dim=Y,
        rope_pairs=None if pairs is None else tuple(pairs))
    problem = resolved._problem(options)  # pylint: disable=protected-access
    if problem:
      raise ValueError(problem)
    return resolved

  def _problem(self, o) -> str | None:
    """What GTA cannot take with the layer's options `o`, and what to do,
    or None."""
    for name in _NOT_TIED:
      if getattr(o, name):
        return (f'{name}=True with attention=\'gta\': grouped-tied '
                'attention has its own projections (kv, rope_key); set '
                f'{name}=False')
    H, Y = o.head_dim, self.qk_rope_head_dim
    if not isinstance(Y, int) or isinstance(Y, bool):
      return f'gta.qk_rope_head_dim={Y!r} must be an integer'
    if o.use_rope and not (0 < Y < H and Y % 2 == 0):
      return (f'gta.qk_rope_head_dim={Y} with use_rope=True: the shared RoPE '
              'key needs an even width between 0 and head_dim='
              f'{H}, both excluded; set it (None: head_dim / 2 = {H // 2})')
    if not o.use_rope and Y:
      return (f'gta.qk_rope_head_dim={Y} with use_rope=False: nothing turns '
              'the RoPE key; set qk_rope_head_dim=0 (or None), or '
              'use_rope=True')
    return pairs_problem(self.rope_pairs, self.qk_rope_head_dim, o.head_dim,
                         'gta.rope_pairs', '--to_gta')

  def param_shapes(self, options, d_model: int, *, shared_kv: bool = False
                   ) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape (the module docstring's table)."""
    D, N, K = d_model, options.num_heads, options.num_kv_heads
    H, Y = options.head_dim, self.qk_rope_head_dim
    shapes = {'query': (D, N, H)}
    if not shared_kv:
      shapes |= {'kv': (D, K, H)}
      if Y:
        shapes |= {'rope_key': (D, Y)}
    return {**shapes, 'out': (N, H, D)}

  def entries(self, options) -> tuple[kv_cache.Entry, ...]:
    """The tied states of K heads, and the RoPE key (none when Y = 0)."""
    out = [kv_cache.Entry('cached_tied', options.num_kv_heads,
                          options.head_dim, False, 'tied_scale')]
    if self.qk_rope_head_dim:
      out.append(kv_cache.Entry('cached_rope_key', 1, self.qk_rope_head_dim,
                                False, 'rope_key_scale'))
    return tuple(out)

  def project(self, options, params, w, x_BTD, pos_bT, shared: bool
              ) -> tuple[Array, dict[str, Array]]:
    """(queries [B, T, N, H], their last Y features turned by RoPE; the
    cache entries of the new tokens: tied states [B, T, K, H] and the
    turned RoPE key [B, T, 1, Y]; none when shared)."""
    del params  # No norms: every weight is read in the compute dtype, w.
    B, T, D = x_BTD.shape
    N, K, H = options.num_heads, options.num_kv_heads, options.head_dim
    Y = self.qk_rope_head_dim
    # Plain [X, D] x [D, E·H] matmuls, X = B·T (see grouped.project).
    x_XD = x_BTD.reshape(B * T, D)
    rope = lambda x: apply_rope(
        x, pos_bT, base=options.rope_base, scaling=options.rope_scaling,
        frequencies=pair_frequencies(options, self.rope_pairs))
    q_BTNH = (x_XD @ w['query'].reshape(D, -1)).reshape(B, T, N, H)
    if Y:
      q_BTNH = jnp.concatenate(
          [q_BTNH[..., :H - Y], rope(q_BTNH[..., H - Y:])], axis=-1)
    if shared:
      return q_BTNH, {}
    new = {'cached_tied': (x_XD @ w['kv'].reshape(D, -1)).reshape(
        B, T, K, H)}
    if Y:  # One head, shared.
      new['cached_rope_key'] = rope((x_XD @ w['rope_key']).reshape(
          B, T, 1, Y))
    return q_BTNH, new

  def attend(self, options, w, q_BTNH, kv, mask) -> Array:
    """The full pass: [B, T, N, H], against each KV head's keys (`keys`)
    and its tied states as values."""
    del w
    return dot_product_attention(
        q_BTNH, keys(kv.key, kv.value), kv.key, mask=mask,
        is_causal=options.is_causal, scale=options.scale,
        local_window=options.local_window,
        logits_soft_cap=options.logits_soft_cap)

  def attend_cached(self, options, w, q_BTNH, kv, visible) -> Array:
    """Against the cache: [B, T, N, H]. Per platform lowered for: on the
    CPU, where it takes the call (`cpu_kernel.refusal`), the C++ kernel,
    which reads each block of tied states once for both products (a paged
    pool in place); elsewhere `tied_attention` (a paged cache's rows
    gathered first)."""
    del w
    Y = self.qk_rope_head_dim
    def jax_path():
      rows = kv_cache.gathered(kv, options)
      return tied_attention(
          q_BTNH, rows.key, rows.value, visible, rope_dim=Y,
          scale=options.scale, logits_soft_cap=options.logits_soft_cap,
          tied_scale_ZS=rows.key_scale, rope_key_scale_BS=rows.value_scale)
    if cpu_kernel.refusal(options, kv, visible) is not None:
      return jax_path()
    return jax.lax.platform_dependent(
        cpu=lambda: cpu_kernel.tied_attention(options, q_BTNH, kv, visible,
                                              rope_dim=Y),
        default=jax_path)

  def flops_per_token(self, options, d_model: int, context: float,
                      shares_kv: bool, absorbed: bool) -> float:
    """Grouped-query attention's, with the tied states' 2·D·K·H and the
    shared RoPE key's 2·D·Y for the K and V projections."""
    del absorbed  # Decoding computes what the full pass does.
    D, N, K, H = d_model, options.num_heads, options.num_kv_heads, (
        options.head_dim)
    kv = 0 if shares_kv else 2 * D * (K * H + self.qk_rope_head_dim)
    return (2 * D * N * H + 2 * N * H * D + kv
            + self.attention_flops_per_key(options) * context)

  def attention_flops_per_key(self, options, absorbed: bool = False
                              ) -> float:
    del absorbed
    return 2 * 2 * options.num_heads * options.head_dim

  def mesh_counts(self, options) -> dict[str, int]:
    return {'kv_heads': options.num_kv_heads}

  def describe(self, options) -> str:
    return (f'GTA: {options.num_kv_heads} tied KV heads x {options.head_dim} '
            f'+ a RoPE key of {self.qk_rope_head_dim}')


def keys(tied_BSKH: Array, rope_key_BS1Y: Array | None) -> Array:
  """[B, S, K, H]: KV head k's keys, [t_k[:I], r], from the tied states and
  the (turned) shared RoPE key (None: Y = 0, the key is the tied state)."""
  if rope_key_BS1Y is None:
    return tied_BSKH
  B, S, K, H = tied_BSKH.shape
  Y = rope_key_BS1Y.shape[-1]
  r_BSKY = jnp.broadcast_to(rope_key_BS1Y.astype(tied_BSKH.dtype), (B, S, K, Y))
  return jnp.concatenate([tied_BSKH[..., :H - Y], r_BSKY], axis=-1)


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
