"""The serving engine: a plan per step, run over a paged KV cache.

Split as vLLM and JetStream split a server:

  serve.scheduler.Scheduler   which sequences prefill (in chunks) and which
                              decode this step; preempts the newest when the
                              pool runs out (pure Python, tested alone)
  serve.kv_pages.KVPageManager  the pages each sequence owns, grown on
                              demand; a double free refused
  ModelRunner (here)          the jitted functions: a plan's rows as padded
                              [B, T] batches with page tables, through the
                              model (`serve.paged.forward`), one token
                              sampled per finished row (`lm.sampling`)
  Engine (here)               the online API: add_request(), step() -> the
                              outputs finished in that step, has_unfinished()

Every step decodes one token for each running sequence whose prompt is in
the cache and, beside them, feeds the next chunk of the prompts being
prefilled, so running sequences keep producing while new ones arrive. A
sequence's settings are its own (temperature, top_k, top_p, seed, stop
strings) and its token at position t is sampled with the key of (its seed,
t), so what shares its batch, or a preemption, changes nothing:
`train.sample` gives the same text.

Letters: B rows, T tokens per row, M pages per row's table, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from serve import kv_pages, paged, pages as pages_lib
from serve.scheduler import RequestRefused, Row, Scheduler, Sequence
from lm import model as model_lib
from lm import sampling
from lm import inference
from infra.errors import UserError
from lm.sampling import SamplingParams

__all__ = ['Engine', 'ModelRunner', 'Output', 'PoolSizeError', 'PoolTooLarge',
           'PoolTooSmall', 'Request',
           'RequestRefused', 'Stats', 'pool_pages']


@dataclasses.dataclass
class Request:
  """A prompt to continue: its token ids, how many tokens to add at most,
  and how to choose them."""
  id: object  # Any JSON value; unique among the requests in flight.
  prompt: np.ndarray | list[int]  # [T] token ids.
  max_new_tokens: int
  sampling: SamplingParams = SamplingParams()
  arrival: float | None = None  # perf_counter time; None: when added.


@dataclasses.dataclass
class Output:
  """A finished request: its tokens (an end-of-sequence token not
  included), why it ended ('length', 'eos' or 'stop'), and its timings in
  seconds; or the one-line reason it was refused (`error`)."""
  id: object
  tokens: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  time_to_first_token_s: float | None = None  # From arrival, queue included.
  per_token_s: float | None = None  # Mean between later tokens.
  error: str | None = None


@dataclasses.dataclass
class Stats:
  """What the engine did since it was made (or `run` began): requests done
  and refused, tokens generated, steps, running sequences summed over steps
  (mean in flight = in_flight / steps), preemptions, prefill tokens (those
  recomputed after a preemption included), the pool's high-water mark in
  pages, its size, and the seconds from the first request to the last step."""
  done: int = 0
  refused: int = 0
  tokens: int = 0
  steps: int = 0
  in_flight: int = 0
  preemptions: int = 0
  prefill_tokens: int = 0
  high_water_pages: int = 0
  usable_pages: int = 0
  page_bytes: int = 0
  seconds: float = 0.0

  @property
  def mean_in_flight(self) -> float:
    return self.in_flight / self.steps if self.steps else 0.0


class PoolSizeError(UserError):
  """A KV memory budget the engine cannot use."""


class PoolTooSmall(PoolSizeError):
  """A KV memory budget that holds no sequence at all."""


class PoolTooLarge(PoolSizeError):
  """A KV memory budget past what the device holds."""


def device_memory() -> int | None:
  """Bytes the default device holds: its allocator's limit where it says
  (GPU, TPU), else the host's physical memory (CPU); None if unknown."""
  try:
    limit = (jax.devices()[0].memory_stats() or {}).get('bytes_limit')
    if limit:
      return int(limit)
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return None


def pool_pages(config: model_lib.ModelConfig, kv_memory: int,
               page_size: int) -> int:
  """The pages of page_size tokens that kv_memory bytes hold (page 0 the
  scratch page); PoolTooSmall if too few for any sequence."""
  page_bytes = paged.page_bytes(config, page_size)
  num_pages = kv_memory // page_bytes
  if num_pages < 2:  # The scratch page and one for a sequence.
    raise PoolTooSmall(
        f'the KV memory ({kv_memory:,} bytes) holds {num_pages} page(s) of '
        f'{page_bytes:,} bytes ({page_size} tokens, every layer, '
        f'num_kv_heads={config.num_kv_heads}), too few for any sequence; '
        f'give at least {2 * page_bytes:,} bytes (a scratch page and one to '
        'hold a sequence), or smaller pages')
  return num_pages


# Sizes per octave of the batch, length and table-width buckets: 4 pads by
# less than a quarter (exact up to 8), at 4 compiled sizes per doubling.
BUCKETS_PER_OCTAVE = 4
# Page-table widths, two per doubling (exact up to 4, then 6, 8, 12, 16, ...):
# a sequence crosses every width as it grows, each a compile (about 1 s for
# gqa_small on 2 cores), while a wider table costs a step little more.
WIDTHS_PER_OCTAVE = 2


def bucket(n: int, per_octave: int = BUCKETS_PER_OCTAVE) -> int:
  """The least size >= n (n >= 1) among n itself up to 2·per_octave, then
  per_octave evenly spaced sizes per doubling (per_octave a power of two;
  1: the next power of two): at most per_octave·(log2(limit) + 1) sizes up
  to a limit."""
  unit = 1 << max(0, (n - 1).bit_length() - per_octave.bit_length())
  return -(-n // unit) * unit


def _run_rows(model, params, pool, tokens_BT, table_BM, lengths_B, num_new_B,
              settings: sampling.Rows, needs: sampling.Needs | None = None):
  """Each row's tokens written at positions lengths_B.. of its pages (the
  first num_new_B real; None: all T), and one token sampled from the logits
  of each row's last real token, at position lengths_B + num_new_B:
  (tokens [B], the pool). needs (static): what the rows' sampling uses."""
  logits_BTV, pool = paged.forward(model, params, pool, tokens_BT, table_BM,
                                   lengths_B, num_new_B)
  B, T, _ = logits_BTV.shape
  num_new_B = jnp.full((B,), T) if num_new_B is None else num_new_B
  last_BV = jnp.take_along_axis(
      logits_BTV, jnp.maximum(num_new_B - 1, 0)[:, None, None], axis=1)[:, 0]
  return sampling.sample(last_BV, settings, lengths_B + num_new_B,
                         needs), pool


class ModelRunner:
  """The device side: the pool, the model and its jitted step.

  `run(rows, pages)` feeds a plan's rows as the first rows of a batch of the
  next bucket size (at least 2: a one-row write becomes an update XLA does
  on a copy of the whole pool), padded to the bucket of the longest row's
  tokens, with page tables as wide as the bucket of the pages the rows
  reach: a few compiled shapes however lengths mix, and short sequences do
  not read max_len positions. Decode rows (one token each) and prefill
  chunks are separate calls, so a decode row is never padded to a chunk.
  """

  def __init__(self, config: model_lib.ModelConfig, params, *,
               num_pages: int, page_size: int):
    self.model, self.params = paged.serving_model(config, params)
    self.config = self.model.config
    self.page_size = page_size
    self.max_pages = pages_lib.pages_for(self.config.max_len, page_size)
    self.pool = paged.empty_pool(self.config, num_pages, page_size)
    # Programs specialised to what the rows' sampling needs (a greedy batch
    # compiles in about half the time of one that samples).
    self._step = jax.jit(functools.partial(_run_rows, self.model),
                         donate_argnums=1, static_argnames='needs',
                         compiler_options=inference.compiler_options())

  def run(self, rows: list[Row], pages: kv_pages.KVPageManager
          ) -> dict[str, int]:
    """{sequence id: its sampled token} for the rows that sample; every
    row's tokens written into its pages."""
    if not rows:
      return {}
    B = max(2, bucket(len(rows)))
    T = bucket(max(len(row.tokens) for row in rows))
    M = min(self.max_pages, bucket(max(
        pages_lib.pages_for(row.end, self.page_size) for row in rows),
        WIDTHS_PER_OCTAVE))
    tokens_BT = np.zeros((B, T), np.int32)
    table_BM = np.zeros((B, M), np.int32)  # Idle rows: the scratch page.
    lengths_B = np.zeros(B, np.int32)
    num_new_B = np.zeros(B, np.int32)
    params = [SamplingParams()] * B
    for b, row in enumerate(rows):
      tokens_BT[b, :len(row.tokens)] = row.tokens
      owned = pages.pages(row.seq.id)[:M]
      table_BM[b, :len(owned)] = owned
      lengths_B[b], num_new_B[b] = row.start, len(row.tokens)
      params[b] = row.seq.sampling
    # One token per row (decoding): no padding to mask, none passed.
    padded = None if T == 1 else num_new_B
    tokens_B, self.pool = self._step(self.params, self.pool, tokens_BT,
                                     table_BM, lengths_B, padded,
                                     sampling.rows(params),
                                     needs=sampling.needs(params))
    tokens_B = np.asarray(tokens_B)
    return {row.seq.id: int(tokens_B[b]) for b, row in enumerate(rows)
            if row.sample}


@dataclasses.dataclass
class _Tracked:
  request: Request
  arrival: float
  first_at: float | None = None


class Engine:
  """Serves requests over a pool of kv_memory bytes of pages of page_size
  tokens, at most `slots` sequences in flight, prompts fed in chunks of at
  most prefill_chunk tokens.

  eos_ids end a sequence; detokenize(token ids) -> text is needed for
  requests with stop strings. admission: 'reserve' admits a request when
  the pool can carry it and the running ones to their max_new_tokens (no
  recompute, which on a CPU costs as much as the prefill it repeats);
  'optimistic' (vLLM's) admits on its first chunk's pages and preempts the
  newest when the pool runs out (`serve.scheduler`). Errors are typed (RequestRefused,
  PoolTooSmall, kv_pages.KVPageError, all UserErrors); a command turns
  them into its flags' messages.
  """

  def __init__(self, config: model_lib.ModelConfig, params, *,
               kv_memory: int, page_size: int = 16, slots: int = 8,
               prefill_chunk: int = 64, eos_ids: Iterable[int] = (),
               kv_cache_dtype=None,
               detokenize: Callable[[list[int]], str] | None = None,
               admission: str = 'reserve'):
    if admission not in ('reserve', 'optimistic'):
      raise UserError(f'admission={admission!r}; use reserve or optimistic')
    if page_size < 1 or slots < 1 or prefill_chunk < 1:
      raise UserError(f'page_size={page_size}, slots={slots} and '
                      f'prefill_chunk={prefill_chunk} must each be >= 1')
    if kv_cache_dtype:
      config = dataclasses.replace(config, kv_cache_dtype=kv_cache_dtype)
    if page_size > config.max_len:
      raise UserError(f'page_size={page_size} is more than model.max_len '
                      f'({config.max_len}): a page would hold more than any '
                      f'sequence; give at most {config.max_len} (16 is usual)')
    self.page_bytes = paged.page_bytes(config, page_size)
    num_pages = pool_pages(config, kv_memory, page_size)
    limit = device_memory()
    if limit is not None and num_pages * self.page_bytes > limit:
      raise PoolTooLarge(
          f'the KV memory ({kv_memory:,} bytes) is more than the device '
          f'holds ({limit:,} bytes); give less (the pool is allocated whole)')
    self.pages = kv_pages.KVPageManager(num_pages, page_size)
    self.eos_ids = tuple(int(t) for t in eos_ids)
    self.detokenize = detokenize
    self.scheduler = Scheduler(
        self.pages, max_rows=slots, prefill_chunk=prefill_chunk,
        max_len=config.max_len, eos_ids=self.eos_ids, stop=self._stopped,
        reserve=admission == 'reserve')
    self.slots = slots
    self.runner = ModelRunner(config, params, num_pages=num_pages,
                              page_size=page_size)
    self.config = self.runner.config
    self._tracked: dict[str, _Tracked] = {}
    self._count = 0
    self.reset_stats()

  def reset_stats(self):
    self.stats = Stats(usable_pages=self.pages.usable,
                       page_bytes=self.page_bytes)
    self.started = None

  # The online API.

  def add_request(self, request: Request):
    """Queues the request; RequestRefused (its `.reason` one line) if it
    can never run: bad settings, an empty prompt, past max_len, more pages
    than the pool holds, or an id already in flight."""
    key = json.dumps(request.id)
    if key in self._tracked:
      raise RequestRefused(key, f'id {key} is already in flight; give each '
                           'request its own id')
    settings = request.sampling
    try:
      settings.check(self.config.vocab_size, prefix='')
    except UserError as e:
      raise RequestRefused(key, str(e)) from None
    if settings.stop and self.detokenize is None:
      raise RequestRefused(key, 'stop strings need the engine to be given '
                           'detokenize; pass the tokenizer\'s decode')
    self.scheduler.add(Sequence(
        key, [int(t) for t in request.prompt], int(request.max_new_tokens),
        sampling=settings))
    now = time.perf_counter()
    if self.started is None:
      self.started = now
    self._tracked[key] = _Tracked(request, (
        now if request.arrival is None else request.arrival))

  def has_unfinished(self) -> bool:
    return self.scheduler.has_unfinished()

  def step(self) -> list[Output]:
    """One step of the plan: decode rows and prefill chunks through the
    model; the outputs of the requests that finished in it."""
    if self.started is None:  # Requests added before `reset_stats`.
      self.started = time.perf_counter()
    plan = self.scheduler.schedule()
    if not plan.rows:
      if self.has_unfinished():  # The scheduler admits whenever pages free.
        raise RuntimeError('the scheduler planned nothing with requests '
                           'waiting; a bug')
      return []
    sampled = self.runner.run(plan.decode, self.pages)
    sampled.update(self.runner.run(plan.prefill, self.pages))
    finished = self.scheduler.update(plan, sampled)
    now = time.perf_counter()
    for key in sampled:
      tracked = self._tracked[key]
      if tracked.first_at is None:
        tracked.first_at = now
    s = self.stats
    s.steps += 1
    s.in_flight += len(plan.rows)
    s.preemptions += len(plan.preempted)
    s.prefill_tokens += plan.prefill_tokens
    s.high_water_pages = max(s.high_water_pages, self.pages.high_water)
    s.seconds = now - self.started
    return [self._output(seq, now) for seq in finished]

  def run(self, requests: Iterable[Request]) -> Iterator[Output]:
    """Every request served; yields each Output as it finishes (a refusal at
    once, as an Output with `error`). `stats` counts this run."""
    self.reset_stats()
    for request in requests:
      try:
        self.add_request(request)
      except RequestRefused as e:
        self.stats.refused += 1
        yield Output(request.id, error=e.reason)
    while self.has_unfinished():
      yield from self.step()

  # Helpers.

  def _stopped(self, seq: Sequence) -> bool:
    stop = seq.sampling.stop
    return bool(stop) and sampling.stop_at(
        self.detokenize(seq.generated), stop) is not None

  def _output(self, seq: Sequence, now: float) -> Output:
    tracked = self._tracked.pop(seq.id)
    tokens = list(seq.generated)
    if seq.finish_reason == 'eos':
      tokens = tokens[:-1]
    n = len(seq.generated)
    self.stats.done += 1
    self.stats.tokens += n
    return Output(
        tracked.request.id, tokens, seq.finish_reason,
        time_to_first_token_s=tracked.first_at - tracked.arrival,
        per_token_s=(now - tracked.first_at) / (n - 1) if n > 1 else None)
