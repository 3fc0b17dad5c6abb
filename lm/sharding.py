"""The device mesh and how arrays are laid out on it: one rules table, one place.

Parameters carry logical axis names (flax partitioning metadata on the
modules); RULES maps them onto the mesh axes `data`, `fsdp` and `tensor`:
the batch over data x fsdp, parameters' model dimension over fsdp (ZeRO-3
style), and attention heads, MLP hidden units and the vocabulary over tensor.

GQA meets tensor parallelism: query heads are always split over `tensor`; K/V
heads are split too when `tensor` divides num_kv_heads, and otherwise
replicated, so every tensor shard holds all K/V heads beside its N/tensor
query heads (e.g. MQA with tensor=4). That costs K/V projection weights and
compute repeated on each shard, and memory for K/V activations and cache of
K heads per device instead of K/tensor; it is still correct.

Grouped latent attention (model.mla.latent_groups = G) meets it the same way:
the G latents split over `tensor` when it divides G (kv_norm's [A] by whole
groups; kv_up's heads follow the query heads, so a shard's heads read its
own groups), else they are replicated. kv_down [D, A + Y] stays whole on
every tensor shard (split over fsdp): its columns end in the RoPE key shared
by all groups, so no even split of them falls on the groups' boundaries.
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import optax

from infra.errors import UserError

AXES = ('data', 'fsdp', 'tensor')
RULES = (
    ('batch', ('data', 'fsdp')),
    ('embed', 'fsdp'),
    ('vocab', 'tensor'),
    ('q_heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('mlp', 'tensor'),
    ('head_dim', None),
    ('kv_lora', None),  # MLA's latents: small, whole on every shard.
    ('latent_groups', 'tensor'),  # GLA's latent groups (G·F features).
    ('q_lora', None),
    ('layers', None),
    ('position', None),
    ('norm', None),
)


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
  """The (data, fsdp, tensor) mesh; -1 takes all remaining devices."""
  devices = devices or jax.devices()
  sizes = [mesh_config[a] for a in AXES]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise UserError(f'mesh {dict(zip(AXES, sizes))}: use positive sizes, and '
                    '-1 for at most one axis')
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise UserError(f'mesh {dict(zip(AXES, sizes))} does not divide '
                      f'{len(devices)} devices; pick sizes whose product '
                      f'divides {len(devices)}')
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise UserError(f'mesh {dict(zip(AXES, sizes))} has {math.prod(sizes)} '
                    f'devices but {len(devices)} are present; make the product '
                    'match, or set one axis to -1')
  return jax.make_mesh(tuple(sizes), AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)


def rules(model_config, mesh) -> tuple:
  """RULES, checked against the model; K/V heads and latent groups
  replicated when `tensor` does not divide them."""
  tensor, fsdp = mesh.shape['tensor'], mesh.shape['fsdp']
  m = model_config
  for name, size, axis, n in (('model.num_heads', m.num_heads, 'tensor', tensor),
                              ('model.mlp_dim', m.mlp_dim, 'tensor', tensor),
                              ('model.vocab_size', m.vocab_size, 'tensor',
                               tensor),
                              ('model.d_model', m.d_model, 'fsdp', fsdp)):
    if size % n:
      raise UserError(f'{name}={size} does not split over mesh.{axis}={n}; '
                      f'use a mesh.{axis} that divides {size}')
  options = m.attention(0)  # The layout's counts (K/V heads, latent groups).
  whole = {name for name, count in options.layout.mesh_counts(
      options).items() if count % tensor}
  return tuple((k, None if k in whole else v) for k, v in RULES)


def batch_sharding(mesh) -> jax.sharding.NamedSharding:
  return jax.NamedSharding(mesh, jax.P(('data', 'fsdp')))


def global_batches(dataset, config, mesh) -> Callable:
  """(split, seed, step[, stream]) -> a global [train.batch_size,
  data.seq_len + 1] batch of `dataset` (an `lm.data.Source`) on the mesh;
  each host makes only its own rows."""
  tc, dc = config.train, config.data
  sharded = batch_sharding(mesh)

  def global_batch(split, **kwargs):
    local = dataset.batch(split, batch_size=tc.batch_size,
                          seq_len=dc.seq_len, shard=jax.process_index(),
                          num_shards=jax.process_count(), **kwargs)
    if local.shape[0] * jax.process_count() != tc.batch_size:
      raise ValueError(f'this process built {local.shape[0]} rows, not its '
                       f'share of {tc.batch_size}')  # A bug, not bad input.
    return jax.make_array_from_process_local_data(
        sharded, local, (tc.batch_size, dc.seq_len + 1))
  return global_batch


def state_shardings(boxed_params, tx, abstract_state, mesh, rules_):
  """NamedShardings for a TrainState: params by their logical names, the
  optimizer's per-parameter statistics like their parameter, the rest
  replicated."""
  replicated = jax.NamedSharding(mesh, jax.P())
  param_specs = nn.get_partition_spec(boxed_params)
  params = nn.logical_to_mesh_sharding(param_specs, mesh, rules_)
  opt_state = optax.tree_map_params(
      tx, lambda _, sharding: sharding, abstract_state.opt_state, params,
      transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  return abstract_state.replace(step=replicated, params=params,
                                opt_state=opt_state)
