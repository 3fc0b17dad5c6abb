"""`Attention`: the Flax (linen) module around `attention.layer.apply`.

One knob, `num_kv_heads` (K), selects the variant; the parameter shapes show it:

  query kernel  [D, N, H]        key and value kernels  [D, K, H]
  output kernel [N, H, D]        KV cache     [B·K, H, S] and [B·K, S, H]

With `fused_qkv=True` the three input projections are one kernel [D, N + 2K, H]
(one matmul producing (N + 2K)·H features), split into Q, K and V by heads.
`attention.nnx.Attention` is the same layer for Flax NNX (`attention/layer.py`
has the computation both call, and why the cache is stored flat).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention import kv_cache, layer

Dtype = Any
default_kernel_init = nn.initializers.lecun_normal()
# The option fields (names, types, defaults) as `attention.layer.Options`
# declares them, once: the module takes each as a field of its own.
_OptionFields = type('_OptionFields', (nn.Module,), {
    '__module__': __name__,
    '__annotations__': {f.name: f.type
                        for f in dataclasses.fields(layer.Options)},
    **{f.name: f.default for f in dataclasses.fields(layer.Options)
       if f.default is not dataclasses.MISSING}})


class Attention(_OptionFields):
  """Self-attention with N query heads sharing K key/value heads.

  Attributes:
    the fields of `attention.layer.Options`, which say what each computes:
      num_heads (N), num_kv_heads (K; N must be a multiple; K = N is MHA,
      1 < K < N GQA, K = 1 MQA; None means N), head_dim (H), is_causal,
      use_rope, rope_base, local_window, logits_soft_cap,
      query_pre_attn_scalar, fused_qkv, qkv_bias, qk_norm, norm_eps,
      norm_scale_offset, rope_scaling, kv_cache_dtype, and layout: how it
      caches and attends (`attention.layout`; grouped-query by default,
      `attention.latent.MLA(...)`, `attention.tied.GTA(...)`).
    dtype: computation dtype (e.g. bfloat16 on GPU/TPU); logits and softmax
      stay float32.
    param_dtype: parameter dtype.
    shared_kv: the layer attends to another layer's keys and values (passed
      as `shared`, cross-layer attention) and has no K/V projections or cache.
    partitioned: annotate the kernels with logical axis names (embed,
      q_heads, kv_heads, head_dim) for sharding with flax's partitioning
      rules; `init` then returns `nn.LogicallyPartitioned` boxes.
    decode: autoregressive decoding with a KV cache (flax's convention):
      `init` on a [B, max_len, D] input creates the cache in the 'cache'
      collection; each `apply(..., mutable=['cache'])` on the next token(s)
      appends them and attends to everything cached so far.
    kernel_init: initialiser of all kernels.
  """
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  shared_kv: bool = False
  partitioned: bool = False
  decode: bool = False
  kernel_init: nn.initializers.Initializer = default_kernel_init

  @classmethod
  def from_options(cls, options: layer.Options, **fields) -> 'Attention':
    """The module computing `options`; fields: dtype, decode, name, ..."""
    return cls(**{f.name: getattr(options, f.name)
                  for f in dataclasses.fields(options)}, **fields)

  @property
  def options(self) -> layer.Options:
    return layer.Options.of(self)

  @nn.compact
  def __call__(self, x_BTD: jax.Array, mask: jax.Array | None = None, *,
               shared: layer.KV | None = None, return_kv: bool = False,
               paging: kv_cache.Paging | None = None):
    """Attends x to itself.

    Args:
      x_BTD: [B, T, D] inputs.
      mask: optional boolean mask, True = attend: a key-padding mask [B, S] or
        anything broadcastable to [B, N, T, S], where S = T, or max_len when
        decoding. Combined with the causal and window masks.
      shared: with `shared_kv`, the K/V of the layer this one shares (what
        that layer returned with return_kv).
      return_kv: also return the keys and values attended to
        (`attention.layer.KV`), for the layers that share them.
      paging: decode over a paged pool (`attention.kv_cache.PagedCache`):
        the 'cache' collection holds the pool's arrays (`kv_cache.paged_spec`)
        and `paging` each row's page table and position.

    Returns:
      [B, T, D] in `dtype`; with return_kv, (that, the KV).
    """
    options = self.options
    if self.shared_kv != (shared is not None):
      raise ValueError('a layer with shared_kv=True attends to the `shared` '
                       'K/V of another layer, and only such a layer takes it')
    B, T, D = x_BTD.shape
    params = {}
    for name, shape in options.param_shapes(
        D, shared_kv=self.shared_kv).items():
      init = options.param_init(name, self.kernel_init)
      if self.partitioned:
        init = nn.with_logical_partitioning(
            init, options.layout.logical_axes[name])
      params[name] = self.param(name, init, shape, self.param_dtype)
    cache, names = None, ()
    if paging is not None and not self.shared_kv:
      names = [e.name for e in kv_cache.entries(options)]
      names += [e.scale for e in kv_cache.entries(options)
                if self.has_variable('cache', e.scale)]
      cache = kv_cache.PagedCache(
          {name: self.get_variable('cache', name) for name in names},
          *paging)
    elif self.decode and not self.shared_kv:
      # `init` with decode=True creates the cache from the [B, max_len, D]
      # template and runs a plain pass; later calls append to it.
      appending = self.has_variable('cache', 'cache_index')
      spec = options.cache_spec(B, T, self.dtype)
      variables = {name: self.variable('cache', name, jnp.zeros, s.shape,
                                       s.dtype) for name, s in spec.items()}
      if appending:
        names = tuple(spec)
        cache = {name: v.value for name, v in variables.items()}
    out_BTD, cache, kv = layer.apply(options, params, x_BTD, mask=mask,
                                     cache=cache, shared=shared,
                                     dtype=self.dtype)
    for name in names:
      self.put_variable('cache', name, cache[name])
    return (out_BTD, kv) if return_kv else out_BTD

  def kv_cache_bytes(self, batch: int, length: int, dtype: Dtype = None) -> int:
    """Bytes of this layer's KV cache for `batch` sequences of up to
    `length` tokens: 2 (K and V) x B x S x K x H x the stored dtype's size
    (S = length, or the local window), plus int8's scales."""
    return layer.kv_cache_bytes(self.options, batch, length,
                                dtype or self.dtype)

  def num_params(self, d_model: int) -> int:
    """Parameters of this layer for model width D: D·N·H + 2·D·K·H + N·H·D
    (and the biases and norms, if any)."""
    return sum(math.prod(shape) for shape in self.options.param_shapes(
        d_model, shared_kv=self.shared_kv).values())
