"""Grouped decode attention on the CPU: a C++ kernel called by XLA (`jax.ffi`).

`attention.layer.apply` reads the decode cache with it where lowering for
the CPU (`jax.lax.platform_dependent`) and `refusal` is None; elsewhere, and
for what `refusal` names, with the pure-JAX path (`attention.decode`, after
`kv_cache.gathered` for a paged pool). The kernel
(attention/cpu/grouped_decode.cc) takes both cache layouts as they lie:

  paged: the pool's keys and values [K, P, p, H] through each row's page
    table [B, M], in place: no gather of the rows into the dense layout;
  dense: keys [B·K, H, S], values [B·K, S, H] (`attention.Attention`'s cache).

Per (batch row, KV head) it streams that head's keys and values once for
its G·T query rows, skips the pages (blocks) that no query sees, and shares
the rows among XLA's intra-op threads. float32, bfloat16 and int8 caches
(int8: a float32 scale per position and KV head, as the cache stores them),
any visibility mask that is the same for every head, a logits soft cap.
Queries are taken in float32, the output returned in the query's dtype.

The library is built by `pip install` (setup.py) where a C++ compiler is;
without it the pure-JAX path is used, said once per process. The
environment variable GQA_LAB_CPU_KERNEL chooses: 'auto' (the default: the
kernel when built), 'off' (the pure-JAX path, e.g. to benchmark it; read
when a step is traced) or 'require' (importing `attention` fails without
the library: CI's setting).
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

ENV = 'GQA_LAB_CPU_KERNEL'
MODES = ('auto', 'off', 'require')
LIBRARY = pathlib.Path(__file__).parent / 'cpu' / 'libgrouped_decode.so'
PAGED_TARGET = 'gqa_lab_paged_decode'
DENSE_TARGET = 'gqa_lab_dense_decode'
CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)


def mode() -> str:
  """GQA_LAB_CPU_KERNEL's value, checked."""
  value = os.environ.get(ENV, 'auto')
  if value not in MODES:
    raise ValueError(f'{ENV}={value!r}; use one of {MODES}')
  return value


def load(path: pathlib.Path | None = None) -> str | None:
  """Registers the two FFI targets of the library at `path` (None: LIBRARY)
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
                       (DENSE_TARGET, 'GqaLabDenseDecode')):
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
  """None if the kernel takes this cached step (kv: a `kv_cache.KV` of a
  dense cache or a paged pool; visible: `kv_cache.cached_visibility`'s
  [B or 1, 1 or N, T, S] mask), else why not. Read when the step is traced."""
  if mode() == 'off':
    return f'{ENV}=off'
  why = _loaded()
  if why is not None:
    return why
  if options.kv_lora_rank:
    return 'a latent (MLA) cache'
  if options.tie_kv:
    return 'a tied (GTA) cache (the kernel reads separate keys and values)'
  if visible.shape[1] != 1:
    return 'a mask that differs between heads'
  cache = kv.paged.arrays['cached_key'] if kv.paged is not None else kv.key
  if not any(cache.dtype == d for d in CACHE_DTYPES):
    return f'a {cache.dtype} cache (the kernel takes float32, bfloat16, int8)'
  return None


def attention(options, q_BTNH, kv, visible):
  """[B, T, N, H] in q_BTNH's dtype: the step's queries against the cache
  that kv holds (a paged pool in place, or the dense layout), seeing what
  `visible` [B or 1, 1, T, S] says. Call only where `refusal` is None."""
  B, T, N, H = q_BTNH.shape
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
  none = jnp.zeros((0,), jnp.float32)  # A float cache's scales.
  visible_bTS = jnp.broadcast_to(visible[:, 0], (visible.shape[0], T, S))
  call = jax.ffi.ffi_call(
      target, jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),
      vmap_method='sequential')
  out_BTNH = call(
      q_BTNH.astype(jnp.float32), key, value,
      none if key_scale is None else key_scale,
      none if value_scale is None else value_scale, *extra, visible_bTS,
      scale=np.float32(options.scale),
      soft_cap=np.float32(options.logits_soft_cap or 0.0))
  return out_BTNH.astype(q_BTNH.dtype)


if mode() == 'require' and _loaded() is not None:
  raise ImportError(f'{ENV}=require but {_loaded()}')
