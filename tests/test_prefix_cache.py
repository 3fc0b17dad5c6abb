"""Specification of prefix caching (`serve.pages`, `serve.scheduler`) and of
the engine's streaming and cancellation (`Engine.step_deltas`,
`abort_request`).

With the scheduler's fake model (tests/test_scheduler.py: a pool of tokens,
each sampled token a hash of the context read back through the row's pages)
a shared page holding the wrong tokens, or one written by a sequence that
shares it, changes what is sampled. With the real model, every layout the
engine serves (tests/test_layouts.py's LAYOUTS), int8 pages and local
layers give the same tokens with caching on and off, computing fewer
prefill tokens with it on.
"""

import flax.linen as nn
import numpy as np
import pytest

from serve import engine as engine_lib
from serve import runner
from serve.pages import KVPageManager, page_hashes
from serve.scheduler import Scheduler, Sequence, Status
from tests.test_layouts import LAYOUTS, config_for
from tests.test_scheduler import FakeModel, alone, prompt, serve
from lm import config_lib, sampling
from lm import model as model_lib
from train import loop


class SharingGuard(FakeModel):
  """The fake model, refusing a write into a page another sequence holds."""

  def step(self, plan):
    for row in plan.rows:
      for pos in range(row.start, row.end):
        page = row.pages[pos // self.pages.page_size]
        assert self.pages._refs[page] == 1, (  # pylint: disable=protected-access
            f'{row.seq.id} writes position {pos} into shared page {page}')
    return super().step(plan)


PREFIX = prompt(10, 9)  # Two full pages of 4, and two tokens.
SHARED = [(f'r{i}', PREFIX + prompt(2 + i, i), 6) for i in range(5)]


def _served(caching: bool, requests, num_pages=64, max_rows=2, chunk=4,
            **kwargs):
  pages = KVPageManager(num_pages, 4, prefix_caching=caching)
  sched = Scheduler(pages, max_rows=max_rows, prefill_chunk=chunk,
                    max_len=40, **kwargs)
  model = SharingGuard(pages)
  seqs = {i: Sequence(i, list(p), n) for i, p, n in requests}
  for seq in seqs.values():
    sched.add(seq)
  while sched.has_unfinished():
    plan = sched.schedule()
    sched.update(plan, model.step(plan))
    pages.check()
  assert pages.free_count == pages.usable and pages.in_use == 0
  return seqs, sched


def test_requests_sharing_a_prefix_skip_its_pages_and_generate_the_same():
  off, sched_off = _served(False, SHARED)
  on, sched_on = _served(True, SHARED)
  for i, p, n in SHARED:
    assert on[i].generated == off[i].generated == alone(p, n), i
  # r0 computes the prefix's 2 full pages; r1..r4 find them (2 run at once:
  # r1 shares with r0 only once r0's pages are keyed, after its prefill).
  assert sched_off.stats.cached_tokens == sched_off.stats.lookup_tokens == 0
  assert sched_on.stats.cached_tokens >= 3 * 8
  assert (sched_on.stats.prefill_tokens ==
          sched_off.stats.prefill_tokens - sched_on.stats.cached_tokens)
  assert 0 < sched_on.stats.prefix_hit_rate < 1


def test_a_prompt_of_whole_pages_computes_its_last_page_again():
  """The row that samples must be computed: a hit stops before the page of
  the prompt's last token."""
  whole = prompt(8, 3)
  seqs, sched = _served(True, [('a', whole, 3)], max_rows=1)
  _, sched2 = _served(True, [('a', whole, 3), ('b', whole, 3)], max_rows=1)
  assert sched2.stats.cached_tokens == 4  # Page 0 only, for b.
  assert seqs['a'].generated == alone(whole, 3)


def test_keys_name_the_tokens_and_everything_before_them():
  a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, [])
  b = page_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, [])
  assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # Same second page.
  assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, []) == a  # Full only.
  known = page_hashes([1, 2, 3, 4], 4, [])
  assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, known) == a  # Extends.


def test_free_cached_pages_are_evicted_least_recently_freed_first():
  pages = KVPageManager(5, 2, prefix_caching=True)  # 4 usable.
  keys = page_hashes([1, 2, 3, 4], 2, [])
  assert pages.ensure('a', 4)
  for page, key in zip(pages.pages('a'), keys):
    pages.register(page, key)
  pages.free('a')
  assert pages.cached == 2 and pages.free_count == 4 and pages.in_use == 0
  assert pages.cached_prefix(keys) == pages.cached_prefix(keys[:1]) + [
      pages.cached_prefix(keys)[1]]
  assert pages.ensure('b', 4)  # Two never-keyed pages go first.
  assert pages.cached == 2 and pages.evictions == 0
  assert pages.ensure('c', 2)  # Then a's last page (freed first).
  assert pages.evictions == 1 and len(pages.cached_prefix(keys)) == 1
  pages.share('d', pages.cached_prefix(keys))  # The first page, shared.
  assert pages.in_use == 4 and pages.free_count == 0
  pages.check()
  for seq in 'bcd':
    pages.free(seq)
  pages.check()
  assert pages.in_use == 0


def test_without_prefix_caching_nothing_is_found():
  pages = KVPageManager(5, 2)
  keys = page_hashes([1, 2], 2, [])
  pages.ensure('a', 2)
  pages.register(pages.pages('a')[0], keys[0])
  assert pages.cached == 0 and pages.cached_prefix(keys) == []


def test_a_preempted_sequence_finds_its_own_pages_again():
  """Optimistic admission in a small pool: preempted sequences come back
  and, their pages still cached, recompute less."""
  requests = [(f'r{i}', prompt(9, i), 10) for i in range(4)]
  off, sched_off = _served(False, requests, num_pages=9, max_rows=4, chunk=8)
  on, sched_on = _served(True, requests, num_pages=9, max_rows=4, chunk=8)
  assert sched_off.stats.preemptions > 0 and sched_on.stats.preemptions > 0
  for i, p, n in requests:
    assert on[i].generated == off[i].generated == alone(p, n)
  assert sched_on.stats.cached_tokens > 0


def test_abort_returns_pages_at_once_wherever_the_sequence_is():
  pages = KVPageManager(6, 4, prefix_caching=True)  # 5 usable.
  sched = Scheduler(pages, max_rows=1, prefill_chunk=8, max_len=32)
  model = FakeModel(pages)
  a, b = Sequence('a', prompt(9, 1), 8), Sequence('b', prompt(5, 2), 4)
  sched.add(a)
  sched.add(b)
  plan = sched.schedule()
  sched.update(plan, model.step(plan))
  assert a.status is Status.RUNNING and b.status is Status.WAITING
  assert sched.abort('b') is b and b.finish_reason == 'abort'  # Waiting.
  assert sched.abort('b') is None  # Gone.
  held = pages.in_use
  assert held > 0 and sched.abort('a') is a  # Running: pages back now.
  assert pages.in_use == 0 and not sched.has_unfinished()
  assert sched.stats.aborted == 2
  pages.check()
  sched.add(Sequence('a', prompt(9, 1), 2))  # Its id is free again.
  plan = sched.schedule()
  with pytest.raises(ValueError, match='between schedule'):
    sched.abort('a')


# The real model.


def _params(mc):
  return nn.unbox(loop.init_params(model_lib.Transformer(mc), seed=1))


def _requests():
  rng = np.random.default_rng(0)
  prefix = rng.integers(0, 256, 13).tolist()
  hot = sampling.SamplingParams(temperature=1.0, top_k=20, seed=7)
  return [engine_lib.Request(i, prefix + rng.integers(0, 256, 1 + i).tolist(),
                             5, hot if i % 2 else sampling.SamplingParams())
          for i in range(4)]


def _run(mc, params, caching: bool):
  served = engine_lib.Engine(mc, params, kv_memory=2**20, page_size=4,
                             slots=2, prefix_caching=caching)
  outputs = {o.id: o.tokens for o in served.run(_requests())}
  assert served.pages.in_use == 0
  served.pages.check()
  return outputs, served.stats


@pytest.mark.slow
@pytest.mark.parametrize('name,model', [
    *[(name, {}) for name in LAYOUTS],
    ('gqa', dict(kv_cache_dtype='int8')),
    ('mla', dict(kv_cache_dtype='int8')),
    ('gqa', dict(num_layers=4, attention_pattern='LG', local_window=4))])
def test_caching_on_and_off_give_the_same_tokens(name, model):
  """Every layout, int8 pages and local layers (a paged local layer keeps
  every position, so its pages can be shared as any other's)."""
  mc = config_lib.model_config(config_for(name, **model))
  params = _params(mc)
  off, stats_off = _run(mc, params, False)
  on, stats_on = _run(mc, params, True)
  assert on == off
  # r0 and r1 are prefilled together; r2 and r3 find 3 pages of the prefix.
  assert stats_on.cached_tokens == 2 * 12
  assert stats_on.prefill_tokens < stats_off.prefill_tokens


@pytest.mark.slow
def test_deltas_stream_each_token_and_add_up_to_the_output():
  mc = config_lib.model_config(config_for('gqa'))
  params = _params(mc)
  served = engine_lib.Engine(mc, params, kv_memory=2**20, page_size=4,
                             slots=2)
  requests = _requests()
  for request in requests:
    request.logprobs = 2
    served.add_request(request)
  streamed, outputs, steps = {r.id: [] for r in requests}, {}, 0
  while served.has_unfinished():
    steps += 1
    for delta in served.step_deltas():
      assert len(delta.tokens) <= 1 and len(delta.logprobs) == len(
          delta.tokens)
      streamed[delta.id] += delta.tokens
      if delta.output:
        outputs[delta.id] = delta.output
  for request in requests:
    out = outputs[request.id]
    assert streamed[request.id] == out.tokens and len(out.tokens) == 5
    assert [t.token for t in out.logprobs] == out.tokens
    assert all(len(t.top) == 2 and t.top[0][1] >= t.logprob
               for t in out.logprobs)
  assert steps >= 5


@pytest.mark.slow
def test_aborting_a_running_request_frees_its_pages_and_the_rest_go_on():
  mc = config_lib.model_config(config_for('gqa'))
  params = _params(mc)
  served = engine_lib.Engine(mc, params, kv_memory=2**20, page_size=4,
                             slots=2)
  requests = _requests()
  for request in requests:
    served.add_request(request)
  served.step()
  running = [s.id for s in served.scheduler.running]
  assert running and served.pages.in_use > 0
  out = served.abort_request(requests[0].id)
  assert out.finish_reason == 'abort' and out.id == requests[0].id
  assert served.abort_request(requests[0].id) is None
  left = {}
  while served.has_unfinished():
    for o in served.step():
      left[o.id] = o.tokens
  assert sorted(left) == [1, 2, 3] and served.pages.in_use == 0
  alone, _ = _run(mc, params, True)
  assert all(left[i] == alone[i] for i in left)
  assert served.stats.aborted == 1
