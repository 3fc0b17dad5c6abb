"""Attention for a few query tokens against a long KV cache (decoding).

Two cache layouts, each read once where it lies, which is what decoding is
bound by:

`heads_major_attention`: the layout of `attention.Attention`'s cache, one row
per (batch row, KV head), Z = B·K: keys [Z, H, S], values [Z, S, H]. Per row
the G·T queries of the group are a [G·T, H] x [H, S] product, then
[G·T, S] x [S, H]: two batched matmuls over Z, no wasted arithmetic, each
operand in the layout the CPU's matmul kernel reads without repacking. Kept
3-D so that nothing is reshaped between the in-place write of a token and
these matmuls (with a 4-D cache and K = 1, XLA's CPU fusion duplicates the
write for the reshape and copies the whole cache to do it).

`cache_layout_attention`: a token-major [B, S, K, H] cache, as
`dot_product_attention` takes keys (implementation 'short_query'). The dense path
contracts 'BTKGH,BSKH->BKGTS'; for that batched matmul XLA first copies the
whole cache into a heads-major [B, K, S, H] layout, on every decoded token,
which on a CPU costs several times the attention itself. Here the cache is
read in place, as a [B, S, K·H] matrix: the queries become a block-diagonal
[K·H, T·K·G] matrix (query head (k, g) is nonzero only in KV head k's rows),
so one plain matmul per batch row yields all logits, and a second one all
outputs, of which the diagonal K blocks are kept. That spends K times the
(tiny) arithmetic of T = 1 to stream the cache once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention import numerics

MAX_QUERIES = 8  # Past this the wasted K-fold arithmetic stops being cheap.


def cache_layout_attention(query, key, value, mask_BKGTS, *, scale,
                           logits_soft_cap):
  """query [B, T, N, H], key/value [B, S, K, H] -> [B, T, N, H] (query dtype).

  mask_BKGTS: boolean broadcastable to [B, K, G, T, S], or None.
  """
  B, T, N, H = query.shape
  S, K = key.shape[1:3]
  G = N // K
  eye_KJ = jnp.eye(K, dtype=query.dtype)
  q_BTKGH = query.reshape(B, T, K, G, H)
  # C = K·H cache columns, R = T·K·G query rows.
  q_BCR = jnp.einsum('BTKGH,KJ->BKHTJG', q_BTKGH, eye_KJ).reshape(
      B, K * H, T * K * G)
  logits_BSR = jnp.einsum('BSC,BCR->BSR', key.reshape(B, S, K * H), q_BCR,
                          preferred_element_type=jnp.float32) * scale
  logits_BSTKG = numerics.soft_cap(logits_BSR.reshape(B, S, T, K, G),
                                  logits_soft_cap)
  mask_BSTKG = None if mask_BKGTS is None else jnp.moveaxis(
      mask_BKGTS, 4, 1).transpose(0, 1, 4, 2, 3)
  probs_BSTKG = numerics.masked_softmax(logits_BSTKG, mask_BSTKG, axis=1)
  out_BRC = jnp.einsum(
      'BSR,BSC->BRC', probs_BSTKG.reshape(B, S, T * K * G).astype(value.dtype),
      value.reshape(B, S, K * H), preferred_element_type=jnp.float32)
  out_BTKGH = jnp.einsum('BTKGJH,KJ->BTKGH',
                         out_BRC.reshape(B, T, K, G, K, H), eye_KJ)
  return out_BTKGH.reshape(B, T, N, H).astype(query.dtype)


def heads_major_attention(query, key_ZHS, value_ZSH, mask_BNTS, *, scale,
                          logits_soft_cap, key_scale_ZS=None,
                          value_scale_ZS=None):
  """query [B, T, N, H], key [Z, H, S], value [Z, S, H], Z = B·K -> [B, T, N, H].

  mask_BNTS: boolean broadcastable to [B, N, T, S] (True = attend), or None.
  The cache may be stored in another dtype than the query (bfloat16, or int8
  with a float32 scale per token and KV head, key_scale_ZS and
  value_scale_ZS): the matmuls take it as it is and the scales multiply the
  [R, S] logits and weights, never the cache.
  R = G·T: the query rows of one KV head.

  The softmax is written so that the [R, S] arrays are streamed as few times
  as possible (with G = 8 they are a quarter of the keys' bytes): the mask
  is added as a bias of its own small shape, so that the logits' matmul,
  the bias, the max and the exp are one fusion for XLA's CPU; the weights
  are normalised after the value matmul, on the [R, H] output, rather than
  in another pass over [R, S].
  """
  B, T, N, H = query.shape
  Z, S = value_ZSH.shape[:2]
  K = Z // B
  G = N // K
  q_ZRH = query.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(
      Z, G * T, H)
  logits_ZRS = _batched_matmul(q_ZRH, key_ZHS) * scale
  if key_scale_ZS is not None:
    logits_ZRS = logits_ZRS * key_scale_ZS[:, None, :]
  logits_BKGTS = numerics.soft_cap(logits_ZRS, logits_soft_cap).reshape(
      B, K, G, T, S)
  if mask_BNTS is not None:
    mask_BKGTS = numerics.grouped_mask(mask_BNTS, K)  # Or [B, 1, 1, T, S].
    logits_BKGTS = logits_BKGTS + jnp.where(mask_BKGTS, 0.0,
                                            numerics.MASKED_LOGIT)
  # Unnormalised softmax weights; a masked logit's is exactly 0.
  weights_BKGTS = jnp.exp(
      logits_BKGTS - logits_BKGTS.max(axis=-1, keepdims=True))
  total_BKGT1 = weights_BKGTS.sum(axis=-1, keepdims=True)
  weights_ZRS = weights_BKGTS.reshape(Z, G * T, S)
  if value_scale_ZS is not None:
    weights_ZRS = weights_ZRS * value_scale_ZS[:, None, :]
  out_ZRH = _batched_matmul(weights_ZRS.astype(query.dtype), value_ZSH)
  out_BKGTH = out_ZRH.reshape(B, K, G, T, H) / total_BKGT1
  if mask_BNTS is not None:  # A row with nothing to attend to gives zeros.
    out_BKGTH = jnp.where(mask_BKGTS.any(axis=-1, keepdims=True), out_BKGTH,
                          0.0)
  out_BTNH = out_BKGTH.transpose(0, 3, 1, 2, 4)
  return out_BTNH.reshape(B, T, N, H).astype(query.dtype)


def _batched_matmul(a_ZMC, b_ZCS):
  """[Z, M, C] x [Z, C, S] -> [Z, M, S] float32, with b in its own dtype
  (a bfloat16 or int8 cache is read as stored: on TPU the matmul takes the
  int8 operand itself; XLA's CPU converts it on the fly)."""
  return jax.lax.dot_general(a_ZMC, b_ZCS, (((2,), (1,)), ((0,), (0,))),
                             preferred_element_type=jnp.float32)
