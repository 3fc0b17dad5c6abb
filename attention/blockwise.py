"""Blockwise (flash-style) attention for the CPU: skips masked blocks, O(T) memory.

The dense path materialises [B, N, T, S] logits; for long causal sequences
that is both wasted work (half of it is masked) and memory traffic that
dominates on a CPU. Here the queries of one (batch, KV-head) group, `heads`
of its G heads at a time (see `tiling`), are split into blocks of `block`
rows; query block i only multiplies the keys up to its diagonal, a static
prefix, so masked blocks are never computed. Each block's logits row is
complete, so its softmax is exact (no running rescaling); its log-sum-exp is
kept for the backward pass, which recomputes the probabilities block by
block (FlashAttention-2's backward, Dao 2023): dQ per block, dK and dV
accumulated over the same prefixes. `lax.map` walks the B·K groups, and each
group's chunks of heads, so that one step's blocks stay in cache.

Supports causal or full attention without extra masks, soft cap or window;
`attention.core` falls back to the dense path for the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG = -1e30  # Masked logits; finite, so exp() is 0 without NaN.
MIN_LENGTH = 256  # Below this the dense path is as fast (BENCHMARKS.md).


def tiling(T: int, G: int) -> tuple[int, int]:
  """(heads, block): query heads of a KV group taken together, rows per block.

  Heads sharing a KV head are multiplied together (bigger matmuls, the K/V
  prefix read once for all of them: 1.1-1.2x faster backward at T = 2048),
  but at most 4096 query rows, heads·T, per step: XLA's CPU scheduler runs
  the independent blocks of a step concurrently, so all their temporaries can
  be live at once, and taking all G heads let MQA's peak memory exceed MHA's.
  Rows per block heads·block ~ 128 (256 past T = 1024), measured: blocks that
  fit a core's L2 cache win; at most 32 blocks keep compile time short (and
  XLA's simplifier out of trouble). block = T when no power of two divides T.
  """
  heads = G
  while heads > 1 and (heads * T > 4096 or G % heads):
    heads -= 1
  rows = 128 if T <= 1024 else 256
  block = max(rows // heads, 32, T // 32)
  while block > 1 and T % block:
    block //= 2
  return heads, (block if block >= 16 else T)


def blockwise_attention(query, key, value, *, is_causal: bool, scale: float,
                        heads_and_block: tuple[int, int] | None = None):
  """query [B, T, N, H], key/value [B, S, K, H] -> [B, T, N, H].

  heads_and_block defaults to tiling(T, N // K); heads must divide N // K and
  block T (and T <= S when causal).
  """
  B, T, N, H = query.shape
  S, K = key.shape[1:3]
  G = N // K
  heads, block = heads_and_block or tiling(T, G)
  # Heads-major layouts, one transpose each: X = B·K groups of G heads, in
  # C = G // heads chunks of g = heads; b below is a block's query rows.
  q_XCgTH = query.reshape(B, T, K, G // heads, heads, H).transpose(
      0, 2, 3, 4, 1, 5).reshape(B * K, G // heads, heads, T, H)
  k_XSH = key.transpose(0, 2, 1, 3).reshape(B * K, S, H)
  v_XSH = value.transpose(0, 2, 1, 3).reshape(B * K, S, H)
  o_XCgTH = _attention(q_XCgTH, k_XSH, v_XSH, is_causal, scale, block)
  return o_XCgTH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(
      B, T, N, H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q_XCgTH, k_XSH, v_XSH, is_causal, scale, block):
  return _forward(q_XCgTH, k_XSH, v_XSH, is_causal, scale, block)[0]


def _blocks(T, S, is_causal, block):
  """(query rows, visible key prefix) per block; bottom-right causal alignment."""
  for start in range(0, T, block):
    end = S - T + start + block if is_causal else S
    yield slice(start, start + block), end


def _logits(q_gbH, k_SH, rows, end, T, S, is_causal, scale):
  logits_gbS = jnp.einsum('gbH,SH->gbS', q_gbH, k_SH[:end],
                          preferred_element_type=jnp.float32) * scale
  if is_causal:  # Only the diagonal block has masked entries.
    q_pos = S - T + jnp.arange(rows.start, rows.stop)[:, None]
    logits_gbS = jnp.where(jnp.arange(end)[None, :] <= q_pos, logits_gbS, _NEG)
  return logits_gbS


def _forward(q_XCgTH, k_XSH, v_XSH, is_causal, scale, block):
  T, S = q_XCgTH.shape[3], k_XSH.shape[1]

  def one_chunk(q_gTH, k_SH, v_SH):
    outs, lses = [], []
    for rows, end in _blocks(T, S, is_causal, block):
      logits_gbS = _logits(q_gTH[:, rows], k_SH, rows, end, T, S, is_causal,
                           scale)
      max_gb1 = logits_gbS.max(-1, keepdims=True)
      p_gbS = jnp.exp(logits_gbS - max_gb1)
      sum_gb1 = p_gbS.sum(-1, keepdims=True)
      o_gbH = jnp.einsum('gbS,SH->gbH', p_gbS.astype(v_SH.dtype), v_SH[:end],
                         preferred_element_type=jnp.float32) / sum_gb1
      outs.append(o_gbH.astype(q_gTH.dtype))
      lses.append(max_gb1[..., 0] + jnp.log(sum_gb1[..., 0]))
    return jnp.concatenate(outs, 1), jnp.concatenate(lses, 1)

  def one_group(args):  # One (batch, KV head), its query heads chunk by chunk.
    q_CgTH, k_SH, v_SH = args
    return jax.lax.map(lambda q_gTH: one_chunk(q_gTH, k_SH, v_SH), q_CgTH)

  o_XCgTH, lse_XCgT = jax.lax.map(one_group, (q_XCgTH, k_XSH, v_XSH))
  return o_XCgTH, (q_XCgTH, k_XSH, v_XSH, o_XCgTH, lse_XCgT)


def _forward_vjp(q_XCgTH, k_XSH, v_XSH, is_causal, scale, block):
  return _forward(q_XCgTH, k_XSH, v_XSH, is_causal, scale, block)


def _backward(is_causal, scale, block, residuals, do_XCgTH):
  q_XCgTH, k_XSH, v_XSH, o_XCgTH, lse_XCgT = residuals
  T, S = q_XCgTH.shape[3], k_XSH.shape[1]
  # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij, the softmax Jacobian's term.
  delta_XCgT = jnp.einsum('XCgTH,XCgTH->XCgT', do_XCgTH.astype(jnp.float32),
                          o_XCgTH.astype(jnp.float32))

  def one_chunk(dk_HS, dv_HS, chunk, k_SH, v_SH):
    q_gTH, do_gTH, lse_gT, delta_gT = chunk
    dqs = []
    for rows, end in _blocks(T, S, is_causal, block):
      q_gbH, do_gbH = q_gTH[:, rows], do_gTH[:, rows]
      logits_gbS = _logits(q_gbH, k_SH, rows, end, T, S, is_causal, scale)
      p_gbS = jnp.exp(logits_gbS - lse_gT[:, rows, None])
      dp_gbS = jnp.einsum('gbH,SH->gbS', do_gbH, v_SH[:end],
                          preferred_element_type=jnp.float32)
      ds_gbS = p_gbS * (dp_gbS - delta_gT[:, rows, None]) * scale
      dqs.append(jnp.einsum('gbS,SH->gbH', ds_gbS, k_SH[:end]))
      # dK, dV as [H, S]: the matmuls then read ds and p in their own layout
      # (an [S, H] result would first copy each block's ds and p transposed).
      dk_HS = dk_HS.at[:, :end].add(jnp.einsum('gbH,gbS->HS', q_gbH, ds_gbS))
      dv_HS = dv_HS.at[:, :end].add(jnp.einsum('gbH,gbS->HS', do_gbH, p_gbS))
    return (dk_HS, dv_HS), jnp.concatenate(dqs, 1)

  def one_group(args):  # dK, dV summed over the group's chunks of heads.
    q_CgTH, k_SH, v_SH, do_CgTH, lse_CgT, delta_CgT = args
    zeros_HS = jnp.zeros(k_SH.shape[::-1], jnp.float32)
    (dk_HS, dv_HS), dq_CgTH = jax.lax.scan(
        lambda carry, chunk: one_chunk(*carry, chunk, k_SH, v_SH),
        (zeros_HS, zeros_HS), (q_CgTH, do_CgTH, lse_CgT, delta_CgT))
    return dq_CgTH, dk_HS.T, dv_HS.T

  dq, dk, dv = jax.lax.map(
      one_group, (q_XCgTH, k_XSH, v_XSH, do_XCgTH, lse_XCgT, delta_XCgT))
  return (dq.astype(q_XCgTH.dtype), dk.astype(k_XSH.dtype),
          dv.astype(v_XSH.dtype))


_attention.defvjp(_forward_vjp, _backward)

