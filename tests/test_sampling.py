"""Specification of choosing the next token (`lm.sampling`)."""

import hashlib
import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm import sampling
from lm import sampling_params
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


def test_a_token_depends_only_on_its_seed_and_index():
  """The same (settings, seed, index in the generation) gives the same token
  in any row of any batch, beside any neighbours: what makes the front ends
  agree."""
  rng = np.random.default_rng(0)
  logits_BV = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
  mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7)
  others = [SamplingParams(), SamplingParams(temperature=2.0, seed=3),
            SamplingParams(temperature=1.0, top_p=0.3, seed=7),
            SamplingParams(temperature=0.5, top_k=1, seed=1),
            SamplingParams(temperature=1.0, seed=99)]
  indices = jnp.array([11, 3, 4, 5, 6, 7])
  alone = sampling.sample(logits_BV[:1], sampling.rows([mine]), indices[:1])
  for row in range(6):  # `mine` moved to each row, with its logits.
    order = others[:row] + [mine] + others[row:]
    perm = [1, 2, 3, 4, 5]
    perm.insert(row, 0)
    batch = sampling.sample(logits_BV[jnp.array(perm)], sampling.rows(order),
                            indices[jnp.array(perm)])
    chex.assert_trees_all_equal(batch[row], alone[0])


def test_seed_and_index_each_change_the_draws():
  base = _draws(SamplingParams(temperature=1.0, seed=1))
  assert (base != _draws(SamplingParams(temperature=1.0, seed=2))).mean() > 0.3
  # The same seed at indices shifted by one: other keys.
  logits_BV = jnp.broadcast_to(jnp.log(jnp.asarray(PROBS)), (400, 4))
  shifted = np.asarray(sampling.sample(
      logits_BV, sampling.rows([SamplingParams(temperature=1.0, seed=1)] *
                               400), jnp.arange(400) + 1))
  assert (base[1:] == shifted[:-1]).all() and (base != shifted).mean() > 0.3


def test_the_key_of_a_token_is_its_requests_seed_then_its_index():
  """vLLM's per-request generator: key(seed) alone, the token's index in
  its generation folded in (not its position in the sequence, which the
  prompt's length would shift)."""
  key = sampling.token_keys(jnp.array([5], jnp.uint32), jnp.array([9]))[0]
  expected = jax.random.fold_in(jax.random.key(5), 9)
  chex.assert_trees_all_equal(jax.random.key_data(key),
                              jax.random.key_data(expected))


def test_requests_of_different_seeds_draw_uncorrelated_streams():
  """Two requests' draws at the same indices, from the same distribution:
  as often equal as independent draws are (sum of p^2 = 0.3), not more."""
  n = 4000
  a = _draws(SamplingParams(temperature=1.0, seed=1), n=n)
  b = _draws(SamplingParams(temperature=1.0, seed=2), n=n)
  same = (a == b).mean()
  expected = (PROBS ** 2).sum()
  assert abs(same - expected) < 4 * np.sqrt(expected * (1 - expected) / n)


def test_a_request_seed_is_derived_from_the_seed_and_the_id_stably():
  """SHA-256 of [seed, id] as compact JSON, its first 4 bytes: the same in
  any process (Python's hash() of a str is salted per process), another for
  another id or seed, any JSON id."""
  digest = hashlib.sha256(b'[3,"a"]').digest()
  assert sampling.request_seed(3, 'a') == int.from_bytes(digest[:4], 'big')
  seeds = {sampling.request_seed(s, i) for s in (0, 1)
           for i in ('a', 'b', 7, None, [1, 2], {'k': 1})}
  assert len(seeds) == 12 and all(0 <= s < 2**32 for s in seeds)
  code = 'from lm import sampling; print(sampling.request_seed(3, "a"))'
  for salt in ('1', '2'):
    out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                         text=True, check=True,
                         env={**os.environ, 'PYTHONHASHSEED': salt})
    assert int(out.stdout) == sampling.request_seed(3, 'a')


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
  with pytest.raises(UserError, match='^' + re.escape(message)):
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


def test_stop_strings_found_as_tokens_come_where_the_whole_text_finds_them():
  """The engine checked its stop strings by decoding the whole text after
  every token (quadratic in the length). `StopStrings` decodes the newest
  tokens only and stops where the whole text first holds a stop string,
  multi-byte characters split across tokens included."""
  rng = np.random.default_rng(0)
  text = ''.join(rng.choice(list('ab é€😀\n'), 400))
  tokens = list(text.encode())
  for stop in (('😀a',), ('\n\n', 'é€'), ('€ b',), ('never',)):
    decoded = []
    def decode(ids):
      decoded.append(len(ids))
      return _decode(ids)
    checker = sampling_params.StopStrings(decode, stop)
    found = next((n for n, t in enumerate(tokens) if checker.add(t)), None)
    whole = next((n for n in range(len(tokens)) if sampling.stop_at(
        _decode(tokens[:n + 1]), stop) is not None), None)
    assert found == whole, stop
    # A few tokens decoded per token (a 4-byte character's held back while
    # it is incomplete; the whole text once, to confirm): linear, where
    # decoding the whole text after every token was n(n + 1)/2 (280k here).
    assert sum(decoded) <= 10 * len(tokens), stop
