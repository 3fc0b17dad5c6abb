"""Specification of the `attention.Attention` Flax module."""


from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import Attention, dot_product_attention
from tests import hlo

B, L, D, N, H = 2, 12, 32, 8, 8
VARIANTS = (('mha', 8), ('gqa', 2), ('mqa', 1))


def _x(t=L, seed=0):
  return jax.random.normal(jax.random.key(seed), (B, t, D))


def _decode_in_chunks(module, params, x, chunks):
  """Prefill/step through x in the given chunk lengths; returns the outputs."""
  cache = module.clone(decode=True).init(jax.random.key(0), x)['cache']
  outs, start = [], 0
  for n in chunks:
    out, mutated = module.clone(decode=True).apply(
        {'params': params, 'cache': cache}, x[:, start:start + n],
        mutable=['cache'])
    cache, start = mutated['cache'], start + n
    outs.append(out)
  return jnp.concatenate(outs, axis=1), cache


class AttentionTest(chex.TestCase):

  @parameterized.named_parameters(*VARIANTS)
  def test_parameter_shapes_show_the_grouping(self, K):
    params = Attention(N, K, H).init(jax.random.key(0), _x())['params']
    chex.assert_shape(params['query'], (D, N, H))
    chex.assert_shape([params['key'], params['value']], (D, K, H))
    chex.assert_shape(params['out'], (N, H, D))
    n_params = sum(p.size for p in jax.tree.leaves(params))
    self.assertEqual(n_params, Attention(N, K, H).num_params(D))
    self.assertEqual(n_params, 2 * D * N * H + 2 * D * K * H)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*VARIANTS)
  @pytest.mark.slow
  def test_fused_qkv_matches_separate_projections(self, K):
    separate = Attention(N, K, H)
    params = separate.init(jax.random.key(0), _x())['params']
    fused_params = {
        'qkv': jnp.concatenate(
            [params['query'], params['key'], params['value']], axis=1),
        'out': params['out'],
    }
    fused = Attention(N, K, H, fused_qkv=True)
    chex.assert_shape(fused.init(jax.random.key(0), _x())['params']['qkv'],
                      (D, N + 2 * K, H))
    apply = self.variant(lambda m, p, x: m.apply({'params': p}, x),
                         static_argnums=0)
    chex.assert_trees_all_close(apply(fused, fused_params, _x()),
                                apply(separate, params, _x()), atol=1e-6)

  def test_is_causal_by_default_and_can_be_turned_off(self):
    x = _x()
    x_changed_future = x.at[:, -1].add(1.0)
    for causal in (True, False):
      m = Attention(N, 2, H, is_causal=causal)
      p = m.init(jax.random.key(0), x)
      delta = jnp.abs(m.apply(p, x) - m.apply(p, x_changed_future))[:, :-1]
      self.assertEqual(bool(delta.max() > 1e-4), not causal)

  @parameterized.named_parameters(
      *[(f'{v}_{rope}', k, rope) for v, k in VARIANTS
        for rope in ('rope', 'no_rope')])
  @pytest.mark.slow
  def test_decode_equals_full_causal_pass(self, K, rope):
    m = Attention(N, K, H, use_rope=rope == 'rope')
    x = _x()
    params = m.init(jax.random.key(0), x)['params']
    full = m.apply({'params': params}, x)
    # A prompt of 5 prefilled at once, then one token at a time.
    stepped, cache = _decode_in_chunks(m, params, x, [5] + [1] * (L - 5))
    chex.assert_trees_all_close(stepped, full, atol=1e-5)
    # The cache holds K heads, not N: it is N/K times smaller than MHA's.
    chex.assert_shape(cache['cached_key'], (B * K, H, L))
    chex.assert_shape(cache['cached_value'], (B * K, L, H))
    self.assertEqual(int(cache['cache_index']), L)

  def test_decode_under_jit_with_window_soft_cap_and_padding(self):
    m = Attention(N, 2, H, local_window=4, logits_soft_cap=3.0)
    x = _x()
    pad = jnp.ones((B, L), bool).at[1, :2].set(False)  # Batch 1: left padding.
    params = m.init(jax.random.key(0), x)['params']
    full = m.apply({'params': params}, x, pad)
    dm = m.clone(decode=True)
    cache = dm.init(jax.random.key(0), x)['cache']
    step = jax.jit(lambda c, x: dm.apply({'params': params, 'cache': c}, x,
                                         pad, mutable=['cache']))
    outs = []
    for t in range(L):
      out, mutated = step(cache, x[:, t:t + 1])
      cache = mutated['cache']
      outs.append(out)
    chex.assert_trees_all_close(jnp.concatenate(outs, 1), full, atol=1e-5)

  @pytest.mark.slow
  def test_writing_past_max_len_fails(self):
    m = Attention(N, 2, H)
    x = _x(t=4)
    params = m.init(jax.random.key(0), x)['params']
    _, cache = _decode_in_chunks(m, params, x, [3])
    apply = lambda c, x: m.clone(decode=True).apply(
        {'params': params, 'cache': c}, x, mutable=['cache'])
    with self.assertRaisesRegex(ValueError, 'KV cache overflow.*max_len=4'):
      apply(cache, x[:, :2])
    # Under jit the index is traced: the overflowing step returns NaN.
    out, _ = jax.jit(apply)(cache, x[:, :2])
    self.assertTrue(np.all(np.isnan(out)))
    out, _ = jax.jit(apply)(cache, x[:, :1])  # Exactly full is fine.
    self.assertTrue(np.all(np.isfinite(out)))

  def test_rope_makes_scores_depend_on_relative_position_only(self):
    from attention import apply_rope
    q = jax.random.normal(jax.random.key(1), (1, 1, 1, H))
    k = jax.random.normal(jax.random.key(2), (1, 1, 1, H))
    score = lambda i, j: jnp.vdot(apply_rope(q, jnp.array([i])),
                                  apply_rope(k, jnp.array([j])))
    np.testing.assert_allclose(score(3, 1), score(10, 8), rtol=1e-5)
    self.assertGreater(abs(float(score(3, 1) - score(3, 2))), 1e-4)

  @parameterized.named_parameters(*VARIANTS)
  @pytest.mark.cpu_only
  @pytest.mark.slow
  def test_decode_step_writes_the_cache_in_place(self, K):
    """The jitted step copies no cache-sized buffer: decoding reads it once."""
    m = Attention(N, K, H, decode=True)
    x = _x(t=64)
    variables = m.init(jax.random.key(0), x)
    step = jax.jit(lambda c, x: m.apply({'params': variables['params'],
                                         'cache': c}, x, mutable=['cache']),
                   donate_argnums=0)
    cache_size = B * 64 * K * H
    self.assertEqual(
        _copies_of_size(step, cache_size, variables['cache'], x[:, :1]), 0)

    # The check can fail: XLA copies a cache kept 4-D, [B, S, K, H], when
    # one token is written into it and the decode kernel reads it.
    def four_d(cache_BSKH, new_BTKH, q_BTNH, i):
      cache_BSKH = jax.lax.dynamic_update_slice(cache_BSKH, new_BTKH,
                                                (0, i, 0, 0))
      return cache_BSKH, dot_product_attention(
          q_BTNH, cache_BSKH, cache_BSKH, implementation='short_query')
    self.assertGreater(_copies_of_size(
        jax.jit(four_d, donate_argnums=0), cache_size,
        jnp.zeros((B, 64, K, H)), jnp.ones((B, 1, K, H)),
        jnp.ones((B, 1, N, H)), 3), 0)

  @parameterized.named_parameters(*VARIANTS)
  @pytest.mark.slow
  def test_kv_cache_bytes(self, K):
    m = Attention(N, K, H, dtype=jnp.bfloat16)
    self.assertEqual(m.kv_cache_bytes(batch=4, length=100),
                     2 * 4 * 100 * K * H * 2)
    cache = m.clone(decode=True).init(
        jax.random.key(0), jnp.zeros((4, 100, D)))['cache']
    actual = cache['cached_key'].nbytes + cache['cached_value'].nbytes
    self.assertEqual(m.kv_cache_bytes(batch=4, length=100), actual)

  def test_num_heads_not_multiple_of_num_kv_heads_is_a_clear_error(self):
    with self.assertRaisesRegex(ValueError, 'num_heads=8 must be a multiple '
                                'of num_kv_heads=3'):
      Attention(8, 3, H).init(jax.random.key(0), _x())

  @pytest.mark.slow
  def test_bfloat16_compute_keeps_float32_params(self):
    m = Attention(N, 2, H, dtype=jnp.bfloat16)
    variables = m.init(jax.random.key(0), _x())
    self.assertTrue(all(p.dtype == jnp.float32
                        for p in jax.tree.leaves(variables)))
    out = m.apply(variables, _x())
    self.assertEqual(out.dtype, jnp.bfloat16)
    f32 = m.clone(dtype=jnp.float32).apply(variables, _x())
    chex.assert_trees_all_close(out.astype(jnp.float32), f32, atol=5e-2)


def _copies_of_size(jitted, size, *args):
  """Copy instructions in the compiled HLO whose result has `size` elements."""
  return hlo.copies_of_size(jitted.lower(*args).compile().as_text(), size)
