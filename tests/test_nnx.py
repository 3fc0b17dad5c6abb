"""Specification of `attention.nnx.Attention`: the linen layer's twin for Flax NNX."""

import dataclasses
import types

from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import pytest

from attention import Attention
from attention import layer
from attention import nnx as attention_nnx

B, L, D, N, H = 2, 12, 32, 8, 8
OPTIONS = (
    ('mha', dict(num_kv_heads=8)),
    ('gqa', dict(num_kv_heads=2)),
    ('mqa', dict(num_kv_heads=1)),
    ('gqa_fused', dict(num_kv_heads=2, fused_qkv=True)),
    ('gqa_window_soft_cap', dict(num_kv_heads=2, local_window=4,
                                 logits_soft_cap=3.0)),
    ('mqa_bidirectional_no_rope', dict(num_kv_heads=1, is_causal=False,
                                       use_rope=False)),
)


def _x(seed=0):
  return jax.random.normal(jax.random.key(seed), (B, L, D))


def _pair(opts):
  linen = Attention(N, head_dim=H, **opts)
  params = linen.init(jax.random.key(1), _x())['params']
  return linen, params, attention_nnx.Attention.from_linen(linen, params)


class NnxAttentionTest(chex.TestCase):

  @parameterized.named_parameters(*OPTIONS)
  def test_same_parameter_names_and_shapes_as_linen(self, opts):
    linen, params, _ = _pair(opts)
    fresh = attention_nnx.Attention(N, head_dim=H, in_features=D,
                                    rngs=nnx.Rngs(0), **opts)
    chex.assert_trees_all_equal_shapes_and_dtypes(fresh.linen_params(),
                                                  params)

  @parameterized.named_parameters(*OPTIONS)
  @pytest.mark.slow
  def test_same_outputs_and_gradients_from_the_same_parameters(self, opts):
    linen, params, layer = _pair(opts)
    chex.assert_trees_all_equal(layer(_x()),
                                linen.apply({'params': params}, _x()))
    target = jax.random.normal(jax.random.key(2), (B, L, D))
    linen_grads = jax.grad(lambda p: jnp.vdot(
        target, linen.apply({'params': p}, _x())))(params)
    nnx_grads = nnx.grad(lambda m: jnp.vdot(target, m(_x())))(layer)
    chex.assert_trees_all_close(nnx.to_pure_dict(nnx_grads), linen_grads,
                                atol=1e-6)

  @parameterized.named_parameters(*OPTIONS[:5])
  @pytest.mark.slow
  def test_decoding_with_a_cache_of_k_heads_equals_the_full_pass(self, opts):
    """The NNX layer fed a prefill and then single tokens through its cache
    gives, at every position, its own full causal pass's outputs."""
    layer = attention_nnx.Attention(N, head_dim=H, in_features=D,
                                    rngs=nnx.Rngs(4), **opts)
    x = _x()
    full = layer(x)  # No cache yet: the full pass.
    layer.init_cache(B, L)
    Z, S = B * opts['num_kv_heads'], opts.get('local_window', L)  # A ring.
    chex.assert_shape(layer.cached_key[...], (Z, H, S))
    chex.assert_shape(layer.cached_value[...], (Z, S, H))
    outs, start = [], 0
    for n in (5, 1, 1, 2, 1):  # A prefill, then steps.
      outs.append(layer(x[:, start:start + n]))
      start += n
    chex.assert_trees_all_close(jnp.concatenate(outs, axis=1),
                                full[:, :start], atol=1e-5)
    self.assertEqual(int(layer.cache_index[...]), start)

  def test_parameters_move_both_ways_with_one_call(self):
    layer = attention_nnx.Attention(N, 2, H, in_features=D, rngs=nnx.Rngs(3))
    linen = Attention(N, 2, H)
    moved = layer.linen_params()  # NNX -> linen.
    chex.assert_trees_all_equal(linen.apply({'params': moved}, _x()),
                                layer(_x()))
    back = attention_nnx.Attention.from_linen(linen, moved)  # linen -> NNX.
    chex.assert_trees_all_equal(back.linen_params(), moved)

  def test_num_heads_not_multiple_of_num_kv_heads_is_a_clear_error(self):
    with self.assertRaisesRegex(ValueError, 'num_heads=8 must be a multiple '
                                'of num_kv_heads=3'):
      attention_nnx.Attention(8, 3, H, in_features=D, rngs=nnx.Rngs(0))

  def test_the_options_are_declared_once_and_an_unknown_one_is_an_error(self):
    # The linen shell's fields are layer.Options' own, with its defaults.
    linen = {f.name: f.default for f in dataclasses.fields(Attention)}
    for f in dataclasses.fields(layer.Options):
      self.assertIn(f.name, linen)
      self.assertEqual(linen[f.name], f.default, f.name)
    with self.assertRaisesRegex(TypeError, 'local_windw'):
      attention_nnx.Attention(N, 2, H, in_features=D, rngs=nnx.Rngs(0),
                              local_windw=4)
    renamed = dataclasses.asdict(layer.Options(8, 2, 4))
    renamed['qk_normalise'] = renamed.pop('qk_norm')  # A shell renamed it.
    with self.assertRaisesRegex(TypeError, 'has no field qk_norm of'):
      layer.Options.of(types.SimpleNamespace(**renamed))
