"""The serving engine: a plan per step, run over a paged KV cache.

Split as vLLM and JetStream split a server:

  serve.scheduler.Scheduler   which sequences prefill (in chunks) and which
                              decode this step, with the pages each row
                              uses; preempts the newest when the pool runs
                              out (pure Python, no JAX, tested alone)
  serve.pages.KVPageManager   the pages each sequence owns, grown on
                              demand; a double free refused
  serve.runner.ModelRunner    the jitted step: a plan's rows as padded
                              [B, T] batches with their page tables, through
                              the model over the pool, one token sampled per
                              finished row (`lm.sampling`)
  Engine (here)               the online API: add_request(), step() -> the
                              outputs finished in that step, has_unfinished()

Every step decodes one token for each running sequence whose prompt is in
the cache and, beside them, feeds the next chunk of the prompts being
prefilled, so running sequences keep producing while new ones arrive. A
sequence's settings are its own (temperature, top_k, top_p, seed, stop
strings) and its i-th generated token is sampled with the key
fold_in(key(its seed), i), so what shares its batch, or a preemption,
changes nothing: `train.sample` gives the same text. One `Stats` counts
what the scheduler and the engine did.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable, Iterable, Iterator

import jax
import numpy as np

from serve import pages as pages_lib
from serve import runner as runner_lib
from serve.scheduler import RequestRefused, Scheduler, Sequence, Stats
from lm import model as model_lib
from infra.errors import UserError
from lm.sampling_params import SamplingParams, StopStrings

__all__ = ['Engine', 'Output', 'PoolSizeError', 'PoolTooLarge', 'PoolTooSmall',
           'Request', 'RequestRefused', 'Stats', 'pool_pages']


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
  page_bytes = runner_lib.page_bytes(config, page_size)
  num_pages = kv_memory // page_bytes
  if num_pages < 2:  # The scratch page and one for a sequence.
    raise PoolTooSmall(
        f'the KV memory ({kv_memory:,} bytes) holds {num_pages} page(s) of '
        f'{page_bytes:,} bytes ({page_size} tokens, every layer, '
        f'num_kv_heads={config.num_kv_heads}), too few for any sequence; '
        f'give at least {2 * page_bytes:,} bytes (a scratch page and one to '
        'hold a sequence), or smaller pages')
  return num_pages


_END = object()


@dataclasses.dataclass
class _Tracked:
  request: Request
  arrival: float
  first_at: float | None = None
  stops: StopStrings | None = None  # Its text so far, with stop strings.


class Engine:
  """Serves requests over a pool of kv_memory bytes of pages of page_size
  tokens, at most `slots` sequences in flight, prompts fed in chunks of at
  most prefill_chunk tokens.

  eos_ids end a sequence; detokenize(token ids) -> text is needed for
  requests with stop strings. admission: 'reserve' admits a request when
  the pool can carry it and the running ones to their max_new_tokens (no
  recompute, which on a CPU costs as much as the prefill it repeats);
  'optimistic' (vLLM's) admits on its first chunk's pages and preempts the
  newest when the pool runs out (`serve.scheduler`). Errors are typed
  (RequestRefused, PoolTooSmall, pages.KVPageError, all UserErrors); a
  command turns them into its flags' messages.
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
    self.page_bytes = runner_lib.page_bytes(config, page_size)
    num_pages = pool_pages(config, kv_memory, page_size)
    limit = device_memory()
    if limit is not None and num_pages * self.page_bytes > limit:
      raise PoolTooLarge(
          f'the KV memory ({kv_memory:,} bytes) is more than the device '
          f'holds ({limit:,} bytes); give less (the pool is allocated whole)')
    self.pages = pages_lib.KVPageManager(num_pages, page_size)
    self.eos_ids = tuple(int(t) for t in eos_ids)
    self.detokenize = detokenize
    self.scheduler = Scheduler(
        self.pages, max_rows=slots, prefill_chunk=prefill_chunk,
        max_len=config.max_len, eos_ids=self.eos_ids, stop=self._stopped,
        reserve=admission == 'reserve')
    self.slots = slots
    self.runner = runner_lib.ModelRunner(config, params, num_pages=num_pages,
                                         page_size=page_size)
    self.config = self.runner.config
    self._tracked: dict[str, _Tracked] = {}
    self.reset_stats()

  def reset_stats(self):
    """A new `Stats` for the scheduler and the engine to count into."""
    self.stats = self.scheduler.stats = Stats(usable_pages=self.pages.usable,
                                              page_bytes=self.page_bytes)
    self.started = None

  # The online API.

  def add_request(self, request: Request):
    """Queues the request; RequestRefused (its `.reason` one line) if it
    can never run: bad settings, an empty prompt, past max_len, more pages
    than the pool holds, or an id already in flight (the scheduler's
    check)."""
    key = json.dumps(request.id)
    settings = request.sampling
    try:
      settings.check(self.config.vocab_size, prefix='')
    except UserError as e:
      self.stats.refused += 1
      raise RequestRefused(key, str(e)) from None
    if settings.stop and self.detokenize is None:
      self.stats.refused += 1
      raise RequestRefused(key, 'stop strings need the engine to be given '
                           'detokenize; pass the tokenizer\'s decode')
    self.scheduler.add(Sequence(
        key, [int(t) for t in request.prompt], int(request.max_new_tokens),
        sampling=settings))
    now = time.perf_counter()
    if self.started is None:
      self.started = now
    self._tracked[key] = _Tracked(
        request, now if request.arrival is None else request.arrival,
        stops=StopStrings(self.detokenize, settings.stop) if settings.stop
        else None)

  def has_unfinished(self) -> bool:
    return self.scheduler.has_unfinished()

  def wants_requests(self) -> bool:
    """Whether to add another request before the next step: fewer wait
    than `slots`, so that admission never starves while requests are read
    only as they can be served (not all queued first)."""
    return self.scheduler.num_waiting < self.slots

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
    sampled = self.runner.run(plan.decode)
    sampled.update(self.runner.run(plan.prefill))
    finished = self.scheduler.update(plan, sampled)
    now = time.perf_counter()
    for key in sampled:
      tracked = self._tracked[key]
      if tracked.first_at is None:
        tracked.first_at = now
    self.stats.high_water_pages = max(self.stats.high_water_pages,
                                      self.pages.high_water)
    self.stats.seconds = now - self.started
    return [self._output(seq, now) for seq in finished]

  def run(self, requests: Iterable[Request]) -> Iterator[Output]:
    """Every request served; yields each Output as it finishes (a refusal at
    once, as an Output with `error`). Requests are taken from the iterable
    as the engine has room for them (`wants_requests`), so the first
    outputs come while the rest are still unread. `stats` counts this
    run."""
    self.reset_stats()
    pending, more = iter(requests), True
    while more or self.has_unfinished():
      while more and self.wants_requests():
        request = next(pending, _END)
        if request is _END:
          more = False
          break
        try:
          self.add_request(request)
        except RequestRefused as e:
          yield Output(request.id, error=e.reason)
      if self.has_unfinished():
        yield from self.step()

  # Helpers.

  def _stopped(self, seq: Sequence) -> bool:
    """Whether seq's newest token completes a stop string (its text checked
    incrementally, `StopStrings`)."""
    stops = self._tracked[seq.id].stops
    return stops is not None and stops.add(seq.generated[-1])

  def _output(self, seq: Sequence, now: float) -> Output:
    tracked = self._tracked.pop(seq.id)
    tokens = list(seq.generated)
    if seq.finish_reason == 'eos':
      tokens = tokens[:-1]
    n = len(seq.generated)
    return Output(
        tracked.request.id, tokens, seq.finish_reason,
        time_to_first_token_s=tracked.first_at - tracked.arrival,
        per_token_s=(now - tracked.first_at) / (n - 1) if n > 1 else None)
