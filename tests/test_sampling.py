"""Specification of choosing the next token (`lm.sampling`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import sampling
from infra.errors import UserError
from lm.sampling import SamplingParams

PROBS = np.array([0.1, 0.2, 0.3, 0.4])


def _draws(params: SamplingParams, n=400, logits_V=np.log(PROBS)):
  """n tokens drawn by `params` from one distribution, at positions 0..n-1."""
  logits_BV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32),
                               (n, len(logits_V)))
  return np.asarray(sampling.sample(logits_BV, sampling.rows([params] * n),
                                    jnp.arange(n)))


def test_greedy_is_the_argmax_whatever_the_seed():
  for seed in (0, 1, 2**32 - 1):
    assert set(_draws(SamplingParams(seed=seed))) == {3}


def test_temperature_one_follows_the_softmax():
  counts = np.bincount(_draws(SamplingParams(temperature=1.0), n=4000),
                       minlength=4)
  # 4000 draws: each frequency within 4 standard errors of its probability.
  se = np.sqrt(PROBS * (1 - PROBS) / 4000)
  np.testing.assert_array_less(np.abs(counts / 4000 - PROBS), 4 * se)


def test_top_k_samples_only_among_the_k_likeliest():
  assert set(_draws(SamplingParams(temperature=1.0, top_k=2))) == {2, 3}


@pytest.mark.parametrize('top_p, kept', [
    (0.4, {3}), (0.5, {2, 3}), (0.7, {2, 3}), (0.71, {1, 2, 3}),
    (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
  # The likeliest tokens until their probability reaches top_p, the one
  # crossing it included: 0.4 | 0.4 + 0.3 = 0.7 | 0.9 | 1.
  assert set(_draws(SamplingParams(temperature=1.0, top_p=top_p),
                    n=2000)) == kept


def test_top_k_and_top_p_together_take_the_smaller_set():
  assert set(_draws(SamplingParams(temperature=1.0, top_k=3, top_p=0.5),
                    n=1000)) == {2, 3}


def test_a_token_depends_only_on_its_seed_and_position():
  """The same (settings, seed, position) gives the same token in any row of
  any batch, beside any neighbours: what makes the front ends agree."""
  rng = np.random.default_rng(0)
  logits_BV = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
  mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7)
  others = [SamplingParams(), SamplingParams(temperature=2.0, seed=3),
            SamplingParams(temperature=1.0, top_p=0.3, seed=7),
            SamplingParams(temperature=0.5, top_k=1, seed=1),
            SamplingParams(temperature=1.0, seed=99)]
  positions = jnp.array([11, 3, 4, 5, 6, 7])
  alone = sampling.sample(logits_BV[:1], sampling.rows([mine]),
                          positions[:1])
  for row in range(6):  # `mine` moved to each row, with its logits.
    order = others[:row] + [mine] + others[row:]
    perm = [1, 2, 3, 4, 5]
    perm.insert(row, 0)
    batch = sampling.sample(logits_BV[jnp.array(perm)], sampling.rows(order),
                            positions[jnp.array(perm)])
    chex.assert_trees_all_equal(batch[row], alone[0])


def test_seed_and_position_each_change_the_draws():
  base = _draws(SamplingParams(temperature=1.0, seed=1))
  assert (base != _draws(SamplingParams(temperature=1.0, seed=2))).mean() > 0.3
  # The same seed at positions shifted by one: other keys.
  logits_BV = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS)), (400, 4))
  shifted = np.asarray(sampling.sample(
      logits_BV, sampling.rows([SamplingParams(temperature=1.0, seed=1)] *
                               400), jnp.arange(400) + 1))
  assert (base[1:] == shifted[:-1]).all() and (base != shifted).mean() > 0.3


def test_the_key_of_a_token_is_seed_then_position():
  key = sampling.token_keys(jnp.array([5], jnp.uint32), jnp.array([9]))[0]
  expected = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 5), 9)
  chex.assert_trees_all_equal(jax.random.key_data(key),
                              jax.random.key_data(expected))


@pytest.mark.parametrize('params, message', [
    (SamplingParams(temperature=-1.0), '--temperature=-1.0 must be'),
    (SamplingParams(temperature=float('nan')), '--temperature=nan must be'),
    (SamplingParams(top_k=-1), '--top_k=-1 must be an integer in 0..4'),
    (SamplingParams(top_k=5), '--top_k=5 must be'),
    (SamplingParams(top_p=0.0), '--top_p=0.0 must be in (0, 1]'),
    (SamplingParams(top_p=1.5), '--top_p=1.5 must be'),
    (SamplingParams(seed=-1), '--seed=-1 must be'),
    (SamplingParams(seed=2**32), '--seed=4294967296 must be'),
    (SamplingParams(stop=('',)), "--stop=[''] must be non-empty strings"),
])
def test_settings_out_of_range_are_refused_in_one_line(params, message):
  with pytest.raises(UserError, match='^' + __import__('re').escape(message)):
    params.check(vocab_size=4)


def test_settings_in_range_pass():
  params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=2**32 - 1,
                          stop=('\n\n',))
  assert params.check(vocab_size=4) is params


def _decode(tokens):
  return bytes(tokens).decode('utf-8', 'replace')


def test_cut_ends_at_the_first_end_of_sequence_token():
  done = sampling.cut(list(b'ab') + [0] + list(b'cd'), eos_ids=(0,),
                      decode=_decode)
  assert (done.text, done.tokens, done.reason) == ('ab', list(b'ab'), 'eos')


def test_cut_ends_the_text_before_the_first_stop_string():
  done = sampling.cut(list(b'x = 1\n\ny = 2\nz'), eos_ids=(0,),
                      decode=_decode, stop=('\nz', '\n\n'))
  assert (done.text, done.reason) == ('x = 1', 'stop')


def test_cut_keeps_everything_without_eos_or_stop():
  done = sampling.cut(list(b'abc'), eos_ids=(0,), decode=_decode, stop=('q',))
  assert (done.text, done.tokens, done.reason) == ('abc', list(b'abc'),
                                                   'length')


@pytest.mark.parametrize('batch', [
    [SamplingParams(), SamplingParams(seed=3)],
    [SamplingParams(), SamplingParams(temperature=1.0, seed=3)],
    [SamplingParams(temperature=0.7, top_k=5, seed=1),
     SamplingParams(temperature=1.0, top_p=0.8), SamplingParams()]])
def test_a_program_specialised_to_what_the_rows_need_draws_the_same(batch):
  """`needs` leaves unused ways out of the program, not out of the result."""
  logits_BV = jnp.asarray(np.random.default_rng(0).normal(size=(
      len(batch), 30)), jnp.float32)
  settings, positions = sampling.rows(batch), jnp.arange(len(batch)) + 4
  needs = sampling.needs(batch)
  assert needs.draw == any(p.temperature > 0 for p in batch)
  chex.assert_trees_all_equal(
      jax.jit(sampling.sample, static_argnames='needs')(
          logits_BV, settings, positions, needs=needs),
      sampling.sample(logits_BV, settings, positions))
