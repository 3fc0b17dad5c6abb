"""The decode cache: what each layer kind stores per token, and the two
strategies for where it is written and read.

Every layout (`attention.layout`) describes its cache as `Entry`s: per
token and layer, `heads` (E) vectors of `features` (F) numbers.
Grouped-query attention stores its keys and values (E = K KV heads, F = H);
multi-head latent attention (`attention.latent`) its latents (E = G latent
groups, F = A / G; G = 1 is MLA's one latent) and shared RoPE key (E = 1,
F = Y); grouped-tied attention (`attention.tied`) its tied states (E = K,
F = H) and shared RoPE key (E = 1, F = Y). One table per layout, read by
both strategies and by the byte counts, so no layout is declared twice.

`DenseCache`: one sequence per batch row, every row at the same position
(`cache_index`), laid out heads-major, Z = B·E rows: an entry is [Z, S, F],
or [Z, F, S] when `transposed` (grouped-query keys: the [H, S] operand of the
logits' matmul, which the CPU's matmul kernels read without repacking). A
causal local layer keeps a ring buffer of its window (slot s holds the latest
position p with p % w == s).

`PagedCache`: a pool of P pages of p positions, laid out as JAX's TPU
paged-attention kernel reads it: an entry is [E, P, p, F]. Each batch row
has its own page table [M] (position t at page_table[t // p], offset t % p)
and its own position (`lengths`), so sequences at different points share a
step. Page 0 is scratch: unused table entries and padding tokens write
there and nothing reads it. A local layer keeps every position and sees its
window through the mask.

int8 (`kv_cache_dtype='int8'`): each token's entry is stored as int8 times
one float32 scale per head (symmetric, absmax / 127), the scale arrays [Z, S]
(dense) or [E, P, p] (paged).

Both strategies' `write` returns a `KV`: what the step's queries attend to,
in the dense layout (a paged cache's rows gathered lazily, `gathered`), with
each slot's position (-1: empty) and the queries' positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention import numerics
from attention.core import as_4d_mask, attention_mask

Array = jax.Array


class Entry(NamedTuple):
  """One array a decode cache holds per token: `heads` vectors of
  `features` numbers, its int8 scale's name."""
  name: str
  heads: int  # E.
  features: int  # F.
  transposed: bool  # Dense layout [Z, F, S] (else [Z, S, F]).
  scale: str


def entries(options) -> tuple[Entry, ...]:
  """The cache entries of a layer with `options` (attention.layer.Options):
  its layout's (`attention.layout`), e.g. grouped-query attention's keys
  and values of K heads."""
  return options.layout.entries(options)


def _stored_dtype(options, dtype):
  return jnp.dtype(options.kv_cache_dtype or dtype)


def dense_spec(options, batch: int, max_len: int, dtype: Any
               ) -> dict[str, jax.ShapeDtypeStruct]:
  """A dense cache's arrays for `batch` sequences of up to max_len tokens
  (S = options.cache_length(max_len) slots); dtype: the compute dtype,
  stored unless kv_cache_dtype says otherwise."""
  S = options.cache_length(max_len)
  stored = _stored_dtype(options, dtype)
  spec = {}
  for e in entries(options):
    Z, F = batch * e.heads, e.features
    spec[e.name] = ((Z, F, S) if e.transposed else (Z, S, F)), stored
  if options.kv_cache_dtype == 'int8':
    spec |= {e.scale: ((batch * e.heads, S), jnp.float32)
             for e in entries(options)}
  spec['cache_index'] = ((), jnp.int32)
  return {name: jax.ShapeDtypeStruct(shape, kind)
          for name, (shape, kind) in spec.items()}


def paged_spec(options, num_pages: int, page_size: int, dtype: Any
               ) -> dict[str, jax.ShapeDtypeStruct]:
  """A paged pool's arrays: [E, P, p, F] per entry, int8 scales [E, P, p]:
  the dense arrays' bytes for P sequences of p tokens, every position kept."""
  P, p = num_pages, page_size
  stored = _stored_dtype(options, dtype)
  spec = {e.name: ((e.heads, P, p, e.features), stored)
          for e in entries(options)}
  if options.kv_cache_dtype == 'int8':
    spec |= {e.scale: ((e.heads, P, p), jnp.float32)
             for e in entries(options)}
  return {name: jax.ShapeDtypeStruct(shape, kind)
          for name, (shape, kind) in spec.items()}


class KV(NamedTuple):
  """What a layer's queries attended to; a layer sharing it (cross-layer
  attention) attends to the same.

  Full pass: the new tokens' entries, token-major: key and value
  [B, S, E, F] (MLA: the latent, E = G groups, and the RoPE key, E = 1;
  GTA: the tied states, E = K, and the RoPE key, E = 1). Decoding: the
  cache's entries in the dense layout (keys [Z, H, S], values [Z, S, H],
  int8 scales [Z, S] or None; MLA and GTA: their entries [Z, S, F]) with each
  slot's position (-1: empty), or, for a paged cache not yet gathered,
  `paged` (`gathered` reads it).
  """
  key: Array | None
  value: Array | None
  key_scale: Array | None = None
  value_scale: Array | None = None
  positions_S: Array | None = None  # None: a full pass.
  query_positions: Array | None = None  # [B or 1, T] of this step's tokens.
  overflow: Array | bool = False  # A write ran past the cache's end.
  paged: 'PagedCache | None' = None


def fields(arrays: dict, options) -> tuple:
  """(key, value, key_scale, value_scale) of a dict of entry arrays."""
  es = entries(options)
  name = lambda i, scale: (None if i >= len(es) else
                           arrays.get(es[i].scale if scale else es[i].name))
  return name(0, False), name(1, False), name(0, True), name(1, True)


def quantize(x, axis: int) -> tuple[Array, Array]:
  """(int8 x / scale, scale): symmetric, one float32 scale (absmax / 127)
  per slice along `axis` (a token's features), which is dropped."""
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  q = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
  return q, jnp.squeeze(scale, axis)


def _stored(options, new: dict[str, Array], dtype_of) -> dict[str, Array]:
  """The new tokens' entries ([B, T, E, F] each) as the cache stores them:
  its dtype (dtype_of(name)), or int8 with a float32 scale [B, T, E]."""
  out = {}
  for e in entries(options):
    x = new[e.name]
    if options.kv_cache_dtype == 'int8':
      out[e.name], out[e.scale] = quantize(x, axis=3)
    else:
      out[e.name] = x.astype(dtype_of(e.name))
  return out


def head_rms_norm(x, weight, options):
  """RMSNorm over the last axis (each head's features, a latent), float32
  inside, with options' norm_eps and norm_scale_offset."""
  return numerics.rms_norm(x, weight, eps=options.norm_eps,
                           offset=options.norm_scale_offset)


# Dense caches.


def slot_positions(end, S: int) -> Array:
  """[S]: the position each slot holds once positions 0..end-1 are written
  (slot s: the latest p < end with p % S == s), -1 where none is."""
  s = jnp.arange(S)
  p = end - 1 - jnp.mod(end - 1 - s, S)
  return jnp.where(p >= 0, p, -1)


def _is_ring(options, S: int) -> bool:
  """Whether a cache of S slots is a local layer's ring buffer."""
  return options.is_causal and options.local_window == S


@dataclasses.dataclass(frozen=True)
class DenseCache:
  """A dense cache's arrays (`dense_spec`, `cache_index` included)."""
  arrays: dict

  def positions(self, T: int) -> Array:
    """[1, T]: the positions of the next T tokens (every row's)."""
    return (self.arrays['cache_index'] + jnp.arange(T))[None]

  def write(self, options, new: dict[str, Array]
            ) -> tuple[dict[str, Array], KV]:
    """(the arrays with the T new tokens' entries (new: [B, T, E, F] each)
    written at cache_index, in place; what the tokens attend to)."""
    arrays = self.arrays
    first = entries(options)[0]
    B, T = new[first.name].shape[:2]
    S = arrays[first.name].shape[1 + first.transposed]
    expected = dense_spec(options, B, S, jnp.float32)
    held = {e.name: arrays[e.name].shape for e in entries(options)}
    if held != {e.name: expected[e.name].shape for e in entries(options)}:
      raise ValueError(
          f'decode step gives {B} sequence(s) of '
          f'{ {e.name: new[e.name].shape[2:] for e in entries(options)} } '
          f'[E, F] but the cache holds {held} (Z = B·E rows); init the cache '
          'with the same batch size and heads')
    stored = _stored(options, new, lambda name: arrays[name].dtype)
    laid, axes = {}, {}
    for e in entries(options):
      x = stored[e.name]  # [B, T, E, F] -> [Z, F, T] or [Z, T, F].
      laid[e.name] = (x.transpose(0, 2, 3, 1).reshape(B * e.heads, -1, T)
                      if e.transposed else
                      x.transpose(0, 2, 1, 3).reshape(B * e.heads, T, -1))
      axes[e.name] = 2 if e.transposed else 1
      if e.scale in stored:
        laid[e.scale] = stored[e.scale].transpose(0, 2, 1).reshape(
            B * e.heads, T)
        axes[e.scale] = 1
    return _write_slots(options, arrays, laid, axes, S, T)


def _write_slots(options, cache: dict, new: dict[str, Array],
                 axes: dict[str, int], S: int, T: int
                 ) -> tuple[dict[str, Array], KV]:
  """(the cache with the T new positions of each array in `new` written at
  its index along that array's position axis, in place; what the new tokens
  attend to)."""
  start = cache['cache_index']
  ring = _is_ring(options, S)
  if not ring:
    _check_capacity(start, T, S)
  overflow = False if ring else start + T > S
  query_positions = (start + jnp.arange(T))[None]
  if ring and T > 1:
    # Later tokens of the chunk would overwrite keys its earlier queries
    # still see: they attend to the old slots and the chunk, then the last
    # min(T, S) tokens are written.
    seen = {name: jnp.concatenate([cache[name], x], axis=axes[name])
            for name, x in new.items()}
    kv = KV(*fields(seen, options),
            positions_S=jnp.concatenate([slot_positions(start, S),
                                         start + jnp.arange(T)]),
            query_positions=query_positions, overflow=overflow)
    keep = min(T, S)
    slots = jnp.mod(start + T - keep + jnp.arange(keep), S)
    written = {name: _scatter(cache[name], x, slots, axes[name])
               for name, x in new.items()}
  else:
    at = jnp.mod(start, S) if ring else start  # T == 1 in a ring.
    written = {name: jax.lax.dynamic_update_slice_in_dim(
        cache[name], x, at, axes[name]) for name, x in new.items()}
    kv = None
  cache = {**cache, **written, 'cache_index': start + T}
  if kv is None:
    kv = KV(*fields(cache, options),
            positions_S=slot_positions(start + T, S),
            query_positions=query_positions, overflow=overflow)
  return cache, kv


def _scatter(array, new, slots, axis: int):
  """array with new's last len(slots) positions along `axis` at `slots`."""
  new = jax.lax.slice_in_dim(new, new.shape[axis] - slots.shape[0],
                             new.shape[axis], axis=axis)
  index = (slice(None),) * axis + (slots,)
  return array.at[index].set(new)


def _check_capacity(index, T, max_len):
  """Raises when the cache index is concrete (eager use) and would overflow."""
  try:
    index = int(index)
  except jax.errors.ConcretizationTypeError:
    return  # Under jit: the step returns NaN for the overflowing write.
  if index + T > max_len:
    raise ValueError(
        f'KV cache overflow: writing {T} token(s) at position {index} exceeds '
        f'max_len={max_len}; init the cache with a longer [B, max_len, D] input')


# Paged caches.


class Paging(NamedTuple):
  """A step's rows over a paged pool: page tables [B, M], positions [B]
  (tokens so far) and real new tokens [B] (None: all of the step's T)."""
  page_table_BM: Array
  lengths_B: Array
  num_new_B: Array | None = None


@dataclasses.dataclass(frozen=True)
class PagedCache:
  """A paged pool's arrays (`paged_spec`) and this step's rows: each row's
  page table [B, M], position `lengths` [B] (its tokens so far) and
  `num_new` [B] (how many of the step's T tokens are real; the rest are
  padding, written to the scratch page; None: all T)."""
  arrays: dict
  page_table_BM: Array
  lengths_B: Array
  num_new_B: Array | None = None

  def positions(self, T: int) -> Array:
    """[B, T]: each row's positions of its next T tokens."""
    return self.lengths_B[:, None] + jnp.arange(T)

  def write(self, options, new: dict[str, Array]
            ) -> tuple[dict[str, Array], KV]:
    """(the pool with each row's new tokens (new: [B, T, E, F] each) at
    their pages and offsets, in place; what the tokens attend to, to be
    `gathered`: positions 0..M·p - 1 of each row's pages)."""
    arrays = self.arrays
    first = entries(options)[0].name
    p = arrays[first].shape[2]
    B, T = new[first].shape[:2]
    M = self.page_table_BM.shape[1]
    pos_BT = self.positions(T)
    real_BT = pos_BT < M * p
    if self.num_new_B is not None:
      real_BT &= jnp.arange(T) < self.num_new_B[:, None]
    page_BT = jnp.where(real_BT, jnp.take_along_axis(
        self.page_table_BM, pos_BT // p, axis=1, mode='clip'), 0)
    at_BT = pos_BT % p
    stored = _stored(options, new, lambda name: arrays[name].dtype)
    # Adjacent advanced indices keep their place: pool[:, page_BT, at_BT]
    # is [E, B, T, F] (scales [E, B, T]), the new tokens with E moved first.
    written = {name: arrays[name].at[:, page_BT, at_BT].set(
        jnp.moveaxis(x, 2, 0)) for name, x in stored.items()}
    pool = {**arrays, **written}
    overflow = jnp.any((pos_BT >= M * p) & (
        True if self.num_new_B is None
        else jnp.arange(T) < self.num_new_B[:, None]))
    view = dataclasses.replace(self, arrays=pool)
    return pool, KV(None, None, positions_S=jnp.arange(M * p),
                    query_positions=pos_BT, overflow=overflow, paged=view)


def gathered(kv: KV, options) -> KV:
  """kv with a paged cache's rows gathered into the dense layout (each
  row's M pages, E heads each, never one per query head: keys [Z, F, S],
  others [Z, S, F], scales [Z, S]); kv itself when it is not paged."""
  if kv.paged is None:
    return kv
  table_BM = kv.paged.page_table_BM
  B, M = table_BM.shape
  arrays = {}
  for e in entries(options):
    x_EBMpF = kv.paged.arrays[e.name][:, table_BM]
    E, _, _, p, F = x_EBMpF.shape
    arrays[e.name] = (
        x_EBMpF.transpose(1, 0, 4, 2, 3).reshape(B * E, F, M * p)
        if e.transposed else
        x_EBMpF.transpose(1, 0, 2, 3, 4).reshape(B * E, M * p, F))
    if e.scale in kv.paged.arrays:
      arrays[e.scale] = kv.paged.arrays[e.scale][:, table_BM].transpose(
          1, 0, 2, 3).reshape(B * E, M * p)
  return kv._replace(**dict(zip(('key', 'value', 'key_scale', 'value_scale'),
                                fields(arrays, options))), paged=None)


def cached_visibility(options, kv: KV, mask, B: int):
  """[B or 1, 1 or N, T, S]: which cached slots of `kv` each of the step's
  queries sees (True = attend): slots holding a position, before the query
  (causal) and within its window; and `mask`'s, a mask over positions
  (S = max_len), where given."""
  pos_bT = kv.query_positions
  k_pos_S = kv.positions_S
  visible_bTS = (k_pos_S >= 0)[None, None, :]
  structural = attention_mask(pos_bT, k_pos_S, is_causal=options.is_causal,
                              local_window=options.local_window)
  if structural is not None:
    visible_bTS = visible_bTS & structural
  visible = visible_bTS[:, None]
  if mask is not None:
    # A mask over positions (max_len): each slot takes its position's.
    mask = as_4d_mask(mask, B, mask.shape[-1])
    if mask.shape[-1] > 1:
      mask = jnp.take(mask, jnp.maximum(k_pos_S, 0), axis=-1)
    visible = mask & visible
  return visible
