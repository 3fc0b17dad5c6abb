"""Specification of `attention.dot_product_attention`."""

import functools

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import dot_product_attention
from tests import hlo, reference

B, T, S, N, H = 2, 5, 7, 8, 16
KV_HEADS = (('mha', 8), ('gqa', 2), ('mqa', 1))
OPTIONS = (
    ('plain', {}),
    ('causal', dict(is_causal=True)),
    ('padding', dict(padding=True)),
    ('causal_padding', dict(is_causal=True, padding=True)),
    ('causal_window', dict(is_causal=True, local_window=3)),
    ('window', dict(local_window=2)),
    ('soft_cap', dict(logits_soft_cap=2.0)),
    ('everything', dict(is_causal=True, padding=True, local_window=4,
                        logits_soft_cap=5.0, scale=0.3)),
)
CASES = [(f'{v}_{o}', k, opts) for v, k in KV_HEADS for o, opts in OPTIONS]


def _inputs(K, dtype=jnp.float32, t=T, s=S, seed=0):
  return reference.inputs(B, t, s, N, K, H, dtype, seed)


def _padding(s=S):
  # Batch 0 sees all keys, batch 1 only the first three.
  return jnp.arange(s)[None, :] < jnp.array([[s], [3]])


class DotProductAttentionTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(*CASES)
  def test_matches_repeated_kv_reference_forward_and_gradients(self, K, opts):
    self._check_against_reference(K, opts, 'xla')

  @chex.variants(with_jit=True)
  @parameterized.named_parameters(*CASES)
  def test_decode_path_matches_reference_forward_and_gradients(self, K, opts):
    self._check_against_reference(K, opts, 'short_query')

  def _check_against_reference(self, K, opts, implementation):
    opts = dict(opts)
    mask = _padding() if opts.pop('padding', False) else None
    q, k, v, ct = _inputs(K)
    attend = self.variant(lambda q, k, v, m: dot_product_attention(
        q, k, v, mask=m, implementation=implementation, **opts))

    out = attend(q, k, v, mask)
    chex.assert_shape(out, (B, T, N, H))
    chex.assert_trees_all_close(
        out, reference.reference_attention(q, k, v, mask=mask, **opts),
        atol=1e-5, rtol=1e-5)

    # Gradients: the reference differentiates through explicitly repeated
    # K/V; dK and dV are its gradients summed over each group of G heads.
    allowed = reference.allowed_positions(B, N, T, S, mask=mask, **{
        o: opts[o] for o in ('is_causal', 'local_window') if o in opts})
    ref_opts = {o: opts[o] for o in ('scale', 'logits_soft_cap') if o in opts}
    k_rep, v_rep = jnp.repeat(k, N // K, 2), jnp.repeat(v, N // K, 2)
    ref_dq, ref_dk_rep, ref_dv_rep = jax.grad(
        lambda q, k, v: jnp.vdot(ct, reference.attention_repeated(
            q, k, v, allowed, **ref_opts)), argnums=(0, 1, 2))(q, k_rep, v_rep)
    group_sum = lambda g: g.reshape(B, S, K, N // K, H).sum(3)
    dq, dk, dv = jax.grad(lambda q, k, v: jnp.vdot(ct, attend(q, k, v, mask)),
                          argnums=(0, 1, 2))(q, k, v)
    chex.assert_shape([dk, dv], (B, S, K, H))
    chex.assert_trees_all_close(
        (dq, dk, dv), (ref_dq, group_sum(ref_dk_rep), group_sum(ref_dv_rep)),
        atol=1e-4, rtol=1e-4)

  @parameterized.named_parameters(
      ('mha_causal', 8, dict(is_causal=True)),
      ('gqa_causal', 2, dict(is_causal=True)),
      ('mqa_plain', 1, {}),
      ('gqa_window', 4, dict(is_causal=True, local_window=3)),
      ('gqa_mask', 2, dict(mask=True)),
  )
  @pytest.mark.slow
  def test_matches_jax_nn_dot_product_attention(self, K, opts):
    q, k, v, _ = _inputs(K, t=S)  # jax.nn's causal mask is top-left aligned.
    ours, theirs = dict(opts), dict(opts)
    if opts.get('mask'):
      m = jax.random.bernoulli(jax.random.key(3), 0.7, (B, N, S, S))
      ours['mask'] = theirs['mask'] = m
    if 'local_window' in opts:
      theirs['local_window_size'] = (theirs.pop('local_window') - 1, 0)
    chex.assert_trees_all_close(
        dot_product_attention(q, k, v, **ours),
        jax.nn.dot_product_attention(q, k, v, implementation='xla', **theirs),
        atol=1e-5, rtol=1e-5)

  @parameterized.parameters(8, 2, 1)
  def test_query_head_n_uses_kv_head_n_div_group(self, K):
    # Zero every KV head but one; exactly its G query heads may see nonzero V.
    q, k, v, _ = _inputs(K)
    live = K - 1
    v = v * (jnp.arange(K) == live)[None, None, :, None]
    out = dot_product_attention(q, k, v)
    heads_with_output = np.flatnonzero(np.abs(out).sum((0, 1, 3)) > 0)
    G = N // K
    np.testing.assert_array_equal(heads_with_output,
                                  np.arange(live * G, (live + 1) * G))

  @parameterized.parameters(8, 2, 1)
  @pytest.mark.slow
  def test_causal_output_ignores_the_future(self, K):
    # d out[:, i] / d x[:, j] == 0 for every key position j after query i.
    q, k, v, _ = _inputs(K, t=S)
    for i in range(S):
      grads = jax.grad(lambda q, k, v: dot_product_attention(
          q, k, v, is_causal=True)[:, i].sum(), argnums=(0, 1, 2))(q, k, v)
      for g in grads:
        np.testing.assert_array_equal(g[:, i + 1:], 0.0)
      dv = grads[2]  # Every visible value position does matter.
      self.assertTrue(np.all(np.abs(dv[:, :i + 1]).sum(-1) > 0))

  @pytest.mark.slow
  def test_causal_mask_is_bottom_right_aligned_when_t_below_s(self):
    # The last T queries against all S keys equal the last T rows of the
    # full causal pass: what decoding and chunked prefill rely on.
    q, k, v, _ = _inputs(2, t=S)
    full = dot_product_attention(q, k, v, is_causal=True)
    for t in (1, 3):
      chex.assert_trees_all_close(
          dot_product_attention(q[:, -t:], k, v, is_causal=True),
          full[:, -t:], atol=1e-6)

  @parameterized.parameters(jnp.float32, jnp.bfloat16, jnp.float16)
  @pytest.mark.slow
  def test_fully_masked_rows_are_zero_not_nan(self, dtype):
    q, k, v, _ = _inputs(2, dtype)
    mask = jnp.ones((B, S), bool).at[1].set(False)  # Batch 1 sees nothing.
    out, vjp = jax.vjp(
        lambda q, k, v: dot_product_attention(q, k, v, mask=mask), q, k, v)
    self.assertEqual(out.dtype, dtype)
    np.testing.assert_array_equal(out[1], 0.0)
    self.assertTrue(np.all(np.isfinite(out.astype(jnp.float32))))
    for g in vjp(jnp.ones_like(out)):
      self.assertTrue(np.all(np.isfinite(g.astype(jnp.float32))))
    # A causal window past every key leaves a query with nothing to attend to.
    out = dot_product_attention(q, k, v, mask=jnp.zeros((B, S), bool),
                                is_causal=True)
    np.testing.assert_array_equal(out, 0.0)

  @parameterized.parameters(8, 2, 1)
  @pytest.mark.slow
  def test_bfloat16_within_tolerance_of_float32(self, K):
    q, k, v, _ = _inputs(K)
    f32 = dot_product_attention(q, k, v, is_causal=True)
    bf16 = dot_product_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)),
                                 is_causal=True)
    self.assertEqual(bf16.dtype, jnp.bfloat16)
    # bf16 keeps 8 mantissa bits: inputs and probabilities each round at
    # ~0.4%; outputs are O(1), so 3e-2 absolute covers them with margin.
    chex.assert_trees_all_close(bf16.astype(jnp.float32), f32, atol=3e-2)

  @parameterized.named_parameters(
      ('n_not_multiple_of_k', (B, T, 8, H), (B, S, 3, H), (B, S, 3, H), None,
       r'N=8 .* K=3'),
      ('head_dims_differ', (B, T, 8, H), (B, S, 2, 8), (B, S, 2, 8), None,
       r'head dim'),
      ('key_value_differ', (B, T, 8, H), (B, S, 2, H), (B, S + 1, 2, H), None,
       r'same shape'),
      ('rank', (B, T, 8 * H), (B, S, 2, H), (B, S, 2, H), None, r'ranks'),
      ('mask_not_broadcastable', (B, T, 8, H), (B, S, 2, H), (B, S, 2, H),
       (B, 1, T, S + 1), r'does not broadcast'),
      ('padding_mask_wrong_length', (B, T, 8, H), (B, S, 2, H), (B, S, 2, H),
       (B, S + 1), r'key-padding'),
  )
  def test_bad_shapes_raise_value_error_naming_them(self, qs, ks, vs, ms, msg):
    mask = None if ms is None else jnp.ones(ms, bool)
    with self.assertRaisesRegex(ValueError, msg):
      dot_product_attention(jnp.zeros(qs), jnp.zeros(ks), jnp.zeros(vs),
                            mask=mask)

  def test_bad_options_raise_value_error(self):
    q, k, v, _ = _inputs(2)
    with self.assertRaisesRegex(ValueError, 'local_window'):
      dot_product_attention(q, k, v, local_window=0)
    with self.assertRaisesRegex(ValueError, 'logits_soft_cap'):
      dot_product_attention(q, k, v, logits_soft_cap=-1.0)
    with self.assertRaisesRegex(ValueError, 'boolean'):
      dot_product_attention(q, k, v, mask=jnp.ones((B, S)))


def _hlo_element_counts(fn, *args):
  return hlo.element_counts(jax.jit(fn).lower(*args).compile().as_text())


@pytest.mark.slow
@pytest.mark.parametrize('implementation', ['xla', 'short_query'])
@pytest.mark.parametrize('K', [2, 1])
@pytest.mark.parametrize('is_causal', [False, True])
def test_compiled_function_never_copies_kv_per_query_head(K, is_causal,
                                                          implementation):
  """No tensor in the optimised HLO, forward or backward, has N·S·H elements."""
  b, t, s, n, h = 2, 3, 50, 8, 16  # t != s, so N·S·H is unique to K/V copies.
  q, k, v, _ = _inputs(K, t=t, s=s)
  q = jnp.zeros((b, t, n, h))
  repeated = b * s * n * h

  def loss(fn):
    return lambda q, k, v: jax.grad(
        lambda q, k, v: fn(q, k, v, is_causal=is_causal).sum(),
        argnums=(0, 1, 2))(q, k, v)

  ours = _hlo_element_counts(
      loss(functools.partial(dot_product_attention,
                             implementation=implementation)), q, k, v)
  assert repeated not in ours
  # The check can fail: the repeat-K/V reference does materialise the copies.
  ref = _hlo_element_counts(loss(reference.reference_attention), q, k, v)
  assert repeated in ref
