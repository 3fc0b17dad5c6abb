"""Named attention layouts: the one protocol a way of caching K/V implements.

A layout is how an attention layer turns tokens into what it caches, and how
its queries attend to that: grouped-query attention's K key/value heads
(`attention.grouped`, 'gqa': MHA, GQA and MQA through `num_kv_heads`), a
multi-head latent (`attention.latent`, 'mla': MLA, and GLA through its
latent_groups) or tied K/V states (`attention.tied`, 'gta'). Each is a
frozen dataclass of its own fields (`attention.layer.Options.layout` holds
one), registered under its name, and everything else asks it:

  resolve(options)        itself with its defaults filled in, or ValueError
                          naming the field and the fix
  param_shapes(options, D, shared_kv), logical_axes
                          its parameters and their sharding axis names
  entries(options)        what its cache holds per token (`kv_cache.Entry`);
                          the dense and paged caches, their byte counts and
                          the engine's pools are built from these alone
  project, attend, attend_cached
                          the layer's projections (queries and the new
                          tokens' cache entries), its full pass, and its
                          decode step against a dense or paged cache (which
                          kernel reads the cache, per platform, is its own
                          choice)
  flops_per_token(options, D, C, shares_kv, absorbed),
  attention_flops_per_key(options, absorbed)
                          its FLOPs, one formula each (`lm.flops` sums them)
  mesh_counts(options)    how many of each logical axis it has, so that the
                          tensor axis splits only those it divides
  describe(options)       what it caches per token, in words

The layer's other options (heads, RoPE, local windows, soft caps, cache
dtypes, cross-layer sharing) are the same for every layout and orthogonal to
it. A new idea is one module: a `Layout` subclass decorated with
`register`, and it trains, decodes, pages, counts its bytes and shards with
no other file changed (tests/test_layouts.py runs every registered layout
through the same checks). Adding a layout: docs/attention.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

_REGISTRY: dict[str, type['Layout']] = {}


@dataclasses.dataclass(frozen=True)
class Layout:
  """The protocol (see the module docstring). Subclasses are frozen
  dataclasses whose fields are the layout's own settings; the defaults
  below are those a layout without a choice of its own takes."""
  name: ClassVar[str]
  # Parameter name -> its axes' logical names, for flax's partitioning rules
  # (`lm.sharding`): the layout's own parameters (query, out and the rest).
  logical_axes: ClassVar[dict[str, tuple[str | None, ...]]]

  def resolve(self, options) -> 'Layout':
    """Itself with every default filled in (from the layer's options), or
    ValueError naming what options cannot take and what to change."""
    del options
    return self

  def scale(self, options) -> float:
    """The logits' multiplier: query_pre_attn_scalar (None: head_dim)
    ** -0.5."""
    return (options.query_pre_attn_scalar or options.head_dim) ** -0.5

  def param_shapes(self, options, d_model: int, *, shared_kv: bool = False
                   ) -> dict[str, tuple[int, ...]]:
    raise NotImplementedError

  def entries(self, options) -> tuple[Any, ...]:
    raise NotImplementedError

  def project(self, options, params, w, x_BTD, pos_bT, shared: bool):
    """(the queries, in whatever form attend takes them; the new tokens'
    cache entries {name: [B, T, E, F]}, none when `shared`)."""
    raise NotImplementedError

  def attend(self, options, w, queries, kv, mask):
    """The full pass: [B, T, N, X] before the output projection."""
    raise NotImplementedError

  def attend_cached(self, options, w, queries, kv, visible):
    """A step against the cache (`kv_cache.KV`): [B, T, N, X]."""
    raise NotImplementedError

  def flops_per_token(self, options, d_model: int, context: float,
                      shares_kv: bool, absorbed: bool) -> float:
    """One layer's attention FLOPs per token (projections, scores, mix and
    output projection), with `context` keys per query; absorbed: as
    decoding computes them."""
    raise NotImplementedError

  def attention_flops_per_key(self, options, absorbed: bool = False
                              ) -> float:
    """The scores' and the mix's FLOPs per query token and key it sees."""
    raise NotImplementedError

  def mesh_counts(self, options) -> dict[str, int]:
    """Logical axis name -> how many the layer has of it, for the axes the
    mesh's tensor axis splits only where it divides them."""
    del options
    return {}

  def describe(self, options) -> str:
    raise NotImplementedError


def register(cls: type[Layout]) -> type[Layout]:
  """Class decorator: the layout, known by cls.name (a new name only)."""
  if not (isinstance(cls, type) and issubclass(cls, Layout)
          and dataclasses.is_dataclass(cls)):
    raise TypeError(f'{cls!r} is not a dataclass subclass of '
                    'attention.layout.Layout')
  if _REGISTRY.get(cls.name, cls) is not cls:
    raise ValueError(f'a layout named {cls.name!r} is registered already '
                     f'({_REGISTRY[cls.name].__module__}); pick another name')
  _REGISTRY[cls.name] = cls
  return cls


def names() -> tuple[str, ...]:
  """The registered layouts' names, in registration order."""
  return tuple(_REGISTRY)


def get(name: str) -> type[Layout]:
  """The layout class registered as `name`; ValueError naming the others."""
  try:
    return _REGISTRY[name]
  except (KeyError, TypeError):
    raise ValueError(f'attention={name!r} is no layout; use one of '
                     f'{", ".join(map(repr, _REGISTRY))}') from None


def fields(cls: type[Layout]) -> dict[str, dataclasses.Field]:
  """A layout's own settings, name -> dataclass field."""
  return {f.name: f for f in dataclasses.fields(cls)}
