"""Specification of serving over a paged KV cache (`serve/`, `serve.generate`):
each request's greedy output equals `train.sample`'s for its prompt alone,
whatever shares the batch, for every cache layout; pages are reused; bad input
is one line and the other requests go on."""

import argparse
import dataclasses
import errno
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from scripts import bench_serve
from serve import engine, generate, pages, runner
from serve import prompts as prompts_lib
from serve import results as results_lib
from tests.test_faults import _one_line_error, _run
from train import loop
from lm import checkpoint
from lm import config_lib
from lm import model as model_lib
from lm import inference
from lm import sampling
from infra.errors import UserError
from studies import variants
from lm.model import Transformer

REPO = pathlib.Path(__file__).parent.parent


def _alone(mc, params, prompt, new, settings=None):
  """train.sample's tokens for one prompt decoded by itself (greedy unless
  settings say otherwise)."""
  out = inference.generate(params, jnp.asarray(prompt)[None],
                        None if settings is None else sampling.rows([settings]),
                        model=Transformer(mc, decode=True),
                        max_new_tokens=new)
  return np.asarray(out[0]).tolist()


def _config(**model):
  config = tiny.get_config()
  config.model.update(**model)
  return config_lib.model_config(config)


def _random_model(**model):
  """A random tiny model (its greedy tokens vary, unlike a 20-step one's)."""
  mc = _config(**model)
  return mc, nn.unbox(loop.init_params(Transformer(mc), seed=1))


def test_sizes_parse_with_units_and_a_bad_one_is_one_line():
  assert pages.parse_bytes('256MiB') == 256 * 2**20
  assert pages.parse_bytes('1.5kb') == 1500
  assert pages.parse_bytes('4096') == 4096
  for bad in ('lots', '12 parsecs', '0', ''):
    with pytest.raises(UserError, match=r'^--kv_memory=.* (is not a size|'
                       r'must be at least)'):
      pages.parse_bytes(bad)


def test_the_allocator_reuses_returned_pages_and_never_hands_out_page_0():
  allocator = pages.Allocator(5)  # Pages 1-4; 0 is the scratch page.
  a = allocator.allocate(3)
  assert 0 not in a and allocator.allocate(2) is None  # Nothing taken.
  allocator.release(a)
  b = allocator.allocate(4)
  assert sorted(b) == [1, 2, 3, 4] and allocator.high_water == 4
  allocator.release(b)
  assert allocator.in_use == 0


@pytest.mark.parametrize('model', [
    dict(num_kv_heads=4), dict(num_kv_heads=1, kv_cache_dtype='int8'),
    dict(num_layers=4, attention_pattern='LLGG', local_window=4, kv_share=2,
         kv_cache_dtype='bfloat16')])
def test_a_page_holds_the_bytes_the_models_kv_count_gives(model):
  mc = _config(**model)
  pool = runner.empty_pool(mc, 3, 8)
  every_global = dataclasses.replace(mc, attention_pattern='G',
                                     local_window=None)
  assert sum(x.nbytes for x in jax.tree.leaves(pool)) == 3 * runner.page_bytes(
      mc, 8) == 3 * model_lib.kv_cache_bytes(every_global, 1, 8)


# Prompt lengths mixed across page boundaries (page 8): one token, one page,
# several pages; with the model's max_len 32.
MIXED = [(3, 10), (9, 5), (1, 14), (17, 12), (12, 8)]


@pytest.mark.slow
def test_more_prompts_than_slots_in_a_small_pool_each_equal_to_decoding_alone():
  mc, params = _random_model()
  rng = np.random.default_rng(0)
  requests = [engine.Request(i, rng.integers(0, 256, P).astype(np.int32), new)
              for i, (P, new) in enumerate(MIXED)]
  need = sum(pages.pages_for(P + new, 8) for P, new in MIXED)  # 13 pages.
  served = engine.Engine(mc, params, kv_memory=9 * runner.page_bytes(mc, 8),
                         page_size=8, slots=2)
  results = {r.id: r for r in served.run(requests)}
  assert served.stats.usable_pages == 8 < need
  assert 0 < served.stats.high_water_pages <= 8
  assert served.pages.in_use == 0  # Every page returned.
  served.pages.check()
  assert served.stats.mean_in_flight > 1.5  # The batch was kept full.
  for r in requests:
    assert results[r.id].error is None
    assert results[r.id].tokens == _alone(mc, params, r.prompt,
                                          r.max_new_tokens), r.id
    assert results[r.id].time_to_first_token_s > 0


@pytest.mark.slow
@pytest.mark.parametrize('admission', [
    pytest.param('optimistic', marks=pytest.mark.slowest),  # 16 s on 2 cores.
    'reserve'])
def test_preempted_requests_are_recomputed_to_the_same_tokens(admission):
  """Optimistic admission in a pool too small for every sequence's peak:
  the newest is preempted and recomputed, greedy or sampled, each output
  still train.sample's; reserve admission preempts nothing."""
  mc, params = _random_model()
  rng = np.random.default_rng(1)
  hot = sampling.SamplingParams(temperature=1.0, top_k=30, seed=5)
  requests = [engine.Request(i, rng.integers(0, 256, P).astype(np.int32),
                             new, sampling=hot if i % 2 else
                             sampling.SamplingParams())
              for i, (P, new) in enumerate(MIXED)]
  served = engine.Engine(mc, params, kv_memory=9 * runner.page_bytes(mc, 4),
                         page_size=4, slots=3, prefill_chunk=8,
                         admission=admission)
  results = {r.id: r for r in served.run(requests)}
  assert (served.stats.preemptions > 0) == (admission == 'optimistic')
  for r in requests:
    assert results[r.id].tokens == _alone(mc, params, r.prompt,
                                          r.max_new_tokens, r.sampling), r.id
  assert served.pages.in_use == 0


@pytest.mark.slow
@pytest.mark.parametrize('model', [
    dict(num_kv_heads=4, kv_cache_dtype='bfloat16'),  # MHA.
    dict(num_kv_heads=1, num_layers=4, attention_pattern='LG',
         local_window=4),  # MQA, local layers: windows inside a page.
    dict(num_kv_heads=2, num_layers=4, attention_pattern='LLGG',
         local_window=6, kv_share=2, kv_cache_dtype='int8')])
def test_every_cache_layout_decodes_as_train_sample_does(model):
  mc, params = _random_model(**model)
  prompt = np.arange(1, 12, dtype=np.int32) * 7
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=4, slots=2)
  [result] = served.run([engine.Request(0, prompt, 12)])  # A slot idle.
  assert result.tokens == _alone(mc, params, prompt, 12)


def _spy_shapes(served, monkeypatch):
  """[(tokens [B, T], table [B, M]) shapes] of every call the runner makes."""
  calls, step = [], served.runner._step  # pylint: disable=protected-access
  def spy(params, pool, tokens_BT, table_BM, *args, **kwargs):
    calls.append((tokens_BT.shape, table_BM.shape))
    return step(params, pool, tokens_BT, table_BM, *args, **kwargs)
  monkeypatch.setattr(served.runner, '_step', spy)
  return calls


@pytest.mark.slow
def test_tables_as_wide_as_the_pages_in_use_still_decode_as_train_sample(
    monkeypatch):
  """Steps read only the bucket of the pages in use (exact up to 8, not
  max_len's 8 nor a power of two), so sequences cross width buckets as they
  grow; prompts admitted together are prefilled in one call, decode rows
  in calls of their own (never padded to a chunk)."""
  mc, params = _random_model()
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=4, slots=2)
  calls = _spy_shapes(served, monkeypatch)
  requests = [engine.Request(0, np.arange(1, 4, dtype=np.int32) * 5, 13),
              engine.Request(1, np.array([7, 11], np.int32), 3)]
  results = {r.id: r.tokens for r in served.run(requests)}
  for r in requests:
    assert results[r.id] == _alone(mc, params, r.prompt, r.max_new_tokens)
  assert calls[0] == ((2, 3), (2, 1))  # Both prompts, 1 page of the longest.
  decode_widths = {table for tokens, table in calls[1:]}
  assert {tokens for tokens, _ in calls[1:]} == {(2, 1)}
  # Lengths 3..15 and 2..4 (the new token's position included): 1 page, then
  # 2, 3 and 4 (3 no longer read as 4).
  assert sorted(decode_widths) == [(2, 1), (2, 2), (2, 3), (2, 4)]


@pytest.mark.slow
def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(
    monkeypatch):
  """Chunked prefill beside decode rows: a sequence already running gets a
  token every step while a long prompt arrives and is fed a chunk at a
  time; both still equal train.sample."""
  mc, params = _random_model()
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=4, slots=2,
                         prefill_chunk=4)
  calls = _spy_shapes(served, monkeypatch)
  short = engine.Request('short', np.array([3, 1, 4], np.int32), 12)
  long = engine.Request('long', np.arange(1, 19, dtype=np.int32), 4)
  served.add_request(short)
  served.step()  # The short prompt prefilled: it decodes from now on.
  served.add_request(long)
  outputs, tokens_before = {}, []
  while served.has_unfinished():
    running = {seq.id: len(seq.generated) for seq in served.scheduler.running}
    finished = served.step()
    outputs.update({o.id: o.tokens for o in finished})
    tokens_before.append(running)
  # The 18-token prompt took 5 steps of chunks of at most 4 tokens, and in
  # each of them the short sequence produced a token.
  chunks = [tokens for tokens, _ in calls if tokens[1] > 1]
  assert [T for _, T in chunks] == [3, 4, 4, 4, 4, 2]
  assert outputs['short'] == _alone(mc, params, short.prompt, 12)
  assert outputs['long'] == _alone(mc, params, long.prompt, 4)


def test_buckets_pad_by_less_than_a_quarter_past_8_with_few_sizes():
  sizes = [runner.bucket(n) for n in range(1, 129)]
  assert sizes[:8] == list(range(1, 9))  # 9 pages read as 10, not 16:
  assert sizes[8] == 10 and sizes[18] == 20  # 19 busy slots run as 20.
  assert all(n <= size < 1.25 * n for n, size in enumerate(sizes, 1))
  assert len(set(sizes)) == 24
  assert [runner.bucket(n, 1) for n in (1, 3, 9, 19)] == [1, 4, 16, 32]  # pylint: disable=protected-access


@pytest.mark.slow
def test_a_sampled_output_does_not_depend_on_what_shares_the_batch():
  """Each request samples by its own settings with the keys of (its seed,
  each token's position): alone, beside others, or in train.sample, the
  same tokens."""
  mc, params = _random_model()
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=8, slots=2)
  settings = [sampling.SamplingParams(temperature=1.0, top_k=20, seed=3),
              sampling.SamplingParams(temperature=0.8, top_p=0.9, seed=5),
              sampling.SamplingParams(),
              sampling.SamplingParams(temperature=1.0, top_k=20, seed=4)]
  prompts = [np.array([3, 1, 4], np.int32), np.array([1, 5, 9, 2], np.int32),
             np.array([6, 5], np.int32), np.array([3, 1, 4], np.int32)]
  requests = [engine.Request(i, p, 9, sampling=s)
              for i, (p, s) in enumerate(zip(prompts, settings))]
  mixed = {r.id: r.tokens for r in served.run(requests)}
  [alone] = served.run(requests[1:2])
  assert alone.tokens == mixed[1]
  for r in requests:
    assert mixed[r.id] == _alone(mc, params, r.prompt, 9, r.sampling), r.id
  assert mixed[0] != mixed[3]  # The seed is the request's.


@pytest.mark.slow
def test_mla_is_served_from_a_paged_int8_latent_cache():
  """Requests side by side, chunked prefill beside decoding, int8 latents:
  each request's tokens are decoding it alone (float32 latents:
  tests/test_layouts.py's paged pool and serving of MLA)."""
  mc, params = _random_model(attention='mla', num_kv_heads=4,
                             kv_cache_dtype='int8',
                             mla=dict(kv_lora_rank=8, qk_rope_head_dim=4))
  pool = runner.empty_pool(mc, 3, 4)
  assert set(pool['layers_0']['attention']) >= {'cached_latent'}
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=4, slots=2,
                         prefill_chunk=4)
  requests = [engine.Request(0, np.arange(1, 12, dtype=np.int32) * 7, 10),
              engine.Request(1, np.array([5, 2], np.int32), 6)]
  results = {r.id: r.tokens for r in served.run(requests)}
  for r in requests:
    assert results[r.id] == _alone(mc, params, r.prompt, r.max_new_tokens)


@pytest.mark.slow
def test_a_learned_position_model_is_served_with_per_row_positions():
  mc, params = _random_model(use_rope=False, learned_positions=True)
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=4, slots=2,
                         prefill_chunk=4)
  requests = [engine.Request(0, np.arange(1, 10, dtype=np.int32), 8),
              engine.Request(1, np.array([5, 2], np.int32), 12)]
  results = {r.id: r.tokens for r in served.run(requests)}
  for r in requests:
    assert results[r.id] == _alone(mc, params, r.prompt, r.max_new_tokens)


def test_the_engine_refuses_bad_requests_typed_and_in_one_line():
  mc, params = _random_model()
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=4, slots=2)
  served.add_request(engine.Request('a', np.array([1, 2], np.int32), 4))
  for request, reason in [
      (engine.Request('a', np.array([3], np.int32), 4), 'already in flight'),
      (engine.Request('b', np.array([], np.int32), 4), 'empty prompt'),
      (engine.Request('c', np.arange(30, dtype=np.int32), 4),
       'model.max_len (32)'),
      (engine.Request('d', np.array([3], np.int32), 4,
                      sampling.SamplingParams(top_p=2.0)), 'top_p=2.0'),
      (engine.Request('e', np.array([3], np.int32), 4,
                      sampling.SamplingParams(stop=('x',))),
       'stop strings need')]:
    with pytest.raises(engine.RequestRefused) as refused:
      served.add_request(request)
    assert reason in refused.value.reason and '\n' not in str(refused.value)
  # The refusals took nothing: 'a' alone is served.
  assert [(o.id, len(o.tokens)) for o in served.run([])] == [('a', 4)]
  assert not served.has_unfinished() and served.pages.in_use == 0


def test_a_rerun_keeps_results_and_retries_errors_and_a_cut_short_line(
    tmp_path):
  out = tmp_path / 'out.jsonl'
  results = [{'id': 'a', 'text': 'x', 'tokens': [120], 'request': 'r1'},
             {'id': 7, 'text': '', 'tokens': [], 'request': 'r2'}]
  _write_lines(out, [results[0], {'id': 'b', 'error': 'empty prompt; ...'},
                     {'line': 3, 'error': 'line 3: not JSON'}, results[1]])
  out.write_text(out.read_text() + '{"id": "c", "te')  # Killed mid-write.
  held = results_lib.plan(out, retry_errors=True)
  # 'b', line 3 and 'c' are run again.
  assert held.done == {prompts_lib.digest('"a"'): 'r1',
                       prompts_lib.digest('7'): 'r2'}
  results_lib.compact(out, held.drop)
  assert _lines(out) == results
  assert [p.name for p in tmp_path.iterdir()] == ['out.jsonl']


def test_the_last_line_for_an_id_wins_and_replaces_the_ones_before(tmp_path):
  """A regenerated request's line is appended; the run's end drops the
  line it replaces, and an error after a result means: not done."""
  out = tmp_path / 'out.jsonl'
  old, new = ({'id': 'a', 'text': 'x', 'request': 'r1'},
              {'id': 'a', 'text': 'y', 'request': 'r2'})
  _write_lines(out, [old, {'id': 'b', 'text': 'z', 'request': 'r3'}, new,
                     {'id': 'b', 'error': 'empty prompt'}])
  held = results_lib.plan(out, retry_errors=False)
  assert held.done == {prompts_lib.digest('"a"'): 'r2'}
  results_lib.compact(out, held.drop)
  assert _lines(out) == [new, {'id': 'b', 'error': 'empty prompt'}]


class _Bytes:
  encode = staticmethod(lambda text: np.frombuffer(text.encode(), np.uint8))


def test_a_max_new_tokens_leaving_no_room_is_one_line_unless_lines_give_theirs(
    tmp_path):
  prompts = tmp_path / 'prompts.jsonl'
  _write_lines(prompts, [{'id': 'own', 'prompt': 'ab', 'max_new_tokens': 4},
                         {'id': 'flag', 'prompt': 'c'}])
  lines = [prompts_lib.parse(n, text, 32, sampling.SamplingParams())
           for n, text in enumerate(prompts.read_text().splitlines(), 1)]
  assert [line.max_new_tokens for line in lines] == [4, 32]
  found = prompts_lib.scan(prompts)
  assert (found.defaulted, found.first_defaulted) == (1, 'flag')
  with pytest.raises(UserError, match=r'^--max_new_tokens=32 leaves no room '
                     r'for a prompt in model.max_len \(32\), so 1 request'):
    generate.check_max_new_tokens(32, 32, 1, 'flag')
  generate.check_max_new_tokens(31, 32, 1, 'flag')  # A one-token prompt fits.
  generate.check_max_new_tokens(32, 32, 0)  # Every line gives its own.


def test_the_summary_counts_refusals_and_exits_1_when_any(capsys):
  stats = engine.Stats(done=4, refused=2, tokens=40, steps=10, in_flight=20,
                       seconds=2.0)
  assert generate.report(stats, 'out.jsonl') == 1
  assert capsys.readouterr().err.splitlines()[-1] == (
      'generate: 4 done, 2 refused (see out.jsonl)')
  assert generate.report(dataclasses.replace(stats, refused=0),
                         'out.jsonl') == 0


def _write_lines(path, lines):
  path.write_text(''.join(
      (line if isinstance(line, str) else json.dumps(line)) + '\n'
      for line in lines))


@pytest.mark.slow
def test_bad_requests_are_one_line_each_and_the_rest_are_served_once(
    trained, tmp_path):
  prompts, out = tmp_path / 'prompts.jsonl', tmp_path / 'out.jsonl'
  _write_lines(prompts, [
      {'id': 'a', 'prompt': 'def '}, 'not json', {'id': 'empty', 'prompt': ''},
      {'id': 'long', 'prompt': 'x' * 30}, '[1, 2]',
      {'id': 'big', 'prompt': 'y' * 20, 'max_new_tokens': 12},
      {'id': 7, 'prompt': 'import', 'max_new_tokens': 4}])
  mc, params, _ = checkpoint.load_workdir(str(trained))
  # 3 usable pages of 8 tokens: 'big' (32 tokens, 4 pages) can never fit.
  memory = str(4 * runner.page_bytes(mc, 8))
  run = lambda: generate.generate_file(str(trained), str(prompts), str(out),
                                       kv_memory=memory, max_new_tokens=10,
                                       page_size=8, slots=1)
  stats = run()
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  by_key = {(e.get('id'), e.get('line')): e for e in lines}
  assert len(lines) == 7 and stats.high_water_pages <= 3
  assert (stats.done, stats.refused) == (2, 5)
  assert by_key[(None, 2)]['error'].startswith('line 2: not JSON')
  assert by_key[(None, 5)]['error'].startswith('line 5: needs an "id"')
  assert by_key[('empty', None)]['error'].startswith('empty prompt')
  assert 'model.max_len (32)' in by_key[('long', None)]['error']
  assert by_key[('big', None)]['error'] == (
      'it needs up to 4 pages of 8 tokens but the pool has 3; raise '
      '--kv_memory or shorten it')
  for key, prompt, new in [('a', b'def ', 10), (7, b'import', 4)]:
    expected = _alone(mc, params, np.frombuffer(prompt, np.uint8), new)
    assert by_key[(key, None)]['tokens'] == expected
    assert by_key[(key, None)]['text'] == bytes(expected).decode()
  assert all('\n' not in e.get('error', '') for e in lines)
  # A rerun into the same OUT retries only the refused (refused again, their
  # lines replaced, not repeated); a cut-short last line (a kill mid-write)
  # is redone.
  fields = lambda e: str([e.get('id'), e.get('line'), e.get('tokens'),
                          e.get('error')])
  read = lambda: sorted(map(fields, map(json.loads,
                                        out.read_text().splitlines())))
  stats = run()
  assert (stats.done, stats.refused) == (0, 5)
  assert read() == sorted(map(fields, lines))
  out.write_text(out.read_text()[:-5])
  run()
  assert read() == sorted(map(fields, lines))
  # Once its line is fixed, a refused request is served and its error gone.
  text = prompts.read_text().replace('"prompt": ""', '"prompt": "def "')
  prompts.write_text(text)
  stats = run()
  assert (stats.done, stats.refused) == (1, 4)
  fixed = {e.get('id'): e for e in map(json.loads,
                                         out.read_text().splitlines())}
  assert len(out.read_text().splitlines()) == 7
  assert fixed['empty']['tokens'] == by_key[('a', None)]['tokens']
  # --max_new_tokens leaving no room for a prompt: one line before any work.
  with pytest.raises(UserError, match='^--max_new_tokens=32 leaves no room'):
    generate.generate_file(str(trained), str(prompts), str(out),
                           kv_memory=memory, max_new_tokens=32)
  assert len(out.read_text().splitlines()) == 7


@pytest.mark.slow
def test_a_pool_too_small_for_any_sequence_is_one_line(trained, tmp_path):
  prompts = tmp_path / 'prompts.jsonl'
  _write_lines(prompts, [{'id': 1, 'prompt': 'def '}])
  result = _run('serve.generate', f'--workdir={trained}',
                f'--prompts={prompts}', f'--out={tmp_path / "out.jsonl"}',
                '--kv_memory=1KiB')
  _one_line_error(result, 'error: --kv_memory=1KiB: the KV memory (1,024 '
                  'bytes) holds 0 page(s)')
  assert 'too few for any sequence; give at least' in result.stderr
  result = _run('serve.generate', f'--workdir={trained}',
                f'--prompts={prompts}', f'--out={tmp_path / "out.jsonl"}',
                '--kv_memory=lots')
  _one_line_error(result, "--kv_memory='lots' is not a size")


@pytest.mark.slow
def test_bench_serve_reports_a_trace_beside_one_at_a_time(tmp_path):
  """Each contestant compiled once and timed in turns; the row holds the
  medians, and each ratio paired within a turn with its range."""
  args = argparse.Namespace(requests=3, prompt_len=[2, 9], output_len=[3, 6],
                            seed=0, slots=2, page_size=8, kv_memory='24KiB')
  trace = bench_serve.make_trace(args, 256, 32)
  assert [len(p) for p, _ in trace] == [
      len(p) for p, _ in bench_serve.make_trace(args, 256, 32)]  # Seeded.
  mc, params = _random_model(num_kv_heads=1)
  engine = bench_serve.engine_runner(mc, params, trace, 24 * 2**10, args)
  alone = bench_serve.alone_runner(mc, params, trace)
  static = bench_serve.static_runner(mc, params, trace, 24 * 2**10, 2)
  runs = [engine() | alone() | static() for _ in range(3)]
  row = bench_serve.summarize(runs)
  assert row['tokens'] == sum(new for _, new in trace)
  assert row['usable_pages'] == 24 * 2**10 // runner.page_bytes(mc, 8) - 1
  assert row['tokens_per_sec'] > 0 and row['alone_tokens_per_sec'] > 0
  assert row['tokens_per_cpu_sec'] > 0 and row['alone_tokens_per_cpu_sec'] > 0
  assert 1 <= row['mean_in_flight'] <= 2
  ratios = [r['tokens_per_sec'] / r['alone_tokens_per_sec'] for r in runs]
  assert row['alone_speedup'] == pytest.approx(np.median(ratios))
  assert row['alone_speedup_range'] == [min(ratios), max(ratios)]
  # The static peer's batch: the dense caches --kv_memory holds, at most
  # --slots (24 KiB holds 3 caches of the longest request's 15 tokens).
  assert row['static_batch'] == bench_serve.static_batch(
      mc, trace, 24 * 2**10, 2) == 2
  assert row['static_tokens_per_sec'] > 0 and 'static_speedup' in row
  assert row['seconds'] == pytest.approx(np.median(
      [r['seconds'] for r in runs]))
  bench_serve.plot([row], tmp_path / 'serve.png')
  report = bench_serve.report({'command': 'c', 'date': 'd', 'repeats': 3,
                               'rows': [row]}, args)
  assert '| 1 | 1,024 |' in report and '| (2) ' in report
  low, high = row['alone_speedup_range']
  assert f'wall {row["alone_speedup"]:.2f}x ({low:.2f} to {high:.2f}), CPU ' \
      in report
  assert '3 timed run(s) of each, taking turns' in report


def test_bench_serve_serves_named_layouts_and_refuses_what_it_cannot_peer():
  """--variants in studies.variants' grammar (bench_decode's), in place of --kv_heads (8,2,1
  by default); a layout transformers cannot compute needs --no_hf."""
  args = lambda **given: argparse.Namespace(
      **{'kv_heads': None, 'variants': None, 'no_hf': False, **given})
  names = lambda a: [v.name for v in bench_serve._variants(a)]  # pylint: disable=protected-access
  assert names(args()) == ['K8', 'K2', 'K1']
  assert names(args(kv_heads=[4])) == ['K4']
  tpa = variants.variant_list('K2,TPA2')
  assert names(args(variants=tpa, no_hf=True)) == ['K2', 'TPA2']
  with pytest.raises(UserError, match='^--variants=TPA2: the transformers '
                     'peer computes grouped-query attention only; add '
                     '--no_hf$'):
    bench_serve._variants(args(variants=tpa))  # pylint: disable=protected-access
  with pytest.raises(UserError, match='^give --kv_heads or --variants, not '
                     'both'):
    bench_serve._variants(args(variants=tpa, kv_heads=[2], no_hf=True))  # pylint: disable=protected-access


def test_bench_serve_says_under_load_only_when_more_than_it_ran():
  assert not bench_serve._loaded({'cores': 2, 'load_average': [1.4, 1, 1]})  # pylint: disable=protected-access
  assert bench_serve._loaded({'cores': 2, 'load_average': [18.4, 18, 18]})  # pylint: disable=protected-access
  assert bench_serve._loaded({})  # pylint: disable=protected-access  # Unknown: not called idle.


@pytest.mark.slow
def test_bench_serve_runs_transformers_on_the_same_trace_in_its_own_process():
  config = tiny.get_config()
  config.model.num_kv_heads = 1
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=1))
  trace = [(np.array([5, 6, 7], np.int32), 4), (np.array([9], np.int32), 2),
           (np.array([1, 2], np.int32), 3)]
  with bench_serve.transformers_runner(config, params, trace,
                                      slots=2) as run:
    row = run()
  assert row['hf_tokens_per_sec'] > 0 and row['hf_tokens_per_cpu_sec'] > 0
  assert row['hf_threads'] == bench_serve.jax_threads()
  assert 0 < row['hf_time_to_first_token_s'] < row['hf_seconds']


def test_bench_serve_draws_lengths_on_the_length_step():
  args = argparse.Namespace(requests=20, prompt_len=[8, 80],
                            output_len=[16, 64], length_step=24, seed=0)
  trace = bench_serve.make_trace(args, 256, 256)
  assert {len(p) for p, _ in trace} <= {8, 32, 56, 80}
  assert {new for _, new in trace} <= {16, 40, 64}
  assert len({(len(p), new) for p, new in trace}) > 4  # Still a mix.


def test_bench_serve_refuses_a_trace_past_max_len_in_one_line():
  args = argparse.Namespace(requests=3, prompt_len=[8, 30],
                            output_len=[4, 8], seed=0)
  with pytest.raises(UserError, match=r'past model.max_len \(32\); lower '
                     'their highs$'):
    bench_serve.make_trace(args, 256, 32)


def _ynn_dots(compiled_text: str) -> int:
  """How many fusions handed to YNNPACK hold a dot."""
  bodies = dict(re.findall(r'^(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}',
                           compiled_text, re.M | re.S))
  called = re.findall(r'calls=(%[\w.\-]+)[^\n]*__ynn_fusion', compiled_text)
  return sum(' dot(' in bodies.get(name, '') for name in called)


def test_the_cpu_decode_step_leaves_its_matmuls_to_xla_not_ynnpack():
  mc, params = _random_model()
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=4, slots=8)
  model_runner, B = served.runner, 8
  rows = lambda: np.zeros(B, np.int32)
  args = (model_runner.params, model_runner.pool, np.zeros((B, 1), np.int32),
          np.zeros((B, 2), np.int32), rows(), None,
          sampling.rows([sampling.SamplingParams()] * B), rows())
  ours = model_runner._step.lower(*args).compile().as_text()  # pylint: disable=protected-access
  control = jax.jit(functools.partial(  # The same step, XLA's defaults.
      runner._run_rows, model_runner.model)).lower(  # pylint: disable=protected-access
          *args).compile().as_text()
  assert _ynn_dots(control) > 0
  assert _ynn_dots(ours) == 0


@pytest.mark.slow  # A subprocess compiling nothing: seconds of imports.
def test_bench_serve_refuses_a_pool_too_small_for_the_trace_before_any_run(
    tmp_path):
  """Checked for every K before the first is timed (it was refused when
  its engine was built, after the K before it had run)."""
  result = _run('scripts.bench_serve', '--config=tiny', '--kv_heads=1,4',
                '--kv_memory=20KiB', '--requests=4', '--prompt_len=20,20',
                '--output_len=12,12', f'--out={tmp_path / "out"}', '--no_hf')
  _one_line_error(result, 'K=4: the trace\'s longest request')
  assert 'give --kv_memory of at least' in result.stderr
  assert not (tmp_path / 'out').exists()


def _prompts(path, ids):
  _write_lines(path, [{'id': i, 'prompt': f'def f{i}'} for i in ids])
  return path


def _lines(out):
  return [json.loads(line) for line in out.read_text().splitlines()]


def _generate(trained, prompts, out, **kwargs):
  kwargs = dict(dict(kv_memory='1MiB', max_new_tokens=4, page_size=8,
                     slots=2), **kwargs)
  return generate.generate_file(str(trained), str(prompts), str(out),
                                **kwargs)


def test_duplicate_ids_are_refused_before_anything_is_written(trained,
                                                              tmp_path):
  prompts = tmp_path / 'prompts.jsonl'
  _write_lines(prompts, [{'id': 'a', 'prompt': 'x'}, {'id': 'b', 'prompt': 'y'},
                         {'id': 'a', 'prompt': 'z'}])
  with pytest.raises(UserError, match=r'id "a" is on lines 1 and 3; give each '
                     r'prompt its own id \(nothing was written\)$'):
    _generate(trained, prompts, tmp_path / 'out.jsonl')
  assert sorted(p.name for p in tmp_path.iterdir()) == ['prompts.jsonl']


def test_out_equal_to_prompts_is_refused_and_the_prompts_kept(trained,
                                                              tmp_path):
  prompts = _prompts(tmp_path / 'prompts.jsonl', ['a'])
  before = prompts.read_text()
  for out in (prompts, tmp_path / '.' / 'prompts.jsonl'):
    with pytest.raises(UserError, match=r'is the --prompts file; give another '
                       'file for the results$'):
      _generate(trained, prompts, out)
  assert prompts.read_text() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ['prompts.jsonl']


@pytest.mark.slow
def test_a_rerun_under_other_settings_is_refused_naming_the_difference(
    trained, tmp_path):
  prompts = _prompts(tmp_path / 'prompts.jsonl', ['a', 'b'])
  out = tmp_path / 'out.jsonl'
  _generate(trained, prompts, out)
  before = out.read_text()
  _prompts(prompts, ['a', 'b', 'c'])  # A new request to run.
  for kwargs, difference in [
      (dict(max_new_tokens=5), 'max_new_tokens=4, not 5'),
      (dict(settings=sampling.SamplingParams(temperature=0.5)),
       'temperature=0.0, not 0.5'),
      (dict(kv_cache_dtype='int8'), "kv_cache_dtype='float32', not 'int8'")]:
    with pytest.raises(UserError, match=f'holds results made with '
                       f'{re.escape(difference)}; rerun with the same '
                       'settings or give another --out$'):
      _generate(trained, prompts, out, **kwargs)
    assert out.read_text() == before  # Nothing mixed in.
  # Serving settings change no text: another --slots, --page_size and
  # --prefill_chunk complete the same OUT.
  _generate(trained, prompts, out, slots=1, page_size=4, prefill_chunk=2)
  assert out.read_text().startswith(before)
  assert [e['id'] for e in _lines(out)] == ['a', 'b', 'c']


def test_a_second_process_on_the_same_out_is_refused(trained, tmp_path):
  prompts = _prompts(tmp_path / 'prompts.jsonl', ['a'])
  out = tmp_path / 'out.jsonl'
  with results_lib.Lock(out):
    with pytest.raises(UserError, match=r'^out.jsonl is being written by '
                       rf'serve.generate pid {os.getpid()}; wait for it to '
                       'end or give another --out$'):
      _generate(trained, prompts, out)
  assert not out.exists()


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_a_rerun_completes_the_rest(
    trained, tmp_path, monkeypatch):
  prompts = _prompts(tmp_path / 'prompts.jsonl', ['a', 'b', 'c', 'd'])
  out = tmp_path / 'out.jsonl'
  entry, written = generate._Run._entry, []  # pylint: disable=protected-access
  def fills_up(*args):
    if len(written) == 2:
      raise OSError(errno.ENOSPC, 'No space left on device')
    written.append(1)
    return entry(*args)
  monkeypatch.setattr(generate._Run, '_entry', fills_up)  # pylint: disable=protected-access
  with pytest.raises(UserError, match=r'^cannot write .*out.jsonl \(No space '
                     r'left on device\); free space and rerun the same '
                     'command: the results written are kept'):
    _generate(trained, prompts, out)
  assert len(_lines(out)) == 2
  monkeypatch.undo()
  _generate(trained, prompts, out)
  assert sorted(e['id'] for e in _lines(out)) == ['a', 'b', 'c', 'd']


@pytest.mark.slowest
def test_kill_9_then_rerun_gives_every_id_exactly_once(trained, tmp_path):
  ids = [f'r{i}' for i in range(24)]
  prompts = _prompts(tmp_path / 'prompts.jsonl', ids)
  out = tmp_path / 'out.jsonl'
  command = [sys.executable, '-m', 'serve.generate', f'--workdir={trained}',
             f'--prompts={prompts}', f'--out={out}', '--kv_memory=1MiB',
             '--max_new_tokens=20', '--slots=2', '--page_size=8']
  process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  deadline = time.time() + 120
  while time.time() < deadline and (
      not out.exists() or out.read_text().count('\n') < 3):
    time.sleep(0.05)
  process.kill()  # SIGKILL, mid-run.
  process.wait()
  done_before = out.read_text().count('\n')
  assert 3 <= done_before < len(ids)
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          timeout=180)
  assert result.returncode == 0, result.stderr
  lines = out.read_text().splitlines(keepends=True)
  assert all(line.endswith('\n') for line in lines)
  assert sorted(json.loads(line)['id'] for line in lines) == sorted(ids)


def test_an_out_this_command_did_not_write_is_refused_and_kept(trained,
                                                               tmp_path):
  prompts = _prompts(tmp_path / 'prompts.jsonl', ['a'])
  notes = tmp_path / 'notes.txt'
  notes.write_text('my notes\nno newline at end')
  with pytest.raises(UserError, match=r'is a file this command did not write '
                     r'\(no notes.txt.settings.json beside it\); give a new '
                     'file for the results$'):
    _generate(trained, prompts, notes)
  assert notes.read_text() == 'my notes\nno newline at end'


def test_prompt_lines_with_unknown_keys_or_no_prompt_are_refused_by_id(
    trained, tmp_path):
  prompts = tmp_path / 'prompts.jsonl'
  _write_lines(prompts, [{'id': 'hot', 'prompt': 'def ', 'temperature': 0.9},
                         {'id': 'none'}, {'id': 'ok', 'prompt': 'def '}])
  out = tmp_path / 'out.jsonl'
  stats = _generate(trained, prompts, out)
  by_id = {e['id']: e for e in _lines(out)}
  assert by_id['hot']['error'] == (
      'line 1: unknown key(s) temperature; a line takes "id", "prompt", '
      '"max_new_tokens" and "seed" (the rest of sampling is set by the '
      'flags)')
  assert by_id['none']['error'].startswith('line 2: needs a "prompt" string')
  assert 'tokens' in by_id['ok'] and (stats.done, stats.refused) == (1, 2)


def test_an_empty_prompt_file_is_one_line_not_a_success(trained, tmp_path):
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text('\n')
  with pytest.raises(UserError, match=r'holds no prompts; write'):
    _generate(trained, prompts, tmp_path / 'out.jsonl')
  assert sorted(p.name for p in tmp_path.iterdir()) == ['prompts.jsonl']


def test_pools_and_pages_the_engine_cannot_use_are_typed_one_line_errors():
  mc = _config()
  with pytest.raises(engine.PoolTooLarge, match=r'^the KV memory '
                     r'\(1,000,000,000,000,000 bytes\) is more than the device '
                     r'holds \([\d,]+ bytes\); give less'):
    engine.Engine(mc, None, kv_memory=10**15)
  with pytest.raises(UserError, match=r'^page_size=64 is more than '
                     r'model.max_len \(32\)'):
    engine.Engine(mc, None, kv_memory=2**20, page_size=64)


@pytest.mark.slow
def test_settings_that_cannot_change_a_text_do_not_refuse_a_rerun(
    trained, tmp_path):
  """The model's own cache dtype named, or another seed when greedy: the
  same texts, so the rerun goes on."""
  prompts = _prompts(tmp_path / 'prompts.jsonl', ['a'])
  out = tmp_path / 'out.jsonl'
  _generate(trained, prompts, out)
  _prompts(prompts, ['a', 'b'])
  _generate(trained, prompts, out, kv_cache_dtype='float32',
            settings=sampling.SamplingParams(seed=9, top_k=3))
  assert [e['id'] for e in _lines(out)] == ['a', 'b']


@pytest.mark.slow
def test_a_pipe_reads_stdin_and_streams_to_stdout_leaving_no_files(
    trained, tmp_path):
  """--prompts=- and --out=- (nothing to resume, so no OUT.settings.json and
  no lock), the same lines a file gets; a device as --out is refused with
  the way to stream."""
  lines = [json.dumps({'id': i, 'prompt': f'def f{i}'}) for i in 'ab']
  result = subprocess.run(
      [sys.executable, '-m', 'serve.generate', f'--workdir={trained}',
       '--prompts=-', '--out=-', '--kv_memory=1MiB', '--max_new_tokens=4',
       '--page_size=8'], input='\n'.join(lines) + '\n', cwd=tmp_path,
      capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  streamed = [json.loads(line) for line in result.stdout.splitlines()]
  assert sorted(e['id'] for e in streamed) == ['a', 'b']
  assert 'see stdout' in result.stderr
  assert list(tmp_path.iterdir()) == []
  prompts = _prompts(tmp_path / 'prompts.jsonl', ['a', 'b'])
  _generate(trained, prompts, tmp_path / 'out.jsonl')
  by_id = {e['id']: e['tokens'] for e in _lines(tmp_path / 'out.jsonl')}
  assert {e['id']: e['tokens'] for e in streamed} == by_id
  with pytest.raises(UserError, match=r'^--out=/dev/stdout is a device; '
                     r'give a file for the results, or --out=- to stream'):
    _generate(trained, prompts, '/dev/stdout')
