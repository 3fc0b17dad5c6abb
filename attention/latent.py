"""Multi-head latent attention (MLA, DeepSeek-V2/V3) and its grouped form
(GLA, Zadouri, Strauss & Dao 2025) as pure functions.

The layout 'mla' (`attention.layout`): `attention.layer.apply` hands a
layer here when its options' layout is an `MLA`. Letters (with those of `attention.core`: B, T, S, N, D, Z):

  A  kv_lora_rank, the latent's width    Q  q_lora_rank (optional)
  I  qk_nope_head_dim, a head's key      Y  qk_rope_head_dim, the RoPE key
     features without position              shared by the heads
  U  v_head_dim                          G  latent_groups (here only: not
  M  N / G, query heads per latent          core's N // K); 1 is MLA
  F  A / G, a group's latent width (a cache entry's features)

  params  kv_down [D, A + Y] (the G latents, group-major, then the RoPE key;
          DeepSeek's kv_a_proj_with_mqa), kv_norm [A] (latent_norm: an
          RMSNorm of each group's F features, its weight viewed [G, F]),
          kv_up [F, N, I + U] (DeepSeek's kv_b_proj: head n's key_up [F, I],
          then its value_up [F, U], reading its group's latent), out
          [N, U, D]; the query: query [D, N, I + Y], or query_down [D, Q],
          query_down_norm [Q] and query_up [Q, N, I + Y]. A layer sharing
          another's K/V (kv_share) reads that layer's latents: it has no
          kv_down or kv_norm.
  cache   cached_latent [B, S, G, F] per token (dense: [Z, S, F], Z = B·G
          rows), cached_rope_key [B, S, 1, Y] (none when Y = 0); int8:
          latent_scale (one per token and group) and rope_key_scale, float32.

Query head n = g·M + m reads latent group g = n // M (the order of
`jnp.repeat`, as a KV head's in `attention.core`). Its key is
[c_g·key_up[:, n], RoPE(k_rope)] and its value c_g·value_up[:, n] for the
normed latent c_g of its group. The full pass (training, and any pass without
a cache) builds them and runs `dot_product_attention`. Decoding never does
("absorbed", as DeepSeek's inference code): the query absorbs key_up,
q_lat = q_nope·key_upᵀ [B, T, N, F], so a logit is q_lat·c_g + q_rope·k_rope
against the cache as it lies, each group's latents read once for its M query
heads, and value_up is applied after the weighted sum of the latents,
o = (Σ_s p_s c_g,s)·value_up. The cache holds A + Y numbers per token and
layer whatever G (N·(I + U) for a per-head K/V of the same heads); G > 1
splits the work of decoding by groups, which tensor parallelism shards.
Lowered for the CPU, `attend_cached` reads the cache with a C++ kernel
(`attention.cpu_kernel.latent_attention`) that streams each latent once for
both the logits and the weighted sum; the absorption and value_up stay
here.
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


@register
@dataclasses.dataclass(frozen=True)
class MLA(Layout):
  """Multi-head latent attention's settings, named as DeepSeek's configs:
  a kv_lora_rank-wide latent (A; None: 4·head_dim, DeepSeek-V2/V3's 512
  for their 128-wide heads), an optional q_lora_rank query
  latent (Q), a qk_rope_head_dim RoPE key shared by the heads (Y), per-head
  qk_nope_head_dim keys (I) and v_head_dim values (U); None: head_dim, and
  for Y head_dim / 2 with RoPE (0 without). latent_groups (G): GLA's groups,
  1 is MLA. latent_norm: the latent's RMSNorm (DeepSeek's kv_a_layernorm; a
  checkpoint converted into MLA has none, an RMSNorm not being linear).
  rope_pairs: for a model converted from a RoPE model (`train.convert
  --to_mla`), RoPE pair j turns at frequency rope_pairs[j] of a
  head_dim-wide RoPE (pairs kept from the source's); None: a
  qk_rope_head_dim-wide RoPE."""
  name: ClassVar[str] = 'mla'
  logical_axes: ClassVar[dict] = {
      'query': ('embed', 'q_heads', 'head_dim'),
      'out': ('q_heads', 'head_dim', 'embed'),
      'query_down': ('embed', 'q_lora'),
      'query_down_norm': ('norm',),
      'query_up': ('q_lora', 'q_heads', 'head_dim'),
      'kv_down': ('embed', 'kv_lora'),
      'kv_norm': ('latent_groups',),  # [A]: G groups of F, group-major.
      'kv_up': ('kv_lora', 'q_heads', 'head_dim'),
  }
  kv_lora_rank: int | None = None
  q_lora_rank: int | None = None
  qk_rope_head_dim: int | None = None
  qk_nope_head_dim: int | None = None
  v_head_dim: int | None = None
  latent_groups: int = 1
  latent_norm: bool = True
  rope_pairs: tuple[int, ...] | None = None

  def resolve(self, options) -> 'MLA':
    """Itself with kv_lora_rank (None: 4·head_dim), qk_nope_head_dim and
    v_head_dim (None: head_dim) and qk_rope_head_dim (None: head_dim / 2
    with use_rope, else 0) filled in;
    ValueError, naming the field and the fix, for what MLA (or GLA) cannot
    take."""
    H = options.head_dim
    defaults = {'kv_lora_rank': 4 * H, 'qk_nope_head_dim': H, 'v_head_dim': H,
                'qk_rope_head_dim': H // 2 if options.use_rope else 0}
    pairs = self.rope_pairs
    resolved = dataclasses.replace(
        self, **{name: value for name, value in defaults.items()
                 if getattr(self, name) is None},
        rope_pairs=None if pairs is None else tuple(pairs))
    problem = resolved._problem(options)  # pylint: disable=protected-access
    if problem:
      raise ValueError(problem)
    return resolved

  def _problem(self, o) -> str | None:
    """What MLA cannot take with the layer's options `o`, and what to do,
    or None."""
    A, Q, Y = self.kv_lora_rank, self.q_lora_rank, self.qk_rope_head_dim
    is_int = lambda v, low: isinstance(v, int) and not isinstance(
        v, bool) and v >= low
    for name, value, low in (('kv_lora_rank', A, 1),
                             ('qk_rope_head_dim', Y, 0),
                             ('qk_nope_head_dim', self.qk_nope_head_dim, 0),
                             ('v_head_dim', self.v_head_dim, 1)):
      if not is_int(value, low):
        return f'mla.{name}={value!r} must be an integer >= {low}'
    if Q is not None and not is_int(Q, 1):
      return (f'mla.q_lora_rank={Q!r} must be an integer >= 1, or None (no '
              'query latent)')
    if not isinstance(self.latent_norm, bool):
      return f'mla.latent_norm={self.latent_norm!r} must be True or False'
    G, N = self.latent_groups, o.num_heads
    if not is_int(G, 1):
      return f'mla.latent_groups={G!r} must be an integer >= 1 (1: MLA)'
    if N % G or A % G:
      fits = [g for g in range(1, min(N, A) + 1) if N % g == 0 == A % g]
      return (f'mla.latent_groups={G} must divide num_heads={N} and '
              f'mla.kv_lora_rank={A} (each latent group holds kv_lora_rank '
              f'/ G features for num_heads / G query heads); pick '
              f'latent_groups in {fits}')
    if self.qk_nope_head_dim + Y == 0:
      return ('mla.qk_nope_head_dim=0 and mla.qk_rope_head_dim=0 leave the '
              'keys empty; give one of them > 0')
    for name in ('qk_norm', 'qkv_bias', 'fused_qkv'):
      if getattr(o, name):
        return (f'{name}=True with attention=\'mla\': multi-head latent '
                f'attention has its own projections; set {name}=False')
    if o.num_kv_heads != o.num_heads:
      return (f'num_kv_heads={o.num_kv_heads} with attention=\'mla\': MLA '
              'rebuilds every query head\'s key and value from the latent; '
              f'set num_kv_heads={o.num_heads} (num_heads)')
    if o.use_rope and (Y == 0 or Y % 2):
      return (f'mla.qk_rope_head_dim={Y} with use_rope=True: MLA turns a '
              'shared RoPE key of qk_rope_head_dim features, which must be '
              'even and > 0; set it, or use_rope=False with '
              'qk_rope_head_dim=0')
    if not o.use_rope and Y:
      return (f'mla.qk_rope_head_dim={Y} with use_rope=False: nothing turns '
              'the RoPE key; set qk_rope_head_dim=0, or use_rope=True')
    return pairs_problem(self.rope_pairs, self.qk_rope_head_dim, o.head_dim,
                         'mla.rope_pairs', '--to_mla')

  def scale(self, options) -> float:
    """DeepSeek's softmax scale: query_pre_attn_scalar (None: the query's
    qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times YaRN's mscale
    squared when the RoPE scaling is YaRN's with mscale_all_dim."""
    width = self.qk_nope_head_dim + self.qk_rope_head_dim
    mscale = (options.rope_scaling.softmax_mscale
              if options.rope_scaling is not None else 1.0)
    return (options.query_pre_attn_scalar or width) ** -0.5 * mscale * mscale

  def param_shapes(self, options, d_model: int, *, shared_kv: bool = False
                   ) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape (the module docstring's table)."""
    D, N, A, Q = d_model, options.num_heads, self.kv_lora_rank, (
        self.q_lora_rank)
    I, Y, U = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
    F = A // self.latent_groups
    if Q:
      shapes = {'query_down': (D, Q), 'query_down_norm': (Q,),
                'query_up': (Q, N, I + Y)}
    else:
      shapes = {'query': (D, N, I + Y)}
    if not shared_kv:
      shapes |= {'kv_down': (D, A + Y)}
      if self.latent_norm:
        shapes |= {'kv_norm': (A,)}
    return {**shapes, 'kv_up': (F, N, I + U), 'out': (N, U, D)}

  def entries(self, options) -> tuple[kv_cache.Entry, ...]:
    """The latent as G groups of A/G features, and the RoPE key (none when
    qk_rope_head_dim is 0)."""
    del options
    G = self.latent_groups
    out = [kv_cache.Entry('cached_latent', G, self.kv_lora_rank // G, False,
                          'latent_scale')]
    if self.qk_rope_head_dim:
      out.append(kv_cache.Entry('cached_rope_key', 1, self.qk_rope_head_dim,
                                False, 'rope_key_scale'))
    return tuple(out)

  def project(self, options, params, w, x_BTD, pos_bT, shared: bool
              ) -> tuple[tuple[Array, Array], dict[str, Array]]:
    """The projections: ((q_nope [B, T, N, I], q_rope [B, T, N, Y] turned
    by RoPE), the cache entries of the new tokens: the normed latents
    [B, T, G, F] and the turned RoPE key [B, T, 1, Y]; none when shared)."""
    B, T, D = x_BTD.shape
    x_XD = x_BTD.reshape(B * T, D)
    q_BTNI, q_BTNY = self._queries(options, params, w, x_XD, B, T)
    rope = lambda x: apply_rope(
        x, pos_bT, base=options.rope_base, scaling=options.rope_scaling,
        frequencies=pair_frequencies(options, self.rope_pairs))
    if self.qk_rope_head_dim:
      q_BTNY = rope(q_BTNY)
    if shared:
      return (q_BTNI, q_BTNY), {}
    c_BTGF, k_BTY = self._latent(options, params, w, x_XD, B, T)
    new = {'cached_latent': c_BTGF}
    if self.qk_rope_head_dim:
      new['cached_rope_key'] = rope(k_BTY[:, :, None])  # One head, shared.
    return (q_BTNI, q_BTNY), new

  def attend(self, options, w, queries, kv, mask) -> Array:
    """The full pass: [B, T, N, U], against per-head keys and values built
    from the latents (`expand`)."""
    q_BTNI, q_BTNY = queries
    c_BSGF = kv.key
    k_BSY = (jnp.zeros(c_BSGF.shape[:2] + (0,), c_BSGF.dtype)
             if kv.value is None else kv.value[:, :, 0])
    k_BSNH, v_BSNU = expand(*split_up(w['kv_up'], self.qk_nope_head_dim),
                            c_BSGF, k_BSY)
    return _expanded_attention(options, q_BTNI, q_BTNY, k_BSNH, v_BSNU, mask)

  def attend_cached(self, options, w, queries, kv, visible) -> Array:
    """Against the cache: [B, T, N, U], absorbed. Per platform lowered for:
    on the CPU, where it takes the call (`cpu_kernel.refusal`), the C++
    kernel, which reads each cached latent once for the logits and the
    weighted sum (a paged pool in place); elsewhere `absorbed_attention` (a
    paged cache's rows gathered first)."""
    q_BTNI, q_BTNY = queries
    key_up_FNI, value_up_FNU = split_up(w['kv_up'], self.qk_nope_head_dim)

    def jax_path():
      rows = kv_cache.gathered(kv, options)
      return absorbed_attention(
          q_BTNI, q_BTNY, key_up_FNI, value_up_FNU, rows.key, rows.value,
          visible, scale=options.scale,
          logits_soft_cap=options.logits_soft_cap,
          latent_scale_ZS=rows.key_scale, rope_key_scale_BS=rows.value_scale)

    def kernel():
      o_BTNF = cpu_kernel.latent_attention(
          options, absorb_query(q_BTNI, key_up_FNI), q_BTNY, kv, visible)
      return latent_values(o_BTNF, value_up_FNU)

    if cpu_kernel.refusal(options, kv, visible) is not None:
      return jax_path()
    return jax.lax.platform_dependent(cpu=kernel, default=jax_path)

  def flops_per_token(self, options, d_model: int, context: float,
                      shares_kv: bool, absorbed: bool) -> float:
    """query 2·D·N·(I+Y), or 2·D·Q + 2·Q·N·(I+Y) with a query latent;
    latent and RoPE key 2·D·(A+Y) (none when sharing K/V); keys and values
    from it 2·(A/G)·N·(I+U), or absorbed (decoding) the queries'
    2·N·I·(A/G) and the outputs' 2·N·(A/G)·U; scores and mix per key
    (`attention_flops_per_key`); output projection 2·N·U·D."""
    D, N, A, Q = d_model, options.num_heads, self.kv_lora_rank, (
        self.q_lora_rank)
    I, Y, U = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
    A_head = A // self.latent_groups  # The latent a head reads: its group's.
    query = 2 * D * Q + 2 * Q * N * (I + Y) if Q else 2 * D * N * (I + Y)
    latent = 0 if shares_kv else 2 * D * (A + Y)
    expand_ = (2 * N * I * A_head + 2 * N * A_head * U if absorbed
               else 2 * A_head * N * (I + U))
    attend = self.attention_flops_per_key(options, absorbed) * context
    return query + latent + expand_ + attend + 2 * N * U * D

  def attention_flops_per_key(self, options, absorbed: bool = False
                              ) -> float:
    """2·N·(I+Y) + 2·N·U expanded; 2·N·(A/G+Y) + 2·N·(A/G) absorbed."""
    N = options.num_heads
    I, Y, U = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
    if absorbed:
      A_head = self.kv_lora_rank // self.latent_groups
      return 2 * N * (A_head + Y) + 2 * N * A_head
    return 2 * N * (I + Y) + 2 * N * U

  def mesh_counts(self, options) -> dict[str, int]:
    del options
    return {'latent_groups': self.latent_groups}

  def describe(self, options) -> str:
    del options
    groups = (f' in {self.latent_groups} groups (GLA)'
              if self.latent_groups > 1 else '')
    return (f'MLA: a latent of {self.kv_lora_rank}{groups} + a RoPE key of '
            f'{self.qk_rope_head_dim}')

  def _queries(self, options, params, w, x_XD, B: int, T: int
               ) -> tuple[Array, Array]:
    """(q_nope [B, T, N, I], q_rope [B, T, N, Y]): through the query
    latent (query_down, its RMSNorm, query_up) when q_lora_rank is set."""
    N, I = options.num_heads, self.qk_nope_head_dim
    if self.q_lora_rank:
      q_XQ = kv_cache.head_rms_norm(x_XD @ w['query_down'],
                                    params['query_down_norm'], options)
      kernel = w['query_up']
    else:
      q_XQ, kernel = x_XD, w['query']
    q_BTNH = (q_XQ @ kernel.reshape(kernel.shape[0], -1)).reshape(
        B, T, N, -1)
    return q_BTNH[..., :I], q_BTNH[..., I:]

  def _latent(self, options, params, w, x_XD, B: int, T: int
              ) -> tuple[Array, Array]:
    """(the normed latents c [B, T, G, F], the RoPE key, not yet turned,
    [B, T, Y]) of the tokens."""
    A, G = self.kv_lora_rank, self.latent_groups
    ck_X = x_XD @ w['kv_down']  # [B·T, A + Y].
    c_XGF, k_XY = ck_X[:, :A].reshape(B * T, G, A // G), ck_X[:, A:]
    if self.latent_norm:  # Each group's latent by itself (GLA's).
      c_XGF = kv_cache.head_rms_norm(c_XGF, params['kv_norm'].reshape(G, -1),
                                     options)
    return c_XGF.reshape(B, T, G, -1), k_XY.reshape(B, T, -1)


def split_up(kv_up, I: int) -> tuple[Array, Array]:
  """(key_up [F, N, I], value_up [F, N, U]) of kv_up [F, N, I + U]."""
  return kv_up[..., :I], kv_up[..., I:]


def expand(key_up_FNI, value_up_FNU, c_BSGF, k_BSY
           ) -> tuple[Array, Array]:
  """Per-head keys [B, S, N, I + Y] ([c_g·key_up[:, n], k_rope]) and values
  [B, S, N, U] (c_g·value_up[:, n]) from the latents (head n = g·M + m reads
  group g's) and the RoPE key: what the full pass attends to, and what
  decoding never builds."""
  F, N, I = key_up_FNI.shape
  B, S, G, _ = c_BSGF.shape
  # Per group, a plain [B·S, F] x [F, M·W] matmul (see layer.project),
  # batched over the G groups: [G, B·S, F] x [G, F, M·W].
  c_GXF = c_BSGF.reshape(B * S, G, F).transpose(1, 0, 2)
  per_head = lambda up_FNW: jnp.matmul(
      c_GXF, up_FNW.reshape(F, G, -1).transpose(1, 0, 2)).reshape(
          G, B, S, N // G, -1).transpose(1, 2, 0, 3, 4).reshape(B, S, N, -1)
  k_BSNI, v_BSNU = per_head(key_up_FNI), per_head(value_up_FNU)
  k_BSNY = jnp.broadcast_to(k_BSY[:, :, None].astype(k_BSNI.dtype),
                            (B, S, N, k_BSY.shape[-1]))
  return jnp.concatenate([k_BSNI, k_BSNY], axis=-1), v_BSNU


def _expanded_attention(options, q_BTNI, q_BTNY, k_BSNH, v_BSNU, mask):
  """[B, T, N, U]: the queries against the keys and values expanded from
  the latents, by `dot_product_attention` (keys and values zero-padded to
  one width, which changes no logit and no output feature)."""
  q_BTNH = jnp.concatenate([q_BTNI, q_BTNY.astype(q_BTNI.dtype)], axis=-1)
  H, U = q_BTNH.shape[-1], v_BSNU.shape[-1]
  pad = lambda x, width: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
  width = max(H, U)
  out_BTNH = dot_product_attention(
      pad(q_BTNH, width), pad(k_BSNH, width), pad(v_BSNU, width), mask=mask,
      is_causal=options.is_causal, scale=options.scale,
      local_window=options.local_window,
      logits_soft_cap=options.logits_soft_cap)
  return out_BTNH[..., :U]


def absorbed_attention(q_BTNI, q_BTNY, key_up_FNI, value_up_FNU, latent_ZSF,
                       rope_key_BSY, visible, *, scale: float,
                       logits_soft_cap: float | None,
                       latent_scale_ZS=None, rope_key_scale_BS=None):
  """[B, T, N, U]: T queries against S cached latents, with the key
  up-projection absorbed into the query and the value up-projection applied
  after the weighted sum, so no per-head key or value is formed.

  latent [Z, S, F] (Z = B·G rows, batch row b's group g at b·G + g) and
  rope_key [B, S, Y] (None when Y = 0) are read as stored (int8 with their
  [Z, S] and [B, S] float32 scales, which multiply the [.., S] logits and
  probabilities); visible: boolean broadcastable to [B, N, T, S] (True =
  attend).
  """
  B, T, N, I = q_BTNI.shape
  Z, S, F = latent_ZSF.shape
  G = Z // B
  q_BTNF = absorb_query(q_BTNI, key_up_FNI)
  # Group g's R = T·M query rows against its latents, one matmul per row of
  # the cache: each group's latents read once for its M query heads.
  logits_ZRS = _matmul(_by_group(q_BTNF, G), latent_ZSF, contract=2)
  if latent_scale_ZS is not None:
    logits_ZRS = logits_ZRS * latent_scale_ZS[:, None, :]
  logits_BTNS = _by_head(logits_ZRS, B, T)
  if rope_key_BSY is not None:  # One RoPE key for all N heads.
    rope_BRS = _matmul(q_BTNY.reshape(B, T * N, -1).astype(q_BTNI.dtype),
                       rope_key_BSY, contract=2)
    if rope_key_scale_BS is not None:
      rope_BRS = rope_BRS * rope_key_scale_BS[:, None, :]
    logits_BTNS = logits_BTNS + rope_BRS.reshape(B, T, N, S)
  logits_BTNS = numerics.soft_cap(logits_BTNS * scale, logits_soft_cap)
  mask_BTNS = None if visible is None else jnp.swapaxes(visible, 1, 2)
  probs_BTNS = numerics.masked_softmax(logits_BTNS, mask_BTNS)
  probs_ZRS = _by_group(probs_BTNS, G)
  if latent_scale_ZS is not None:
    probs_ZRS = probs_ZRS * latent_scale_ZS[:, None, :]
  # The latents' weighted sum [B, T, N, F], then W_UV.
  o_ZRF = _matmul(probs_ZRS.astype(q_BTNI.dtype), latent_ZSF, contract=1)
  return latent_values(_by_head(o_ZRF, B, T).astype(q_BTNI.dtype),
                       value_up_FNU)


def absorb_query(q_BTNI, key_up_FNI):
  """W_UK absorbed: q_lat[n] = q_nope[n]·key_up[:, n]ᵀ, [B, T, N, F]."""
  return jnp.einsum('BTNI,FNI->BTNF', q_BTNI, key_up_FNI)


def latent_values(o_BTNF, value_up_FNU):
  """W_UV after the weighted sum: [B, T, N, F] -> [B, T, N, U], in
  o_BTNF's dtype."""
  return jnp.einsum('BTNF,FNU->BTNU', o_BTNF, value_up_FNU).astype(
      o_BTNF.dtype)


def _by_group(x_BTNW, G: int):
  """[B, T, N, W] -> [Z, R, W]: each latent group's rows (Z = B·G), its M
  heads' T·M query rows (R) in (t, m) order, a [.., G, M, ..] view."""
  B, T, N, W = x_BTNW.shape
  return x_BTNW.reshape(B, T, G, N // G, W).transpose(0, 2, 1, 3, 4).reshape(
      B * G, T * (N // G), W)


def _by_head(x_ZRW, B: int, T: int):
  """`_by_group`'s inverse: [Z, R, W] -> [B, T, N, W]."""
  Z, R, W = x_ZRW.shape
  G, M = Z // B, R // T
  return x_ZRW.reshape(B, G, T, M, W).transpose(0, 2, 1, 3, 4).reshape(
      B, T, G * M, W)


def _matmul(a_ZRC, b_ZSC, contract: int):
  """Per row of the cache, [R, C] x the cache [S, C] as stored: contract=2,
  its features (-> [Z, R, S]), or [R, S] x [S, C], contract=1, its slots (->
  [Z, R, C]); float32, the cache in its own dtype (as decode's)."""
  return jax.lax.dot_general(a_ZRC, b_ZSC, (((2,), (contract,)), ((0,), (0,))),
                             preferred_element_type=jnp.float32)
