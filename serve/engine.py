"""Continuous batching over the paged cache.

A fixed number of decode slots; each step decodes one token for every busy
slot at once. When a sequence ends (max_new_tokens, or an end-of-sequence
token) its pages go back to the pool and its slot takes the next request:
the prompt is prefilled into freshly allocated pages, then the request
decodes with the others, so the batch stays full. A request is given all
the pages it can need (prompt + max_new_tokens) when admitted, so a running
sequence never waits for memory (no preemption); requests that cannot get
them wait, in order, and one that could never fit (more pages than the pool
has, or past the model's max_len) is refused with a one-line error while
the others go on.

Each request samples with its own keys (the seed, its `sample_index` and the
token's position), so its output does not depend on what shares the batch;
greedy
decoding (temperature 0) is `train.sample`'s argmax.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from serve import paged, pages as pages_lib
from train import model as model_lib
from train import sample
from train.errors import UserError


@dataclasses.dataclass
class Request:
  """A prompt to continue: its token ids and how many tokens to add."""
  id: object
  prompt: np.ndarray  # [T] int32.
  max_new_tokens: int
  arrival: float | None = None  # perf_counter time; None: the run's start.
  # Its sampling keys' index (e.g. its line in a file, the same on a rerun);
  # None: its place in the run.
  sample_index: int | None = None


@dataclasses.dataclass
class Result:
  """A finished request: its tokens (the end-of-sequence token not
  included) and timings in seconds, or the one-line error refusing it."""
  id: object
  tokens: list[int] = dataclasses.field(default_factory=list)
  time_to_first_token_s: float | None = None  # From arrival, queue included.
  per_token_s: float | None = None  # Mean between later tokens.
  error: str | None = None


@dataclasses.dataclass
class Stats:
  """What a run did: requests done and refused, tokens generated, decode
  steps, busy slots summed over steps (sequences in flight = in_flight /
  steps), the pool's high-water mark in pages, and its size."""
  done: int = 0
  refused: int = 0
  tokens: int = 0
  steps: int = 0
  in_flight: int = 0
  high_water_pages: int = 0
  usable_pages: int = 0
  page_bytes: int = 0
  seconds: float = 0.0

  @property
  def mean_in_flight(self) -> float:
    return self.in_flight / self.steps if self.steps else 0.0


@dataclasses.dataclass
class _Slot:
  request: Request
  index: int  # The request's place in the run: its sampling keys.
  pages: list[int]
  length: int  # Positions written to the cache.
  tokens: list[int]
  first_at: float
  arrival: float


def pool_pages(config: model_lib.ModelConfig, kv_memory: int,
               page_size: int) -> int:
  """The pages of page_size tokens that kv_memory bytes hold (page 0 the
  scratch page); a UserError if too few for any sequence."""
  page_bytes = paged.page_bytes(config, page_size)
  num_pages = kv_memory // page_bytes
  if num_pages < 2:  # The scratch page and one for a sequence.
    raise UserError(
        f'the KV memory ({kv_memory:,} bytes) holds {num_pages} page(s) of '
        f'{page_bytes:,} bytes ({page_size} tokens, every layer, '
        f'num_kv_heads={config.num_kv_heads}), too few for any sequence; '
        f'give --kv_memory of at least {2 * page_bytes:,} bytes (a scratch '
        'page and one to hold a sequence), or a smaller --page_size')
  return num_pages


# A slot given a request whose prompt is not yet prefilled.
_ADMITTED = object()


class Engine:
  """Decodes requests in `slots` slots over a pool of `kv_memory` bytes of
  pages of `page_size` tokens."""

  def __init__(self, config: model_lib.ModelConfig, params, *,
               kv_memory: int, page_size: int = 16, slots: int = 8,
               temperature: float = 0.0, top_k: int = 0, seed: int = 0,
               eos_ids: tuple[int, ...] = (), kv_cache_dtype=None):
    if config.kv_lora_rank:  # Its cache holds latents, not K/V pages.
      raise UserError('serve.generate does not serve multi-head latent '
                      f'attention (model.kv_lora_rank={config.kv_lora_rank})'
                      ' yet; use train.sample')
    if config.learned_positions:
      raise UserError('this model adds a learned position table, which the '
                      'paged cache does not index per sequence; decode it '
                      'with train.sample')
    if page_size < 1 or slots < 1:
      raise UserError(f'--page_size={page_size} and --slots={slots} must be '
                      '>= 1')
    self.model, self.params = paged.serving_model(config, params,
                                                  kv_cache_dtype)
    self.config = self.model.config
    self.page_size, self.slots = page_size, slots
    self.page_bytes = paged.page_bytes(self.config, page_size)
    num_pages = pool_pages(self.config, kv_memory, page_size)
    self.max_pages = pages_lib.pages_for(self.config.max_len, page_size)
    self.allocator = pages_lib.Allocator(num_pages)
    self.eos_ids = tuple(eos_ids)
    self._pool = paged.empty_pool(self.config, num_pages, page_size)
    self._sampling = dict(temperature=temperature, top_k=top_k)
    self._decode = jax.jit(
        functools.partial(_step, self.model, **self._sampling),
        donate_argnums=1, compiler_options=sample.compiler_options())
    self._key = jax.random.key(seed)

  def run(self, requests: Iterable[Request]) -> Iterator[Result]:
    """Yields each request's Result as it finishes (refusals at once);
    `self.stats` holds the run's counts when the iterator is exhausted."""
    start = self.started = time.perf_counter()
    self.stats = Stats(usable_pages=self.allocator.usable,
                       page_bytes=self.page_bytes)
    waiting = collections.deque(enumerate(requests))
    slots: list[_Slot | None] = [None] * self.slots
    while waiting or any(slots):
      admitted = []  # (slot, request, its keys' index, its pages).
      for i in range(self.slots):
        while slots[i] is None and waiting:
          index, request = waiting[0]
          refusal = self._refusal(request)
          if refusal:
            waiting.popleft()
            self.stats.refused += 1
            yield Result(request.id, error=refusal)
            continue
          pages = self.allocator.allocate(self._pages_needed(request))
          if pages is None:
            break  # It waits for a sequence to end.
          waiting.popleft()
          if request.sample_index is not None:
            index = request.sample_index
          admitted.append((i, request, index, pages))
          slots[i] = _ADMITTED
      if admitted:  # Those ending at once free their slots for the next.
        yield from self._prefill_all(slots, admitted, start)
      elif any(slots):
        yield from self._step_all(slots)
    self.stats.high_water_pages = self.allocator.high_water
    self.stats.seconds = time.perf_counter() - start

  def _pages_needed(self, request: Request) -> int:
    return pages_lib.pages_for(len(request.prompt) + request.max_new_tokens,
                               self.page_size)

  def _refusal(self, request: Request) -> str | None:
    """Why the request can never run, in one line, or None."""
    P, new, max_len = (len(request.prompt), request.max_new_tokens,
                       self.config.max_len)
    if P < 1:
      return 'empty prompt; give at least one token of text'
    if new < 1 or P + new > max_len:
      return (f'prompt ({P} tokens) + max_new_tokens ({new}) must be within '
              f'1..model.max_len ({max_len}); shorten one')
    need = self._pages_needed(request)
    if need > self.allocator.usable:
      return (f'needs {need} pages of {self.page_size} tokens '
              f'({need * self.page_bytes:,} bytes) but the KV memory holds '
              f'{self.allocator.usable}; raise --kv_memory or shorten it')
    return None

  def _prefill_all(self, slots: list[_Slot | None], admitted: list,
                   start: float) -> Iterator[Result]:
    """Writes the admitted prompts into their pages, one call per bucket of
    prompt pages (short prompts are not padded to the longest), each slot
    then holding its first token; yields those already finished."""
    by_width = collections.defaultdict(list)
    for a in admitted:
      by_width[min(_bucket(pages_lib.pages_for(len(a[1].prompt),
                                               self.page_size)),
                   self.max_pages)].append(a)
    for width, group in sorted(by_width.items()):
      yield from self._prefill_group(slots, group, width, start)

  def _prefill_group(self, slots: list[_Slot | None], admitted: list,
                     width: int, start: float) -> Iterator[Result]:
    """The admitted prompts, each within `width` pages, prefilled in one
    call: the first rows of a batch of the next bucket size (`_bucket`; at
    least 2, as `_step_all`'s), padded to `width` pages: a few compiled
    prefills, however the lengths mix."""
    B = max(2, _bucket(len(admitted)))
    tokens_BT = np.zeros((B, width * self.page_size), np.int32)
    lengths_B = np.ones(B, np.int32)  # Idle rows: a token at the scratch page.
    index_B = np.zeros(B, np.int32)
    for row, (_, request, index, _) in enumerate(admitted):
      tokens_BT[row, :len(request.prompt)] = request.prompt
      lengths_B[row], index_B[row] = len(request.prompt), index
    table = self._table([pages for *_, pages in admitted] +
                        [[]] * (B - len(admitted)), width)
    first_B, self._pool = _prefill(self.model, self.params, self._pool,
                                   tokens_BT, table, lengths_B, self._key,
                                   index_B, **self._sampling)
    first_B = np.asarray(first_B)
    now = time.perf_counter()
    for row, (i, request, index, pages) in enumerate(admitted):
      arrival = start if request.arrival is None else request.arrival
      slots[i] = _Slot(request, index, pages, len(request.prompt),
                       [int(first_B[row])], now, arrival)
      done = self._finished(slots[i])
      if done:
        slots[i] = None
        yield done

  def _table(self, page_lists, width: int) -> np.ndarray:
    """[len(page_lists), width] page tables, 0 (scratch) where none: each
    sequence's first `width` pages (those holding what a step reads and
    writes)."""
    table = np.zeros((len(page_lists), width), np.int32)
    for row, pages in enumerate(page_lists):
      table[row, :min(len(pages), width)] = pages[:width]
    return table

  def _step_all(self, slots: list[_Slot | None]) -> Iterator[Result]:
    """One decoded token for every busy slot; yields those that finish.

    The busy slots are decoded as the first rows of a batch of the next
    bucket size (`_bucket`; at least 2: a one-row write becomes an update
    XLA does on a copy of the whole pool), so that a pool holding few
    sequences does not pay for idle rows; the page tables are as wide as the
    bucket of the pages in use (the longest sequence's, its new token's
    included), so that short sequences do not gather max_len positions. One
    compiled step per (batch, width) pair that a run meets: with 128 slots
    and 16 pages per sequence at most 23 x 12.
    """
    busy = [i for i, s in enumerate(slots) if s is not None]
    B = max(2, _bucket(len(busy)))
    rows = [slots[i] for i in busy] + [None] * (B - len(busy))
    width = min(self.max_pages, _bucket(max(
        pages_lib.pages_for(slots[i].length + 1, self.page_size)
        for i in busy)))
    table = self._table([s.pages if s else [] for s in rows], width)
    lengths = np.array([s.length if s else 0 for s in rows], np.int32)
    last = np.array([s.tokens[-1] if s else 0 for s in rows], np.int32)
    index = np.array([s.index if s else 0 for s in rows], np.int32)
    step = np.array([len(s.tokens) if s else 0 for s in rows], np.int32)
    next_B, self._pool = self._decode(self.params, self._pool, last, table,
                                      lengths, self._key, index, step)
    next_B = np.asarray(next_B)
    self.stats.steps += 1
    self.stats.in_flight += len(busy)
    for row, i in enumerate(busy):
      s = slots[i]
      s.length += 1
      s.tokens.append(int(next_B[row]))
      done = self._finished(s)
      if done:
        slots[i] = None
        yield done

  def _finished(self, s: _Slot) -> Result | None:
    """The slot's Result, its pages released, if it has ended."""
    ended = s.tokens[-1] in self.eos_ids
    if not ended and len(s.tokens) < s.request.max_new_tokens:
      return None
    now = time.perf_counter()
    self.allocator.release(s.pages)
    tokens = s.tokens[:-1] if ended else s.tokens
    self.stats.tokens += len(s.tokens)
    self.stats.done += 1
    n = len(s.tokens)
    return Result(s.request.id, tokens,
                  time_to_first_token_s=s.first_at - s.arrival,
                  per_token_s=(now - s.first_at) / (n - 1) if n > 1 else None)


def _sample_rows(logits_BV, key, index_B, step_B, *, temperature, top_k):
  """A token per row, row b with the key of (its request, its position)."""
  keys_B = jax.vmap(lambda i, t: jax.random.fold_in(
      jax.random.fold_in(key, i), t))(index_B, step_B)
  return jax.vmap(lambda k, logits_V: sample.sample_logits(
      k, logits_V[None], temperature, top_k)[0])(keys_B, logits_BV)


def _step(model, params, pool, last_B, table_BM, lengths_B, key, index_B,
          step_B, *, temperature, top_k):
  """Every slot's last token written at its length; (its next token [B],
  the pool)."""
  logits_B1V, pool = paged.forward(model, params, pool, last_B[:, None],
                                   table_BM, lengths_B)
  return _sample_rows(logits_B1V[:, 0], key, index_B, step_B,
                      temperature=temperature, top_k=top_k), pool


@functools.partial(jax.jit, static_argnames=('model', 'temperature', 'top_k'),
                   donate_argnums=2)
def _prefill(model, params, pool, tokens_BT, table_BM, lengths_B, key,
             index_B, *, temperature, top_k):
  """Prompts (padded to tokens_BT, lengths_B real tokens each) written into
  their pages; (each one's first generated token [B], the pool)."""
  logits_BTV, pool = paged.forward(model, params, pool, tokens_BT, table_BM,
                                   jnp.zeros_like(lengths_B))
  logits_BV = jnp.take_along_axis(
      logits_BTV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
  first_B = _sample_rows(logits_BV, key, index_B, jnp.zeros_like(index_B),
                         temperature=temperature, top_k=top_k)
  return first_B, pool


# Sizes per octave of the batch and table-width buckets: 4 pads a batch or a
# table by less than a quarter (exact up to 8), at 4 compiled sizes per
# doubling; powers of two (1) padded up to 2x (19 busy slots ran as 32 rows,
# 9 pages were read as 16).
BUCKETS_PER_OCTAVE = 4


def _bucket(n: int, per_octave: int = BUCKETS_PER_OCTAVE) -> int:
  """The least size >= n (n >= 1) among n itself up to 2·per_octave, then
  per_octave evenly spaced sizes per doubling (per_octave a power of two;
  1: the next power of two): at most per_octave·(log2(limit) + 1) sizes up
  to a limit."""
  unit = 1 << max(0, (n - 1).bit_length() - per_octave.bit_length())
  return -(-n // unit) * unit
