"""Choosing the next token: one function, per-request settings, one key scheme.

Every front end that generates text (`train.sample`, `serve.generate`, the
lm_eval model's `generate_until`) samples through `sample`, so the same
request gives the same text from each of them, whatever shares its batch:

- Settings are per row (`Rows`: temperature, top_k, top_p, seed as [B]
  arrays), so requests with different settings decode together.
- The key of a sampled token is `fold_in(fold_in(key(0), seed), position)`,
  position the token's absolute place in its sequence (prompt length + how
  many tokens came before it). It depends on nothing else: not the batch,
  not the row, not the step at which the engine happened to run it.
- Temperature 0 is greedy (argmax, no key used). Otherwise the logits are
  divided by the temperature, cut to the top_k likeliest (0: all) and to the
  smallest set whose probability reaches top_p (1: all), then sampled.

`SamplingParams` is the host-side record of one request's settings, checked
once (`check`); `cut` ends a generation at its first end-of-sequence token
or stop string, the one rule for every front end.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from infra.errors import UserError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """One request's sampling settings.

  temperature: 0 = greedy. top_k: 0 = every token. top_p: 1 = every token
  (nucleus sampling below 1). seed: the request's key (with each token's
  position). stop: strings that end the text (not included in it).
  """
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop: tuple[str, ...] = ()

  def check(self, vocab_size: int, prefix: str = '--') -> 'SamplingParams':
    """Itself, or a UserError naming the first setting out of range (as the
    flag `prefix`+name, so a command's message names its flag)."""
    p = prefix
    if not (isinstance(self.temperature, (int, float)) and
            math.isfinite(self.temperature) and self.temperature >= 0):
      raise UserError(f'{p}temperature={self.temperature} must be a number '
                      '>= 0 (0 = greedy)')
    if not (_is_int(self.top_k) and 0 <= self.top_k <= vocab_size):
      raise UserError(f'{p}top_k={self.top_k} must be an integer in '
                      f'0..{vocab_size} (the vocabulary; 0 = all)')
    if not (isinstance(self.top_p, (int, float)) and
            math.isfinite(self.top_p) and 0 < self.top_p <= 1):
      raise UserError(f'{p}top_p={self.top_p} must be in (0, 1] (1 = all)')
    if not (_is_int(self.seed) and 0 <= self.seed < 1 << 32):
      raise UserError(f'{p}seed={self.seed} must be an integer in '
                      '0..2**32 - 1')
    if not all(isinstance(s, str) and s for s in self.stop):
      raise UserError(f'{p}stop={list(self.stop)!r} must be non-empty '
                      'strings')
    return self

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


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


def token_keys(seed_B, position_B):
  """[B] keys: row b's is fold_in(fold_in(key(0), seed), position)."""
  root = jax.random.key(0)
  return jax.vmap(lambda s, t: jax.random.fold_in(
      jax.random.fold_in(root, s), t))(jnp.asarray(seed_B, jnp.uint32),
                                        jnp.asarray(position_B, jnp.uint32))


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


def sample(logits_BV, settings: Rows, position_B, needs: Needs | None = None):
  """[B] tokens from [B, V] logits: row b by its settings and the key of
  (its seed, position_B[b], the absolute position of the token sampled).

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
    keys_B = token_keys(settings.seed, position_B)
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


@dataclasses.dataclass(frozen=True)
class Finished:
  """A generation as returned: its text, its tokens (up to the first
  end-of-sequence token, not included), and why it ended: 'eos', 'stop' (a
  stop string, cut from the text) or 'length'."""
  text: str
  tokens: list[int]
  reason: str


def length_refusal(prompt_len: int, max_new_tokens: int, max_len: int
                   ) -> str:
  """Why a prompt of prompt_len tokens cannot be continued by
  max_new_tokens in a model of max_len positions (one line), or ''."""
  if prompt_len < 1:
    return 'empty prompt; give at least one token of text'
  if max_new_tokens < 1 or prompt_len + max_new_tokens > max_len:
    return (f'prompt ({prompt_len} tokens) + max_new_tokens '
            f'({max_new_tokens}) must be within 1..model.max_len '
            f'({max_len}); shorten one')
  return ''


def stop_at(text: str, stop: Sequence[str]) -> int | None:
  """Where the earliest stop string begins in text, or None."""
  found = [i for i in (text.find(s) for s in stop) if i >= 0]
  return min(found) if found else None


def cut(tokens, *, eos_ids: Sequence[int], decode, stop: Sequence[str] = ()
        ) -> Finished:
  """The generation `tokens` ends with: up to its first end-of-sequence
  token, its text (decode(tokens)) up to its first stop string."""
  tokens = [int(t) for t in tokens]
  reason = 'length'
  ends = [i for i, t in enumerate(tokens) if t in set(eos_ids)]
  if ends:
    tokens, reason = tokens[:ends[0]], 'eos'
  text = decode(tokens)
  at = stop_at(text, stop)
  if at is not None:
    text, reason = text[:at], 'stop'
  return Finished(text, tokens, reason)
