"""A request's sampling settings and how its text ends, on the host: no JAX.

The pieces of sampling that the scheduler, the prompt reader and the result
writer need, importable without the device side (`lm.sampling`, which
draws the tokens, re-exports them):

- `SamplingParams`: one request's settings (temperature, top_k, top_p,
  seed, stop strings), checked once (`check`).
- `request_seed`: the seed of a request that names none, derived from a
  front end's seed and the request's id.
- `length_refusal`: why a prompt cannot be continued in a model's max_len.
- `cut` / `stop_at`: a generation ended at its first end-of-sequence token
  or stop string, the one rule for every front end; `StopStrings` finds the
  first stop string as tokens come, decoding only the newest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Callable, Sequence

import numpy as np

from infra.errors import UserError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """One request's sampling settings.

  temperature: 0 = greedy. top_k: 0 = every token. top_p: 1 = every token
  (nucleus sampling below 1). seed: the request's random stream (its i-th
  token drawn with fold_in(key(seed), i)). stop: strings that end the text
  (not included in it).
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
    if not (is_int(self.top_k) and 0 <= self.top_k <= vocab_size):
      raise UserError(f'{p}top_k={self.top_k} must be an integer in '
                      f'0..{vocab_size} (the vocabulary; 0 = all)')
    if not (isinstance(self.top_p, (int, float)) and
            math.isfinite(self.top_p) and 0 < self.top_p <= 1):
      raise UserError(f'{p}top_p={self.top_p} must be in (0, 1] (1 = all)')
    if not (is_int(self.seed) and 0 <= self.seed < 1 << 32):
      raise UserError(f'{p}seed={self.seed} must be an integer in '
                      '0..2**32 - 1')
    if not all(isinstance(s, str) and s for s in self.stop):
      raise UserError(f'{p}stop={list(self.stop)!r} must be non-empty '
                      'strings')
    return self

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def is_int(x) -> bool:
  """An integer, numpy's included, and not a bool."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def request_seed(seed: int, request_id) -> int:
  """The seed of a request that names none: a uint32 derived from a front
  end's `seed` and the request's id (any JSON value), the first 4 bytes of
  the SHA-256 of `[seed, id]` as compact JSON. Stable across processes and
  machines (unlike Python's hash()), and different for different ids."""
  text = json.dumps([int(seed), request_id], separators=(',', ':'),
                    sort_keys=True)
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], 'big')


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
  eos = set(eos_ids)
  ends = [i for i, t in enumerate(tokens) if t in eos]
  if ends:
    tokens, reason = tokens[:ends[0]], 'eos'
  text = decode(tokens)
  at = stop_at(text, stop)
  if at is not None:
    text, reason = text[:at], 'stop'
  return Finished(text, tokens, reason)


class StopStrings:
  """Whether a generation's text holds a stop string yet, checked as each
  token comes at the cost of the newest tokens, not of the whole text.

  Tokens are decoded incrementally as vLLM and Hugging Face's streamers
  decode them: the text so far grows by decode(tokens[prefix:]) minus
  decode(tokens[prefix:read]), the window starting at the tokens before the
  last ones read (a tokenizer may write a token differently after another),
  and waits while that ends in an incomplete character (U+FFFD). Only the
  new text and the longest stop string's length before it are searched.
  What it finds is confirmed against the whole text once (`stop_at`), so
  it stops exactly where checking the whole text after every token would,
  or later where a token's text is held back, never earlier; `cut` then
  makes the same text either way.
  """

  def __init__(self, decode: Callable[[list[int]], str],
               stop: Sequence[str]):
    self.decode, self.stop = decode, tuple(stop)
    self.longest = max(map(len, self.stop), default=0)
    self.tokens: list[int] = []
    self.text = ''
    self._prefix = self._read = 0

  def add(self, token: int) -> bool:
    """Appends one generated token; whether a stop string is in the text."""
    self.tokens.append(int(token))
    if not self.stop:
      return False
    before = self.decode(self.tokens[self._prefix:self._read])
    now = self.decode(self.tokens[self._prefix:])
    if len(now) <= len(before) or now.endswith('\ufffd'):
      return False  # A character not yet complete: wait for its bytes.
    start = max(0, len(self.text) - self.longest + 1)
    self.text += now[len(before):]
    self._prefix, self._read = self._read, len(self.tokens)
    return (stop_at(self.text[start:], self.stop) is not None and
            stop_at(self.decode(self.tokens), self.stop) is not None)
