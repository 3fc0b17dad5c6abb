"""Which tokens of which sequences a serving step feeds: a plan per step.

The engine (the model's shell) calls `schedule()`, runs the plan's rows
through the model, samples one token for each row with sample=True, and
hands them back with `update(plan, sampled)`. The plan is the only message
between the two: each row carries the page ids its tokens are written to
and read from, so the runner never reads the page manager (vLLM v1's
SchedulerOutput and its block ids). Pure Python, importing nothing that
imports JAX (the length rule is `lm.sampling_params.length_refusal`, the
one train.sample applies): the policy is tested without a model.

Policy (vLLM v1's, with JetStream's split of scheduler and model):
  1. Decode first: every running sequence whose context is computed but for
     its last sampled token gets a row of that one token, so decoding goes
     on while others prefill. Its pages grow on demand; when the pool runs
     out the newest running sequence (latest arrival) is preempted: its
     pages are freed and it waits again, at the front, to be recomputed
     (prompt + the tokens it generated, which it keeps).
  2. Running sequences part-way through their prefill get their next chunk
     (at most prefill_chunk tokens, within the step's prefill_budget),
     preempting the newest when the pool cannot hold it.
  3. In a step that preempted nothing, waiting sequences are admitted in
     arrival order (preempted ones are the oldest, so first) while a row, the
     budget and the pages of their first chunk allow (with reserve=True, the
     pages of their peak need beside the running sequences' outstanding
     growth); the first that does not fit stops admission (nothing is
     preempted for a newcomer). With the page manager's prefix caching, an
     admitted sequence first shares the cached pages its context starts with
     (all but its last token: the row that samples is always computed) and
     its prefill starts after them; every page a step fills is keyed
     (`serve.pages`), generated tokens' pages too, so a preempted sequence
     finds its own pages again when no one has taken them.
A row that reaches the end of its sequence's context samples its next token.
Running sequences never outnumber max_rows, so each gets a row every step.
`abort(id)` ends a sequence wherever it is, its pages returned at once.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from typing import Callable, Literal

from serve import pages as pages_lib
from serve.pages import KVPageManager
from infra.errors import UserError
from lm.sampling_params import length_refusal

FinishReason = Literal['length', 'eos', 'stop', 'abort']


class Status(enum.Enum):
  WAITING = 'waiting'
  RUNNING = 'running'  # Holds pages: prefilling or decoding.
  PREEMPTED = 'preempted'  # Waiting again, its pages freed.
  FINISHED = 'finished'


@dataclasses.dataclass(eq=False)
class Sequence:
  """A request and its progress. `generated` keeps the end-of-sequence token
  when one ends it (finish_reason 'eos')."""
  id: str
  prompt: list[int]
  max_new_tokens: int
  sampling: object = None  # The engine's, passed through untouched.
  generated: list[int] = dataclasses.field(default_factory=list)
  arrival: int = -1  # Its place in add() order; set by add().
  num_computed: int = 0  # Context tokens whose K/V is in its pages.
  status: Status = Status.WAITING
  finish_reason: FinishReason | None = None
  # Prefix caching: whether it may start from cached pages (a request that
  # wants every prompt token's log-probability computes them all); the
  # hashes of its context's full pages (`pages.page_hashes`); how many of
  # its pages are keyed or were found keyed; tokens found cached at its last
  # admission.
  reads_cache: bool = True
  page_hashes: list[bytes] = dataclasses.field(default_factory=list)
  keyed_pages: int = 0
  cached_tokens: int = 0
  # The runner's, passed through: top log-probabilities it returns for each
  # of the sequence's positions (None: none).
  logprobs: int | None = None

  @property
  def context(self) -> list[int]:
    return self.prompt + self.generated

  @property
  def context_len(self) -> int:
    return len(self.prompt) + len(self.generated)


@dataclasses.dataclass(eq=False)
class Row:
  """Feeds `tokens` at positions start..end-1 of `seq`, whose pages (in
  position order, holding at least positions 0..end-1) are `pages`;
  sample: the row reaches the end of the context, so the logits of its last
  token give the next one."""
  seq: Sequence
  start: int
  tokens: list[int]
  sample: bool
  pages: tuple[int, ...] = ()

  @property
  def end(self) -> int:
    return self.start + len(self.tokens)


@dataclasses.dataclass(eq=False)
class Plan:
  """One step: decode rows (one token each), prefill rows (chunks), and the
  sequences preempted to make room (their pages already freed)."""
  decode: list[Row] = dataclasses.field(default_factory=list)
  prefill: list[Row] = dataclasses.field(default_factory=list)
  preempted: list[Sequence] = dataclasses.field(default_factory=list)

  @property
  def rows(self) -> list[Row]:
    return self.decode + self.prefill

  @property
  def prefill_tokens(self) -> int:
    return sum(len(row.tokens) for row in self.prefill)


class RequestRefused(UserError):
  """A request that can never run; `.reason` says why and what to change."""

  def __init__(self, seq_id: str, reason: str):
    super().__init__(f'request {seq_id!r} refused: {reason}')
    self.seq_id, self.reason = seq_id, reason


@dataclasses.dataclass
class Stats:
  """What a scheduler (and the engine over it) did: steps planned with
  rows; rows summed over those steps (mean in flight = in_flight / steps);
  tokens fed as decode rows and as prefill chunks (the latter including
  recomputed ones); preemptions and the computed tokens they threw away;
  requests admitted (re-admissions included), done, refused and aborted;
  the tokens the requests done generated; prefix caching: context tokens
  looked up at admissions and those found cached (their prefill skipped).
  The engine adds the pool's high-water mark, its size, and the seconds
  from the first request to the last step."""
  steps: int = 0
  in_flight: int = 0
  decode_tokens: int = 0
  prefill_tokens: int = 0
  preemptions: int = 0
  recomputed_tokens: int = 0
  admitted: int = 0
  done: int = 0
  refused: int = 0
  aborted: int = 0
  tokens: int = 0
  lookup_tokens: int = 0
  cached_tokens: int = 0
  high_water_pages: int = 0
  usable_pages: int = 0
  page_bytes: int = 0
  seconds: float = 0.0

  @property
  def mean_in_flight(self) -> float:
    return self.in_flight / self.steps if self.steps else 0.0

  @property
  def prefix_hit_rate(self) -> float:
    """Of the context tokens looked up at admission, those found cached."""
    return self.cached_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class Scheduler:
  """Plans steps of at most max_rows rows over the sequences added.

  prefill_budget: prefill tokens per step over all chunks (decode rows are
  not counted); None: prefill_chunk * max_rows, i.e. no limit beyond rows and
  chunk. max_len: the model's positions; prompt + max_new_tokens must fit.
  stop(seq) -> bool ends a sequence (reason 'stop') after any sampled token.
  reserve: admit a request only when the free pages cover its peak need
  (prompt + max_new_tokens) beside what the running sequences may still
  take, so that sequences running to their max_new_tokens never preempt one
  another; pages are still handed out as contexts grow (early ends free
  theirs sooner). False (vLLM's optimistic admission): admit on its first
  chunk's pages and preempt the newest when the pool runs out.
  """

  def __init__(self, pages: KVPageManager, *, max_rows: int,
               prefill_chunk: int, max_len: int,
               prefill_budget: int | None = None, eos_ids=(),
               stop: Callable[[Sequence], bool] | None = None,
               reserve: bool = False):
    if prefill_budget is None:
      prefill_budget = prefill_chunk * max_rows
    if min(max_rows, prefill_chunk, max_len, prefill_budget) < 1:
      raise UserError(f'Scheduler(max_rows={max_rows}, prefill_chunk='
                      f'{prefill_chunk}, max_len={max_len}, prefill_budget='
                      f'{prefill_budget}): give each a value of at least 1')
    self.pages = pages
    self.max_rows, self.prefill_chunk, self.max_len = (max_rows, prefill_chunk,
                                                       max_len)
    self.prefill_budget = prefill_budget
    self.eos_ids, self.stop = frozenset(eos_ids), stop
    self.reserve = reserve
    self.stats = Stats()
    self._waiting: list[Sequence] = []  # By arrival.
    self._running: list[Sequence] = []  # By arrival.
    self._prefilling: set[str] = set()  # Running; no sample since admitted.
    self._live: dict[str, Sequence] = {}  # Waiting or running, by id.
    self._arrivals = 0
    self._pending: Plan | None = None  # Scheduled, not yet updated.

  def add(self, seq: Sequence):
    """Queues seq (WAITING, its arrival set), or raises RequestRefused."""
    reason = self._refusal(seq)
    if reason:
      self.stats.refused += 1
      raise RequestRefused(seq.id, reason)
    seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
    seq.status, seq.num_computed, seq.finish_reason = Status.WAITING, 0, None
    self._waiting.append(seq)
    self._live[seq.id] = seq

  def has_unfinished(self) -> bool:
    return bool(self._waiting or self._running)

  @property
  def running(self) -> tuple[Sequence, ...]:
    """The sequences holding pages, by arrival."""
    return tuple(self._running)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  @property
  def waiting(self) -> tuple[Sequence, ...]:
    """The sequences waiting for pages (preempted ones first), by arrival."""
    return tuple(self._waiting)

  def schedule(self) -> Plan:
    """The next step's rows; pages for every row are ensured."""
    if self._pending is not None:
      raise ValueError('schedule() called twice; call update(plan, sampled) '
                       'with the last plan first')
    plan = Plan()
    for seq in list(self._running):  # 1. Decode.
      if seq.status is Status.RUNNING and seq.id not in self._prefilling:
        if self._make_room(seq, seq.num_computed + 1, plan):
          plan.decode.append(Row(seq, seq.num_computed, [seq.generated[-1]],
                                 sample=True, pages=self._pages(seq)))
    budget = self.prefill_budget
    for seq in list(self._running):  # 2. Prefills under way.
      if (seq.status is Status.RUNNING and seq.id in self._prefilling and
          budget > 0):
        n = min(seq.context_len - seq.num_computed, self.prefill_chunk, budget)
        if self._make_room(seq, seq.num_computed + n, plan):
          plan.prefill.append(self._chunk(seq, n))
          budget -= n
    while (not plan.preempted and self._waiting and budget > 0 and  # 3. Admit.
           len(self._running) < self.max_rows):
      seq = self._waiting[0]
      hit = self._cached(seq)
      # Pages shared with running sequences come from no free page.
      if self.reserve and (self._peak(seq) - self.pages.held(hit) >
                           self.pages.free_count - self._outstanding()):
        break
      if not self._take_pages(seq, hit, budget):
        break
      n = min(seq.context_len - seq.num_computed, self.prefill_chunk, budget)
      self._waiting.pop(0)
      seq.status = Status.RUNNING
      self._running.append(seq)
      self._running.sort(key=lambda s: s.arrival)
      self._prefilling.add(seq.id)
      self.stats.admitted += 1
      plan.prefill.append(self._chunk(seq, n))
      budget -= n
    if plan.rows:
      self.stats.steps += 1
      self.stats.in_flight += len(plan.rows)
    self.stats.decode_tokens += len(plan.decode)
    self.stats.prefill_tokens += plan.prefill_tokens
    self._pending = plan
    return plan

  def _cached(self, seq: Sequence) -> list[int]:
    """The cached pages seq's context starts with, up to the page of its
    last token (excluded: a row must sample); [] when it reads none."""
    if not (seq.reads_cache and self.pages.prefix_caching):
      return []
    before_last = (seq.context_len - 1) // self.pages.page_size
    return self.pages.cached_prefix(self._hashes(seq)[:before_last])

  def _take_pages(self, seq: Sequence, hit: list[int], budget: int) -> bool:
    """Gives a sequence being admitted the cached pages `hit` its context
    starts with and pages for its first chunk after them; False, nothing
    held, if the pool lacks them."""
    self.pages.share(seq.id, hit)
    start = len(hit) * self.pages.page_size
    n = min(seq.context_len - start, self.prefill_chunk, budget)
    if not self.pages.ensure(seq.id, start + n):
      self.pages.free(seq.id)
      return False
    if seq.reads_cache and self.pages.prefix_caching:
      self.stats.lookup_tokens += seq.context_len
      self.stats.cached_tokens += start
    seq.num_computed = seq.cached_tokens = start
    seq.keyed_pages = len(hit)
    return True

  def _hashes(self, seq: Sequence) -> list[bytes]:
    """The hashes of seq's context's full pages, computed once each."""
    if len(seq.page_hashes) < seq.context_len // self.pages.page_size:
      pages_lib.page_hashes(seq.context, self.pages.page_size,
                            seq.page_hashes)
    return seq.page_hashes

  def _key_pages(self, seq: Sequence):
    """Keys seq's pages that its computed positions now fill."""
    full = seq.num_computed // self.pages.page_size
    if full <= seq.keyed_pages:
      return
    held, hashes = self.pages.pages(seq.id), self._hashes(seq)
    for i in range(seq.keyed_pages, full):
      self.pages.register(held[i], hashes[i])
    seq.keyed_pages = full

  def _peak(self, seq: Sequence) -> int:
    """The most pages seq can hold: its prompt and max_new_tokens but the
    last (never written)."""
    return self.pages.pages_for(len(seq.prompt) + seq.max_new_tokens - 1)

  def _outstanding(self) -> int:
    """Pages the running sequences may still take before they end."""
    return sum(self._peak(seq) - len(self.pages.pages(seq.id))
               for seq in self._running)

  def update(self, plan: Plan, sampled: dict[str, int]) -> list[Sequence]:
    """Records the step: every row's tokens computed, a sampled token (one
    for each row with sample=True, keyed by seq id) appended; returns the
    sequences that finished, their pages freed."""
    if plan is not self._pending:
      raise ValueError('update() takes the plan the last schedule() returned, '
                       'once')
    want = {row.seq.id for row in plan.rows if row.sample}
    if set(sampled) != want:
      raise ValueError(f'sampled has ids {sorted(set(sampled) - want)} with no '
                       f'sampling row and lacks {sorted(want - set(sampled))}; '
                       'give one token for each row with sample=True')
    self._pending = None
    finished = []
    for row in plan.rows:
      seq = row.seq
      seq.num_computed = row.end
      if self.pages.prefix_caching:
        self._key_pages(seq)
      if not row.sample:
        continue
      self._prefilling.discard(seq.id)
      token = int(sampled[seq.id])
      seq.generated.append(token)
      reason = ('eos' if token in self.eos_ids else
                'length' if len(seq.generated) >= seq.max_new_tokens else
                'stop' if self.stop is not None and self.stop(seq) else None)
      if reason:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.pages.free(seq.id)
        self._running.remove(seq)
        del self._live[seq.id]
        finished.append(seq)
    self.stats.done += len(finished)
    self.stats.tokens += sum(len(seq.generated) for seq in finished)
    return finished

  def abort(self, seq_id: str) -> Sequence | None:
    """Ends the sequence seq_id wherever it is (finish_reason 'abort'), its
    pages returned now; None if none is waiting or running under that id.
    Not between schedule() and update()."""
    if self._pending is not None:
      raise ValueError('abort() between schedule() and update(); abort '
                       'after the step is updated')
    seq = self._live.pop(seq_id, None)
    if seq is None:
      return None
    if seq.status is Status.RUNNING:
      self.pages.free(seq.id)
      self._running.remove(seq)
      self._prefilling.discard(seq.id)
    else:  # Waiting: it holds no pages.
      self._waiting.remove(seq)
    seq.status, seq.finish_reason = Status.FINISHED, 'abort'
    self.stats.aborted += 1
    return seq

  def _chunk(self, seq: Sequence, n: int) -> Row:
    start = seq.num_computed
    return Row(seq, start, seq.context[start:start + n],
               sample=start + n == seq.context_len, pages=self._pages(seq))

  def _pages(self, seq: Sequence) -> tuple[int, ...]:
    """seq's pages as a row carries them: ensured before its row is made,
    and changed by nothing else in the step (a preempted sequence's rows
    leave the plan with its pages)."""
    return tuple(self.pages.pages(seq.id))

  def _make_room(self, seq: Sequence, num_tokens: int, plan: Plan) -> bool:
    """Ensures seq's pages hold num_tokens, preempting the newest running
    sequences until they do; False if seq itself was preempted."""
    while not self.pages.ensure(seq.id, num_tokens):
      victim = self._running[-1]  # The newest.
      self._preempt(victim, plan)
      if victim is seq:
        return False
    return True

  def _preempt(self, seq: Sequence, plan: Plan):
    self.pages.free(seq.id)
    self._running.remove(seq)
    self._prefilling.discard(seq.id)
    self.stats.preemptions += 1
    self.stats.recomputed_tokens += seq.num_computed
    seq.status, seq.num_computed, seq.keyed_pages = Status.PREEMPTED, 0, 0
    bisect.insort(self._waiting, seq, key=lambda s: s.arrival)
    plan.decode = [row for row in plan.decode if row.seq is not seq]
    plan.prefill = [row for row in plan.prefill if row.seq is not seq]
    plan.preempted.append(seq)

  def _refusal(self, seq: Sequence) -> str | None:
    """Why seq can never run, in one line, or None."""
    P, new = len(seq.prompt), seq.max_new_tokens
    if seq.id in self._live:
      return 'its id is already in flight; give each live request its own id'
    if seq.generated or seq.status is not Status.WAITING:
      return 'it was added before; add a fresh Sequence'
    why = length_refusal(P, new, self.max_len)
    if why:
      return why
    # The last sampled token is never fed, so never written.
    need = self.pages.pages_for(P + new - 1)
    if need > self.pages.usable:
      return (f'it needs up to {need} pages of {self.pages.page_size} tokens '
              f'but the pool has {self.pages.usable}; give the pool more pages '
              'or shorten it')
    return None
