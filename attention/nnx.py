"""`Attention` for Flax NNX: the same layer as the linen `attention.Attention`.

Same options, same parameter names and shapes (query [D, N, H], key and value
[D, K, H], out [N, H, D], or qkv [D, N + 2K, H]), same KV cache of K heads
(`layer.Options.cache_spec`), and the same computation (`attention.layer.apply`), so
the two give identical outputs from the same parameters. Moving parameters:

  nnx_layer = Attention.from_linen(linen_layer, linen_params)   # linen -> NNX
  linen_params = nnx_layer.linen_params()                       # NNX -> linen

Decoding, NNX's convention: `init_cache(batch, max_len)`, then each call
appends its tokens to the cache and attends to everything cached so far.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
from flax.core import meta
import jax
import jax.numpy as jnp

from attention import layer

Dtype = Any


class Attention(nnx.Module):
  """Self-attention with N query heads sharing K key/value heads (NNX).

  Args:
    num_heads: N. num_kv_heads: K (None: N); N must be a multiple of K.
    head_dim: H. in_features: D, the model width.
    dtype: computation dtype; logits and softmax stay float32.
    param_dtype, kernel_init: as for `attention.Attention`.
    rngs: initialises the kernels.
    **options: the other fields of `attention.layer.Options` (is_causal,
      use_rope, local_window, ...), with its defaults; an unknown one is an
      error.
  """

  def __init__(self, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int = 64, *, in_features: int,
               dtype: Dtype = jnp.float32, param_dtype: Dtype = jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(),
               rngs: nnx.Rngs, **options):
    self.options = layer.Options(num_heads, num_kv_heads, head_dim,
                                 **options)
    self.dtype = dtype
    for name, shape in self.options.param_shapes(in_features).items():
      init = self.options.param_init(name, kernel_init)
      setattr(self, name, nnx.Param(init(rngs.params(), shape, param_dtype)))
    for name in self.options.cache_names():
      setattr(self, name, nnx.data(None))

  def init_cache(self, batch: int, max_len: int, dtype: Dtype | None = None):
    """An empty KV cache of K heads for `batch` sequences of max_len tokens
    (`layer.Options.cache_spec`; dtype: the compute dtype's, by default)."""
    spec = self.options.cache_spec(batch, max_len, dtype or self.dtype)
    for name, s in spec.items():
      setattr(self, name, nnx.Cache(jnp.zeros(s.shape, s.dtype)))

  def _cache_names(self) -> list[str]:
    return [name for name in self.options.cache_names()
            if getattr(self, name) is not None]

  def __call__(self, x_BTD: jax.Array, mask: jax.Array | None = None
               ) -> jax.Array:
    """x_BTD [B, T, D] -> [B, T, D]; appends to the cache once it exists."""
    cache = None
    if self.cache_index is not None:
      cache = {name: getattr(self, name)[...] for name in self._cache_names()}
    out_BTD, cache, _ = layer.apply(self.options, self.linen_params(), x_BTD,
                                    mask=mask, cache=cache, dtype=self.dtype)
    if cache is not None:
      for name in self._cache_names():
        getattr(self, name)[...] = cache[name]
    return out_BTD

  def linen_params(self) -> dict[str, jax.Array]:
    """The parameters as `attention.Attention` (linen) names them."""
    return {name: getattr(self, name)[...]
            for name in self.options.param_shapes(1)}

  @classmethod
  def from_linen(cls, module, params, *, dtype: Dtype | None = None
                 ) -> 'Attention':
    """The NNX layer of a linen `attention.Attention` and its params."""
    params = meta.unbox(params)  # Plain arrays, partitioned or not.
    in_features = params['out'].shape[-1]
    options = {f.name: getattr(module.options, f.name)
               for f in dataclasses.fields(module.options)}
    layer_ = cls(**options, in_features=in_features,
                 dtype=dtype or module.dtype, param_dtype=module.param_dtype,
                 rngs=nnx.Rngs(0))
    for name, value in params.items():
      getattr(layer_, name)[...] = jnp.asarray(value)
    return layer_
