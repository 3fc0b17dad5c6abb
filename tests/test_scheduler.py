"""The scheduler and its page manager, specified without a model.

The fake model keeps a real paged pool (a token per slot): each row writes its
tokens into its sequence's pages, and a sampling row reads the whole context
back through the page list and hashes it. So a row that feeds the wrong
tokens or positions, pages shared or lost, or a recompute that misses a token
changes what is sampled, and the reference (decoding each request alone, by
the same hash of its context) no longer matches.
"""

import subprocess
import sys
import zlib

import pytest

from serve.pages import SCRATCH_PAGE, DoubleFree, KVPageError, KVPageManager
from serve.scheduler import (Plan, RequestRefused, Scheduler, Sequence,
                             Status)
from infra.errors import UserError

VOCAB = 50


def next_token(context: list[int]) -> int:
  return zlib.crc32(repr(list(context)).encode()) % VOCAB


def alone(prompt, max_new_tokens, eos_ids=(), stop=None) -> list[int]:
  """The reference: one token at a time from the whole context."""
  out = []
  while len(out) < max_new_tokens:
    out.append(next_token(prompt + out))
    if out[-1] in eos_ids or (stop and stop(out)):
      break
  return out


class FakeModel:
  """A paged pool of tokens; the step a model would run on a plan."""

  def __init__(self, pages: KVPageManager):
    self.pages = pages
    self.pool = [[None] * pages.page_size for _ in range(pages.num_pages)]

  def step(self, plan: Plan) -> dict[str, int]:
    """Each row through the pages the plan gives it (`Row.pages`), as the
    runner reads them: never the page manager."""
    size, sampled = self.pages.page_size, {}
    for row in plan.rows:
      table = row.pages
      assert len(table) * size >= row.end  # Its pages hold what it writes.
      assert list(table) == self.pages.pages(row.seq.id)  # And are its own.
      for pos, token in enumerate(row.tokens, row.start):
        self.pool[table[pos // size]][pos % size] = token
      if row.sample:
        sampled[row.seq.id] = next_token(
            [self.pool[table[p // size]][p % size] for p in range(row.end)])
    return sampled


def serve(sched: Scheduler, requests, max_steps=500):
  """Adds (id, prompt, max_new_tokens) requests and runs to the end,
  checking the pool after every step; returns {id: seq} and the plans."""
  model = FakeModel(sched.pages)
  seqs = {i: Sequence(i, list(p), n) for i, p, n in requests}
  for seq in seqs.values():
    sched.add(seq)
  plans = []
  while sched.has_unfinished():
    assert len(plans) < max_steps, 'no progress'
    plan = sched.schedule()
    plans.append(plan)
    sched.update(plan, model.step(plan))
    sched.pages.check()
  assert sched.pages.free_count == sched.pages.usable  # No page leaked.
  return seqs, plans


def prompt(n, seed):
  return [(seed * 7 + 3 * i) % VOCAB for i in range(n)]


MIXED = [('a', prompt(3, 1), 10), ('b', prompt(9, 2), 5),
         ('c', prompt(1, 3), 14),
         ('d', prompt(17, 4), 12), ('e', prompt(12, 5), 8)]


@pytest.mark.parametrize('num_pages,page_size,max_rows,chunk,budget', [
    (64, 4, 8, 8, None),  # Everything fits.
    (64, 4, 2, 5, 6),  # Few rows, chunked prompts under a budget.
    (9, 4, 4, 4, 8),  # A small pool: preemptions.
    (9, 4, 5, 32, None)])  # Whole prompts at once into the small pool.
def test_each_request_generates_what_it_would_alone(num_pages, page_size,
                                                    max_rows, chunk, budget):
  pages = KVPageManager(num_pages, page_size)
  sched = Scheduler(pages, max_rows=max_rows, prefill_chunk=chunk, max_len=32,
                    prefill_budget=budget)
  seqs, _ = serve(sched, MIXED)
  for i, p, n in MIXED:
    assert seqs[i].generated == alone(p, n), i
    assert seqs[i].status is Status.FINISHED
    assert seqs[i].finish_reason == 'length'
  if num_pages == 9:  # The pool is too small to hold all at their peak.
    assert sched.stats.preemptions > 0 and pages.high_water == pages.usable
  assert sched.stats.done == len(MIXED)


def test_decoding_goes_on_while_a_long_prompt_is_prefilled_in_chunks():
  sched = Scheduler(KVPageManager(32, 4), max_rows=4, prefill_chunk=4,
                    max_len=64)
  model = FakeModel(sched.pages)
  a = Sequence('a', prompt(2, 1), 10)
  sched.add(a)
  plan = sched.schedule()
  sched.update(plan, model.step(plan))  # a is decoding now.
  b = Sequence('b', prompt(18, 2), 3)
  sched.add(b)
  for step in range(5):  # 18 tokens in chunks of 4: 4 4 4 4 2.
    plan = sched.schedule()
    assert [(r.seq.id, r.start, len(r.tokens)) for r in plan.decode] == [
        ('a', 2 + step, 1)]
    assert [(r.seq.id, r.start, len(r.tokens), r.sample)
            for r in plan.prefill] == [('b', 4 * step, min(4, 18 - 4 * step),
                                        step == 4)]
    sched.update(plan, model.step(plan))
  assert len(a.generated) == 6 and len(b.generated) == 1
  plan = sched.schedule()
  assert [r.seq.id for r in plan.decode] == ['a', 'b'] and not plan.prefill


def test_chunks_keep_within_the_chunk_the_budget_and_the_rows():
  sched = Scheduler(KVPageManager(64, 4), max_rows=3, prefill_chunk=5,
                    max_len=32, prefill_budget=7)
  _, plans = serve(sched, MIXED)
  for plan in plans:
    assert len(plan.rows) <= 3
    assert all(len(r.tokens) == 1 and r.sample for r in plan.decode)
    assert all(1 <= len(r.tokens) <= 5 for r in plan.prefill)
    assert plan.prefill_tokens <= 7
  assert max(p.prefill_tokens for p in plans) == 7  # The budget was reached.
  assert sched.stats.prefill_tokens == sum(len(p) for _, p, _ in MIXED)
  assert sched.stats.decode_tokens == sum(n - 1 for *_, n in MIXED)


def test_pages_grow_with_the_context_not_reserved_up_front():
  pages = KVPageManager(16, 4)
  sched = Scheduler(pages, max_rows=1, prefill_chunk=8, max_len=32)
  model = FakeModel(pages)
  seq = Sequence('a', prompt(3, 1), 20)
  sched.add(seq)
  held = []
  for _ in range(100):
    if not sched.has_unfinished():
      break
    plan = sched.schedule()
    (row,) = plan.rows
    assert len(pages.pages('a')) == pages.pages_for(row.end)  # Just enough.
    held.append(pages.in_use)
    sched.update(plan, model.step(plan))
  # Positions 0..21 written (3 + 20 - 1 tokens): 1 page, growing to 6.
  assert held[0] == 1 and held[-1] == pages.high_water == 6
  assert held == sorted(held) and pages.in_use == 0


def test_the_newest_is_preempted_and_recomputed_to_the_same_tokens():
  # 4 usable pages of 4; each sequence peaks at pages_for(4 + 8 - 1) = 3.
  # Chunks of one page: the victim's pages would let it back at once, but a
  # step that preempts admits nothing (it would be preempted again).
  pages = KVPageManager(5, 4)
  sched = Scheduler(pages, max_rows=4, prefill_chunk=4, max_len=32)
  model = FakeModel(pages)
  a, b = Sequence('a', prompt(4, 1), 8), Sequence('b', prompt(4, 2), 8)
  sched.add(a)
  sched.add(b)
  preempted = []
  for _ in range(100):
    if not sched.has_unfinished():
      break
    plan = sched.schedule()
    preempted += plan.preempted
    for seq in plan.preempted:
      assert seq.status is Status.PREEMPTED and seq.num_computed == 0
      assert pages.pages(seq.id) == [] and seq.generated  # Kept.
      assert all(r.seq is not seq for r in plan.rows)
    sched.update(plan, model.step(plan))
    pages.check()
  assert preempted and all(s is b for s in preempted)  # Never the older a.
  assert sched.stats.recomputed_tokens > 0
  assert a.generated == alone(a.prompt, 8) and b.generated == alone(b.prompt, 8)
  assert pages.free_count == pages.usable


def test_reserve_admits_only_what_the_pool_carries_to_the_end():
  """reserve=True: the same two sequences as above never preempt; b waits
  until a's peak need is no longer outstanding, pages still grow on demand
  (a holds 1, then 2, then 3), and both equal their runs alone."""
  pages = KVPageManager(5, 4)
  sched = Scheduler(pages, max_rows=4, prefill_chunk=4, max_len=32,
                    reserve=True)
  model = FakeModel(pages)
  a, b = Sequence('a', prompt(4, 1), 8), Sequence('b', prompt(4, 2), 8)
  sched.add(a)
  sched.add(b)
  held = []
  while sched.has_unfinished():
    plan = sched.schedule()
    assert not plan.preempted
    if a.status is Status.RUNNING:
      held.append(len(pages.pages('a')))
      assert b.status is Status.WAITING  # 3 + 3 pages > 4.
    sched.update(plan, model.step(plan))
    pages.check()
  assert sorted(set(held)) == [1, 2, 3] and sched.stats.preemptions == 0
  assert a.generated == alone(a.prompt, 8) and b.generated == alone(b.prompt, 8)
  assert pages.free_count == pages.usable


def test_a_newcomer_waits_for_pages_instead_of_preempting():
  pages = KVPageManager(5, 4)  # 4 usable pages.
  sched = Scheduler(pages, max_rows=4, prefill_chunk=16, max_len=32)
  model = FakeModel(pages)
  sched.add(Sequence('a', prompt(12, 1), 2))  # 3 pages at once.
  plan = sched.schedule()
  sched.update(plan, model.step(plan))
  sched.add(Sequence('b', prompt(8, 2), 2))  # Needs 2 pages; 1 is free.
  plan = sched.schedule()
  assert [r.seq.id for r in plan.rows] == ['a'] and not plan.preempted


def test_eos_and_stop_end_a_sequence_early():
  full = alone(prompt(5, 1), 12)
  eos = full[3]
  seqs, _ = serve(Scheduler(KVPageManager(32, 4), max_rows=2, prefill_chunk=4,
                            max_len=32, eos_ids=[eos]),
                  [('a', prompt(5, 1), 12)])
  assert seqs['a'].generated == full[:full.index(eos) + 1]
  assert seqs['a'].finish_reason == 'eos'

  def stop(seq):
    return len(seq.generated) >= 2 and seq.generated[-1] % 2 == 0

  seqs, _ = serve(Scheduler(KVPageManager(32, 4), max_rows=2, prefill_chunk=4,
                            max_len=32, stop=stop), MIXED)
  for i, p, n in MIXED:
    want = alone(p, n, stop=lambda out: len(out) >= 2 and out[-1] % 2 == 0)
    assert seqs[i].generated == want
    # 'length' comes first when both end it.
    assert seqs[i].finish_reason == ('length' if len(want) == n else 'stop')
  assert any(s.finish_reason == 'stop' for s in seqs.values())


def test_refusals_say_why():
  sched = Scheduler(KVPageManager(4, 4), max_rows=2, prefill_chunk=4,
                    max_len=32)
  sched.add(Sequence('a', [1, 2], 3))
  for seq, reason in [
      (Sequence('a', [1], 1), 'already in flight'),
      (Sequence('b', [], 3), 'empty prompt'),
      (Sequence('c', [1] * 30, 3), 'within 1..model.max_len'),
      (Sequence('d', [1], 0), 'within 1..model.max_len'),
      # 3 usable pages hold 12 positions; 10 + 4 - 1 = 13 need 4 pages.
      (Sequence('e', [1] * 10, 4), 'needs up to 4 pages')]:
    with pytest.raises(RequestRefused, match=reason) as refused:
      sched.add(seq)
    assert reason in refused.value.reason and isinstance(refused.value,
                                                         UserError)
  sched.add(Sequence('f', [1] * 10, 3))  # 12 positions: 3 pages, fits.
  assert sched.stats.refused == 5


def test_update_takes_one_token_for_each_sampling_row_of_the_last_plan():
  sched = Scheduler(KVPageManager(32, 4), max_rows=4, prefill_chunk=4,
                    max_len=32)
  sched.add(Sequence('a', prompt(2, 1), 4))
  sched.add(Sequence('b', prompt(9, 2), 4))  # Its first chunk does not sample.
  plan = sched.schedule()
  for wrong in ({}, {'a': 1, 'b': 2}, {'a': 1, 'z': 3}):
    with pytest.raises(ValueError, match='sample=True'):
      sched.update(plan, wrong)
  with pytest.raises(ValueError, match='schedule'):
    sched.schedule()  # The plan is not yet updated.
  sched.update(plan, {'a': 7})
  with pytest.raises(ValueError, match='last schedule'):
    sched.update(plan, {'a': 7})  # Twice.


def test_pages_are_all_or_nothing_and_never_the_scratch_page():
  pages = KVPageManager(4, 4)  # 3 usable.
  assert pages.ensure('a', 8) and pages.ensure('a', 5)  # Never shrinks.
  assert len(pages.pages('a')) == 2
  assert not pages.ensure('b', 5) and pages.pages('b') == []
  assert pages.free_count == 1 and pages.in_use == 2
  assert pages.ensure('b', 4)
  assert SCRATCH_PAGE not in pages.pages('a') + pages.pages('b')
  pages.check()
  pages.free('a')
  assert pages.free_count == 2 and pages.high_water == 3


def test_a_double_free_raises():
  pages = KVPageManager(4, 4)
  pages.ensure('a', 3)
  pages.free('a')
  with pytest.raises(DoubleFree, match='once'):
    pages.free('a')
  with pytest.raises(DoubleFree):
    pages.free('never')
  assert issubclass(DoubleFree, KVPageError) and issubclass(KVPageError,
                                                            UserError)
  assert pages.free_count == pages.usable


def test_check_sees_a_page_owned_twice():
  pages = KVPageManager(8, 4)
  pages.ensure('a', 4)
  pages.ensure('b', 4)
  pages.check()
  pages._owned['b'] = pages.pages('a')  # pylint: disable=protected-access
  with pytest.raises(AssertionError, match='owned twice'):
    pages.check()


@pytest.mark.parametrize('num_pages,page_size', [(1, 4), (4, 0)])
def test_a_pool_too_small_is_refused_with_what_to_give(num_pages, page_size):
  with pytest.raises(KVPageError,
                     match=r'give num_pages >= 2 .* page_size >= 1'):
    KVPageManager(num_pages, page_size)


def test_the_scheduler_and_its_pages_import_nothing_that_imports_jax():
  """Issue 58: the scheduler imported train.sampling, which imports JAX.
  The policy and the page manager are host code: a process importing them
  (and the prompt reader) holds no jax module."""
  code = ('import sys; import serve.scheduler, serve.pages, serve.prompts; '
          'print(sorted(m for m in sys.modules if m.split(".")[0] in '
          '("jax", "jaxlib", "flax")))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True,
                       text=True, check=True)
  assert out.stdout.strip() == '[]'
