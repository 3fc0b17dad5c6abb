"""Blockwise (flash-style) attention for the CPU: skips masked blocks, O(T) memory.

The dense path materialises [B, N, T, S] logits; for long causal sequences
that is both wasted work (half of it is masked) and memory traffic that
dominates on a CPU. Here the queries of one (batch, KV-head) group, all G of
its heads at once, are split into blocks of `block` rows; query block i only
multiplies the keys up to its diagonal, a static prefix, so masked blocks are
never computed. Each block's logits row is complete, so its softmax is exact
(no running rescaling); its log-sum-exp is kept for the backward pass, which
recomputes the probabilities block by block (FlashAttention-2's backward,
Dao 2023): dQ per block, dK and dV accumulated over the same prefixes.
`lax.map` walks the B·K groups so that one group's blocks stay in cache.

Supports causal or full attention without extra masks, soft cap or window;
`attention.core` falls back to the dense path for the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG = -1e30  # Masked logits; finite, so exp() is 0 without NaN.
MIN_LENGTH = 256  # Below this the dense path is as fast (BENCHMARKS.md).


def block_size(T: int, G: int) -> int:
  """Query rows per block: G·block ~ 128 rows (256 past T = 1024), measured.

  Blocks that fit a core's L2 cache win; at most 32 blocks keep compile
  time short (and XLA's simplifier out of trouble). Falls back to T when no power of two divides it.
  """
  rows = 128 if T <= 1024 else 256
  block = max(rows // G, 32, T // 32)
  while block > 1 and T % block:
    block //= 2
  return block if block >= 16 else T


def blockwise_attention(query, key, value, *, is_causal: bool, scale: float,
                        block: int):
  """query [B, T, N, H], key/value [B, S, K, H] -> [B, T, N, H]; T % block == 0."""
  B, T, N, H = query.shape
  S, K = key.shape[1:3]
  G = N // K
  # Heads-major layouts, one transpose each: X = B·K groups of G heads.
  q_XGTH = query.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(
      B * K, G, T, H)
  k_XSH = key.transpose(0, 2, 1, 3).reshape(B * K, S, H)
  v_XSH = value.transpose(0, 2, 1, 3).reshape(B * K, S, H)
  o_XGTH = _attention(q_XGTH, k_XSH, v_XSH, is_causal, scale, block)
  return o_XGTH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(
      B, T, N, H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q_XGTH, k_XSH, v_XSH, is_causal, scale, block):
  return _forward(q_XGTH, k_XSH, v_XSH, is_causal, scale, block)[0]


def _blocks(T, S, is_causal, block):
  """(query rows, visible key prefix) per block; bottom-right causal alignment."""
  for start in range(0, T, block):
    end = S - T + start + block if is_causal else S
    yield slice(start, start + block), end


def _logits(q_GbH, k_SH, rows, end, T, S, is_causal, scale):
  logits_GbS = jnp.einsum('GTH,SH->GTS', q_GbH, k_SH[:end],
                          preferred_element_type=jnp.float32) * scale
  if is_causal:  # Only the diagonal block has masked entries.
    q_pos = S - T + jnp.arange(rows.start, rows.stop)[:, None]
    logits_GbS = jnp.where(jnp.arange(end)[None, :] <= q_pos, logits_GbS, _NEG)
  return logits_GbS


def _forward(q_XGTH, k_XSH, v_XSH, is_causal, scale, block):
  T, S = q_XGTH.shape[2], k_XSH.shape[1]

  def one_group(args):
    q_GTH, k_SH, v_SH = args
    outs, lses = [], []
    for rows, end in _blocks(T, S, is_causal, block):
      logits_GbS = _logits(q_GTH[:, rows], k_SH, rows, end, T, S, is_causal,
                           scale)
      max_Gb1 = logits_GbS.max(-1, keepdims=True)
      p_GbS = jnp.exp(logits_GbS - max_Gb1)
      sum_Gb1 = p_GbS.sum(-1, keepdims=True)
      o_GbH = jnp.einsum('GTS,SH->GTH', p_GbS.astype(v_SH.dtype), v_SH[:end],
                         preferred_element_type=jnp.float32) / sum_Gb1
      outs.append(o_GbH.astype(q_GTH.dtype))
      lses.append(max_Gb1[..., 0] + jnp.log(sum_Gb1[..., 0]))
    return jnp.concatenate(outs, 1), jnp.concatenate(lses, 1)

  o_XGTH, lse_XGT = jax.lax.map(one_group, (q_XGTH, k_XSH, v_XSH))
  return o_XGTH, (q_XGTH, k_XSH, v_XSH, o_XGTH, lse_XGT)


def _forward_vjp(q_XGTH, k_XSH, v_XSH, is_causal, scale, block):
  return _forward(q_XGTH, k_XSH, v_XSH, is_causal, scale, block)


def _backward(is_causal, scale, block, residuals, do_XGTH):
  q_XGTH, k_XSH, v_XSH, o_XGTH, lse_XGT = residuals
  T, S = q_XGTH.shape[2], k_XSH.shape[1]
  # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij, the softmax Jacobian's term.
  delta_XGT = jnp.einsum('XGTH,XGTH->XGT', do_XGTH.astype(jnp.float32),
                         o_XGTH.astype(jnp.float32))

  def one_group(args):
    q_GTH, k_SH, v_SH, do_GTH, lse_GT, delta_GT = args
    dk_SH = jnp.zeros(k_SH.shape, jnp.float32)
    dv_SH = jnp.zeros(v_SH.shape, jnp.float32)
    dqs = []
    for rows, end in _blocks(T, S, is_causal, block):
      q_GbH, do_GbH = q_GTH[:, rows], do_GTH[:, rows]
      logits_GbS = _logits(q_GbH, k_SH, rows, end, T, S, is_causal, scale)
      p_GbS = jnp.exp(logits_GbS - lse_GT[:, rows, None])
      dp_GbS = jnp.einsum('GTH,SH->GTS', do_GbH, v_SH[:end],
                          preferred_element_type=jnp.float32)
      ds_GbS = p_GbS * (dp_GbS - delta_GT[:, rows, None]) * scale
      dqs.append(jnp.einsum('GTS,SH->GTH', ds_GbS, k_SH[:end]))
      dk_SH = dk_SH.at[:end].add(jnp.einsum('GTS,GTH->SH', ds_GbS, q_GbH))
      dv_SH = dv_SH.at[:end].add(jnp.einsum('GTS,GTH->SH', p_GbS, do_GbH))
    return jnp.concatenate(dqs, 1), dk_SH, dv_SH

  dq, dk, dv = jax.lax.map(
      one_group, (q_XGTH, k_XSH, v_XSH, do_XGTH, lse_XGT, delta_XGT))
  return (dq.astype(q_XGTH.dtype), dk.astype(k_XSH.dtype),
          dv.astype(v_XSH.dtype))


_attention.defvjp(_forward_vjp, _backward)

