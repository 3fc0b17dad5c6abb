"""Rotary position embeddings (Su et al. 2021), the half-split form of Gemma and Llama."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

RopeKind = Literal['linear', 'llama3', 'yarn']


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Longer contexts from the same frequencies, as Hugging Face's `rope_type`s.

  kind 'linear': every frequency divided by `factor` (positions interpolated).
  kind 'llama3' (Llama 3.1+): wavelengths above original_max_len /
  low_freq_factor divided by `factor`, those below original_max_len /
  high_freq_factor kept, the ones between interpolated smoothly.
  kind 'yarn' (Peng et al. 2023; DeepSeek-V2/V3): frequencies turning fewer
  than beta_slow times over original_max_len divided by `factor`, more than
  beta_fast kept, a linear ramp between; the rotated features times
  `attention_factor` (from mscale and mscale_all_dim, 0: absent), and MLA's
  softmax scale times `softmax_mscale` squared.
  """
  kind: RopeKind
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0

  KINDS = get_args(RopeKind)

  def __post_init__(self):
    if self.kind not in self.KINDS:
      raise ValueError(f'rope scaling {self.kind!r}; supported: {self.KINDS}')

  @property
  def attention_factor(self) -> float:
    """YaRN's multiplier of the rotated features (1 for other kinds), as
    transformers infers it."""
    if self.kind != 'yarn':
      return 1.0
    if self.mscale and self.mscale_all_dim:
      return (_yarn_mscale(self.factor, self.mscale)
              / _yarn_mscale(self.factor, self.mscale_all_dim))
    return _yarn_mscale(self.factor)

  @property
  def softmax_mscale(self) -> float:
    """DeepSeek's factor on MLA's softmax scale, squared there: YaRN's
    mscale of mscale_all_dim, or 1."""
    if self.kind != 'yarn' or not self.mscale_all_dim:
      return 1.0
    return _yarn_mscale(self.factor, self.mscale_all_dim)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(head_dim: int, base: float, s: RopeScaling) -> np.ndarray:
  """YaRN's [H/2] frequencies, as transformers computes them (float32)."""
  H = head_dim
  pos_freqs = np.float32(base) ** (np.arange(0, H, 2).astype(np.float32)
                                   / np.float32(H))
  extrapolation = np.float32(1.0) / pos_freqs
  interpolation = np.float32(1.0) / (np.float32(s.factor) * pos_freqs)
  dim_of = lambda rotations: (H * math.log(
      s.original_max_len / (rotations * 2 * math.pi))) / (2 * math.log(base))
  low = max(math.floor(dim_of(s.beta_fast)), 0)
  high = min(math.ceil(dim_of(s.beta_slow)), H - 1)
  if low == high:
    high += 0.001  # As transformers: no division by zero.
  ramp = np.clip((np.arange(H // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  keep = np.float32(1) - ramp
  return (interpolation * (np.float32(1) - keep) + extrapolation * keep
          ).astype(np.float32)


def inverse_frequencies(head_dim: int, base: float,
                        scaling: RopeScaling | None = None) -> np.ndarray:
  """[H/2] float32 radians per position of each feature pair.

  Computed on the host in float32 as the reference implementations (Hugging
  Face, Meta's Llama) do, 1 / base**(2i/H), the same on every backend. Equal
  to torch's bit for bit, except in the few frequencies where torch's
  vectorised float32 pow is 1 ulp from the correctly rounded power used here.
  """
  H = head_dim
  exponent = np.arange(0, H, 2, dtype=np.int64).astype(np.float32) / np.float32(H)
  inv_freq = np.float32(1.0) / (np.float32(base) ** exponent)
  if scaling is None:
    return inv_freq
  # As torch computes it: a scalar over a tensor is the scalar times the
  # tensor's float32 reciprocal; a tensor over a scalar, a float32 division.
  one = np.float32(1)
  div = lambda x, y: x / np.float32(y)
  if scaling.kind == 'linear':
    return div(inv_freq, scaling.factor)
  if scaling.kind == 'yarn':
    return _yarn(H, base, scaling)
  factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
  old = scaling.original_max_len
  wavelen = np.float32(2 * math.pi) * (one / inv_freq)
  scaled = np.where(wavelen > old / low, div(inv_freq, factor), inv_freq)
  smooth = div(np.float32(old) * (one / wavelen) - np.float32(low), high - low)
  smoothed = div((one - smooth) * scaled, factor) + smooth * scaled
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def pair_frequencies(options, rope_pairs) -> np.ndarray | None:
  """[Y/2] radians per position of a RoPE key's Y/2 pairs that a converted
  model kept from its source's head_dim-wide RoPE (MLA's and GTA's
  rope_pairs: pair j turns at frequency rope_pairs[j] of options' RoPE), or
  None (a Y-wide RoPE's own frequencies)."""
  if rope_pairs is None:
    return None
  return inverse_frequencies(options.head_dim, options.rope_base,
                             options.rope_scaling)[list(rope_pairs)]


def pairs_problem(pairs, Y: int, head_dim: int, what: str, flag: str
                  ) -> str | None:
  """What is wrong with `pairs`, a Y-wide RoPE key's pairs kept from a
  head_dim-wide RoPE (see `pair_frequencies`: Y / 2 indices below
  head_dim / 2), named `what` (e.g. 'mla.rope_pairs'), or None."""
  if pairs is not None and (len(pairs) != Y // 2 or not all(
      isinstance(p, int) and 0 <= p < head_dim // 2 for p in pairs)):
    return (f'{what}={list(pairs)} must list qk_rope_head_dim / 2 = '
            f'{Y // 2} frequency indices from 0 to head_dim / 2 - 1 = '
            f'{head_dim // 2 - 1}; leave it to train.convert {flag}')
  return None


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float = 10_000.0,
               scaling: RopeScaling | None = None,
               frequencies: np.ndarray | None = None) -> jax.Array:
  """Rotates feature pairs (i, i + H/2) of each head by position-dependent angles.

  Args:
    x: [B, T, N, H] queries or keys (any number of heads), H even.
    positions: [B, T] or [T] integer positions of the tokens.
    base: wavelength base; pair i turns at 1 / base**(2i / H) radians per
      position.
    scaling: optional frequency scaling for long contexts (`RopeScaling`).
    frequencies: [H/2] radians per position of each pair, in place of
      base's and scaling's (a subset of a wider RoPE's, `attention.latent`).

  Returns:
    [B, T, N, H] in x's dtype, computed in float32. The dot product of a rotated
    query and key depends only on their relative position.
  """
  H = x.shape[-1]
  if H % 2:
    raise ValueError(f'RoPE needs an even head dim, got H={H}')
  freq_h = jnp.asarray(inverse_frequencies(H, base, scaling)
                       if frequencies is None else frequencies)  # [H/2]
  angle_BTh = jnp.asarray(positions, jnp.float32)[..., None] * freq_h
  angle_BT1h = angle_BTh[..., None, :]  # Broadcast over heads.
  sin, cos = jnp.sin(angle_BT1h), jnp.cos(angle_BT1h)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  if scaling is not None and scaling.attention_factor != 1.0:
    rotated = rotated * scaling.attention_factor  # YaRN's.
  return rotated.astype(x.dtype)
