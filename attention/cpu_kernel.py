"""Decode attention on the CPU: C++ kernels called by XLA (`jax.ffi`).

A layout's decode step (`attention.layer`'s grouped-query attention,
`attention.tied`, `attention.latent`) reads its cache with one of them
where lowering for the CPU (`jax.lax.platform_dependent`) and `refusal` is
None; elsewhere, and for what `refusal` names, with its pure-JAX path
(after `kv_cache.gathered` for a paged pool). One function per layout
family, each taking both cache layouts as they lie:

  `attention` (grouped-query; attention/cpu/grouped_decode.cc):
    paged: the pool's keys and values [K, P, p, H] through each row's page
      table [B, M], in place: no gather of the rows into the dense layout;
    dense: keys [B·K, H, S], values [B·K, S, H] (`attention.Attention`'s
      cache);
  `tied_attention` (GTA; attention/cpu/tied_decode.cc): tied states
    [K, P, p, H] and the shared RoPE key [1, P, p, Y] through the page
    tables, or dense [B·K, S, H] and [B, S, Y]; each block of tied states
    read once for both the logits and the weighted sum (XLA's two matmuls
    read it twice);
  `latent_attention` (MLA and GLA, absorbed; the same kernel as GTA's): the
    G latent groups [G, P, p, F] and the RoPE key, or dense [B·G, S, F]
    and [B, S, Y]; each latent read once for the logits (against the query
    with key_up absorbed) and the weighted sum in latent space.

Per (batch row, KV head or latent group) a kernel streams that head's cache
once for its query rows, skips the pages (blocks) that no query sees, and
shares the rows among XLA's intra-op threads. float32, bfloat16 and int8
caches (int8: a float32 scale per position and head, as the cache stores
them), any visibility mask that is the same for every head, a logits soft
cap. Queries are taken in float32, the output returned in the query's
dtype. A page id outside the pool, or an empty pool, fails the call with
an error naming it (`jax.errors.JaxRuntimeError`, INVALID_ARGUMENT) rather
than reading a wrong page.

The library is built by `pip install` (setup.py, attention/cpu/build.py)
where a C++ compiler is; without it the pure-JAX path is used, said once
per process. The environment variable GQA_LAB_CPU_KERNEL chooses: 'auto'
(the default: the kernel when built), 'off' (the pure-JAX path, e.g. to
benchmark it; read when a step is traced) or 'require' (importing
`attention` fails without the library: CI's setting).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import pathlib

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from attention import kv_cache

ENV = 'GQA_LAB_CPU_KERNEL'
MODES = ('auto', 'off', 'require')
LIBRARY = pathlib.Path(__file__).parent / 'cpu' / 'libgrouped_decode.so'
PAGED_TARGET = 'gqa_lab_paged_decode'
DENSE_TARGET = 'gqa_lab_dense_decode'
PAGED_TIED_TARGET = 'gqa_lab_paged_tied_decode'
DENSE_TIED_TARGET = 'gqa_lab_dense_tied_decode'
CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)


def mode() -> str:
  """GQA_LAB_CPU_KERNEL's value, checked."""
  value = os.environ.get(ENV, 'auto')
  if value not in MODES:
    raise ValueError(f'{ENV}={value!r}; use one of {MODES}')
  return value


def load(path: pathlib.Path | None = None) -> str | None:
  """Registers the FFI targets of the library at `path` (None: LIBRARY)
  with jax; None when done, else why the library could not be loaded."""
  path = path or LIBRARY
  if not path.is_file():
    return (f'{path.name} is not built (pip install -e . with a C++ '
            'compiler builds it)')
  try:
    library = ctypes.cdll.LoadLibrary(str(path))
  except OSError as e:
    return f'{path.name} does not load: {e}'
  for name, symbol in ((PAGED_TARGET, 'GqaLabPagedDecode'),
                       (DENSE_TARGET, 'GqaLabDenseDecode'),
                       (PAGED_TIED_TARGET, 'GqaLabPagedTiedDecode'),
                       (DENSE_TIED_TARGET, 'GqaLabDenseTiedDecode')):
    jax.ffi.register_ffi_target(
        name, jax.ffi.pycapsule(getattr(library, symbol)), platform='cpu')
  return None


@functools.cache
def _loaded() -> str | None:
  """load()'s answer, once per process; a missing library said once."""
  why = load()
  if why is not None:
    logging.warning('attention: no CPU decode kernel (%s); decoding on the '
                    'CPU uses the pure-JAX path', why)
  return why


@contextlib.contextmanager
def disabled():
  """The pure-JAX path for the steps traced inside (GQA_LAB_CPU_KERNEL=off
  meanwhile), e.g. to benchmark both paths in one process. A function jax
  has traced already keeps the path it was traced with."""
  before = os.environ.get(ENV)
  os.environ[ENV] = 'off'
  try:
    yield
  finally:
    if before is None:
      del os.environ[ENV]
    else:
      os.environ[ENV] = before


def available() -> bool:
  """Whether the kernel is built and loaded."""
  return _loaded() is None


def refusal(options, kv, visible) -> str | None:
  """None if a kernel takes this cached step (kv: a `kv_cache.KV` of a
  dense cache or a paged pool, of any layout; visible:
  `kv_cache.cached_visibility`'s [B or 1, 1 or N, T, S] mask), else why
  not. Read when the step is traced."""
  if mode() == 'off':
    return f'{ENV}=off'
  why = _loaded()
  if why is not None:
    return why
  if visible.shape[1] != 1:
    return 'a mask that differs between heads'
  first = kv_cache.entries(options)[0].name
  cache = kv.paged.arrays[first] if kv.paged is not None else kv.key
  if not any(cache.dtype == d for d in CACHE_DTYPES):
    return f'a {cache.dtype} cache (the kernel takes float32, bfloat16, int8)'
  if kv.paged is not None and cache.shape[1] == 0:
    return 'an empty pool (no pages)'
  return None


def attention(options, q_BTNH, kv, visible):
  """[B, T, N, H] in q_BTNH's dtype: the step's queries against the cache
  that kv holds (a paged pool in place, or the dense layout), seeing what
  `visible` [B or 1, 1, T, S] says. Call only where `refusal` is None."""
  H = q_BTNH.shape[-1]
  if kv.paged is not None:
    arrays = kv.paged.arrays
    key, value = arrays['cached_key'], arrays['cached_value']  # [K, P, p, H].
    key_scale, value_scale = arrays.get('key_scale'), arrays.get(
        'value_scale')  # [K, P, p].
    table_BM = kv.paged.page_table_BM.astype(jnp.int32)
    S = table_BM.shape[1] * key.shape[2]
    target, extra = PAGED_TARGET, (table_BM,)
  else:
    key, value = kv.key, kv.value  # [B·K, H, S], [B·K, S, H].
    key_scale, value_scale = kv.key_scale, kv.value_scale  # [B·K, S].
    S = value.shape[1]
    target, extra = DENSE_TARGET, ()
  if key.shape[-1 if kv.paged is not None else 1] != H:
    raise ValueError(f'queries of head_dim {H} against a cache of keys '
                     f'{key.shape}; the layer and its cache disagree')
  return _call(target, options, q_BTNH, (key, value),
               (key_scale, value_scale), extra, visible, S, H)


def tied_attention(options, q_BTNH, kv, visible, *, rope_dim: int):
  """[B, T, N, H] in q_BTNH's dtype: grouped-tied attention's step (its
  queries' last Y = rope_dim features turned by RoPE) against the
  tied cache that kv holds (a paged pool in place, or the dense layout:
  kv.key the tied states [B·K, S, H], kv.value the RoPE keys [B, S, Y] or
  None when Y = 0, their int8 scales kv.key_scale and kv.value_scale), as
  `attention.tied.tied_attention` computes it, seeing what `visible`
  [B or 1, 1, T, S] says. Call only where `refusal` is None."""
  return _state_attention(options, q_BTNH, kv, visible, rope_dim)


def latent_attention(options, q_BTNF, q_BTNY, kv, visible):
  """[B, T, N, F] in q_BTNF's dtype: multi-head (or grouped) latent
  attention's weighted sums of latents, absorbed: each query head's
  q_lat = q_nope·key_upᵀ [B, T, N, F] and turned q_rope [B, T, N, Y]
  against the latent cache that kv holds (a paged pool in place, or the
  dense layout: kv.key the latents [B·G, S, F], kv.value the RoPE keys
  [B, S, Y] or None when Y = 0, their int8 scales), head n reading latent
  group n // (N / G), as the middle of `attention.latent.absorbed_attention`
  computes it (value_up is the caller's), seeing what `visible`
  [B or 1, 1, T, S] says. Call only where `refusal` is None."""
  q_BTNH = jnp.concatenate([q_BTNF, q_BTNY.astype(q_BTNF.dtype)], axis=-1)
  return _state_attention(options, q_BTNH, kv, visible, q_BTNY.shape[-1])


def _state_attention(options, q_BTNH, kv, visible, rope_dim: int):
  """[B, T, N, W] in q_BTNH's dtype, by tied_decode.cc: the queries (their
  last Y features against the shared RoPE key, the first H - Y against a
  state's first H - Y) against a cache whose first entry is a state [W]
  per head and position, both key and value (GTA's tied state, MLA's
  latent), and whose second, where there is one, the RoPE key of rope_dim
  (0: none)."""
  B, H = q_BTNH.shape[0], q_BTNH.shape[-1]
  es = kv_cache.entries(options)
  if kv.paged is not None:
    arrays = kv.paged.arrays
    state = arrays[es[0].name]  # [E, P, p, W].
    rope_key = arrays[es[1].name] if len(es) > 1 else None  # [1, P, p, Y].
    state_scale = arrays.get(es[0].scale)  # [E, P, p].
    rope_scale = arrays.get(es[1].scale) if len(es) > 1 else None
    table_BM = kv.paged.page_table_BM.astype(jnp.int32)
    S = table_BM.shape[1] * state.shape[2]
    no_rope_shape = (1, *state.shape[1:3], 0)
    target, extra = PAGED_TIED_TARGET, (table_BM,)
  else:
    state, rope_key = kv.key, kv.value  # [B·E, S, W], [B, S, Y].
    state_scale, rope_scale = kv.key_scale, kv.value_scale  # [B·E, S], [B, S].
    S = state.shape[1]
    no_rope_shape = (B, S, 0)
    target, extra = DENSE_TIED_TARGET, ()
  W = state.shape[-1]
  Y = 0 if rope_key is None else rope_key.shape[-1]
  if Y != rope_dim or not 0 <= H - Y <= W:
    raise ValueError(f'queries [B, T, N, H] = {q_BTNH.shape} with a RoPE '
                     f'key of {rope_dim} against states {state.shape} and '
                     f'RoPE keys {None if rope_key is None else rope_key.shape}'
                     ': H is not I + Y with I at most the states\' width; the '
                     'layer and its cache disagree')
  if rope_key is None:
    rope_key = jnp.zeros(no_rope_shape, state.dtype)
  return _call(target, options, q_BTNH, (state, rope_key),
               (state_scale, rope_scale), extra, visible, S, W)


def _call(target, options, q_BTNH, caches, scales, extra, visible, S, W):
  """The FFI call of `target`: [B, T, N, W] in q_BTNH's dtype from the
  queries [B, T, N, H] (in float32), the two cache arrays, their int8
  scales (None: a float cache's, passed empty), `extra` (a page table) and
  the mask broadcast to [B or 1, T, S]."""
  B, T, N, _ = q_BTNH.shape
  none = jnp.zeros((0,), jnp.float32)
  visible_bTS = jnp.broadcast_to(visible[:, 0], (visible.shape[0], T, S))
  call = jax.ffi.ffi_call(
      target, jax.ShapeDtypeStruct((B, T, N, W), jnp.float32),
      vmap_method='sequential')
  out_BTNW = call(
      q_BTNH.astype(jnp.float32), *caches,
      *(none if x is None else x for x in scales), *extra, visible_bTS,
      scale=np.float32(options.scale),
      soft_cap=np.float32(options.logits_soft_cap or 0.0))
  return out_BTNW.astype(q_BTNH.dtype)


# The raw value: a bad one is refused where it is used (`mode`), and by the
# commands in one line before any work, not by every import of attention.
if os.environ.get(ENV) == 'require' and _loaded() is not None:
  raise ImportError(f'{ENV}=require but {_loaded()}')
