"""Choosing the next token: one function, per-request settings, one key scheme.

Every front end that generates text (`train.sample`, `serve.generate`, the
lm_eval model's `generate_until`) samples through `sample`, so the same
request gives the same text from each of them, whatever shares its batch:

- Settings are per row (`Rows`: temperature, top_k, top_p, seed as [B]
  arrays), so requests with different settings decode together.
- A request's randomness is its own, as vLLM's `SamplingParams.seed`: the
  key of its i-th generated token (i = 0 for the first) is
  `fold_in(key(seed), i)`. It depends on nothing else: not the prompt's
  length, not the batch, not the row, not the step at which the engine
  happened to run it. Two requests with different seeds draw independent
  streams; the same (prompt, settings, seed) gives the same text. A front
  end whose request names no seed derives one from its own seed and the
  request's id (`request_seed`), so that requests of one prompt under
  different ids sample independently.
- Temperature 0 is greedy (argmax, no key used). Otherwise the logits are
  divided by the temperature, cut to the top_k likeliest (0: all) and to the
  smallest set whose probability reaches top_p (1: all), then sampled.

The host-side pieces (`SamplingParams`, one request's settings checked once;
`request_seed`; `length_refusal`; `cut` and `stop_at`, which end a
generation at its first end-of-sequence token or stop string, the one rule
for every front end) live in `lm.sampling_params`, which imports no JAX
(the serving scheduler needs them), and are re-exported here.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The host-side pieces, one definition each (`lm.sampling_params`).
from lm.sampling_params import (Finished, SamplingParams, cut,  # pylint: disable=unused-import
                                   length_refusal, request_seed, stop_at)


class Rows(NamedTuple):
  """Per-row settings of a batch, each [B] (see SamplingParams)."""
  temperature: jax.Array  # float32.
  top_k: jax.Array  # int32; 0 = all.
  top_p: jax.Array  # float32; 1 = all.
  seed: jax.Array  # uint32.


def rows(params: Sequence[SamplingParams]) -> Rows:
  """The [B] arrays of B requests' settings (host numpy; jit takes them)."""
  return Rows(np.array([p.temperature for p in params], np.float32),
              np.array([p.top_k for p in params], np.int32),
              np.array([p.top_p for p in params], np.float32),
              np.array([p.seed for p in params], np.uint32))


def token_keys(seed_B, index_B):
  """[B] keys: row b's is fold_in(key(seed_b), index_b), index_b the place
  of the token in its request's generation (0 for the first)."""
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
      jnp.asarray(seed_B, jnp.uint32), jnp.asarray(index_B, jnp.uint32))


class Needs(NamedTuple):
  """What a batch's rows use, known on the host: some row draws
  (temperature > 0), some row truncates (top_k or top_p). Passed as a static
  argument, it leaves what no row uses out of the compiled program."""
  draw: bool
  truncate: bool


def needs(params: Sequence[SamplingParams]) -> Needs:
  return Needs(any(p.temperature > 0 for p in params),
               any(p.temperature > 0 and (p.top_k or p.top_p < 1)
                   for p in params))


def sample(logits_BV, settings: Rows, index_B, needs: Needs | None = None):
  """[B] tokens from [B, V] logits: row b by its settings and the key of
  (its seed, index_B[b]: the place of the token sampled in its request's
  generation, 0 for the first).

  needs: what the rows use (`needs`, static): a program without the rest;
  None: decided on the device, every row's way compiled in."""
  logits_BV = logits_BV.astype(jnp.float32)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  if needs is not None and not needs.draw:
    return greedy_B
  temperature_B1 = settings.temperature.astype(jnp.float32)[:, None]
  scaled_BV = logits_BV / jnp.where(temperature_B1 > 0, temperature_B1, 1.0)
  if needs is None:
    scaled_BV = jax.lax.cond(
        jnp.any((settings.top_k > 0) | (settings.top_p < 1)),
        _truncate, lambda x, *_: x, scaled_BV, settings.top_k, settings.top_p)
  elif needs.truncate:
    scaled_BV = _truncate(scaled_BV, settings.top_k, settings.top_p)

  def draw(scaled_BV):
    keys_B = token_keys(settings.seed, index_B)
    drawn_B = jax.vmap(jax.random.categorical)(keys_B, scaled_BV)
    return jnp.where(settings.temperature > 0, drawn_B, greedy_B).astype(
        jnp.int32)
  if needs is not None:
    return draw(scaled_BV)
  # A batch of greedy rows draws no random numbers.
  return jax.lax.cond(jnp.any(settings.temperature > 0), draw,
                      lambda _: greedy_B, scaled_BV)


def _truncate(scaled_BV, top_k_B, top_p_B):
  """Logits outside each row's top_k and top-p nucleus set to -inf (ties
  at the threshold kept, so the result does not depend on sort order)."""
  V = scaled_BV.shape[-1]
  sorted_BV = -jnp.sort(-scaled_BV, axis=-1)  # Descending.
  k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
  kth_B1 = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)
  # The nucleus: the likeliest tokens until their probability reaches top_p
  # (among the top_k), the token crossing it included.
  in_k_BV = jnp.arange(V) < k_B[:, None]
  probs_BV = jax.nn.softmax(jnp.where(in_k_BV, sorted_BV, -jnp.inf), axis=-1)
  before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  keep_BV = in_k_BV & (before_BV < top_p_B[:, None])
  last_B = jnp.sum(keep_BV, axis=-1) - 1  # At least the likeliest.
  threshold_B1 = jnp.maximum(
      kth_B1, jnp.take_along_axis(sorted_BV, last_B[:, None], axis=-1))
  return jnp.where(scaled_BV < threshold_B1, -jnp.inf, scaled_BV)
