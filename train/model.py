"""A decoder-only Transformer language model on `attention.Attention`.

Pre-norm blocks (RMSNorm -> attention -> residual, RMSNorm -> gated MLP ->
residual), token embedding, RoPE inside the attention (`use_rope`) and/or a
learned position table added to the embeddings (`learned_positions`, GPT-2's
and Zoology's), optionally tied output.
Layers are stacked with `nn.scan` (compile time independent of depth) and can
be rematerialised with `nn.remat`. Parameters are `param_dtype` (float32 by
default); activations use `dtype`; logits and the loss are float32.

The defaults are Gemma's conventions (GELU gate, RMSNorm by 1 + scale,
embeddings times √D); the fields below select Llama's, Mistral's and Qwen's,
so that `train.hf` maps those checkpoints onto this one network.

Letters: B batch, T length, D model width, F MLP hidden, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention import Attention, layer
from attention.rope import RopeScaling

Activation = Literal['gelu_tanh', 'silu']
ACTIVATIONS = {'gelu_tanh': functools.partial(nn.gelu, approximate=True),
               'silu': nn.silu}


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
  scan_unroll: int  # Layers per iteration of the scan.
  remat: bool
  rope_base: float
  use_rope: bool  # Rotary positions in every attention layer.
  learned_positions: bool  # A learned [max_len, D] embedding added (GPT-2).
  local_window: int | None
  logits_soft_cap: float | None
  fused_qkv: bool
  dtype: Any
  param_dtype: Any
  mlp_activation: Activation  # 'gelu_tanh' (Gemma), 'silu' (Llama, Qwen).
  norm_eps: float
  norm_scale_offset: float  # RMSNorm multiplies by offset + scale: Gemma 1, Llama 0.
  embed_scale: bool  # Embeddings times √D (Gemma).
  tied_logits_scale: bool  # Tied output divides the logits by √D (HF: no).
  qkv_bias: bool  # Biases on the Q/K/V projections (Qwen2).
  qk_norm: bool  # RMSNorm of each query and key head (Qwen3).
  rope_scaling: RopeScaling | None  # 'linear' or 'llama3' (Llama 3.1+).

  @property
  def attention(self) -> layer.Options:
    """The attention layer's options, passed whole to `Attention`."""
    return layer.Options.of(self, is_causal=True)  # A causal LM.


class RMSNorm(nn.Module):
  """x / rms(x) * (offset + scale), in float32; scale starts at 1 - offset."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BTD):
    c = self.config
    scale_D = self.param(
        'scale', nn.with_logical_partitioning(
            nn.initializers.constant(1.0 - c.norm_scale_offset), ('norm',)),
        (x_BTD.shape[-1],), c.param_dtype)
    x = x_BTD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + c.norm_eps)
    return (x * (c.norm_scale_offset + scale_D.astype(jnp.float32))
            ).astype(c.dtype)


class MLP(nn.Module):
  """Gated MLP: down(activation(x @ gate) * (x @ up))."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BTD):
    c = self.config
    D, F = x_BTD.shape[-1], c.mlp_dim
    w = lambda name, shape, axes: self.param(name, nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), axes), shape, c.param_dtype
    ).astype(c.dtype)
    # Tokens as one axis X = B·T: XLA's CPU backward then forms each weight
    # gradient as one GEMM; contracting B and T as two axes ran this MLP's
    # forward and backward at half the speed (scripts/bench_train.py).
    x_XD = x_BTD.reshape(-1, D)
    gate_XF = x_XD @ w('gate', (D, F), ('embed', 'mlp'))
    up_XF = x_XD @ w('up', (D, F), ('embed', 'mlp'))
    activation = ACTIVATIONS[c.mlp_activation]
    out_XD = (activation(gate_XF) * up_XF) @ w('down', (F, D), ('mlp', 'embed'))
    return out_XD.reshape(x_BTD.shape)


class Block(nn.Module):
  config: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BTD, _=None):
    c = self.config
    attention = Attention.from_options(
        c.attention, dtype=c.dtype, param_dtype=c.param_dtype,
        partitioned=True, decode=self.decode, name='attention')
    x_BTD = x_BTD + attention(RMSNorm(c, name='attention_norm')(x_BTD))
    x_BTD = x_BTD + MLP(c, name='mlp')(RMSNorm(c, name='mlp_norm')(x_BTD))
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
                     param_dtype=c.param_dtype,
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(1.0), ('vocab', 'embed')),
                     name='embed')
    # √D as Hugging Face rounds it: a Python float cast to the dtype.
    sqrt_d = jnp.asarray(c.d_model ** 0.5, c.dtype)
    x_BTD = embed(tokens_BT)
    if c.learned_positions:  # Initialised and scaled as the tokens'.
      x_BTD = x_BTD + self._position_embedding(tokens_BT.shape[1])
    if c.embed_scale:
      x_BTD = x_BTD * sqrt_d

    block = Block
    if c.remat:
      block = nn.remat(block, prevent_cse=not c.scan_layers)
    if c.scan_layers:
      layers = nn.scan(block, variable_axes={'params': 0, 'cache': 0},
                       split_rngs={'params': True}, length=c.num_layers,
                       unroll=min(c.scan_unroll, c.num_layers),
                       metadata_params={nn.PARTITION_NAME: 'layers'})
      x_BTD, _ = layers(c, self.decode, name='layers')(x_BTD)
    else:
      for i in range(c.num_layers):
        x_BTD, _ = block(c, self.decode, name=f'layers_{i}')(x_BTD)

    x_BTD = RMSNorm(c, name='final_norm')(x_BTD)
    B, T, D = x_BTD.shape
    x_XD = x_BTD.reshape(B * T, D)  # One token axis (see MLP).
    if c.tie_embeddings:
      logits_XV = embed.attend(x_XD)
      if c.tied_logits_scale:
        logits_XV = logits_XV / sqrt_d
    else:
      # Small init: the first prediction is near uniform, loss near log V.
      logits_XV = nn.DenseGeneral(
          c.vocab_size, use_bias=False, dtype=c.dtype,
          param_dtype=c.param_dtype,
          kernel_init=nn.with_logical_partitioning(
              nn.initializers.normal(0.02), ('embed', 'vocab')),
          name='unembed')(x_XD)
    logits_BTV = logits_XV.reshape(B, T, -1)
    return logits_BTV.astype(jnp.float32)

  def _position_embedding(self, T: int):
    """[T, D]: the learned embeddings of this call's positions (0..T-1, or
    where decoding has got to: the index lives in the 'cache' collection)."""
    c = self.config
    table_SD = self.param('position_embed', nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ('position', 'embed')),
        (c.max_len, c.d_model), c.param_dtype).astype(c.dtype)
    if not self.decode:
      return table_SD[:T]
    is_initialized = self.has_variable('cache', 'position_index')
    index = self.variable('cache', 'position_index',
                          lambda: jnp.array(0, jnp.int32))
    if not is_initialized:  # init: the cache is being created, [B, max_len].
      return table_SD[:T]
    start = index.value
    index.value = start + T
    return jax.lax.dynamic_slice_in_dim(table_SD, start, T)


def kv_cache_bytes(config: ModelConfig, batch: int, length: int) -> int:
  """Bytes of the whole model's KV cache: layers x one layer's."""
  return config.num_layers * layer.kv_cache_bytes(config.attention, batch,
                                                  length, config.dtype)


def parameter_shapes(config: ModelConfig):
  """The parameters as ShapeDtypeStructs (nothing allocated)."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)  # Any length will do.
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
