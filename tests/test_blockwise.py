"""Specification of the blockwise (flash-style) path of dot_product_attention."""


from absl.testing import parameterized
import chex
import jax
import pytest
import jax.numpy as jnp

from attention import blockwise, dot_product_attention
from tests import hlo, reference

B, N, H = 2, 8, 16


def _inputs(K, T, S, dtype=jnp.float32):
  return reference.inputs(B, T, S, N, K, H, dtype)


class BlockwiseTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ('mha_causal', 8, 64, 64, True, 1),
      ('mha_causal_two_kv_heads_a_step', 8, 64, 64, True, 2),
      ('gqa_causal', 2, 64, 64, True, 2),
      ('gqa_causal_two_groups_a_step', 4, 64, 64, True, 4),
      ('mqa_causal', 1, 64, 64, True, 2),
      ('gqa_causal_t_below_s', 2, 32, 80, True, 2),
      ('mha_full', 8, 64, 48, False, 2),
      ('mqa_full', 1, 32, 64, False, 2),
  )
  @pytest.mark.slow
  def test_matches_reference_forward_and_gradients(self, K, T, S, is_causal,
                                                   heads):
    q, k, v, ct = _inputs(K, T, S)
    # Block 16: several blocks, so the causal prefixes really are skipped.
    # Heads per step: fewer than G (GQA/MQA groups walked in chunks, dK/dV
    # summed over them), or several whole groups (each its own KV head).
    ours = self.variant(lambda q, k, v: blockwise.blockwise_attention(
        q, k, v, is_causal=is_causal, scale=H**-0.5,
        heads_and_block=(heads, 16)))
    ref = lambda q, k, v: reference.reference_attention(
        q, k, v, is_causal=is_causal)
    chex.assert_trees_all_close(ours(q, k, v), ref(q, k, v), atol=2e-5)
    grads = [jax.grad(lambda q, k, v: jnp.vdot(ct, f(q, k, v)),
                      argnums=(0, 1, 2))(q, k, v) for f in (ours, ref)]
    chex.assert_trees_all_close(grads[0], grads[1], atol=2e-4, rtol=2e-4)

  @pytest.mark.slow
  def test_bfloat16_within_tolerance_of_float32(self):
    q, k, v, _ = _inputs(2, 64, 64)
    run = lambda *a: blockwise.blockwise_attention(
        *a, is_causal=True, scale=H**-0.5, heads_and_block=(4, 16))
    bf16 = run(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    self.assertEqual(bf16.dtype, jnp.bfloat16)
    chex.assert_trees_all_close(bf16.astype(jnp.float32), run(q, k, v),
                                atol=3e-2)

  @parameterized.parameters(8, 2, 1)
  @pytest.mark.cpu_only
  @pytest.mark.slow
  def test_long_causal_sequences_use_it_by_default_on_cpu(self, K):
    T = 256
    q, k, v, _ = _inputs(K, T, T)
    auto = jax.jit(lambda q, k, v: dot_product_attention(q, k, v,
                                                         is_causal=True))
    hlo = auto.lower(q, k, v).as_text()
    self.assertIn('while', hlo)  # lax.map over the groups: the blockwise path.
    dense = dot_product_attention(q, k, v, is_causal=True,
                                  implementation='xla')
    chex.assert_trees_all_close(auto(q, k, v), dense, atol=2e-5)

  @pytest.mark.cpu_only  # implementation=None picks blockwise on the CPU.
  def test_never_materialises_the_full_logits_or_kv_copies(self):
    T, S = 256, 512  # T != S: N·S·H elements can only be a K/V copy.
    q, k, v, _ = _inputs(2, T, S)
    grad = jax.jit(jax.grad(
        lambda q, k, v: dot_product_attention(q, k, v, is_causal=True).sum(),
        argnums=(0, 1, 2)))
    sizes = hlo.element_counts(grad.lower(q, k, v).compile().as_text(),
                               dtypes=('f32',))
    # The dense path holds B·N·T·S logits; blockwise holds one group's
    # G x block x S at a time, and never N·S·H copies of K or V.
    self.assertLess(max(sizes), B * N * T * S // 8)
    self.assertFalse(B * S * N * H in sizes, 'a K/V copy per query head')

  def test_unsupported_options_are_refused(self):
    q, k, v, _ = _inputs(2, 64, 64)
    with self.assertRaisesRegex(ValueError, 'blockwise'):
      dot_product_attention(q, k, v, logits_soft_cap=1.0,
                            implementation='blockwise')
    with self.assertRaisesRegex(ValueError, 'T=64 <= S=32'):
      dot_product_attention(q, k[:, :32], v[:, :32], is_causal=True,
                            implementation='blockwise')
    with self.assertRaisesRegex(ValueError, 'implementation='):
      dot_product_attention(q, k, v, implementation='pallas')

  def test_every_length_and_group_has_a_tiling(self):
    # MHA past T = 4096 has no 2- or 4-head step: one head per step (T = 8192
    # with G = 1 raised StopIteration from every dot_product_attention call,
    # since the CPU's choice is made for every platform).
    for T in (64, 4096, 8192, 32768):
      for N, K in ((16, 16), (16, 4), (16, 1), (12, 12), (6, 6)):
        heads, block = blockwise.tiling(T, N // K, N)
        G = N // K
        self.assertTrue(G % heads == 0 if heads <= G else
                        heads % G == 0 and N % heads == 0, (T, N, K, heads))
        self.assertEqual(T % block, 0, (T, N, K, block))
    self.assertEqual(blockwise.tiling(8192, 1, 16)[0], 1)

  @pytest.mark.slow
  def test_a_length_without_power_of_two_blocks_is_one_block(self):
    q, k, v, _ = _inputs(2, 36, 36)  # 36 = 4·9: no block of 16 or more.
    self.assertEqual(blockwise.tiling(36, N // 2, N), (4, 36))
    ours = dot_product_attention(q, k, v, is_causal=True,
                                 implementation='blockwise')
    chex.assert_trees_all_close(
        ours, reference.reference_attention(q, k, v, is_causal=True),
        atol=2e-5)

  @pytest.mark.slowest
  @pytest.mark.slow
  @pytest.mark.cpu_only
  def test_grouped_heads_need_less_peak_memory_than_mha(self):
    # A long training shape (compiled only, not run).
    B, T, N, H = 8, 1024, 8, 64
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)

    def peak_bytes(K, heads_and_block=None):
      kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)
      grad = jax.jit(jax.grad(lambda q, k, v: blockwise.blockwise_attention(
          q, k, v, is_causal=True, scale=H**-0.5,
          heads_and_block=heads_and_block).sum(), argnums=(0, 1, 2)))
      memory = grad.lower(q, kv, kv).compile().memory_analysis()
      return memory.temp_size_in_bytes + memory.output_size_in_bytes

    mha = peak_bytes(8)
    for K in (4, 1):
      self.assertLess(peak_bytes(K), mha, f'K={K}')
    # All 8 heads of the MQA group in one step: its blocks' temporaries,
    # live together, outgrow MHA's taken one head a step (why tiling caps
    # heads·T).
    self.assertGreater(peak_bytes(1, (8, 64)), peak_bytes(8, (1, 128)))
