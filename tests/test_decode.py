"""Specification of `attention.decode.heads_major_attention`, the decode
cache's attention, against the independent reference (K/V repeated)."""

from absl.testing import parameterized
import chex
import jax.numpy as jnp
import numpy as np

from attention import decode
from tests import reference

B, S, N, H = 3, 40, 8, 16


def _heads_major(x_BSKH):
  """[B, S, K, H] -> keys [Z, H, S] and values [Z, S, H], Z = B·K."""
  B_, S_, K, H_ = x_BSKH.shape
  return (x_BSKH.transpose(0, 2, 3, 1).reshape(B_ * K, H_, S_),
          x_BSKH.transpose(0, 2, 1, 3).reshape(B_ * K, S_, H_))


def _int8(x_BSKH):
  """(int8 [B, S, K, H], float32 scale [B, S, K]): one scale per token and
  KV head, as the int8 cache stores them."""
  scale_BSK = jnp.abs(x_BSKH).max(-1) / 127
  return jnp.round(x_BSKH / scale_BSK[..., None]).astype(jnp.int8), scale_BSK


class HeadsMajorAttentionTest(chex.TestCase):

  @parameterized.product(K=(8, 2, 1), T=(1, 3), soft_cap=(None, 5.0))
  def test_matches_the_reference_with_a_row_that_sees_nothing(self, K, T,
                                                              soft_cap):
    q, k, v, _ = reference.inputs(B, T, S, N, K, H)
    allowed = np.random.default_rng(0).random((B, 1, T, S)) < 0.7
    allowed[1, :, -1] = False  # Batch row 1's last query sees no key.
    key_ZHS, _ = _heads_major(k)
    _, value_ZSH = _heads_major(v)
    out = decode.heads_major_attention(
        q, key_ZHS, value_ZSH, jnp.asarray(allowed), scale=H**-0.5,
        logits_soft_cap=soft_cap)
    want = reference.attention_repeated(
        q, jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2),
        np.broadcast_to(allowed, (B, N, T, S)), logits_soft_cap=soft_cap)
    chex.assert_trees_all_close(out, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[1, -1], 0.0)

  @parameterized.parameters(2, 1)
  def test_an_int8_cache_with_its_scales_is_its_dequantised_values(self, K):
    q, k, v, _ = reference.inputs(B, 1, S, N, K, H)
    (k8, k_scale_BSK), (v8, v_scale_BSK) = _int8(k), _int8(v)
    scale_ZS = lambda s_BSK: s_BSK.transpose(0, 2, 1).reshape(B * K, S)
    key_ZHS, _ = _heads_major(k8)
    _, value_ZSH = _heads_major(v8)
    out = decode.heads_major_attention(
        q, key_ZHS, value_ZSH, None, scale=H**-0.5, logits_soft_cap=None,
        key_scale_ZS=scale_ZS(k_scale_BSK),
        value_scale_ZS=scale_ZS(v_scale_BSK))
    want = reference.reference_attention(
        q, k8 * k_scale_BSK[..., None], v8 * v_scale_BSK[..., None])
    chex.assert_trees_all_close(out, want, atol=1e-5, rtol=1e-5)
