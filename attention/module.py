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

from attention import layer
from attention.rope import RopeScaling

Dtype = Any
default_kernel_init = nn.initializers.lecun_normal()
# Logical axis names of each parameter, for flax's partitioning rules.
LOGICAL_AXES = {
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


class Attention(nn.Module):
  """Self-attention with N query heads sharing K key/value heads.

  Attributes:
    num_heads: N, query heads.
    num_kv_heads: K, key/value heads; N must be a multiple. K = N is MHA,
      1 < K < N GQA, K = 1 MQA. None means N.
    head_dim: H.
    dtype: computation dtype (e.g. bfloat16 on GPU/TPU); logits and softmax
      stay float32.
    param_dtype: parameter dtype.
    is_causal: causal self-attention (the default); False for bidirectional.
    use_rope: rotary position embeddings on Q and K.
    rope_base: RoPE wavelength base.
    local_window: sliding-window size w, or None for global attention.
    logits_soft_cap: Gemma-2 style soft cap on the logits, or None.
    query_pre_attn_scalar: the logits are q·k times its -1/2 power; None
      means head_dim (1/sqrt(H)); Gemma 2/3 checkpoints set it.
    fused_qkv: one [D, N + 2K, H] input projection instead of three.
    qkv_bias: biases on the query, key and value projections (Qwen2).
    qk_norm: RMSNorm of each query and key head before RoPE (Qwen3), with
      `norm_eps`, multiplying by norm_scale_offset + weight.
    rope_scaling: RoPE frequency scaling for long contexts
      (`attention.rope.RopeScaling`: 'linear' or 'llama3'), or None.
    kv_cache_dtype: how the decode cache stores K and V: None (`dtype`),
      'float32', 'bfloat16', or 'int8' (a float32 scale per token and KV
      head); a decode-time choice, the full pass is unaffected.
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
  num_heads: int
  num_kv_heads: int | None = None
  head_dim: int = 64
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  is_causal: bool = True
  use_rope: bool = True
  rope_base: float = 10_000.0
  local_window: int | None = None
  logits_soft_cap: float | None = None
  query_pre_attn_scalar: float | None = None
  fused_qkv: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  norm_eps: float = 1e-6
  norm_scale_offset: float = 1.0
  rope_scaling: RopeScaling | None = None
  kv_cache_dtype: layer.KVCacheDtype | None = None
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
               shared: layer.KV | None = None, return_kv: bool = False):
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
        init = nn.with_logical_partitioning(init, LOGICAL_AXES[name])
      params[name] = self.param(name, init, shape, self.param_dtype)
    # `init` with decode=True creates the cache from the [B, max_len, D]
    # template and runs a plain pass; later calls append to it.
    appending = self.decode and self.has_variable('cache', 'cache_index')
    cache = None
    if self.decode and not self.shared_kv:
      spec = options.cache_spec(B, T, self.dtype)
      variables = {name: self.variable('cache', name, jnp.zeros, s.shape,
                                       s.dtype) for name, s in spec.items()}
      if appending:
        cache = {name: v.value for name, v in variables.items()}
    out_BTD, cache, kv = layer.apply(options, params, x_BTD, mask=mask,
                                     cache=cache, shared=shared,
                                     dtype=self.dtype)
    if appending:
      for name, v in variables.items():
        v.value = cache[name]
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
