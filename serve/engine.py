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
                              outputs finished in that step (step_deltas():
                              every request's new tokens as they come),
                              abort_request(), has_unfinished()

Every step decodes one token for each running sequence whose prompt is in
the cache and, beside them, feeds the next chunk of the prompts being
prefilled, so running sequences keep producing while new ones arrive. A
sequence's settings are its own (temperature, top_k, top_p, seed, stop
strings) and its i-th generated token is sampled with the key
fold_in(key(its seed), i), so what shares its batch, or a preemption,
changes nothing: `train.sample` gives the same text. One `Stats` counts
what the scheduler and the engine did.

Prefix caching is on by default (`prefix_caching`): full pages are kept,
keyed by their tokens and everything before them, and a prompt that starts
with cached pages skips their prefill (`serve.pages`); what a request
generates is the same either way. It works for every layout and cache dtype
the pool holds, local layers included (a paged local layer keeps every
position and sees its window through the mask). A request asking for its
prompt's log-probabilities computes its whole prompt (it reads no cached
page, as vLLM's).
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
from lm.sampling_params import SamplingParams, StopStrings, is_int

__all__ = ['Delta', 'Engine', 'Output', 'PoolSizeError', 'PoolTooLarge',
           'PoolTooSmall', 'Request', 'RequestRefused', 'Stats', 'TokenLogprob',
           'pool_pages']


@dataclasses.dataclass
class Request:
  """A prompt to continue: its token ids, how many tokens to add at most,
  and how to choose them. logprobs: return each generated token's
  log-probability and the k likeliest tokens' (k = logprobs, at most
  runner.MAX_LOGPROBS; None: none); prompt_logprobs: the same for every
  prompt token after the first."""
  id: object  # Any JSON value; unique among the requests in flight.
  prompt: np.ndarray | list[int]  # [T] token ids.
  max_new_tokens: int
  sampling: SamplingParams = SamplingParams()
  arrival: float | None = None  # perf_counter time; None: when added.
  logprobs: int | None = None
  prompt_logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """A token's log-probability under the model where it stands, and the
  likeliest tokens' there ((id, log-probability), likeliest first)."""
  token: int
  logprob: float
  top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class Output:
  """A finished request: its tokens (an end-of-sequence token not
  included), why it ended ('length', 'eos', 'stop', or 'abort': cut by
  abort_request), and its timings in seconds; or the one-line reason it
  was refused (`error`). logprobs / prompt_logprobs: one per token (the
  prompt's first token has none), when the request asked."""
  id: object
  tokens: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  time_to_first_token_s: float | None = None  # From arrival, queue included.
  per_token_s: float | None = None  # Mean between later tokens.
  error: str | None = None
  queue_s: float | None = None  # From arrival to its first admission.
  latency_s: float | None = None  # From arrival to its end.
  prompt_tokens: int = 0
  cached_tokens: int = 0  # Prompt tokens found in the prefix cache.
  logprobs: list[TokenLogprob] | None = None
  prompt_logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class Delta:
  """What one step gave a request: its new tokens (an end-of-sequence
  token not included; none in a step that only fed its prompt), their
  log-probabilities if it asked, and its Output when it finished."""
  id: object
  tokens: list[int]
  logprobs: list[TokenLogprob] | None = None
  output: Output | None = None
  # With its first token, if it asked: the prompt's (as Output's).
  prompt_logprobs: list[TokenLogprob] | None = None


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
  admitted_at: float | None = None
  stops: StopStrings | None = None  # Its text so far, with stop strings.
  # Position -> (logprob of the token after it, top ids, top logprobs).
  logprobs: dict = dataclasses.field(default_factory=dict)


class Engine:
  """Serves requests over a pool of kv_memory bytes of pages of page_size
  tokens, at most `slots` sequences in flight, prompts fed in chunks of at
  most prefill_chunk tokens.

  eos_ids end a sequence; detokenize(token ids) -> text is needed for
  requests with stop strings. admission: 'reserve' admits a request when
  the pool can carry it and the running ones to their max_new_tokens (no
  recompute, which on a CPU costs as much as the prefill it repeats);
  'optimistic' (vLLM's) admits on its first chunk's pages and preempts the
  newest when the pool runs out (`serve.scheduler`). prefix_caching: keep
  computed pages for prompts that start the same (see the module
  docstring). Not thread-safe: one thread calls it. Errors are typed
  (RequestRefused, PoolTooSmall, pages.KVPageError, all UserErrors); a
  command turns them into its flags' messages.
  """

  def __init__(self, config: model_lib.ModelConfig, params, *,
               kv_memory: int, page_size: int = 16, slots: int = 8,
               prefill_chunk: int = 64, eos_ids: Iterable[int] = (),
               kv_cache_dtype=None,
               detokenize: Callable[[list[int]], str] | None = None,
               admission: str = 'reserve', prefix_caching: bool = True):
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
    self.pages = pages_lib.KVPageManager(num_pages, page_size,
                                         prefix_caching=prefix_caching)
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
      for name in ('logprobs', 'prompt_logprobs'):
        k = getattr(request, name)
        if k is not None and not (is_int(k) and
                                  0 <= k <= runner_lib.MAX_LOGPROBS):
          raise UserError(f'{name}={k!r} must be an integer in '
                          f'0..{runner_lib.MAX_LOGPROBS}, or None')
    except UserError as e:
      self.stats.refused += 1
      raise RequestRefused(key, str(e)) from None
    if settings.stop and self.detokenize is None:
      self.stats.refused += 1
      raise RequestRefused(key, 'stop strings need the engine to be given '
                           'detokenize; pass the tokenizer\'s decode')
    wanted = [k for k in (request.logprobs, request.prompt_logprobs)
              if k is not None]
    self.scheduler.add(Sequence(
        key, [int(t) for t in request.prompt], int(request.max_new_tokens),
        sampling=settings, reads_cache=request.prompt_logprobs is None,
        logprobs=max(wanted) if wanted else None))
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
    return [delta.output for delta in self.step_deltas() if delta.output]

  def step_deltas(self) -> list[Delta]:
    """One step, as `step`; a Delta for every request that got a token or
    finished in it (streaming: each token as it comes)."""
    if self.started is None:  # Requests added before `reset_stats`.
      self.started = time.perf_counter()
    plan = self.scheduler.schedule()
    if not plan.rows:
      if self.has_unfinished():  # The scheduler admits whenever pages free.
        raise RuntimeError('the scheduler planned nothing with requests '
                           'waiting; a bug')
      return []
    now = time.perf_counter()
    for row in plan.prefill:
      tracked = self._tracked[row.seq.id]
      if tracked.admitted_at is None:
        tracked.admitted_at = now
    sampled, logprobs = self.runner.run(plan.decode)
    more, more_logprobs = self.runner.run(plan.prefill)
    sampled.update(more)
    logprobs.update(more_logprobs)
    for key, rows in logprobs.items():
      self._keep_logprobs(self._tracked[key], rows)
    finished = {seq.id: seq for seq in self.scheduler.update(plan, sampled)}
    now = time.perf_counter()
    deltas = []
    for row in plan.rows:
      if not row.sample:
        continue
      seq, tracked = row.seq, self._tracked[row.seq.id]
      if tracked.first_at is None:
        tracked.first_at = now
      new = [] if seq.finish_reason == 'eos' else [seq.generated[-1]]
      delta = Delta(tracked.request.id, new, self._generated_logprobs(
          seq, tracked, len(seq.generated) - 1, len(new)))
      if len(seq.generated) == 1:
        delta.prompt_logprobs = self._prompt_logprobs(seq, tracked)
      if seq.id in finished:
        delta.output = self._output(seq, now)
      deltas.append(delta)
    self.stats.high_water_pages = max(self.stats.high_water_pages,
                                      self.pages.high_water)
    self.stats.seconds = now - self.started
    return deltas

  def abort_request(self, request_id) -> Output | None:
    """Ends the request now, its pages returned to the pool at once: its
    Output (the tokens it had, finish_reason 'abort'), or None if no
    request of that id is waiting or running."""
    seq = self.scheduler.abort(json.dumps(request_id))
    if seq is None:
      return None
    return self._output(seq, time.perf_counter())

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

  def _keep_logprobs(self, tracked: _Tracked, rows: runner_lib.Logprobs):
    """Keeps a row's log-probabilities by position (a recomputed position
    keeps its first)."""
    for i, chosen in enumerate(rows.chosen):
      tracked.logprobs.setdefault(rows.start + i, (
          float(chosen), rows.top_ids[i], rows.top[i]))

  def _at(self, tracked: _Tracked, position: int, token: int, k: int
          ) -> TokenLogprob:
    chosen, ids, top = tracked.logprobs[position]
    return TokenLogprob(token, chosen, tuple(
        (int(i), float(v)) for i, v in zip(ids[:k], top[:k])))

  def _generated_logprobs(self, seq: Sequence, tracked: _Tracked, first: int,
                          count: int) -> list[TokenLogprob] | None:
    """The log-probabilities of generated tokens first..first+count-1, if
    the request asked."""
    k = tracked.request.logprobs
    if k is None:
      return None
    P = len(seq.prompt)
    return [self._at(tracked, P - 1 + i, seq.generated[i], k)
            for i in range(first, first + count)]

  def _prompt_logprobs(self, seq: Sequence, tracked: _Tracked
                       ) -> list[TokenLogprob] | None:
    k = tracked.request.prompt_logprobs
    return None if k is None else [self._at(tracked, i - 1, seq.prompt[i], k)
                                   for i in range(1, len(seq.prompt))]

  def _output(self, seq: Sequence, now: float) -> Output:
    tracked = self._tracked.pop(seq.id)
    tokens = list(seq.generated)
    if seq.finish_reason == 'eos':
      tokens = tokens[:-1]
    n = len(seq.generated)
    first = tracked.first_at
    whole = seq.finish_reason != 'abort'  # An abort may cut them short.
    return Output(
        tracked.request.id, tokens, seq.finish_reason,
        time_to_first_token_s=None if first is None else first -
        tracked.arrival,
        per_token_s=(now - first) / (n - 1) if n > 1 else None,
        queue_s=(None if tracked.admitted_at is None else
                 tracked.admitted_at - tracked.arrival),
        latency_s=now - tracked.arrival,
        prompt_tokens=len(seq.prompt), cached_tokens=seq.cached_tokens,
        logprobs=(self._generated_logprobs(seq, tracked, 0, len(tokens))
                  if whole else None),
        prompt_logprobs=self._prompt_logprobs(seq, tracked) if whole else None)
