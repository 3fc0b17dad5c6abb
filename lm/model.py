"""A decoder-only Transformer language model on `attention.Attention`.

Pre-norm blocks (RMSNorm -> attention -> residual, RMSNorm -> gated MLP ->
residual; with `post_norms`, Gemma 2/3's, each branch's output normalised
too before it joins the residual), token embedding, RoPE inside the attention (`use_rope`) and/or a
learned position table added to the embeddings (`learned_positions`, GPT-2's
and Zoology's), optionally tied output.
Layers are stacked with `nn.scan` (compile time independent of depth) and can
be rematerialised with `nn.remat`. Two options make layers differ: the
attention pattern (global or local attention, cycled over the layers: 'LG' is
Gemma 2's, 'LLLLLG' Gemma 3's) and K/V sharing (each `kv_share` consecutive
layers attend to the first one's keys and values, cross-layer attention); the
scan then steps over groups of `scan_group` layers, one compiled group, whose
layers are 'layers/block_j' (stacked over the groups). Parameters are
`param_dtype` (float32 by default); activations use `dtype`; logits and the
loss are float32.

The defaults are Gemma's conventions (GELU gate, RMSNorm by 1 + scale,
embeddings times √D); the fields below select Llama's, Mistral's and Qwen's,
so that `train.convert.hf` maps those checkpoints onto this one network.

Letters: B batch, T length, D model width, F MLP hidden, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention import Attention, cpu_kernel, kv_cache, layer, numerics
from attention.layout import Layout
from attention.rope import RopeScaling
from infra import cli

# GQA_LAB_CPU_KERNEL is read when a decode step is traced; every command that
# runs the model checks it first, in one line (infra.cli).
cli.check_environment_with(cpu_kernel.mode)

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
  # The L layers' RoPE base, unscaled (Gemma 3: 10k local, 1M global); None:
  # rope_base and rope_scaling, as the G layers.
  local_rope_base: float | None
  query_pre_attn_scalar: float | None  # Logits x its ** -0.5; None: head_dim.
  post_norms: bool  # RMSNorm of the attention's and MLP's outputs (Gemma 2/3).
  final_logits_soft_cap: float | None  # c·tanh(logits / c) (Gemma 2).
  # Over G (global) and L (local: local_window keys), cycled over the layers.
  attention_pattern: str
  kv_share: int  # Consecutive layers sharing one K/V projection and cache.
  kv_cache_dtype: layer.KVCacheDtype | None  # Decoding's; None: dtype.
  # How attention caches K/V (`attention.layout`): model.attention names
  # it ('gqa', 'mla', 'gta', ...) and model.<name> holds its settings.
  layout: Layout

  def attention(self, i: int) -> layer.Options:
    """Layer i's attention options (a causal LM), passed whole to
    `Attention`: local_window for the pattern's L layers, none for G."""
    local = self.attention_pattern[i % len(self.attention_pattern)] == 'L'
    rope = {}
    if local and self.local_rope_base is not None:
      rope = dict(rope_base=self.local_rope_base, rope_scaling=None)
    return layer.Options.of(self, is_causal=True,
                            local_window=self.local_window if local else None,
                            **rope)

  def layout_description(self) -> str:
    """What a layer caches per token, in words (its layout's)."""
    options = self.attention(0)
    return options.layout.describe(options)

  def shares_kv(self, i: int) -> bool:
    """Whether layer i attends to an earlier layer's K/V (kv_share)."""
    return i % self.kv_share != 0

  @property
  def scan_group(self) -> int:
    """Layers per scan step: the pattern and the sharing repeat in it."""
    return math.lcm(len(self.attention_pattern), self.kv_share)


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
    return numerics.rms_norm(x_BTD, scale_D, eps=c.norm_eps,
                             offset=c.norm_scale_offset, dtype=c.dtype)


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
  """Layer `index` (or any layer of the same kind: index mod scan_group).
  Returns (x, the K/V attended to, for the layers sharing them), or (x,
  None) as the step of a scan over identical layers."""
  config: ModelConfig
  decode: bool = False
  index: int = 0
  scan_step: bool = False

  @nn.compact
  def __call__(self, x_BTD, shared=None, paging=None):
    c = self.config
    attention = Attention.from_options(
        c.attention(self.index), dtype=c.dtype, param_dtype=c.param_dtype,
        partitioned=True, decode=self.decode,
        shared_kv=c.shares_kv(self.index), name='attention')
    out_BTD, kv = attention(RMSNorm(c, name='attention_norm')(x_BTD),
                            shared=shared, return_kv=True, paging=paging)
    if c.post_norms:
      out_BTD = RMSNorm(c, name='post_attention_norm')(out_BTD)
    x_BTD = x_BTD + out_BTD
    out_BTD = MLP(c, name='mlp')(RMSNorm(c, name='mlp_norm')(x_BTD))
    if c.post_norms:
      out_BTD = RMSNorm(c, name='post_mlp_norm')(out_BTD)
    return x_BTD + out_BTD, None if self.scan_step else kv


class Group(nn.Module):
  """scan_group consecutive layers, 'block_0'...: what the scan steps over
  when the layers differ."""
  config: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x_BTD, _=None):
    c = self.config
    block = _maybe_remat(Block, c)
    kv = None
    for j in range(c.scan_group):
      x_BTD, kv = block(c, self.decode, j, name=f'block_{j}')(
          x_BTD, kv if c.shares_kv(j) else None)
    return x_BTD, None  # (carry, output) for nn.scan.


def _maybe_remat(module, c: ModelConfig):
  return nn.remat(module, prevent_cse=not c.scan_layers) if c.remat else module


class Transformer(nn.Module):
  """tokens [B, T] int -> logits [B, T, V] float32.

  Parameters carry logical axis names for `lm.sharding`; `init` returns
  them boxed (`nn.LogicallyPartitioned`), `nn.unbox` gives plain arrays.
  """
  config: ModelConfig
  decode: bool = False

  @nn.compact
  def __call__(self, tokens_BT, paging: kv_cache.Paging | None = None):
    """paging: decode over a paged pool (the 'cache' collection holds each
    layer's pool, `attention.kv_cache.paged_spec`): each row's page table
    and position. Needs unrolled layers (`unroll_layers`)."""
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
      x_BTD = x_BTD + self._position_embedding(tokens_BT.shape[1], paging)
    if c.embed_scale:
      x_BTD = x_BTD * sqrt_d

    if c.scan_layers and paging is not None:
      raise ValueError('a paged decode step needs the layers unrolled; '
                       'run the model of lm.model.unroll_layers')
    if c.scan_layers:
      if c.scan_group > 1:  # The layers differ: scan groups of them.
        step, fields = Group, ()
      else:  # Identical layers: scan one Block (as a scan step).
        step, fields = _maybe_remat(Block, c), (0, True)
      layers = nn.scan(step, variable_axes={'params': 0, 'cache': 0},
                       split_rngs={'params': True},
                       length=c.num_layers // c.scan_group,
                       unroll=max(1, min(c.scan_unroll, c.num_layers)
                                  // c.scan_group),
                       metadata_params={nn.PARTITION_NAME: 'layers'})
      x_BTD, _ = layers(c, self.decode, *fields, name='layers')(x_BTD)
    else:
      block = _maybe_remat(Block, c)
      kv = None
      for i in range(c.num_layers):
        x_BTD, kv = block(c, self.decode, i, name=f'layers_{i}')(
            x_BTD, kv if c.shares_kv(i) else None, paging)

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
    logits_BTV = logits_XV.reshape(B, T, -1).astype(jnp.float32)
    return numerics.soft_cap(logits_BTV, c.final_logits_soft_cap)

  def _position_embedding(self, T: int, paging):
    """[T, D] or [B, T, D]: the learned embeddings of this call's positions
    (0..T-1; where decoding has got to: a dense cache's index lives in the
    'cache' collection; a paged step's rows each have their own)."""
    c = self.config
    table_SD = self.param('position_embed', nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ('position', 'embed')),
        (c.max_len, c.d_model), c.param_dtype).astype(c.dtype)
    if paging is not None:
      pos_BT = paging.lengths_B[:, None] + jnp.arange(T)
      return jnp.take(table_SD, pos_BT, axis=0, mode='clip')
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
  """Bytes of the whole model's decode cache for `batch` sequences of up to
  `length` tokens: every layer that owns one (not those sharing K/V), local
  layers their window, in kv_cache_dtype with int8's scales."""
  return sum(layer.kv_cache_bytes(config.attention(i), batch, length,
                                  config.kv_cache_dtype or config.dtype)
             for i in range(config.num_layers) if not config.shares_kv(i))


def kv_bytes_per_token(config: ModelConfig) -> float:
  """One sequence's decode cache at max_len, in bytes, over max_len: what
  a token of context costs in memory, averaged over the context."""
  return kv_cache_bytes(config, 1, config.max_len) / config.max_len


def parameter_shapes(config: ModelConfig):
  """The parameters as ShapeDtypeStructs (nothing allocated)."""
  return jax.tree.map(lambda x: x, _parameter_shapes(config))  # A new tree.


@functools.lru_cache(maxsize=16)  # A trace of the model each (~0.2 s).
def _parameter_shapes(config: ModelConfig):
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)  # Any length will do.
  return nn.unbox(jax.eval_shape(Transformer(config).init, jax.random.key(0),
                                 tokens)['params'])


def num_params(config: ModelConfig) -> int:
  return sum(x.size for x in jax.tree.leaves(parameter_shapes(config)))


def param_bytes(config: ModelConfig) -> int:
  return sum(x.size * x.dtype.itemsize
             for x in jax.tree.leaves(parameter_shapes(config)))


@dataclasses.dataclass(frozen=True)
class ThroughCache:
  """The network's forward pass read through its decode cache: each call
  prefills an empty cache with the tokens, so the logits are those decoding
  gives (local layers' ring buffers, kv_cache_dtype's rounding). Stands in
  for `Transformer` where only `init` and `apply` are used (evaluation)."""
  config: ModelConfig

  def init(self, *args, **kwargs):
    return Transformer(self.config).init(*args, **kwargs)

  def apply(self, variables, tokens_BT):
    model, params = unroll_layers(Transformer(self.config, decode=True),
                                  variables['params'])
    cache = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype),
        nn.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                tokens_BT)['cache']))
    logits, _ = model.apply({'params': params, 'cache': cache}, tokens_BT,
                            mutable=['cache'])
    return logits


def layer_slot(config: ModelConfig, i: int) -> tuple[tuple[str, ...],
                                                     int | None]:
  """Where layer i's parameters are: (the path of its subtree, its index on
  the stacked axis, or None when the layers are not scanned)."""
  if not config.scan_layers:
    return (f'layers_{i}',), None
  if config.scan_group == 1:
    return ('layers',), i
  return ('layers', f'block_{i % config.scan_group}'), i // config.scan_group


def layer_subtrees(config: ModelConfig, params) -> list:
  """Every layer's parameters (or caches) as its own subtree, in order."""
  def get(i):
    path, index = layer_slot(config, i)
    tree = params
    for key in path:
      tree = tree[key]
    return tree if index is None else jax.tree.map(
        lambda x: _take_layer(x, index, i, config), tree)
  return [get(i) for i in range(config.num_layers)]


def _take_layer(x, index: int, i: int, config: ModelConfig):
  # jax clamps an index past the end: layer i would silently be a copy of
  # the last layer the params have.
  if index >= x.shape[0]:
    raise ValueError(
        f'layer {i} of num_layers={config.num_layers} is not in the params '
        f'({x.shape[0]} stacked on an axis of shape {list(x.shape)}); the '
        'params were made for fewer layers')
  return x[index]


def with_layer_subtrees(params, config: ModelConfig, layers: list) -> dict:
  """params with its layers replaced by `layers` (one subtree per layer,
  as `layer_subtrees` gives them), stacked as `config` stores them
  (`layer_slot`): the converters' way back."""
  out = {k: v for k, v in params.items()
         if k != 'layers' and not k.startswith('layers_')}
  slots: dict[tuple, list] = {}
  for i, tree in enumerate(layers):
    path, index = layer_slot(config, i)
    if index is None:
      out[path[0]] = tree
    else:
      slots.setdefault(path, []).append(tree)
  for path, trees in slots.items():
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *trees)
    target = out
    for key in path[:-1]:
      target = target.setdefault(key, {})
    target[path[-1]] = stacked
  return out


def unroll_layers(model: Transformer, params) -> tuple[Transformer, Any]:
  """The same network with its scanned layers unrolled, for decoding.

  Under `nn.scan` the KV caches of all layers are one stacked [L, ...] array,
  and every decode step copies each layer's cache out of it and back in.
  Unrolled, each layer's cache is its own buffer, updated in place: decoding
  reads the cache once per token, which is what it is bound by.
  """
  c = model.config
  if not c.scan_layers:
    return model, params
  layers = layer_subtrees(c, params)
  params = {k: v for k, v in params.items() if k != 'layers'}
  params |= {f'layers_{i}': tree for i, tree in enumerate(layers)}
  return model.clone(config=dataclasses.replace(c, scan_layers=False)), params
