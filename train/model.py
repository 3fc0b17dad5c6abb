"""A decoder-only Transformer language model on `attention.Attention`.

Pre-norm blocks (RMSNorm -> attention -> residual, RMSNorm -> gated MLP ->
residual), token embedding, RoPE inside the attention, optionally tied output.
Layers are stacked with `nn.scan` (compile time independent of depth) and can
be rematerialised with `nn.remat`. Parameters are float32; activations use
`dtype`; logits and the loss are float32.

Letters: B batch, T length, D model width, F MLP hidden, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention import Attention, layer


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The architecture; values come from the config files (configs/default.py),
  so no field has a default here."""
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_len: int
  tie_embeddings: bool
  scan_layers: bool
  remat: bool
  rope_base: float
  local_window: int | None
  logits_soft_cap: float | None
  fused_qkv: bool
  dtype: Any

  @property
  def attention(self) -> layer.Options:
    """The attention layer's options, passed whole to `Attention`."""
    return layer.Options.of(self)


class RMSNorm(nn.Module):
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD):
    scale_D = self.param(
        'scale', nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)),
        (x_BTD.shape[-1],))
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return (x * (1.0 + scale_D)).astype(self.dtype)


class MLP(nn.Module):
  """Gated (GELU) MLP: down(gelu(x @ gate) * (x @ up))."""
  mlp_dim: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD):
    D, F = x_BTD.shape[-1], self.mlp_dim
    w = lambda name, shape, axes: self.param(name, nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), axes), shape).astype(self.dtype)
    gate_BTF = jnp.einsum('BTD,DF->BTF', x_BTD,
                          w('gate', (D, F), ('embed', 'mlp')))
    up_BTF = jnp.einsum('BTD,DF->BTF', x_BTD, w('up', (D, F), ('embed', 'mlp')))
    return jnp.einsum('BTF,FD->BTD', nn.gelu(gate_BTF) * up_BTF,
                      w('down', (F, D), ('mlp', 'embed')))


class Block(nn.Module):
  config: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BTD, _=None):
    c = self.config
    attention = Attention.from_options(
        c.attention, dtype=c.dtype, partitioned=True, decode=self.decode,
        name='attention')
    x_BTD = x_BTD + attention(RMSNorm(c.dtype, name='attention_norm')(x_BTD))
    x_BTD = x_BTD + MLP(c.mlp_dim, c.dtype, name='mlp')(
        RMSNorm(c.dtype, name='mlp_norm')(x_BTD))
    return x_BTD, None  # (carry, output) for nn.scan.


class Transformer(nn.Module):
  """tokens [B, T] int -> logits [B, T, V] float32.

  Parameters carry logical axis names for `train.sharding`; `init` returns
  them boxed (`nn.LogicallyPartitioned`), `nn.unbox` gives plain arrays.
  """
  config: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BT):
    c = self.config
    embed = nn.Embed(c.vocab_size, c.d_model, dtype=c.dtype,
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(1.0), ('vocab', 'embed')),
                     name='embed')
    x_BTD = embed(tokens_BT) * jnp.sqrt(c.d_model).astype(c.dtype)

    block = Block
    if c.remat:
      block = nn.remat(block, prevent_cse=not c.scan_layers)
    if c.scan_layers:
      layers = nn.scan(block, variable_axes={'params': 0, 'cache': 0},
                       split_rngs={'params': True}, length=c.num_layers,
                       metadata_params={nn.PARTITION_NAME: 'layers'})
      x_BTD, _ = layers(c, self.decode, name='layers')(x_BTD)
    else:
      for i in range(c.num_layers):
        x_BTD, _ = block(c, self.decode, name=f'layers_{i}')(x_BTD)

    x_BTD = RMSNorm(c.dtype, name='final_norm')(x_BTD)
    if c.tie_embeddings:
      logits_BTV = embed.attend(x_BTD) / jnp.sqrt(c.d_model).astype(c.dtype)
    else:
      # Small init: the first prediction is near uniform, loss near log V.
      logits_BTV = nn.DenseGeneral(
          c.vocab_size, use_bias=False, dtype=c.dtype,
          kernel_init=nn.with_logical_partitioning(
              nn.initializers.normal(0.02), ('embed', 'vocab')),
          name='unembed')(x_BTD)
    return logits_BTV.astype(jnp.float32)


def kv_cache_bytes(config: ModelConfig, batch: int, length: int) -> int:
  """Bytes of the whole model's KV cache: layers x one layer's."""
  return config.num_layers * layer.kv_cache_bytes(config.attention, batch,
                                                  length, config.dtype)


def parameter_shapes(config: ModelConfig):
  """The parameters as ShapeDtypeStructs (nothing allocated)."""
  tokens = jax.ShapeDtypeStruct((1, config.max_len), jnp.int32)
  return nn.unbox(jax.eval_shape(Transformer(config).init, jax.random.key(0),
                                 tokens)['params'])


def num_params(config: ModelConfig) -> int:
  return sum(x.size for x in jax.tree.leaves(parameter_shapes(config)))


def param_bytes(config: ModelConfig) -> int:
  return sum(x.size * x.dtype.itemsize
             for x in jax.tree.leaves(parameter_shapes(config)))


def unroll_layers(model: Transformer, params) -> tuple[Transformer, Any]:
  """The same network with its scanned layers unrolled, for decoding.

  Under `nn.scan` the KV caches of all layers are one stacked [L, ...] array,
  and every decode step copies each layer's cache out of it and back in.
  Unrolled, each layer's cache is its own buffer, updated in place: decoding
  reads the cache once per token, which is what it is bound by.
  """
  if not model.config.scan_layers:
    return model, params
  params = dict(params)
  stacked = params.pop('layers')
  for i in range(model.config.num_layers):
    params[f'layers_{i}'] = jax.tree.map(lambda x, i=i: x[i], stacked)
  config = dataclasses.replace(model.config, scan_layers=False)
  return model.clone(config=config), params
