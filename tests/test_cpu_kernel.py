"""The CPU decode kernels (`attention.cpu_kernel`, XLA FFI custom calls)
against references built by hand on the same cache contents (grouped-query
attention: `attention.dot_product_attention`; GTA: its keys built per KV
head; MLA and GLA: the absorbed step as einsums): every K of N = 8 (every
latent width kind), each cache dtype, each kind of mask, one and several
queries per row, both layouts; page ids outside the pool and an empty pool
refused with an error; and in each layout's decode step, where a test shows
the kernel is the one that ran (its custom call in the compiled step), that
the check can fail (not there when turned off), and that it agrees with the
pure-JAX path."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import cpu_kernel, kv_cache, layer
from attention.cpu import build
from attention.grouped import GQA
from attention.latent import MLA
from attention.tied import GTA
from attention.core import attention_mask, dot_product_attention
from configs import tiny
from serve import runner as paged
from lm import config_lib
from train import loop
from lm.model import Transformer

pytestmark = pytest.mark.skipif(
    not cpu_kernel.available(),
    reason='the CPU kernel is not built (python setup.py build_ext --inplace)')


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
  """The kernels whatever GQA_LAB_CPU_KERNEL the suite runs with (it is
  run both ways; this file specifies the kernels themselves, and a test
  that needs another mode sets it)."""
  monkeypatch.setenv(cpu_kernel.ENV, 'auto')

REPO = pathlib.Path(__file__).resolve().parent.parent
B, N, H, P, p, M = 3, 8, 16, 16, 4, 5  # S = M·p = 20 positions per row.
S = M * p
LENGTHS_B = np.array([20, 9, 5])  # Tokens each row holds, the step's last.
MASKS = ('none', 'causal', 'padding', 'window')


def _visible(kind: str, T: int) -> jax.Array:
  """[B, 1, T, S] True = attend: the step's T queries are each row's last T
  tokens (positions LENGTHS_B - T ..)."""
  pos_BT = jnp.asarray(LENGTHS_B[:, None] - T + np.arange(T))
  k_pos_S = jnp.arange(S)
  held_BTS = jnp.broadcast_to(k_pos_S < jnp.asarray(LENGTHS_B)[:, None, None],
                              (B, T, S))
  if kind == 'none':  # Every slot the row holds.
    visible_BTS = held_BTS
  elif kind == 'causal':
    visible_BTS = attention_mask(pos_BT, k_pos_S, is_causal=True)
  elif kind == 'window':
    visible_BTS = attention_mask(pos_BT, k_pos_S, is_causal=True,
                                 local_window=3)
  else:  # Key padding; row 1 sees nothing (its output must be zeros).
    pad_BS = jax.random.bernoulli(jax.random.key(7), 0.6, (B, S))
    pad_BS = pad_BS.at[1].set(False)
    visible_BTS = held_BTS & pad_BS[:, None, :]
  return visible_BTS[:, None]


def _cache(K: int, dtype, seed: int, head_dim: int = H):
  """(stored keys and values [B, S, K, H], their int8 scales [B, S, K] or
  None, the float32 values they stand for)."""
  keys = jax.random.split(jax.random.key(seed), 2)
  kv = [jax.random.normal(k, (B, S, K, head_dim), jnp.float32) for k in keys]
  if dtype == jnp.int8:
    (k8, ks), (v8, vs) = (kv_cache.quantize(x, axis=3) for x in kv)
    return (k8, v8), (ks, vs), (k8 * ks[..., None], v8 * vs[..., None])
  stored = [x.astype(dtype) for x in kv]
  return stored, None, [x.astype(jnp.float32) for x in stored]


def _dense_kv(stored, scales) -> kv_cache.KV:
  """The dense layout: keys [B·K, H, S], values [B·K, S, H], scales
  [B·K, S]."""
  k_BSKH, v_BSKH = stored
  K, head_dim = k_BSKH.shape[2:]
  rows = lambda x_BSK: x_BSK.transpose(0, 2, 1).reshape(B * K, S)
  return kv_cache.KV(
      k_BSKH.transpose(0, 2, 3, 1).reshape(B * K, head_dim, S),
      v_BSKH.transpose(0, 2, 1, 3).reshape(B * K, S, head_dim),
      *((None, None) if scales is None else map(rows, scales)),
      positions_S=jnp.arange(S))


def _paged_kv(stored, scales) -> kv_cache.KV:
  """A grouped-query pool (`_pool`) of keys and values [B, S, K, H] and
  their scales [B, S, K] (or None)."""
  names = ('cached_key', 'cached_value') + (
      () if scales is None else ('key_scale', 'value_scale'))
  return _pool(dict(zip(names, (*stored, *(scales or ())))))


def _pool(entries_BSE) -> kv_cache.KV:
  """A pool [E, P, p, F] (scales [E, P, p]) of each entry [B, S, E, F]
  (scales [B, S, E]) holding each row's positions on pages of a shuffled
  table; every other page, and page 0 that unused table entries name, holds
  noise the kernel must not read into the result."""
  order = np.random.default_rng(0).permutation(np.arange(1, P))
  table_BM = order[:B * M].reshape(B, M)
  table_BM[2, 2:] = 0  # Row 2 holds 5 tokens: 2 pages, the rest unused.
  arrays = {}
  for name, x in entries_BSE.items():
    E = x.shape[2]
    noise = jax.random.normal(jax.random.key(3), (E, P, p, *x.shape[3:]))
    pool = (noise * 50).astype(x.dtype)
    x_EBMp = jnp.moveaxis(x, 2, 0).reshape(E, B, M, p, *x.shape[3:])
    used_BM = table_BM != 0
    pool = pool.at[:, table_BM[used_BM]].set(x_EBMp[:, used_BM])
    arrays[name] = pool
  paged = kv_cache.PagedCache(arrays, jnp.asarray(table_BM, jnp.int32),
                              jnp.asarray(LENGTHS_B))
  return kv_cache.KV(None, None, positions_S=jnp.arange(S), paged=paged)


@pytest.mark.parametrize('layout', ['paged', 'dense'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.int8],
                         ids=['float32', 'bfloat16', 'int8'])
@pytest.mark.parametrize('T', [1, 4])
@pytest.mark.parametrize('K', [8, 4, 2, 1])
def test_the_kernel_matches_the_einsum_path(layout, dtype, T, K):
  _check_against_the_einsum_path(layout, dtype, T, K, H)


@pytest.mark.parametrize('layout', ['paged', 'dense'])
def test_a_head_dim_off_the_vector_width(layout):
  """H = 24: the kernel's loops without its 16-float vectors."""
  _check_against_the_einsum_path(layout, jnp.int8, 4, 2, 24)


def _check_against_the_einsum_path(layout, dtype, T, K, head_dim):
  options = layer.Options(num_heads=N, num_kv_heads=K, head_dim=head_dim)
  stored, scales, reference_kv = _cache(K, dtype, seed=K, head_dim=head_dim)
  kv = (_paged_kv if layout == 'paged' else _dense_kv)(stored, scales)
  q_BTNH = jax.random.normal(jax.random.key(T), (B, T, N, head_dim))
  kernel = jax.jit(lambda q, vis: cpu_kernel.attention(options, q, kv, vis))
  for kind in MASKS:  # One compiled kernel: the masks are arrays.
    visible = _visible(kind, T)
    assert cpu_kernel.refusal(options, kv, visible) is None
    got_BTNH = kernel(q_BTNH, visible)
    want_BTNH = dot_product_attention(q_BTNH, *reference_kv, mask=visible,
                                      scale=options.scale)
    chex.assert_shape(got_BTNH, (B, T, N, head_dim))
    chex.assert_trees_all_close(got_BTNH, want_BTNH, atol=2e-5, rtol=2e-5,
                                custom_message=f'mask {kind}')
    if kind == 'padding':
      np.testing.assert_array_equal(got_BTNH[1], 0.0)


@pytest.mark.parametrize('layout', ['paged', 'dense'])
@pytest.mark.parametrize('K', [8, 2], ids=['mha', 'gqa'])
def test_whole_blocks_and_a_wide_head(layout, K):
  """H = 64 and 160 positions (two whole blocks of a dense cache and half of
  one; ten pages): the vector loops that the small cases above do not
  reach (a single query row's four sums at once)."""
  _check_wide(layout, K, B_=2, S_=160)


@pytest.mark.parametrize('layout', ['paged', 'dense'])
def test_a_call_large_enough_to_share_its_rows_among_threads(layout):
  """8 rows x 8 KV heads x 512 float32 positions of H = 64 (16 MiB of keys
  and values): past the kernel's kMinBytesPerThread (1 MiB) per thread, so
  its units are shared between the calling thread and XLA's intra-op
  threads (the smaller calls above run on the calling thread alone)."""
  _check_wide(layout, 8, B_=8, S_=512)


def _check_wide(layout, K, B_, S_):
  """The kernel against the einsum path: B_ rows of S_ positions of H = 64,
  row 0 holding 10 fewer than the others."""
  H_, p_ = 64, 16
  options = layer.Options(num_heads=N, num_kv_heads=K, head_dim=H_)
  keys = jax.random.split(jax.random.key(K), 3)
  q_BTNH = jax.random.normal(keys[0], (B_, 1, N, H_))
  k_BSKH, v_BSKH = (jax.random.normal(k, (B_, S_, K, H_)) for k in keys[1:])
  held_B = jnp.full(B_, S_).at[0].add(-10)
  visible = (jnp.arange(S_) < held_B[:, None])[:, None, None]
  if layout == 'dense':
    kv = kv_cache.KV(k_BSKH.transpose(0, 2, 3, 1).reshape(B_ * K, H_, S_),
                     v_BSKH.transpose(0, 2, 1, 3).reshape(B_ * K, S_, H_),
                     positions_S=jnp.arange(S_))
  else:  # Row b's page m is page 1 + m·B + b of the pool.
    M_ = S_ // p_
    pool = lambda x: jnp.zeros((K, 1 + B_ * M_, p_, H_)).at[:, 1:].set(
        x.reshape(B_, M_, p_, K, H_).transpose(3, 1, 0, 2, 4).reshape(
            K, M_ * B_, p_, H_))
    table_BM = 1 + jnp.arange(M_)[None, :] * B_ + jnp.arange(B_)[:, None]
    kv = kv_cache.KV(None, None, positions_S=jnp.arange(S_), paged=(
        kv_cache.PagedCache({'cached_key': pool(k_BSKH),
                             'cached_value': pool(v_BSKH)},
                            table_BM.astype(jnp.int32), jnp.zeros(B_, int))))
  got = jax.jit(lambda q: cpu_kernel.attention(options, q, kv, visible))(
      q_BTNH)
  want = dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=visible,
                               scale=options.scale)
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)


# Grouped-tied attention (GTA): `cpu_kernel.tied_attention`.

TIED_SCALES = {'cached_tied': 'tied_scale', 'cached_rope_key': 'rope_key_scale'}


def _tied_options(K, Y, head_dim=H, **fields):
  return layer.Options(num_heads=N, num_kv_heads=K, head_dim=head_dim,
                       layout=GTA(qk_rope_head_dim=Y), use_rope=Y > 0,
                       **fields)


def _tied_kernel(options, q_BTNH, kv, visible):
  """The tied kernel with options' RoPE width (as `tied.GTA` calls it)."""
  return cpu_kernel.tied_attention(
      options, q_BTNH, kv, visible,
      rope_dim=options.layout.qk_rope_head_dim)


def _tied_cache(K, Y, dtype, seed, B_=B, S_=S, head_dim=H):
  """(stored entries: tied states [B, S, K, H], RoPE keys [B, S, 1, Y] (none
  when Y = 0), int8 scales [B, S, K] and [B, S, 1]; the float32 tied states
  and RoPE keys they stand for)."""
  shapes = {'cached_tied': (B_, S_, K, head_dim)}
  if Y:
    shapes['cached_rope_key'] = (B_, S_, 1, Y)
  return _entries(shapes, TIED_SCALES, dtype, seed)


def _entries(shapes, scale_names, dtype, seed):
  """(stored entries of `shapes` ([B, S, E, F] each), int8 scales [B, S, E]
  named by scale_names; the float32 values they stand for)."""
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  stored, real = {}, {}
  for (name, shape), key in zip(shapes.items(), keys):
    x = jax.random.normal(key, shape)
    if dtype == jnp.int8:
      stored[name], scale = kv_cache.quantize(x, axis=3)
      stored[scale_names[name]] = scale
      real[name] = stored[name] * scale[..., None]
    else:
      stored[name] = x.astype(dtype)
      real[name] = stored[name].astype(jnp.float32)
  return stored, real


def _dense_tied_kv(stored, names=('cached_tied', 'cached_rope_key'),
                   scales=('tied_scale', 'rope_key_scale')) -> kv_cache.KV:
  """GTA's dense layout (or MLA's, with its names): tied states (latents)
  [B·E, S, F] and scales [B·E, S], RoPE keys [B, S, Y] and scales
  [B, S]."""
  heads_major = lambda x: jnp.moveaxis(x, 2, 1).reshape(-1, *x.shape[1:2],
                                                        *x.shape[3:])
  get = lambda name: None if name not in stored else heads_major(stored[name])
  return kv_cache.KV(get(names[0]), get(names[1]), get(scales[0]),
                     get(scales[1]),
                     positions_S=jnp.arange(stored[names[0]].shape[1]))


def _tied_reference(q_BTNH, real, visible, options):
  """The einsum path: dot_product_attention over each KV head's keys
  [t[:I], r] and its tied states as values, built by hand."""
  t_BSKH = real['cached_tied']
  k_BSKH = t_BSKH
  if 'cached_rope_key' in real:
    r_BSKY = jnp.broadcast_to(real['cached_rope_key'],
                              (*t_BSKH.shape[:3],
                               options.layout.qk_rope_head_dim))
    k_BSKH = jnp.concatenate(
        [t_BSKH[..., :t_BSKH.shape[3] - r_BSKY.shape[3]], r_BSKY], axis=-1)
  return dot_product_attention(q_BTNH, k_BSKH, t_BSKH, mask=visible,
                               scale=options.scale,
                               logits_soft_cap=options.logits_soft_cap)


@pytest.mark.parametrize('layout', ['paged', 'dense'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.int8],
                         ids=['float32', 'bfloat16', 'int8'])
@pytest.mark.parametrize('T', [1, 4])
@pytest.mark.parametrize('Y', [0, H // 2], ids=['nope', 'rope'])
@pytest.mark.parametrize('K', [8, 2, 1])
def test_the_tied_kernel_matches_the_einsum_path(layout, dtype, T, Y, K):
  _check_tied(layout, dtype, T, K, Y, H)


@pytest.mark.parametrize('layout', ['paged', 'dense'])
@pytest.mark.parametrize('head_dim, Y', [(24, 0), (40, 16)],
                         ids=['nope', 'rope'])
def test_the_tied_kernel_off_the_vector_width(layout, head_dim, Y):
  """H = 24 or 40: a tied state's key part (I = 24) ends past its last
  16-float vector (beside a RoPE key of one vector), and the weighted sum
  runs without vectors."""
  _check_tied(layout, jnp.int8, 4, 2, Y, head_dim)


def _check_tied(layout, dtype, T, K, Y, head_dim):
  options = _tied_options(K, Y, head_dim)
  stored, real = _tied_cache(K, Y, dtype, seed=K + Y, head_dim=head_dim)
  kv = _pool(stored) if layout == 'paged' else _dense_tied_kv(stored)
  q_BTNH = jax.random.normal(jax.random.key(T), (B, T, N, head_dim))
  kernel = jax.jit(lambda q, vis: _tied_kernel(options, q, kv, vis))
  for kind in MASKS:  # One compiled kernel: the masks are arrays.
    visible = _visible(kind, T)
    assert cpu_kernel.refusal(options, kv, visible) is None
    got_BTNH = kernel(q_BTNH, visible)
    chex.assert_shape(got_BTNH, (B, T, N, head_dim))
    chex.assert_trees_all_close(
        got_BTNH, _tied_reference(q_BTNH, real, visible, options),
        atol=2e-5, rtol=2e-5, custom_message=f'mask {kind}')
    if kind == 'padding':
      np.testing.assert_array_equal(got_BTNH[1], 0.0)


@pytest.mark.parametrize('layout', ['paged', 'dense'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.int8],
                         ids=['float32', 'bfloat16', 'int8'])
@pytest.mark.parametrize('K', [8, 2], ids=['mha', 'gqa'])
def test_the_tied_kernel_on_whole_blocks_and_a_wide_head(layout, dtype, K):
  """H = 64 with a RoPE key of 32 and 160 positions (two whole blocks of a
  dense cache and half of one; ten pages), soft-capped: the vector loops
  (one query row: four positions at a time; four rows: one)."""
  _check_tied_wide(layout, K, B_=2, S_=160, dtype=dtype, soft_cap=2.0)


@pytest.mark.parametrize('layout', ['paged', 'dense'])
def test_a_tied_call_large_enough_to_share_its_rows_among_threads(layout):
  """8 rows x 8 KV heads x 512 float32 positions of H = 64, Y = 32 (8.5 MiB
  of tied states and RoPE keys): past kMinBytesPerThread, so the units are
  shared with XLA's intra-op threads."""
  _check_tied_wide(layout, 8, B_=8, S_=512)


def _check_tied_wide(layout, K, B_, S_, dtype=jnp.float32, soft_cap=None):
  """The tied kernel against the einsum path: B_ rows of S_ positions of
  H = 64, Y = 32, row 0 holding 10 fewer than the others."""
  H_, Y_, p_ = 64, 32, 16
  options = _tied_options(K, Y_, H_, logits_soft_cap=soft_cap)
  stored, real = _tied_cache(K, Y_, dtype, seed=K, B_=B_, S_=S_, head_dim=H_)
  q_BTNH = 3 * jax.random.normal(jax.random.key(0), (B_, 1, N, H_))
  held_B = jnp.full(B_, S_).at[0].add(-10)
  visible = (jnp.arange(S_) < held_B[:, None])[:, None, None]
  if layout == 'dense':
    kv = _dense_tied_kv(stored)
  else:  # Row b's page m is page 1 + m·B + b of the pool.
    M_ = S_ // p_
    def pool(x_BSE):  # [B, S, E, F] (or scales [B, S, E]) -> [E, P, p, F].
      x_EBMp = jnp.moveaxis(x_BSE.reshape(B_, M_, p_, *x_BSE.shape[2:]), 3, 0)
      x_EXp = jnp.swapaxes(x_EBMp, 1, 2).reshape(
          x_EBMp.shape[0], M_ * B_, p_, *x_EBMp.shape[4:])
      return jnp.concatenate([jnp.zeros_like(x_EXp[:, :1]), x_EXp], axis=1)
    table_BM = 1 + jnp.arange(M_)[None, :] * B_ + jnp.arange(B_)[:, None]
    kv = kv_cache.KV(None, None, positions_S=jnp.arange(S_), paged=(
        kv_cache.PagedCache({name: pool(x) for name, x in stored.items()},
                            table_BM.astype(jnp.int32), jnp.zeros(B_, int))))
  got = jax.jit(lambda q: _tied_kernel(options, q, kv, visible))(q_BTNH)
  chex.assert_trees_all_close(
      got, _tied_reference(q_BTNH, real, visible, options), atol=2e-5,
      rtol=2e-5)


# Multi-head latent attention (MLA, and GLA's G groups), absorbed:
# `cpu_kernel.latent_attention`.

LATENT_SCALES = {'cached_latent': 'latent_scale',
                 'cached_rope_key': 'rope_key_scale'}
LATENT_NAMES = tuple(LATENT_SCALES), tuple(LATENT_SCALES.values())
# (G, F, Y): MLA with whole vectors (gqa_small's MLA48), GLA's 24-wide
# groups (a vector and a remainder of 8), widths below a vector (every
# feature one by one), no RoPE key.
LATENT_WIDTHS = {'mla': (1, 48, 16), 'gla': (2, 24, 16), 'narrow': (2, 10, 4),
                 'no_rope': (2, 32, 0)}


def _latent_options(G, F, Y, **fields):
  return layer.Options(num_heads=N, num_kv_heads=N, head_dim=16,
                       layout=MLA(kv_lora_rank=G * F, latent_groups=G,
                                  qk_rope_head_dim=Y),
                       use_rope=Y > 0, **fields)


def _latent_kv(layout, G, F, Y, dtype, seed, B_=B, S_=S, p_=None):
  """(kv of a latent cache: latents [B, S, G, F] and RoPE keys [B, S, 1, Y]
  in a paged pool or the dense layout; the float32 values they stand
  for)."""
  shapes = {'cached_latent': (B_, S_, G, F)}
  if Y:
    shapes['cached_rope_key'] = (B_, S_, 1, Y)
  stored, real = _entries(shapes, LATENT_SCALES, dtype, seed)
  if layout == 'dense':
    return _dense_tied_kv(stored, *LATENT_NAMES), real
  if p_ is None:
    return _pool(stored), real
  return _ordered_pool(stored, B_, S_, p_), real


def _latent_reference(q_BTNF, q_BTNY, real, visible, options):
  """The absorbed step by hand: head n = g·M + m against its group's
  latents c and the RoPE key r, softmax(q_lat·c + q_rope·r) times c, zeros
  for a query that sees nothing."""
  c_BSGF = real['cached_latent']
  c_BSNF = jnp.repeat(c_BSGF, N // c_BSGF.shape[2], axis=2)
  logits_BNTS = jnp.einsum('BTNF,BSNF->BNTS', q_BTNF, c_BSNF)
  if 'cached_rope_key' in real:
    logits_BNTS += jnp.einsum('BTNY,BSY->BNTS', q_BTNY,
                              real['cached_rope_key'][:, :, 0])
  logits_BNTS = logits_BNTS * options.scale
  if options.logits_soft_cap:
    cap = options.logits_soft_cap
    logits_BNTS = cap * jnp.tanh(logits_BNTS / cap)
  seen_BNTS = jnp.broadcast_to(visible, logits_BNTS.shape)
  probs_BNTS = jax.nn.softmax(jnp.where(seen_BNTS, logits_BNTS, -jnp.inf), -1)
  probs_BNTS = jnp.where(seen_BNTS.any(-1, keepdims=True), probs_BNTS, 0.0)
  return jnp.einsum('BNTS,BSNF->BTNF', probs_BNTS, c_BSNF)


def _latent_queries(T, F, Y, B_=B, seed=0):
  q = jax.random.normal(jax.random.key(seed), (B_, T, N, F + Y))
  return q[..., :F], q[..., F:]


@pytest.mark.parametrize('layout', ['paged', 'dense'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.int8],
                         ids=['float32', 'bfloat16', 'int8'])
@pytest.mark.parametrize('T', [1, 4])
@pytest.mark.parametrize('widths', LATENT_WIDTHS)
def test_the_latent_kernel_matches_the_absorbed_step_by_hand(layout, dtype, T,
                                                             widths):
  G, F, Y = LATENT_WIDTHS[widths]
  options = _latent_options(G, F, Y)
  kv, real = _latent_kv(layout, G, F, Y, dtype, seed=G + F)
  q_BTNF, q_BTNY = _latent_queries(T, F, Y)
  kernel = jax.jit(lambda qf, qy, vis: cpu_kernel.latent_attention(
      options, qf, qy, kv, vis))
  for kind in MASKS:  # One compiled kernel: the masks are arrays.
    visible = _visible(kind, T)
    assert cpu_kernel.refusal(options, kv, visible) is None
    got_BTNF = kernel(q_BTNF, q_BTNY, visible)
    chex.assert_shape(got_BTNF, (B, T, N, F))
    chex.assert_trees_all_close(
        got_BTNF, _latent_reference(q_BTNF, q_BTNY, real, visible, options),
        atol=2e-5, rtol=2e-5, custom_message=f'mask {kind}')
    if kind == 'padding':
      np.testing.assert_array_equal(got_BTNF[1], 0.0)


@pytest.mark.parametrize('layout', ['paged', 'dense'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16, jnp.int8],
                         ids=['float32', 'bfloat16', 'int8'])
@pytest.mark.parametrize('widths', ['mla', 'gla'])
def test_the_latent_kernel_on_whole_blocks_shared_among_threads(layout, dtype,
                                                                widths):
  """8 rows of 512 positions (pages of 16: the 16-position vector loops;
  8 dense blocks), 1.6-3 MiB of cache: past kMinBytesPerThread, so the
  units are shared with XLA's intra-op threads; soft-capped, row 0 holding
  10 fewer positions than the others."""
  G, F, Y = LATENT_WIDTHS[widths]
  B_, S_ = 8, 512
  options = _latent_options(G, F, Y, logits_soft_cap=2.0)
  kv, real = _latent_kv(layout, G, F, Y, dtype, seed=G, B_=B_, S_=S_, p_=16)
  q_BTNF, q_BTNY = (3 * x for x in _latent_queries(1, F, Y, B_=B_))
  held_B = jnp.full(B_, S_).at[0].add(-10)
  visible = (jnp.arange(S_) < held_B[:, None])[:, None, None]
  got = jax.jit(lambda qf, qy: cpu_kernel.latent_attention(
      options, qf, qy, kv, visible))(q_BTNF, q_BTNY)
  chex.assert_trees_all_close(
      got, _latent_reference(q_BTNF, q_BTNY, real, visible, options),
      atol=2e-5, rtol=2e-5)


def _ordered_pool(stored, B_, S_, p_) -> kv_cache.KV:
  """A pool [E, P, p, F] (scales [E, P, p]) of each entry [B, S, E, F]
  (scales [B, S, E]): row b's page m is page 1 + m·B + b; page 0 zeros."""
  M_ = S_ // p_
  def pool(x_BSE):
    x_EBMp = jnp.moveaxis(x_BSE.reshape(B_, M_, p_, *x_BSE.shape[2:]), 3, 0)
    x_EXp = jnp.swapaxes(x_EBMp, 1, 2).reshape(
        x_EBMp.shape[0], M_ * B_, p_, *x_EBMp.shape[4:])
    return jnp.concatenate([jnp.zeros_like(x_EXp[:, :1]), x_EXp], axis=1)
  table_BM = 1 + jnp.arange(M_)[None, :] * B_ + jnp.arange(B_)[:, None]
  return kv_cache.KV(None, None, positions_S=jnp.arange(S_), paged=(
      kv_cache.PagedCache({name: pool(x) for name, x in stored.items()},
                          table_BM.astype(jnp.int32), jnp.zeros(B_, int))))


# Pages the pool does not hold: refused with an error, never read.


def _paged_call(target, pool_shape, table_BM):
  """The paged FFI target called directly (as `cpu_kernel` calls it) over a
  float32 pool of pool_shape [E, P, p, F] and page table [B, M]."""
  E, P, p_, F = pool_shape
  B_, M_ = table_BM.shape
  call = jax.ffi.ffi_call(target,
                          jax.ShapeDtypeStruct((B_, 1, N, F), jnp.float32))
  second = (1, P, p_, 0) if target == cpu_kernel.PAGED_TIED_TARGET else (
      pool_shape)
  return call(jnp.ones((B_, 1, N, F)), jnp.ones(pool_shape),
              jnp.ones(second), jnp.zeros((0,)), jnp.zeros((0,)),
              jnp.asarray(table_BM, jnp.int32),
              jnp.ones((B_, 1, M_ * p_), bool),
              scale=np.float32(1), soft_cap=np.float32(0))


@pytest.mark.parametrize('target', [cpu_kernel.PAGED_TARGET,
                                    cpu_kernel.PAGED_TIED_TARGET])
@pytest.mark.parametrize('entry', [7, -1], ids=['past_the_pool', 'negative'])
def test_a_page_id_outside_the_pool_is_an_error_naming_it(target, entry):
  """A page table entry that names no page of the pool (7 of a pool of 7
  pages, or -1) fails the call with one line naming the entry and the pool
  (it used to be clamped onto a wrong page, silently)."""
  table_BM = np.array([[1, 2, 3], [4, 5, 6]])
  table_BM[1, 2] = entry
  assert _paged_call(target, (2, 7, 4, 16), table_BM[:1]).shape == (
      1, 1, N, 16)  # The control: the first row's pages are the pool's.
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      f'INVALID_ARGUMENT: {target}: page_table[1, 2] = {entry} is not a page '
      "of the pool's 7 (0 to 6)")):
    _paged_call(target, (2, 7, 4, 16), table_BM)


@pytest.mark.parametrize('target', [cpu_kernel.PAGED_TARGET,
                                    cpu_kernel.PAGED_TIED_TARGET])
def test_an_empty_pool_is_an_error_and_refused(target):
  """A pool of no pages: the kernel fails the call naming it (it was
  undefined behaviour, std::clamp(x, 0, -1)); `refusal` names it before,
  so a layer takes the JAX path."""
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      f'INVALID_ARGUMENT: {target}: an empty pool (0 pages of 4 positions): '
      'allocate its pages first')):
    _paged_call(target, (2, 0, 4, 16), np.zeros((1, 3)))
  options = layer.Options(num_heads=N, num_kv_heads=2, head_dim=16)
  empty = kv_cache.KV(None, None, paged=kv_cache.PagedCache(
      {'cached_key': jnp.zeros((2, 0, 4, 16))}, jnp.zeros((1, 3), jnp.int32),
      jnp.zeros(1, int)))
  assert cpu_kernel.refusal(options, empty, _visible('none', 1)) == (
      'an empty pool (no pages)')


def test_soft_cap_and_bfloat16_queries():
  options = layer.Options(num_heads=N, num_kv_heads=2, head_dim=H,
                          logits_soft_cap=2.0)
  stored, scales, reference_kv = _cache(2, jnp.float32, seed=1)
  kv = _paged_kv(stored, scales)
  q_BTNH = 3 * jax.random.normal(jax.random.key(0), (B, 1, N, H))
  visible = _visible('causal', 1)
  got = jax.jit(lambda q: cpu_kernel.attention(options, q, kv, visible))(
      q_BTNH.astype(jnp.bfloat16))
  want = dot_product_attention(q_BTNH.astype(jnp.bfloat16).astype(
      jnp.float32), *reference_kv, mask=visible, scale=options.scale,
                               logits_soft_cap=2.0)
  assert got.dtype == jnp.bfloat16
  chex.assert_trees_all_close(got.astype(jnp.float32), want, atol=1e-2)


def test_what_the_kernel_refuses_is_named():
  options = layer.Options(num_heads=N, num_kv_heads=2, head_dim=H)
  stored, scales, _ = _cache(2, jnp.float32, seed=0)
  kv = _dense_kv(stored, scales)
  per_head = jnp.ones((B, N, 1, S), bool)
  assert 'differs between heads' in cpu_kernel.refusal(options, kv, per_head)
  half = _dense_kv([x.astype(jnp.float16) for x in stored], None)
  assert 'float16' in cpu_kernel.refusal(options, half, _visible('none', 1))
  tied = _tied_options(2, H // 2)
  tied_kv = _dense_tied_kv(_tied_cache(2, H // 2, jnp.float32, seed=0)[0])
  assert cpu_kernel.refusal(tied, tied_kv, _visible('none', 1)) is None
  assert 'differs between heads' in cpu_kernel.refusal(tied, tied_kv,
                                                       per_head)
  tied_half = _dense_tied_kv(_tied_cache(2, H // 2, jnp.float16, seed=0)[0])
  assert 'float16' in cpu_kernel.refusal(tied, tied_half, _visible('none', 1))
  latent_kv, _ = _latent_kv('dense', 2, 24, 16, jnp.float32, seed=0)
  assert cpu_kernel.refusal(_latent_options(2, 24, 16), latent_kv,
                            _visible('none', 1)) is None
  latent_half, _ = _latent_kv('paged', 2, 24, 16, jnp.float16, seed=0)
  assert 'float16' in cpu_kernel.refusal(_latent_options(2, 24, 16),
                                         latent_half, _visible('none', 1))


def test_an_unknown_mode_is_one_clear_error(monkeypatch):
  monkeypatch.setenv(cpu_kernel.ENV, 'on')
  with pytest.raises(ValueError, match="GQA_LAB_CPU_KERNEL='on'; use one of"):
    cpu_kernel.mode()


def test_a_bad_input_is_one_line_naming_the_shapes():
  """The kernel checks its operands itself (a call that bypasses
  `cpu_kernel.attention`): the error names the target and the shapes."""
  call = jax.ffi.ffi_call(cpu_kernel.DENSE_TARGET,
                          jax.ShapeDtypeStruct((2, 1, 8, 16), jnp.float32))
  with pytest.raises(Exception, match=re.escape(
      'gqa_lab_dense_decode: visible [2, 1, 31] is not [B or 1, T, S] = '
      '[2 or 1, 1, 32]')):
    call(jnp.ones((2, 1, 8, 16)), jnp.ones((4, 16, 32)), jnp.ones((4, 32, 16)),
         jnp.zeros((0,)), jnp.zeros((0,)), jnp.ones((2, 1, 31), bool),
         scale=np.float32(1), soft_cap=np.float32(0))


def test_a_bad_tied_input_is_one_line_naming_the_shapes():
  call = jax.ffi.ffi_call(cpu_kernel.DENSE_TIED_TARGET,
                          jax.ShapeDtypeStruct((2, 1, 8, 16), jnp.float32))
  with pytest.raises(Exception, match=re.escape(
      'gqa_lab_dense_tied_decode: tied states [4, 32, 16] and RoPE keys '
      '[2, 31, 8] are not [B·K, S, W] and [B, S, Y], with B = the query '
      '[2, 1, 8, 16]\'s first')):
    call(jnp.ones((2, 1, 8, 16)), jnp.ones((4, 32, 16)), jnp.ones((2, 31, 8)),
         jnp.zeros((0,)), jnp.zeros((0,)), jnp.ones((2, 1, 32), bool),
         scale=np.float32(1), soft_cap=np.float32(0))


def test_a_missing_library_is_named(tmp_path):
  why = cpu_kernel.load(tmp_path / 'libgrouped_decode.so')
  assert 'libgrouped_decode.so is not built' in why


def _decode_step(options, paged: bool):
  """A jitted decode step of one layer (T = 1) over a paged pool or a dense
  cache, and its arguments."""
  D = 32
  params = {name: 0.1 * jax.random.normal(jax.random.key(i), shape)
            for i, (name, shape) in enumerate(
                options.param_shapes(D).items())}
  x_BTD = jax.random.normal(jax.random.key(9), (B, 1, D))
  if paged:
    arrays = {name: jnp.zeros(s.shape, s.dtype) for name, s in
              kv_cache.paged_spec(options, P, p, jnp.float32).items()}
    table_BM = jnp.arange(1, 1 + B * M, dtype=jnp.int32).reshape(B, M)
    def step(arrays, x_BTD):
      cache = kv_cache.PagedCache(arrays, table_BM, jnp.asarray(LENGTHS_B - 1))
      return layer.apply(options, params, x_BTD, cache=cache)[:2]
  else:
    arrays = {name: jnp.zeros(s.shape, s.dtype) for name, s in
              options.cache_spec(B, S, jnp.float32).items()}
    arrays['cache_index'] = jnp.array(7, jnp.int32)
    def step(arrays, x_BTD):
      return layer.apply(options, params, x_BTD, cache=arrays)[:2]
  return jax.jit(step), (arrays, x_BTD)


STEP_LAYOUTS = {  # Name -> the layer's layout and KV heads.
    'grouped': (GQA(), 2),
    'tied': (GTA(), 2),
    'mla': (MLA(kv_lora_rank=32, qk_rope_head_dim=8), N),
    'gla': (MLA(kv_lora_rank=48, latent_groups=2, qk_rope_head_dim=16), N),
}


def _step_options(name: str, head_dim: int = H, **fields) -> layer.Options:
  layout, K = STEP_LAYOUTS[name]
  return layer.Options(num_heads=N, num_kv_heads=K, head_dim=head_dim,
                       layout=layout, **fields)


def _target(name: str, paged: bool) -> str:
  """The custom call of a layout's decode step: grouped-query attention's
  kernel, or the one tied and latent caches share."""
  if name == 'grouped':
    return cpu_kernel.PAGED_TARGET if paged else cpu_kernel.DENSE_TARGET
  return cpu_kernel.PAGED_TIED_TARGET if paged else cpu_kernel.DENSE_TIED_TARGET


@pytest.mark.parametrize('name', STEP_LAYOUTS)
@pytest.mark.parametrize('paged', [True, False], ids=['paged', 'dense'])
def test_the_decode_step_runs_the_kernel_and_agrees_with_the_jax_path(
    paged, name, monkeypatch):
  options = _step_options(name, kv_cache_dtype='int8')
  target = _target(name, paged)
  step, args = _decode_step(options, paged)
  assert target in step.lower(*args).compile().as_text()
  out_kernel, cache_kernel = step(*args)
  monkeypatch.setenv(cpu_kernel.ENV, 'off')
  step, args = _decode_step(options, paged)  # Traced again: the JAX path.
  assert target not in step.lower(*args).compile().as_text()  # The control.
  out_jax, cache_jax = step(*args)
  chex.assert_trees_all_close(out_kernel, out_jax, atol=1e-5)
  chex.assert_trees_all_equal(cache_kernel, cache_jax)


@pytest.mark.slow
@pytest.mark.parametrize('kv_cache_dtype', [None, 'int8'])
def test_the_serving_step_reads_the_pool_in_place(kv_cache_dtype):
  """The engine's decode step (`serve.runner.forward`) compiled for this CPU:
  every layer's attention is the kernel, and no page of the pool is
  gathered; with the kernel off (the control) each layer gathers its keys
  and values."""
  config = tiny.get_config()
  config.model.update(num_heads=4, num_kv_heads=2, head_dim=H, max_len=64,
                      kv_cache_dtype=kv_cache_dtype)
  mc = config_lib.model_config(config)
  serving, params = paged.serving_model(
      mc, nn.unbox(loop.init_params(Transformer(mc), 0)))
  pool = paged.empty_pool(serving.config, 9, p)
  args = (params, pool, jnp.zeros((B, 1), jnp.int32),
          jnp.zeros((B, M), jnp.int32), jnp.zeros((B,), jnp.int32))
  step = lambda: jax.jit(lambda *args: paged.forward(serving, *args))
  gathers = lambda text: sum(f'x{M}x{p}x{H}x' in line for line in
                             text.splitlines() if 'stablehlo.gather' in line)
  text = step().lower(*args).as_text()
  assert text.count(f'@{cpu_kernel.PAGED_TARGET}(') == mc.num_layers
  assert gathers(text) == 0
  with cpu_kernel.disabled():
    text = step().lower(*args).as_text()
  assert cpu_kernel.PAGED_TARGET not in text
  assert gathers(text) == 2 * mc.num_layers


@pytest.mark.parametrize('kind', ['grouped', 'tied', 'latent'])
@pytest.mark.parametrize('layout', ['paged', 'dense'])
def test_the_benchmark_times_two_paths_that_agree(layout, kind):
  """scripts.bench_cpu_kernel's contestants: the same step's output."""
  from scripts import bench_cpu_kernel  # pylint: disable=import-outside-toplevel
  runs = bench_cpu_kernel.contestants(layout, K=2, batch=3, context=64,
                                      fill=0.5, kind=kind)
  chex.assert_trees_all_close(runs['kernel'](), runs['jax'](), atol=1e-5)


@pytest.mark.parametrize('name', STEP_LAYOUTS)
@pytest.mark.parametrize('platform', ['tpu', 'cuda'])
def test_the_step_lowered_for_an_accelerator_holds_no_cpu_kernel(platform,
                                                                 name):
  options = _step_options(name, head_dim=128)
  target = _target(name, paged=True)
  step, args = _decode_step(options, paged=True)
  text = jax.export.export(step, platforms=[platform])(*args).mlir_module()
  assert target not in text
  assert target in step.lower(*args).as_text()  # Control.


@pytest.mark.slow
def test_require_fails_the_import_without_the_library_and_passes_with_it(
    tmp_path):
  """GQA_LAB_CPU_KERNEL=require (CI's setting): `import attention` from a
  copy of the package without the library fails, naming it; from this one
  it succeeds."""
  shutil.copytree(REPO / 'attention', tmp_path / 'attention',
                  ignore=shutil.ignore_patterns('cpu', '__pycache__'))
  env = {**os.environ, cpu_kernel.ENV: 'require'}
  run = lambda where: subprocess.run(
      [sys.executable, '-c', 'import attention'], capture_output=True,
      text=True, env={**env, 'PYTHONPATH': str(where)}, cwd=where)
  without = run(tmp_path)
  assert without.returncode != 0
  assert without.stderr.strip().splitlines()[-1] == (
      'ImportError: GQA_LAB_CPU_KERNEL=require but libgrouped_decode.so is '
      'not built (pip install -e . with a C++ compiler builds it)')
  with_library = run(REPO)
  assert with_library.returncode == 0, with_library.stderr[-2000:]


_EACH_TARGET = '''
import itertools, pathlib, sys
from attention import cpu_kernel
cpu_kernel.LIBRARY = pathlib.Path(sys.argv[1])  # Before the first load.
import jax.numpy as jnp
from tests import test_cpu_kernel as t
assert cpu_kernel.available()
for layout, dtype, K in itertools.product(
    ['paged', 'dense'], [jnp.float32, jnp.bfloat16, jnp.int8], [4, 1]):
  t._check_against_the_einsum_path(layout, dtype, 4, K, t.H)
t._check_against_the_einsum_path('paged', jnp.int8, 1, 2, 24)
for layout, dtype in itertools.product(
    ['paged', 'dense'], [jnp.bfloat16, jnp.int8]):
  t._check_tied_wide(layout, 2, 2, 160, dtype=dtype, soft_cap=2.0)
for layout in ['paged', 'dense']:
  t._check_tied_wide(layout, 8, 2, 160)  # float32.
  t._check_tied(layout, jnp.int8, 4, 2, 0, 24)
  t.test_the_latent_kernel_on_whole_blocks_shared_among_threads(
      layout, jnp.bfloat16, 'gla')
  t.test_the_latent_kernel_matches_the_absorbed_step_by_hand(
      layout, jnp.int8, 4, 'narrow')
'''


@pytest.mark.slowest
@pytest.mark.slow
@pytest.mark.parametrize('target', ['arch=x86-64-v3', 'default'])
@pytest.mark.skipif(shutil.which('g++') is None, reason='no C++ compiler')
def test_each_target_the_build_dispatches_to_matches_the_einsum_path(
    target, tmp_path):
  """The library built for one target only (AVX2, or the x86-64 baseline),
  as the AVX2 and older machines run it whatever machine the test runs on:
  both kernels (grouped, and tied for GTA and latent caches) equal their
  references."""
  clones = '' if target == 'default' else (
      f'__attribute__((target("{target}")))')
  library = tmp_path / 'libgrouped_decode.so'
  subprocess.run(build.command(jax.ffi.include_dir(), str(library), clones,
                               root=str(REPO)),
                 check=True, capture_output=True)
  result = subprocess.run([sys.executable, '-c', _EACH_TARGET, str(library)],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, 'PYTHONPATH': str(REPO)})
  assert result.returncode == 0, result.stderr[-3000:]
