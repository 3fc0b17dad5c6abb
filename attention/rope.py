"""Rotary position embeddings (Su et al. 2021), the half-split form used by Gemma."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float = 10_000.0
               ) -> jax.Array:
  """Rotates feature pairs (i, i + H/2) of each head by position-dependent angles.

  Args:
    x: [B, T, N, H] queries or keys (any number of heads), H even.
    positions: [B, T] or [T] integer positions of the tokens.
    base: wavelength base; pair i turns at base**(-2i / H) radians per position.

  Returns:
    [B, T, N, H] in x's dtype, computed in float32. The dot product of a rotated
    query and key depends only on their relative position.
  """
  H = x.shape[-1]
  if H % 2:
    raise ValueError(f'RoPE needs an even head dim, got H={H}')
  freq_h = base ** (-jnp.arange(0, H, 2, dtype=jnp.float32) / H)  # [H/2]
  angle_BTh = jnp.asarray(positions, jnp.float32)[..., None] * freq_h
  angle_BT1h = angle_BTh[..., None, :]  # Broadcast over heads.
  sin, cos = jnp.sin(angle_BT1h), jnp.cos(angle_BT1h)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
