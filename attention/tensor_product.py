"""Tensor product attention (TPA; Zhang et al. 2025, "Tensor Product Attention
Is All You Need", arXiv 2501.06425) as pure functions.

The layout 'tpa' (`attention.layout`). Each token's keys, across the N heads,
are a sum of rank-1 tensor products of a head factor a_r(x) ∈ R^N and a token
factor b_r(x) ∈ R^H, both linear in the token (the paper's contextual
factors, its eq. 3.2):

  K_t = (1/R_K) Σ_r a^K_r(x_t) ⊗ b^K_r(x_t)       [N, H], head n's key
                                                   K_t[n] = (1/R_K) Σ_r
                                                   a^K_r[n] b^K_r

and likewise the values (R_V) and the queries (R_Q), or, in the paper's
TPA-KV-only variant (q_rank=0), per-head queries as grouped-query
attention's. RoPE turns the token factors b^Q and b^K (a rotation of the H
features commutes with the sum over ranks: RoPE(K_t[n]) = (1/R_K)
Σ_r a_r[n] RoPE(b_r), the paper's Theorem 1), so the cache holds turned
factors. The logits' scale is head_dim ** -0.5, as T6's (its SDPA default).
Letters (with those of `attention.core`: B, T, S, N, H, D; here only):

  q  R_Q, the queries' rank (or, KV-only, their N heads as the query rows)
  r  R_K, the keys' rank          v  R_V, the values' rank
  F  N + H, a cached factor pair's features: [a_r ; b_r]

  params  query_head_factors [D, q, N], query_token_factors [D, q, H]
          (KV-only: query [D, N, H]); key_head_factors [D, r, N],
          key_token_factors [D, r, H]; value_head_factors [D, v, N],
          value_token_factors [D, v, H]; out [N, H, D]. head_bias: the head
          factors' biases, *_head_factors_bias [q | r | v, N] (none for
          KV-only queries), a constant a_r = W_a x + c_r. A layer sharing
          another's K/V (kv_share) has the query's and out only.
  cache   cached_key_factors [B, S, r, F] and cached_value_factors
          [B, S, v, F] per token (dense [Z, F, S], Z = B·r or B·v rows;
          paged [r or v, P, p, F]): (R_K + R_V)(N + H) numbers per token and
          layer; int8: key_factors_scale and value_factors_scale, one
          float32 per token and rank.

head_bias is for converted models (`train.convert --to_tpa`): a head factor
W_a x cannot be the constant one-hot of the paper's Section 4, where MHA and
GQA are non-contextual TPA (K KV heads: rank K, a_r = K·e(heads of group
r), b_r = W^K_r x); the bias can, with W_a = 0, and uptraining then makes the
factors contextual. A model trained from scratch may take it or not
(default: not, as T6). The biases are not weight-decayed (`train.loop`).

The full pass (training, any pass without a cache) builds each head's
queries, keys and values from the factors and runs `dot_product_attention`
(MHA over N heads). Decoding never does (`factor_attention`, the order of
the authors' FlashTPA decode): a query's token factors meet every cached
token factor (q·r dot products of H per key), its head factors combine those
per head, then the keys' head factors (the logits); the probabilities times
the values' head factors weight the cached value token factors. Its FLOPs per
key are `attention_flops_per_key(absorbed=True)`, against 2·2·N·H for keys
and values built per head.

int8: one scale per cached factor pair [a_r ; b_r]. A pair's split of scale
is free (a ⊗ b = (c·a) ⊗ (b/c)), so before an int8 cache stores them they
are balanced to equal absmax, which lets one scale serve both.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from attention import kv_cache, numerics
from attention.core import dot_product_attention
from attention.layout import Layout, register
from attention.rope import apply_rope

Array = jax.Array

# The grouped-query options TPA refuses: it has its own projections.
_OWN_PROJECTIONS = ('fused_qkv', 'qkv_bias', 'qk_norm')
_KINDS = ('query', 'key', 'value')


@register
@dataclasses.dataclass(frozen=True)
class TPA(Layout):
  """Tensor product attention's settings: the ranks of the queries (q_rank,
  R_Q; 0: per-head queries, the paper's TPA-KV-only), keys (k_rank, R_K)
  and values (v_rank, R_V), T6's 6, 2 and 2 by default; head_bias, a
  learnable constant beside each head factor (a converted model's one-hot).
  The heads are the layer's num_heads (num_kv_heads must equal it)."""
  name: ClassVar[str] = 'tpa'
  logical_axes: ClassVar[dict] = {
      # Head factors split over tensor with the query heads; token factors
      # (every head reads every rank's) whole on each shard, as head_dim.
      **{f'{kind}_head_factors': ('embed', None, 'q_heads')
         for kind in _KINDS},
      **{f'{kind}_token_factors': ('embed', None, 'head_dim')
         for kind in _KINDS},
      **{f'{kind}_head_factors_bias': (None, 'q_heads') for kind in _KINDS},
      'query': ('embed', 'q_heads', 'head_dim'),
      'out': ('q_heads', 'head_dim', 'embed'),
  }
  # 0, not None, for per-head queries: a config's int field cannot be set
  # to None from the command line.
  q_rank: int = 6
  k_rank: int = 2
  v_rank: int = 2
  head_bias: bool = False

  def resolve(self, options) -> 'TPA':
    """Itself; ValueError, naming the setting and the fix, for what TPA
    cannot take."""
    problem = self._problem(options)
    if problem:
      raise ValueError(problem)
    return self

  def _problem(self, o) -> str | None:
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    for name in ('k_rank', 'v_rank'):
      value = getattr(self, name)
      if not (is_int(value) and value >= 1):
        return f'tpa.{name}={value!r} must be an integer >= 1'
    if not (is_int(self.q_rank) and self.q_rank >= 0):
      return (f'tpa.q_rank={self.q_rank!r} must be an integer >= 1, or 0 '
              '(per-head queries: TPA-KV-only)')
    if not isinstance(self.head_bias, bool):
      return f'tpa.head_bias={self.head_bias!r} must be True or False'
    for name in _OWN_PROJECTIONS:
      if getattr(o, name):
        return (f'{name}=True with attention=\'tpa\': tensor product '
                f'attention has its own projections; set {name}=False')
    if o.num_kv_heads != o.num_heads:
      return (f'num_kv_heads={o.num_kv_heads} with attention=\'tpa\': TPA '
              'builds every query head\'s key and value from its factors; '
              f'set num_kv_heads={o.num_heads} (num_heads)')
    return None

  def ranks(self) -> dict[str, int | None]:
    """{'query': R_Q (None: per-head queries, q_rank=0), 'key': R_K,
    'value': R_V}."""
    return dict(zip(_KINDS, (self.q_rank or None, self.k_rank, self.v_rank)))

  def param_shapes(self, options, d_model: int, *, shared_kv: bool = False
                   ) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape (the module docstring's table)."""
    D, N, H = d_model, options.num_heads, options.head_dim
    shapes = {}
    for kind, R in self.ranks().items():
      if kind != 'query' and shared_kv:
        continue
      if R is None:  # KV-only: per-head queries.
        shapes['query'] = (D, N, H)
        continue
      shapes |= {f'{kind}_head_factors': (D, R, N),
                 f'{kind}_token_factors': (D, R, H)}
      if self.head_bias:
        shapes[f'{kind}_head_factors_bias'] = (R, N)
    return {**shapes, 'out': (N, H, D)}

  def entries(self, options) -> tuple[kv_cache.Entry, ...]:
    """Per token, the keys' R_K factor pairs [a_r ; b_r] and the values'
    R_V, N + H numbers each: the cache's only contents."""
    F = options.num_heads + options.head_dim
    # Stored [F, S] per row of the dense cache (`kv_cache.Entry`'s
    # transposed): each row's head factors a contiguous [N, S] block, and
    # both matmuls of `factor_attention` read the cache without repacking.
    return (kv_cache.Entry('cached_key_factors', self.k_rank, F, True,
                           'key_factors_scale'),
            kv_cache.Entry('cached_value_factors', self.v_rank, F, True,
                           'value_factors_scale'))

  def project(self, options, params, w, x_BTD, pos_bT, shared: bool
              ) -> tuple[tuple[Array | None, Array], dict[str, Array]]:
    """((the queries' head factors [B, T, q, N], their token factors
    [B, T, q, H] turned by RoPE; KV-only: (None, the queries [B, T, N, H]
    turned)), the new tokens' cache entries: the key factor pairs
    [B, T, r, F] (b turned by RoPE) and the value factor pairs [B, T, v, F];
    none when shared)."""
    del params  # No norms: every weight is read in the compute dtype, w.
    B, T, D = x_BTD.shape
    x_XD = x_BTD.reshape(B * T, D)
    rope = ((lambda x: apply_rope(x, pos_bT, base=options.rope_base,
                                  scaling=options.rope_scaling))
            if options.use_rope else (lambda x: x))
    if not self.q_rank:
      q_BTNH = (x_XD @ w['query'].reshape(D, -1)).reshape(
          B, T, options.num_heads, options.head_dim)
      queries = (None, rope(q_BTNH))
    else:
      a_BTqN, b_BTqH = self._factors('query', w, x_XD, B, T)
      queries = (a_BTqN, rope(b_BTqH))
    if shared:
      return queries, {}
    a_BTrN, b_BTrH = self._factors('key', w, x_XD, B, T)
    a_BTvN, b_BTvH = self._factors('value', w, x_XD, B, T)
    pairs = lambda a, b: jnp.concatenate(
        balanced(a, b) if options.kv_cache_dtype == 'int8' else (a, b),
        axis=-1)
    return queries, {'cached_key_factors': pairs(a_BTrN, rope(b_BTrH)),
                     'cached_value_factors': pairs(a_BTvN, b_BTvH)}

  def _factors(self, kind: str, w, x_XD, B: int, T: int
               ) -> tuple[Array, Array]:
    """(head factors [B, T, R, N], token factors [B, T, R, H]) of `kind`:
    plain [X, D] x [D, R·N] matmuls, X = B·T (see grouped.project)."""
    D = x_XD.shape[1]
    head_DRN, token_DRH = w[f'{kind}_head_factors'], w[f'{kind}_token_factors']
    a_XRN = (x_XD @ head_DRN.reshape(D, -1)).reshape(-1, *head_DRN.shape[1:])
    if self.head_bias:
      a_XRN = a_XRN + w[f'{kind}_head_factors_bias']
    b_XRH = (x_XD @ token_DRH.reshape(D, -1)).reshape(-1,
                                                       *token_DRH.shape[1:])
    return (a_XRN.reshape(B, T, *a_XRN.shape[1:]),
            b_XRH.reshape(B, T, *b_XRH.shape[1:]))

  def attend(self, options, w, queries, kv, mask) -> Array:
    """The full pass: [B, T, N, H], against per-head keys and values built
    from the factors (`build`)."""
    del w
    a_BTqN, q_BTqH = queries
    q_BTNH = q_BTqH if a_BTqN is None else build(a_BTqN, q_BTqH)
    N = options.num_heads
    return dot_product_attention(
        q_BTNH, build(*split(kv.key, N)), build(*split(kv.value, N)),
        mask=mask, is_causal=options.is_causal, scale=options.scale,
        local_window=options.local_window,
        logits_soft_cap=options.logits_soft_cap)

  def attend_cached(self, options, w, queries, kv, visible) -> Array:
    """Against the cache (dense, or a paged one's rows gathered):
    [B, T, N, H], from the factors (`factor_attention`)."""
    del w
    rows = kv_cache.gathered(kv, options)
    return factor_attention(
        *queries, rows.key, rows.value, visible, scale=options.scale,
        logits_soft_cap=options.logits_soft_cap,
        key_scale_ZS=rows.key_scale, value_scale_ZS=rows.value_scale)

  def flops_per_token(self, options, d_model: int, context: float,
                      shares_kv: bool, absorbed: bool) -> float:
    """Factor projections 2·D·R·(N + H) for each factored rank R (KV-only
    queries: 2·D·N·H; none for K and V when sharing them), output 2·N·H·D;
    the full pass builds per-head Q, K and V, 2·R·N·H each (not the KV-only
    queries), then attends as MHA; decoding (absorbed) builds nothing and
    pays `attention_flops_per_key(absorbed=True)` per key instead."""
    D, N, H = d_model, options.num_heads, options.head_dim
    total = 2 * N * H * D
    for kind, R in self.ranks().items():
      if kind != 'query' and shares_kv:
        continue
      if R is None:
        total += 2 * D * N * H
        continue
      total += 2 * D * R * (N + H) + (0 if absorbed else 2 * R * N * H)
    return total + self.attention_flops_per_key(options, absorbed) * context

  def attention_flops_per_key(self, options, absorbed: bool = False
                              ) -> float:
    """Built per head (the full pass): MHA's 2·2·N·H. From the factors
    (decoding, `factor_attention`): the query rows' dot products with the
    key token factors 2·q·R_K·H (q = R_Q, or N KV-only), their combination
    by the query head factors 2·R_Q·R_K·N (none KV-only) and by the key
    head factors 2·R_K·N; the probabilities times the value head factors
    R_V·N and the weighted sum of the value token factors 2·R_V·N·H. (The
    zeros `factor_attention` pads its products with are not counted.)"""
    N, H = options.num_heads, options.head_dim
    if not absorbed:
      return 2 * 2 * N * H
    Rk, Rv = self.k_rank, self.v_rank
    rows = self.q_rank or N
    heads = 2 * self.q_rank * Rk * N
    return (2 * rows * Rk * H + heads + 2 * Rk * N
            + Rv * N + 2 * Rv * N * H)

  def mesh_counts(self, options) -> dict[str, int]:
    """None conditional: the tensor axis splits the query heads (which it
    must divide, `lm.sharding`), and with them the head factors and out;
    the ranks and the token factors, which every head reads, stay whole on
    each shard (split, a logit would be a sum across shards)."""
    del options
    return {}

  def describe(self, options) -> str:
    N, H = options.num_heads, options.head_dim
    queries = ('per-head queries (KV-only)' if not self.q_rank
               else f'queries of rank {self.q_rank}')
    bias = ', head-factor biases' if self.head_bias else ''
    return (f'TPA: K and V of rank {self.k_rank} and {self.v_rank} over {N} '
            f'heads x {H}, factors of {N} + {H}; {queries}{bias}')


def split(pairs_BSRF: Array, N: int) -> tuple[Array, Array]:
  """(head factors [B, S, R, N], token factors [B, S, R, H]) of cached
  factor pairs [B, S, R, N + H]."""
  return pairs_BSRF[..., :N], pairs_BSRF[..., N:]


def build(a_BSRN: Array, b_BSRH: Array) -> Array:
  """[B, S, N, H]: (1/R) Σ_r a_r ⊗ b_r, per-head queries, keys or values
  from their factors (what the full pass attends with, and decoding never
  builds)."""
  R = a_BSRN.shape[2]
  dtype = jnp.result_type(a_BSRN.dtype, b_BSRH.dtype)
  return (jnp.einsum('BSRN,BSRH->BSNH', a_BSRN.astype(dtype),
                     b_BSRH.astype(dtype)) / R).astype(dtype)


def balanced(a_BTRN: Array, b_BTRH: Array) -> tuple[Array, Array]:
  """(c·a, b/c), c = sqrt(max|b| / max|a|) per token and rank, so that the
  two factors of a pair share one int8 scale without loss to either; the
  same product a ⊗ b. c is a constant to autodiff (the product's gradient
  is the unbalanced one)."""
  amax = lambda x: jnp.max(jnp.abs(x.astype(jnp.float32)), -1, keepdims=True)
  a_max, b_max = amax(a_BTRN), amax(b_BTRH)
  c = jnp.where((a_max > 0) & (b_max > 0),
                jnp.sqrt(b_max / jnp.where(a_max > 0, a_max, 1.0)), 1.0)
  c = jax.lax.stop_gradient(c)
  return ((a_BTRN * c).astype(a_BTRN.dtype),
          (b_BTRH / c).astype(b_BTRH.dtype))


def factor_attention(q_heads_BTqN, q_rows_BTqH, key_ZFS, value_ZFS, visible,
                     *, scale: float, logits_soft_cap: float | None,
                     key_scale_ZS=None, value_scale_ZS=None) -> Array:
  """[B, T, N, H]: T queries against S cached factor pairs, no per-head key
  or value formed (FlashTPA's order, in JAX).

  q_heads_BTqN: the queries' head factors [B, T, q, N] (q = R_Q), or None
  for per-head queries (KV-only: q_rows are then the N heads' queries);
  q_rows_BTqH: their token factors [B, T, q, H], turned by RoPE. key
  [Z, F, S] (Z = B·R_K rows, batch row b's rank r at b·R_K + r; F = N + H
  features, [a_r ; b_r]) and value [B·R_V, F, S] are read as stored (int8
  with their [Z, S] float32 scales, which, squared, multiply the head
  factors: a pair's two halves share one); visible: boolean broadcastable
  to [B, N, T, S] (True = attend), or None.

  Each row's [F, S] matrix is a matmul operand where it lies, and its head
  factors, the first N of its F rows, a contiguous [N, S] block: the query
  rows are padded with N zeros to meet the pairs' F features (no [N:] slice
  of the cache to copy), the weighted sum of the value pairs keeps its last
  H features, and the small contractions over the ranks are unrolled sums
  (XLA's CPU reduces a non-minor axis, or batches tiny matmuls, several
  times slower). In a preliminary microbenchmark on a loaded 2-core Zen 5
  (B = 64, S = 2048, gqa_small's N = 8, H = 32, T6's ranks) this ran 5x
  faster than [Z, S, F] pairs with batched contractions and reduces, and
  3x slower than grouped-query attention's step at 1.25x fewer bytes;
  `scripts.bench_decode --variants=K2,TPA2` is the measurement.
  """
  B, T, q, H = q_rows_BTqH.shape
  Zk, F, S = key_ZFS.shape
  N, Rk, Rv = F - H, Zk // B, value_ZFS.shape[0] // B
  dtype = q_rows_BTqH.dtype
  # The query rows against every cached key token factor: per row of the
  # cache [T·q, F] x [F, S], the rows repeated for each of its R_K ranks.
  rows_BXF = jnp.pad(q_rows_BTqH, [(0, 0)] * 3 + [(N, 0)]).reshape(
      B, 1, T * q, F)
  rows_ZXF = jnp.broadcast_to(rows_BXF, (B, Rk, T * q, F)).reshape(
      Zk, T * q, F)
  c_BrTqS = _matmul(rows_ZXF, key_ZFS, contract=1).reshape(B, Rk, T, q, S)
  a_BrTNS = _head_factors(key_ZFS, key_scale_ZS, B, N)
  if q_heads_BTqN is None:  # Per-head queries: the rows are the heads.
    per_head = lambda r: c_BrTqS[:, r]
    rank_q = 1
  else:  # Each head's combination of the q rows: [B, T, N, S].
    a_BTqN1 = q_heads_BTqN.astype(jnp.float32)[..., None]
    per_head = lambda r: sum(a_BTqN1[:, :, i] * c_BrTqS[:, r, :, i, None]
                             for i in range(q))
    rank_q = q
  # The keys' head factors, Σ_r a_r[n]·(head n's row r): the logits.
  logits_BTNS = sum(per_head(r) * a_BrTNS[:, r] for r in range(Rk)) * (
      scale / (rank_q * Rk))
  logits_BTNS = numerics.soft_cap(logits_BTNS, logits_soft_cap)
  mask_BTNS = None if visible is None else jnp.swapaxes(visible, 1, 2)
  probs_BTNS = numerics.masked_softmax(logits_BTNS, mask_BTNS)
  # The values: p·a_r[n] weights each cached token factor b_r; per row of
  # the cache [F, S] x [S, T·N], summed over the R_V ranks, last H kept.
  weights_ZXS = (probs_BTNS[:, None]
                 * _head_factors(value_ZFS, value_scale_ZS, B, N) / Rv
                 ).reshape(B * Rv, T * N, S)
  out_BFX = _matmul(value_ZFS, weights_ZXS.astype(dtype), contract=2
                    ).reshape(B, Rv, F, T * N).sum(1)
  return jnp.swapaxes(out_BFX[:, N:], 1, 2).reshape(B, T, N, H).astype(dtype)


def _head_factors(pairs_ZFS, scale_ZS, B: int, N: int) -> Array:
  """[B, R, 1, N, S] float32: the cached pairs' head factors (each row's
  first N features), times their int8 scale squared (the pair's token
  factor shares it)."""
  Z, _, S = pairs_ZFS.shape
  a_ZNS = pairs_ZFS[:, :N].astype(jnp.float32)
  if scale_ZS is not None:
    a_ZNS = a_ZNS * jnp.square(scale_ZS)[:, None]
  return a_ZNS.reshape(B, Z // B, 1, N, S)


def _matmul(a_ZXC, b_ZYC, contract: int):
  """Per row z, a [X, C] x the cache [C, S] as stored (contract=1, -> [Z,
  X, S]), or the cache [F, S] x a's [S, X]ᵀ (a: [Z, X, S], contract=2, ->
  [Z, F, X]); float32, the cache in its own dtype (as `attention.decode`).
  The cache is an operand in the layout the CPU's matmul kernels take."""
  if contract == 1:
    return jax.lax.dot_general(a_ZXC, b_ZYC, (((2,), (1,)), ((0,), (0,))),
                               preferred_element_type=jnp.float32)
  return jax.lax.dot_general(a_ZXC, b_ZYC, (((2,), (2,)), ((0,), (0,))),
                             preferred_element_type=jnp.float32)
