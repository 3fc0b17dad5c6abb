"""A layout that lives only in the tests: proof that adding one is one file.

'toy_concat' caches each KV head's key and value as ONE entry of 2·H
features (grouped-query attention's numbers, laid out as a single
[K, 2H] vector per token), so every cache path must go through the
layout's entries rather than assume keys and values. It is registered here
and nowhere else; tests/test_layouts.py runs it through every standard check
with no code of its own (docs/attention.md, "Adding a layout").
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from attention import decode, kv_cache
from attention.core import dot_product_attention
from attention.layout import Layout, register
from attention.rope import apply_rope


@register
@dataclasses.dataclass(frozen=True)
class ToyConcat(Layout):
  """K heads of [key, value] concatenated: params query [D, N, H],
  kv [D, K, 2H], out [N, H, D]; cache 'cached_kv' [.., K, 2H] per token."""
  name: ClassVar[str] = 'toy_concat'
  logical_axes: ClassVar[dict] = {
      'query': ('embed', 'q_heads', 'head_dim'),
      'kv': ('embed', 'kv_heads', 'head_dim'),
      'out': ('q_heads', 'head_dim', 'embed'),
  }

  def resolve(self, options):
    for name in ('fused_qkv', 'qkv_bias', 'qk_norm'):
      if getattr(options, name):
        raise ValueError(f'{name}=True with attention=\'toy_concat\'; set '
                         f'{name}=False')
    return self

  def param_shapes(self, options, d_model, *, shared_kv=False):
    D, N, K, H = (d_model, options.num_heads, options.num_kv_heads,
                  options.head_dim)
    shapes = {'query': (D, N, H)}
    if not shared_kv:
      shapes['kv'] = (D, K, 2 * H)
    return {**shapes, 'out': (N, H, D)}

  def entries(self, options):
    return (kv_cache.Entry('cached_kv', options.num_kv_heads,
                           2 * options.head_dim, False, 'kv_scale'),)

  def project(self, options, params, w, x_BTD, pos_bT, shared):
    del params
    B, T, D = x_BTD.shape
    N, K, H = options.num_heads, options.num_kv_heads, options.head_dim
    x_XD = x_BTD.reshape(B * T, D)
    rope = lambda x: (apply_rope(x, pos_bT, base=options.rope_base,
                                 scaling=options.rope_scaling)
                      if options.use_rope else x)
    q_BTNH = rope((x_XD @ w['query'].reshape(D, -1)).reshape(B, T, N, H))
    if shared:
      return q_BTNH, {}
    kv_BTKW = (x_XD @ w['kv'].reshape(D, -1)).reshape(B, T, K, 2 * H)
    kv_BTKW = jnp.concatenate([rope(kv_BTKW[..., :H]), kv_BTKW[..., H:]],
                              axis=-1)
    return q_BTNH, {'cached_kv': kv_BTKW}

  def attend(self, options, w, q_BTNH, kv, mask):
    del w
    H = options.head_dim
    return dot_product_attention(
        q_BTNH, kv.key[..., :H], kv.key[..., H:], mask=mask,
        is_causal=options.is_causal, scale=options.scale,
        local_window=options.local_window,
        logits_soft_cap=options.logits_soft_cap)

  def attend_cached(self, options, w, q_BTNH, kv, visible):
    del w
    H = options.head_dim
    rows = kv_cache.gathered(kv, options)  # [Z, S, 2H], scales [Z, S].
    return decode.heads_major_attention(
        q_BTNH, jnp.swapaxes(rows.key[..., :H], 1, 2), rows.key[..., H:],
        visible, scale=options.scale,
        logits_soft_cap=options.logits_soft_cap,
        key_scale_ZS=rows.key_scale, value_scale_ZS=rows.key_scale)

  def flops_per_token(self, options, d_model, context, shares_kv, absorbed):
    del absorbed
    D, N, K, H = (d_model, options.num_heads, options.num_kv_heads,
                  options.head_dim)
    kv = 0 if shares_kv else 2 * 2 * D * K * H
    return (4 * D * N * H + kv
            + self.attention_flops_per_key(options) * context)

  def attention_flops_per_key(self, options, absorbed=False):
    return 4 * options.num_heads * options.head_dim

  def mesh_counts(self, options):
    return {'kv_heads': options.num_kv_heads}

  def describe(self, options):
    return (f'{options.num_kv_heads} KV heads of key and value concatenated '
            f'(2 x {options.head_dim})')
