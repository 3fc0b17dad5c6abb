"""An independent, obviously-correct attention: K/V repeated per query head.

This is the seeds' method (`repeat_interleave`), written with explicit loops
for the masks, so that it shares no code with `attention.core`.
"""

import jax
import jax.numpy as jnp
import numpy as np


def allowed_positions(B, N, T, S, *, mask=None, is_causal=False,
                      local_window=None):
  """[B, N, T, S] numpy booleans, built position by position."""
  allowed = np.ones((B, N, T, S), bool)
  for i in range(T):
    q = S - T + i  # Bottom-right alignment: the last query sees the last key.
    for j in range(S):
      if is_causal and j > q:
        allowed[:, :, i, j] = False
      if local_window is not None and abs(q - j) >= local_window:
        allowed[:, :, i, j] = False
  if mask is not None:
    mask = np.asarray(mask)
    if mask.ndim == 2:
      mask = mask[:, None, None, :]
    allowed &= np.broadcast_to(mask, allowed.shape)
  return allowed


def attention_repeated(query, key_BSNH, value_BSNH, allowed_BNTS, *,
                       scale=None, logits_soft_cap=None):
  """Plain MHA on K/V that already have one head per query head."""
  H = query.shape[-1]
  scale = H**-0.5 if scale is None else scale
  logits = jnp.einsum('btnh,bsnh->bnts', query.astype(jnp.float32),
                      key_BSNH.astype(jnp.float32)) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  logits = jnp.where(allowed_BNTS, logits, -1e30)
  probs = jax.nn.softmax(logits, axis=-1) * allowed_BNTS.any(-1, keepdims=True)
  out = jnp.einsum('bnts,bsnh->btnh', probs, value_BSNH.astype(jnp.float32))
  return out.astype(query.dtype)


def reference_attention(query, key, value, *, mask=None, is_causal=False,
                        scale=None, local_window=None, logits_soft_cap=None):
  B, T, N, _ = query.shape
  S, K = key.shape[1:3]
  allowed = allowed_positions(B, N, T, S, mask=mask, is_causal=is_causal,
                              local_window=local_window)
  return attention_repeated(
      query, jnp.repeat(key, N // K, axis=2), jnp.repeat(value, N // K, axis=2),
      allowed, scale=scale, logits_soft_cap=logits_soft_cap)


def inputs(B, T, S, N, K, H, dtype=jnp.float32, seed=0):
  """Normal (query [B, T, N, H], key and value [B, S, K, H], a float32
  cotangent [B, T, N, H] for the gradients)."""
  kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(kq, (B, T, N, H), dtype),
          jax.random.normal(kk, (B, S, K, H), dtype),
          jax.random.normal(kv, (B, S, K, H), dtype),
          jax.random.normal(kg, (B, T, N, H), jnp.float32))
