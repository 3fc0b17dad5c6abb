"""Attention for a few query tokens against a long [B, S, K, H] cache (decoding).

The dense path contracts 'BTKGH,BSKH->BKGTS'; for that batched matmul XLA
first copies the whole cache into a heads-major [B, K, S, H] layout, on every
decoded token, which on a CPU costs several times the attention itself. Here
the cache is read in place, as a [B, S, K·H] matrix: the queries become a
block-diagonal [K·H, T·K·G] matrix (query head (k, g) is nonzero only in KV
head k's rows), so one plain matmul per batch row yields all logits, and a
second one all outputs, of which the diagonal K blocks are kept. That spends
K times the (tiny) arithmetic of T = 1 to stream the cache once, which is what
decoding is bound by.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
  logits_BSTKG = logits_BSR.reshape(B, S, T, K, G)
  if logits_soft_cap is not None:
    logits_BSTKG = logits_soft_cap * jnp.tanh(logits_BSTKG / logits_soft_cap)
  if mask_BKGTS is not None:
    mask_BSTKG = jnp.moveaxis(mask_BKGTS, 4, 1).transpose(0, 1, 4, 2, 3)
    logits_BSTKG = jnp.where(mask_BSTKG, logits_BSTKG,
                             jnp.finfo(jnp.float32).min)
  probs_BSTKG = jax.nn.softmax(logits_BSTKG, axis=1)
  if mask_BKGTS is not None:
    probs_BSTKG = jnp.where(mask_BSTKG, probs_BSTKG, 0.0)
  out_BRC = jnp.einsum(
      'BSR,BSC->BRC', probs_BSTKG.reshape(B, S, T * K * G).astype(value.dtype),
      value.reshape(B, S, K * H), preferred_element_type=jnp.float32)
  out_BTKGH = jnp.einsum('BTKGJH,KJ->BTKGH',
                         out_BRC.reshape(B, T, K, G, K, H), eye_KJ)
  return out_BTKGH.reshape(B, T, N, H).astype(query.dtype)
