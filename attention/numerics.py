"""The numerics every attention path and the model share: soft cap, RMSNorm,
masked softmax, and the grouped view of a mask. In float32, whatever the
inputs' dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Masked logits: finite, so a row with every key masked gives a finite
# softmax (then zeroed) instead of NaN; exp() of it minus any logit is 0.
MASKED_LOGIT = float(jnp.finfo(jnp.float32).min)


def soft_cap(logits, cap: float | None):
  """cap · tanh(logits / cap) (Gemma 2's logit soft cap), or the logits."""
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def rms_norm(x, scale, *, eps: float, offset: float, dtype=None):
  """x / rms(x) · (offset + scale) over the last axis, computed in float32
  and returned in `dtype` (None: x's). scale: [last axis] (Gemma stores
  scale - 1 with offset 1; Llama the scale, offset 0)."""
  y = x.astype(jnp.float32)
  y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
  return (y * (offset + scale.astype(jnp.float32))).astype(dtype or x.dtype)


def masked_softmax(logits, mask, axis: int = -1):
  """Softmax over `axis` of the logits where `mask` is True (None: all); a
  row with nothing to attend to gives zeros."""
  if mask is None:
    return jax.nn.softmax(logits, axis=axis)
  probs = jax.nn.softmax(jnp.where(mask, logits, MASKED_LOGIT), axis=axis)
  return jnp.where(mask, probs, 0.0)


def grouped_mask(mask_bnts, K: int):
  """[b, n, t, s] (n = N or 1) -> [b, K, G, t, s] (or [b, 1, 1, t, s]): query
  head k·G + g's row of the mask at [k, g], the order of the grouped
  queries' [.., K, G, ..] view."""
  b, n = mask_bnts.shape[:2]
  if n == 1:
    return mask_bnts[:, :, None]
  return mask_bnts.reshape(b, K, n // K, *mask_bnts.shape[2:])
