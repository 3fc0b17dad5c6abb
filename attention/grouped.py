"""Grouped-query attention ('gqa'): MHA, GQA and MQA through num_kv_heads.

The layout every layer takes unless it names another (`attention.layout`).
It has no settings of its own: the layer's `num_kv_heads` (K) is the knob,
N = K multi-head, 1 < K < N grouped-query, K = 1 multi-query attention.

  params  query [D, N, H], key [D, K, H], value [D, K, H], out [N, H, D]
          (fused_qkv: qkv [D, N + 2K, H] in place of the first three)
          qkv_bias: query_bias [N, H], key_bias and value_bias [K, H]
          (fused: qkv_bias [N + 2K, H]); qk_norm: query_norm, key_norm [H]
  cache   keys and values of K heads of H features per token
          (`kv_cache`: dense [B·K, H, S] and [B·K, S, H], paged
          [K, P, p, H]); int8: a float32 scale per token and KV head

Query head n attends with KV head n // G (G = N / K), the order of
`jnp.repeat(key, G, axis=2)`; the attention views the queries as
[.., K, G, ..] and never copies K or V per query head (`attention.core`,
`attention.decode`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from attention import cpu_kernel, decode, kv_cache, paged
from attention.core import dot_product_attention
from attention.layout import Layout, register
from attention.rope import apply_rope

Array = jax.Array


@register
@dataclasses.dataclass(frozen=True)
class GQA(Layout):
  """Grouped-query attention: K key/value heads, each read by N / K query
  heads (the layer's num_kv_heads)."""
  name: ClassVar[str] = 'gqa'
  logical_axes: ClassVar[dict] = {
      'query': ('embed', 'q_heads', 'head_dim'),
      'key': ('embed', 'kv_heads', 'head_dim'),
      'value': ('embed', 'kv_heads', 'head_dim'),
      'qkv': ('embed', None, 'head_dim'),
      'out': ('q_heads', 'head_dim', 'embed'),
      'query_bias': ('q_heads', 'head_dim'),
      'key_bias': ('kv_heads', 'head_dim'),
      'value_bias': ('kv_heads', 'head_dim'),
      'qkv_bias': (None, 'head_dim'),
      'query_norm': ('norm',),
      'key_norm': ('norm',),
  }

  def param_shapes(self, options, d_model: int, *, shared_kv: bool = False
                   ) -> dict[str, tuple[int, ...]]:
    D, N, K, H = d_model, options.num_heads, options.num_kv_heads, (
        options.head_dim)
    if shared_kv:
      heads = {'query': N}
    elif options.fused_qkv:
      heads = {'qkv': N + 2 * K}
    else:
      heads = {'query': N, 'key': K, 'value': K}
    shapes = {name: (D, E, H) for name, E in heads.items()}
    if options.qkv_bias:
      shapes |= {f'{name}_bias': (E, H) for name, E in heads.items()}
    if options.qk_norm:
      shapes |= {'query_norm': (H,)}
      if not shared_kv:
        shapes |= {'key_norm': (H,)}
    return {**shapes, 'out': (N, H, D)}

  def entries(self, options) -> tuple[kv_cache.Entry, ...]:
    K, H = options.num_kv_heads, options.head_dim
    # Keys stored [H, S] per row: the logits' matmul operand as the CPU's
    # matmul kernels read it without repacking (`attention.layer`).
    return (kv_cache.Entry('cached_key', K, H, True, 'key_scale'),
            kv_cache.Entry('cached_value', K, H, False, 'value_scale'))

  def project(self, options, params, w, x_BTD, pos_bT, shared: bool
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

  def attend(self, options, w, q_BTNH, kv, mask) -> Array:
    """The full pass: [B, T, N, H]."""
    del w
    return dot_product_attention(
        q_BTNH, kv.key, kv.value, mask=mask, is_causal=options.is_causal,
        scale=options.scale, local_window=options.local_window,
        logits_soft_cap=options.logits_soft_cap)

  def attend_cached(self, options, w, q_BTNH, kv, visible) -> Array:
    """Against the cache: [B, T, N, H]. Per platform lowered for, where its
    kernel takes the call: on the CPU the C++ kernel (`attention.cpu_kernel`,
    a paged pool read in place), on TPU a paged pool's step by JAX's kernel
    (`attention.paged`); else the pure-JAX path, a paged cache's rows
    gathered first."""
    del w
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

  def flops_per_token(self, options, d_model: int, context: float,
                      shares_kv: bool, absorbed: bool) -> float:
    """Q and output projections 2·D·N·H + 2·N·H·D, K and V projections
    2·2·D·K·H (none in a layer sharing K/V), scores and mix 2·2·N·H·C."""
    del absorbed  # Decoding computes what the full pass does.
    D, N, K, H = d_model, options.num_heads, options.num_kv_heads, (
        options.head_dim)
    kv = 0 if shares_kv else 2 * 2 * D * K * H
    return (2 * D * N * H + 2 * N * H * D + kv
            + self.attention_flops_per_key(options) * context)

  def attention_flops_per_key(self, options, absorbed: bool = False
                              ) -> float:
    del absorbed
    return 2 * 2 * options.num_heads * options.head_dim

  def mesh_counts(self, options) -> dict[str, int]:
    return {'kv_heads': options.num_kv_heads}

  def describe(self, options) -> str:
    return f'{options.num_kv_heads} KV heads x {options.head_dim}'


def project(options, params: dict[str, Array], w: dict[str, Array],
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
