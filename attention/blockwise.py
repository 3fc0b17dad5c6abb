"""Blockwise (flash-style) attention for the CPU: skips masked blocks, O(T) memory.

The dense path materialises [B, N, T, S] logits; for long causal sequences
that is both wasted work (half of it is masked) and memory traffic that
dominates on a CPU. Here the queries of one (batch, KV-head) group, `heads`
of its G heads at a time, or of several whole groups at once when G is
small (multi-head attention; see `tiling`), are split into blocks of `block`
rows; query block i only multiplies the keys up to its diagonal, a static
prefix, so masked blocks are never computed. Each block's logits row is
complete, so its softmax is exact (no running rescaling); its log-sum-exp is
kept for the backward pass, which recomputes the probabilities block by
block (FlashAttention-2's backward, Dao 2023): dQ per block, dK and dV
accumulated over the same prefixes. A `lax.fori_loop` walks the steps, one
chunk of heads each: a step copies its queries and its KV heads out of the
[B, T, N, H] and [B, S, K, H] arrays (small strided copies that stay in
cache) and writes its results back in place, so no array is ever transposed
whole and the step's blocks stay in cache.

Supports causal or full attention without extra masks, soft cap or window;
`attention.core` falls back to the dense path for the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attention import numerics

# Shorter sequences take the dense path, whose [B, N, T, S] logits are small
# there; the crossover itself was never measured (set in commit 6558d83).
MIN_LENGTH = 256


def tiling(T: int, G: int, N: int) -> tuple[int, int]:
  """(heads, block): query heads taken together per step, rows per block.

  Heads sharing a KV head are multiplied together (bigger matmuls, and the
  K/V prefix read once for all of them), but at most 4096 query rows,
  heads·T, per step: XLA's CPU scheduler runs the independent blocks of a
  step concurrently, so all their temporaries can be live at once, and
  taking all G heads let MQA's peak memory exceed MHA's. Multi-head
  attention (G = 1) takes up to 4 heads per step, a matmul batched over
  their KV heads: one head per step left MHA 1.2x slower than GQA-2 at the
  same FLOPs (T = 512, measured).
  Rows per block heads·block ~ 128 (256 past T = 1024, or for G = 1),
  measured: blocks that fit a core's L2 cache win; at most 32 blocks keep
  compile time short (and XLA's simplifier out of trouble). block = T when
  no power of two divides T.
  """
  heads = G
  while heads > 1 and (heads * T > 4096 or G % heads):
    heads -= 1
  rows = 128 if T <= 1024 else 256
  if G == 1:  # Whole groups: the most of 4, 2 heads that N and T allow
    # (one head past T = 4096).
    heads = next((h for h in (4, 2) if N % h == 0 and h * T <= 4096), 1)
    rows = 256
  block = max(rows // heads, 32, T // 32)
  while block > 1 and T % block:
    block //= 2
  return heads, (block if block >= 16 else T)


def blockwise_attention(query, key, value, *, is_causal: bool, scale: float,
                        heads_and_block: tuple[int, int] | None = None):
  """query [B, T, N, H], key/value [B, S, K, H] -> [B, T, N, H].

  heads_and_block defaults to tiling(T, G, N); heads must divide G = N // K
  or be a multiple of G that divides N, and block must divide T (and
  T <= S when causal).
  """
  T, N = query.shape[1:3]
  heads, block = heads_and_block or tiling(T, N // key.shape[2], N)
  return _attention(query, key, value, is_causal, scale, heads, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention(query, key, value, is_causal, scale, heads, block):
  return _forward(query, key, value, is_causal, scale, heads, block)[0]


def _step(i, K, G, heads):
  """Step i -> (batch row, first KV head, first query head) of its chunk of
  `heads` query heads: part of one KV head's group (heads <= G) or whole
  groups (heads a multiple of G)."""
  chunks = K * G // heads
  row, chunk = jnp.divmod(i, chunks)
  n = chunk * heads
  return row, n // G, n


def _heads(x, row, first, count):
  """x[row, :, first:first + count] as [count, M, H].

  x: queries [B, T, N, H] (M = T) or keys/values [B, S, K, H] (M = S).
  """
  _, M, _, H = x.shape
  x_1MgH = jax.lax.dynamic_slice(x, (row, 0, first, 0), (1, M, count, H))
  return x_1MgH[0].transpose(1, 0, 2)


def _put_heads(x, row, first, x_gMH):
  """x with x[row, :, first:first + g] = x_gMH, in place."""
  x_1MgH = x_gMH.transpose(1, 0, 2)[None].astype(x.dtype)
  return jax.lax.dynamic_update_slice(x, x_1MgH, (row, 0, first, 0))


def _blocks(T, S, is_causal, block):
  """(query rows, visible key prefix) per block; bottom-right causal alignment."""
  for start in range(0, T, block):
    end = S - T + start + block if is_causal else S
    yield slice(start, start + block), end


def _logits(q_kgbH, k_kSH, rows, end, T, S, is_causal, scale):
  logits_kgbS = jnp.einsum('kgbH,kSH->kgbS', q_kgbH, k_kSH[:, :end],
                           preferred_element_type=jnp.float32) * scale
  if is_causal:  # Only the diagonal block has masked entries.
    q_pos = S - T + jnp.arange(rows.start, rows.stop)[:, None]
    logits_kgbS = jnp.where(jnp.arange(end)[None, :] <= q_pos, logits_kgbS,
                            numerics.MASKED_LOGIT)
  return logits_kgbS


def _split(heads, G):
  """(KV heads, query heads per KV head) of a chunk of `heads` query heads."""
  return (heads // G, G) if heads > G else (1, heads)


def _forward(query, key, value, is_causal, scale, heads, block):
  B, T, N, H = query.shape
  S, K = key.shape[1:3]
  G = N // K
  kc, g = _split(heads, G)

  def one_chunk(q_kgTH, k_kSH, v_kSH):
    outs, lses = [], []
    for rows, end in _blocks(T, S, is_causal, block):
      logits_kgbS = _logits(q_kgTH[:, :, rows], k_kSH, rows, end, T, S,
                            is_causal, scale)
      max_kgb1 = logits_kgbS.max(-1, keepdims=True)
      p_kgbS = jnp.exp(logits_kgbS - max_kgb1)
      sum_kgb1 = p_kgbS.sum(-1, keepdims=True)
      o_kgbH = jnp.einsum('kgbS,kSH->kgbH', p_kgbS.astype(v_kSH.dtype),
                          v_kSH[:, :end],
                          preferred_element_type=jnp.float32) / sum_kgb1
      outs.append(o_kgbH.astype(q_kgTH.dtype))
      lses.append(max_kgb1[..., 0] + jnp.log(sum_kgb1[..., 0]))
    return jnp.concatenate(outs, 2), jnp.concatenate(lses, 2)

  def step(i, carry):
    out_BTNH, lse_BNT = carry
    row, k, n = _step(i, K, G, heads)
    o_kgTH, lse_kgT = one_chunk(
        _heads(query, row, n, heads).reshape(kc, g, T, H),
        _heads(key, row, k, kc), _heads(value, row, k, kc))
    return (_put_heads(out_BTNH, row, n, o_kgTH.reshape(heads, T, H)),
            jax.lax.dynamic_update_slice(
                lse_BNT, lse_kgT.reshape(1, heads, T), (row, n, 0)))

  out_BTNH, lse_BNT = jax.lax.fori_loop(
      0, B * N // heads, step,
      (jnp.zeros_like(query), jnp.zeros((B, N, T), jnp.float32)))
  return out_BTNH, (query, key, value, out_BTNH, lse_BNT)


def _backward(is_causal, scale, heads, block, residuals, do_BTNH):
  query, key, value, out_BTNH, lse_BNT = residuals
  B, T, N, H = query.shape
  S, K = key.shape[1:3]
  G = N // K
  kc, g = _split(heads, G)
  # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij, the softmax Jacobian's term.
  delta_BNT = jnp.einsum('BTNH,BTNH->BNT', do_BTNH.astype(jnp.float32),
                         out_BTNH.astype(jnp.float32))

  def one_chunk(q_kgTH, do_kgTH, lse_kgT, delta_kgT, k_kSH, v_kSH):
    dk_kHS = dv_kHS = jnp.zeros((kc, H, S), jnp.float32)
    dqs = []
    for rows, end in _blocks(T, S, is_causal, block):
      q_kgbH, do_kgbH = q_kgTH[:, :, rows], do_kgTH[:, :, rows]
      logits_kgbS = _logits(q_kgbH, k_kSH, rows, end, T, S, is_causal, scale)
      p_kgbS = jnp.exp(logits_kgbS - lse_kgT[:, :, rows, None])
      dp_kgbS = jnp.einsum('kgbH,kSH->kgbS', do_kgbH, v_kSH[:, :end],
                           preferred_element_type=jnp.float32)
      ds_kgbS = p_kgbS * (dp_kgbS - delta_kgT[:, :, rows, None]) * scale
      dqs.append(jnp.einsum('kgbS,kSH->kgbH', ds_kgbS, k_kSH[:, :end]))
      # dK, dV as [H, S]: the matmuls then read ds and p in their own layout
      # (an [S, H] result would first copy each block's ds and p transposed).
      dk_kHS = dk_kHS.at[:, :, :end].add(
          jnp.einsum('kgbH,kgbS->kHS', q_kgbH, ds_kgbS))
      dv_kHS = dv_kHS.at[:, :, :end].add(
          jnp.einsum('kgbH,kgbS->kHS', do_kgbH, p_kgbS))
    return jnp.concatenate(dqs, 2), dk_kHS, dv_kHS

  def step(i, carry):
    dq_BTNH, dk_BSKH, dv_BSKH = carry
    row, k, n = _step(i, K, G, heads)
    rows_kgT = lambda x_BNT: jax.lax.dynamic_slice(
        x_BNT, (row, n, 0), (1, heads, T)).reshape(kc, g, T)
    chunk = lambda x_BTNH: _heads(x_BTNH, row, n, heads).reshape(kc, g, T, H)
    dq_kgTH, dk_kHS, dv_kHS = one_chunk(
        chunk(query), chunk(do_BTNH), rows_kgT(lse_BNT), rows_kgT(delta_BNT),
        _heads(key, row, k, kc), _heads(value, row, k, kc))
    # A KV head's gradient sums over its chunks of query heads.
    add = lambda d_BSKH, d_kHS: _put_heads(
        d_BSKH, row, k, _heads(d_BSKH, row, k, kc) + d_kHS.transpose(0, 2, 1))
    return (_put_heads(dq_BTNH, row, n, dq_kgTH.reshape(heads, T, H)),
            add(dk_BSKH, dk_kHS), add(dv_BSKH, dv_kHS))

  f32_zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  dq, dk, dv = jax.lax.fori_loop(
      0, B * N // heads, step,
      (f32_zeros(query), f32_zeros(key), f32_zeros(value)))
  return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)


_attention.defvjp(_forward, _backward)  # _forward returns the residuals.
