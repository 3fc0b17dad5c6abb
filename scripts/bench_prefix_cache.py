"""Prefix caching on against off: requests that share a long prefix.

  python -m scripts.bench_prefix_cache --workdir=W [--requests=256]
      [--prefix_len=512] [--suffix_len=8,32] [--new_tokens=16]
      [--kv_memory=64MiB] [--slots=32] [--repeats=3] [--warmups=6]
      [--seed=0] [--out=DIR]
  python -m scripts.bench_prefix_cache --workdir=W --harness
      [--task=gqa_lab_fewshot] [--include_path=tests/lm_eval_tasks]
      [--docs=N] [--num_fewshot=N] [--batch_size=16] [--num_concurrent=1]
      [--kv_memory=64MiB] [--slots=32] [--repeats=3] [--seed=0] [--out=DIR]

The trace: --requests prompts, each the same --prefix_len random tokens
followed by a suffix of its own (random tokens, its length drawn from the
inclusive range --suffix_len), all arriving at once (an offline batch, as
a few-shot task's documents share their examples); each continued by
--new_tokens tokens, sampled at temperature 1 with a seed of its own (so a
wrong cached page would change the text). Prompt tokens are uniform over
the vocabulary, drawn with numpy's generator seeded by --seed; the model is
the workdir's (speed does not depend on the weights; a model of max_len
at least prefix + suffix + new).

Two engines (`serve.engine.Engine`, --kv_memory, --slots), prefix caching
on and off, each warmed up by passes over traces of the same lengths but
other prefixes (so a timed pass finds nothing of its own prefix cached
before it starts) until a pass compiles nothing new (the engine's step
shapes depend on how requests interleave, so one pass can leave programs
for the next), at most --warmups passes, then timed --repeats times,
taking turns; the programs still compiled in the timed passes are
counted in the report (`studies.timing.compiles`).
Each timed pass has a fresh prefix, so caching starts cold every time and
only what the pass itself computed can be shared: the requests admitted
in the first step (up to --slots) compute the prefix side by side (a page
is keyed once a step has filled it), those admitted later find it.
Reported: prompt tokens computed by prefill (the engine's
Stats.prefill_tokens), those found
cached, wall seconds (median), the ratio off / on, and whether every
request's tokens are identical with caching on and off (they must be: the
exit status is 1 if not). Printed with the CPU model and vector extensions
and the load average; writes OUT/bench_prefix_cache.json.

--harness: a few-shot lm_eval task instead of a made-up trace, through the
server as a user runs it: two `python -m serve.api` processes
(`serve.process`, --kv_memory, --slots), one with --noprefix_caching,
each scoring --task (default gqa_lab_fewshot: sums, its 40 shots the same
for every document; tests/lm_eval_tasks) with lm_eval's local-completions
(`evaluation.served`: greedy generate_until requests, --batch_size
prompts a POST, --num_concurrent POSTs at a time). Each pass draws the
task's documents and shots from its own `shots_seed` (--seed + the pass),
so each starts cold as above; a warm-up pass on other shots compiles
first. The task's prompts share their shots as a prefix: the first POST's
prompts compute it side by side, the later ones find it. Reported: the
server's counters over each timed pass (GET /metrics: prompt tokens
computed by prefill, those found cached), the wall seconds of lm_eval's
requests (its model's calls: contexts tokenized through /tokenize, the
completions POSTs) and of its whole evaluation (which adds lm_eval's own
work, building each document's prompt and scoring, alike with caching on
and off), medians, off / on; and whether every document's generation and
the task's metrics are identical with caching on and off (exit status 1
if not, if a server counted another number of requests than lm_eval
sent, or if a server does not drain to exit 0). Writes
OUT/bench_prefix_cache_harness.json.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sys
import time

import numpy as np

from infra import provenance
from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       int_range, positive_int)
from evaluation import evaluate
from evaluation import served
from infra.errors import UserError
from lm import inference
from lm.sampling_params import SamplingParams
from serve import engine as engine_lib
from serve import pages
from serve import process
from studies import timing

# The lab's local lm_eval tasks (each a YAML over data built locally).
TASKS_DIR = pathlib.Path(__file__).resolve().parent.parent / 'tests' / (
    'lm_eval_tasks')


def make_trace(rng, vocab_size: int, requests: int, prefix_len: int,
               suffix_len, new_tokens: int) -> list[engine_lib.Request]:
  """Requests sharing one prefix (drawn here), each with its own suffix."""
  prefix = rng.integers(vocab_size, size=prefix_len).tolist()
  trace = []
  for i in range(requests):
    suffix = rng.integers(vocab_size, size=int(rng.integers(
        suffix_len[0], suffix_len[1] + 1))).tolist()
    trace.append(engine_lib.Request(
        i, prefix + suffix, new_tokens,
        SamplingParams(temperature=1.0, seed=int(rng.integers(1 << 31)))))
  return trace


def warm_up(engine: engine_lib.Engine, traces, most: int) -> int:
  """Passes over traces (an iterator of them) until one compiles nothing
  new, at most `most` (at least one); how many ran."""
  for passes in range(1, max(most, 1) + 1):
    known = timing.compiles()
    list(engine.run(next(traces)))
    if timing.compiles() == known:
      break
  return passes


def timed(engine: engine_lib.Engine, trace) -> dict:
  """One pass: wall seconds, prefill tokens computed and found cached, the
  programs compiled in it, and each request's tokens."""
  known = timing.compiles()
  start = time.perf_counter()
  outputs = list(engine.run(trace))
  seconds = time.perf_counter() - start
  compiled = timing.compiles() - known
  errors = [o.error for o in outputs if o.error]
  if errors:
    raise UserError(f'{len(errors)} requests refused ({errors[0]}); raise '
                    '--kv_memory or shorten the requests')
  s = engine.stats
  return {'seconds': seconds, 'prefill_tokens': s.prefill_tokens,
          'cached_tokens': s.cached_tokens, 'preemptions': s.preemptions,
          'compiled': compiled,
          'tokens': {o.id: list(o.tokens) for o in outputs}}


def run(args) -> dict:
  mc, params, _ = inference.load_language_model(args.workdir)
  longest = args.prefix_len + args.suffix_len[1] + args.new_tokens
  if longest > mc.max_len:
    raise UserError(f'--prefix_len + --suffix_len + --new_tokens reach '
                    f'{longest} tokens, past the model\'s max_len '
                    f'{mc.max_len}; shorten them or use a longer model')
  rng = np.random.default_rng(args.seed)
  shape = (mc.vocab_size, args.requests, args.prefix_len, args.suffix_len,
           args.new_tokens)
  engines = {}
  for caching in (True, False):
    engines[caching] = engine_lib.Engine(
        mc, params, kv_memory=pages.parse_bytes(args.kv_memory),
        slots=args.slots, prefix_caching=caching)
  warmups = {}
  for caching, engine in engines.items():  # Other prefixes than the timed.
    traces = (make_trace(np.random.default_rng([args.seed, 1, i]), *shape)
              for i in range(args.warmups))
    warmups[caching] = warm_up(engine, traces, args.warmups)
  passes = {True: [], False: []}
  for _ in range(args.repeats):
    trace = make_trace(rng, *shape)  # A fresh prefix: a cold cache.
    for caching, engine in engines.items():
      passes[caching].append(timed(engine, trace))
  identical = all(on['tokens'] == off['tokens']
                  for on, off in zip(passes[True], passes[False]))
  summary = {}
  for caching, runs in passes.items():
    summary['on' if caching else 'off'] = {
        'seconds': float(np.median([r['seconds'] for r in runs])),
        'seconds_each': [r['seconds'] for r in runs],
        'warmup_passes': warmups[caching],
        'compiled_when_timed': sum(r['compiled'] for r in runs),
        **{k: runs[-1][k] for k in ('prefill_tokens', 'cached_tokens',
                                    'preemptions')}}
  return {'identical': identical, **summary,
          'speedup': summary['off']['seconds'] / summary['on']['seconds']}


def report(result: dict, args) -> str:
  rows = [f'prefix caching: {args.requests} requests sharing a '
          f'{args.prefix_len}-token prefix (suffixes of {args.suffix_len[0]}'
          f'..{args.suffix_len[1]}, {args.new_tokens} new tokens each); '
          f'{provenance.describe(result["machine"])}; load average '
          f'{result["load_before"]} before, {result["load_after"]} after',
          f'{"caching":10}{"prefill tokens":>16}{"cached":>10}'
          f'{"seconds (median)":>18}']
  for name in ('on', 'off'):
    r = result[name]
    rows.append(f'{name:10}{r["prefill_tokens"]:16,}{r["cached_tokens"]:10,}'
                f'{r["seconds"]:18.2f}')
  rows.append(f'off / on: {result["speedup"]:.2f}x wall time; tokens '
              f'identical: {"yes" if result["identical"] else "NO"}')
  rows.append('warm-up passes (programs still compiled in the timed '
              'passes): ' + ', '.join(
                  f'{name} {result[name]["warmup_passes"]} '
                  f'({result[name]["compiled_when_timed"]})'
                  for name in ('on', 'off')))
  return '\n'.join(rows)


# The server's counters (GET /metrics) a harness pass reports.
COUNTERS = {'prefill_tokens': 'gqa_lab_prefill_tokens_total',
            'cached_tokens': 'gqa_lab_prefix_cache_hits_total',
            'prompt_tokens': 'gqa_lab_prompt_tokens_total',
            'preemptions': 'gqa_lab_preemptions_total',
            'requests': 'gqa_lab_requests_finished_total'}


# Seconds a server has to count the requests a client has its answers to.
COUNT_WAIT_S = 60.0


def counted(server: process.ServerProcess, before: dict,
            requests: int) -> dict:
  """The counters' growth since `before`, once the server has counted
  `requests` more finished (a client has its answer a moment before the
  step's counters are mirrored), or after COUNT_WAIT_S."""
  deadline = time.monotonic() + COUNT_WAIT_S
  while True:
    now = server.counters()
    grown = {k: now.get(m, 0) - before.get(m, 0) for k, m in COUNTERS.items()}
    if grown['requests'] >= requests or time.monotonic() > deadline:
      return {k: int(v) for k, v in grown.items()}
    time.sleep(0.05)


def harness_pass(server, score, shots_seed: int, task: str) -> dict:
  """One lm_eval evaluation through a server: its wall seconds, the
  server's counters over it, each document's responses, the metrics."""
  before = server.counters()
  scored = score(server.url, metadata={'shots_seed': shots_seed})
  responses = scored.responses[task]
  sent = sum(len(doc) for doc in responses)  # One a choice, a repeat.
  return {'seconds': scored.seconds,
          'request_seconds': scored.request_seconds, 'sent': sent,
          **counted(server, before, sent),
          'shared_prefix_chars': len(os.path.commonprefix(
              scored.contexts[task])),
          'responses': responses, 'metrics': scored.metrics[task]}


def run_harness(args) -> dict:
  """Two servers, caching on and off, scoring --task in turns."""
  evaluate.check_tasks([args.task], args.include_path)  # Before loading.
  flags = [f'--kv_memory={args.kv_memory}', f'--slots={args.slots}']
  servers = {}
  try:
    servers[True] = process.ServerProcess(args.workdir, *flags)
    servers[False] = process.ServerProcess(args.workdir, *flags,
                                           '--noprefix_caching')
    card = servers[True].model()
    score = functools.partial(
        served.evaluate, model=card['id'], max_len=card['max_model_len'],
        tasks=[args.task], include_path=args.include_path, limit=args.docs,
        num_fewshot=args.num_fewshot, batch_size=args.batch_size,
        num_concurrent=args.num_concurrent)
    for server in servers.values():  # Compiles, on shots of its own.
      harness_pass(server, score, args.seed + args.repeats, args.task)
    passes = {True: [], False: []}
    for r in range(args.repeats):
      for caching, server in servers.items():
        passes[caching].append(harness_pass(server, score, args.seed + r,
                                            args.task))
  finally:
    status = {caching: server.stop() for caching, server in servers.items()}
  failures = [f'the server with caching {"on" if c else "off"} exited {s} '
              'after SIGTERM' for c, s in status.items() if s != 0]
  failures += [f'a pass sent {r["sent"]} requests and the server with '
               f'caching {"on" if c else "off"} counted {r["requests"]}'
               for c, runs in passes.items() for r in runs
               if r['requests'] != r['sent']]
  identical = all(on['responses'] == off['responses']
                  and on['metrics'] == off['metrics']
                  for on, off in zip(passes[True], passes[False]))
  summary = {}
  for caching, runs in passes.items():
    last = runs[-1]
    summary['on' if caching else 'off'] = {
        **{k: float(np.median([r[k] for r in runs]))
           for k in ('seconds', 'request_seconds')},
        **{f'{k}_each': [r[k] for r in runs]
           for k in ('seconds', 'request_seconds')},
        **{k: last[k] for k in (*COUNTERS, 'shared_prefix_chars')},
        'metrics': last['metrics']}
  return {'identical': identical, 'failures': failures,
          'documents': summary['on']['requests'], **summary,
          'speedup': summary['off']['seconds'] / summary['on']['seconds'],
          'request_speedup': (summary['off']['request_seconds']
                              / summary['on']['request_seconds'])}


def report_harness(result: dict, args) -> str:
  on = result['on']
  rows = [f'prefix caching: lm_eval task {args.task} through serve.api '
          f'(local-completions, {result["documents"]} documents, their '
          f'prompts sharing {on["shared_prefix_chars"]} characters of '
          f'shots; {on["prompt_tokens"]:,} prompt tokens a pass); '
          f'{provenance.describe(result["machine"])}; load average '
          f'{result["load_before"]} before, {result["load_after"]} after',
          f'{"caching":10}{"prefill tokens":>16}{"cached":>10}'
          f'{"requests (s)":>14}{"lm_eval (s)":>13}  (medians)']
  for name in ('on', 'off'):
    r = result[name]
    rows.append(f'{name:10}{r["prefill_tokens"]:16,}{r["cached_tokens"]:10,}'
                f'{r["request_seconds"]:14.2f}{r["seconds"]:13.2f}')
  rows.append(f'off / on: {result["request_speedup"]:.2f}x the requests\' '
              f'wall time, {result["speedup"]:.2f}x lm_eval\'s; generations '
              f'and metrics identical: '
              f'{"yes" if result["identical"] else "NO"}')
  rows += result['failures']
  return '\n'.join(rows)


# Flags read by one mode only: None unless given, then refused in the
# other mode, and their defaults filled in here.
SYNTHETIC = {'requests': 256, 'prefix_len': 512, 'suffix_len': [8, 32],
             'new_tokens': 16, 'warmups': 6}
HARNESS = {'task': 'gqa_lab_fewshot', 'include_path': str(TASKS_DIR),
           'docs': None, 'num_fewshot': None, 'batch_size': 16,
           'num_concurrent': 1}


def _parser() -> ArgumentParser:
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--workdir', required=True,
                      help='a train.main workdir: the model served')
  parser.add_argument('--harness', action='store_true',
                      help='an lm_eval task through two serve.api '
                      'processes instead of the made-up trace')
  synthetic = parser.add_argument_group(
      'the made-up trace (without --harness)')
  synthetic.add_argument('--requests', type=positive_int,
                         help='prompts (default 256)')
  synthetic.add_argument('--prefix_len', type=positive_int,
                         help='tokens of the prefix they share (default 512)')
  synthetic.add_argument('--suffix_len', type=int_range,
                         help="LOW,HIGH: each prompt's own tokens after the "
                         'prefix (default 8,32)')
  synthetic.add_argument('--new_tokens', type=positive_int,
                         help='tokens sampled per request (default 16)')
  synthetic.add_argument('--warmups', type=positive_int,
                         help='warm-up passes at most, until one compiles '
                         'nothing new (default 6)')
  harness = parser.add_argument_group('the harness (with --harness)')
  harness.add_argument('--task', help='an lm_eval task whose documents '
                       'share their shots (default gqa_lab_fewshot)')
  harness.add_argument('--include_path', help="the task's folder (default "
                       'tests/lm_eval_tasks)')
  harness.add_argument('--docs', type=positive_int,
                       help="documents scored (default: the task's all)")
  harness.add_argument('--num_fewshot', type=int,
                       help="shots per document (default: the task's)")
  harness.add_argument('--batch_size', type=positive_int,
                       help='prompts per POST (default 16)')
  harness.add_argument('--num_concurrent', type=positive_int,
                       help='POSTs at a time (default 1)')
  parser.add_argument('--kv_memory', default='64MiB',
                      help="each engine's KV pages, in bytes with a unit "
                      '(default 64MiB)')
  parser.add_argument('--slots', type=positive_int, default=32,
                      help='sequences in flight at most (default 32)')
  parser.add_argument('--repeats', type=positive_int, default=3,
                      help='timed passes of each (default 3)')
  parser.add_argument('--seed', type=int, default=0,
                      help='seeds the trace, or the shots (default 0)')
  parser.add_argument('--out', default=None,
                      help='a folder for the JSON result (default: none)')
  return parser


def parse(argv=None):
  """The flags, checked: the other mode's refused, this mode's defaults
  filled in."""
  args = _parser().parse_args(argv)
  mine, other = (HARNESS, SYNTHETIC) if args.harness else (SYNTHETIC,
                                                            HARNESS)
  given = [f'--{k}' for k in other if getattr(args, k) is not None]
  if given:
    one = len(given) == 1
    raise UserError(
        f'{", ".join(given)} {"is" if one else "are"} read only '
        f'{"without" if args.harness else "with"} --harness; '
        f'{"" if args.harness else "add --harness or "}'
        f'drop {"it" if one else "them"}')
  for k, default in mine.items():
    if getattr(args, k) is None:
      setattr(args, k, default)
  if args.harness and args.num_fewshot is not None and args.num_fewshot < 0:
    raise UserError(f'--num_fewshot={args.num_fewshot} must be >= 0')
  pages.parse_bytes(args.kv_memory)  # A bad size: one line, before loading.
  if args.out:
    check_output_dir(args.out)
  return args


def main(argv=None) -> int:
  args = parse(argv)
  load_before = [round(x, 2) for x in os.getloadavg()]
  result = run_harness(args) if args.harness else run(args)
  result = {**provenance.record('scripts.bench_prefix_cache', args.out or '',
                                argv=argv),
            'load_before': load_before,
            'load_after': [round(x, 2) for x in os.getloadavg()], **result}
  print(report_harness(result, args) if args.harness
        else report(result, args))
  if args.out:
    path = pathlib.Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    name = ('bench_prefix_cache_harness.json' if args.harness
            else 'bench_prefix_cache.json')
    (path / name).write_text(json.dumps(result, indent=1))
  return 0 if result['identical'] and not result.get('failures') else 1


if __name__ == '__main__':
  exit_on_user_error(lambda: sys.exit(main()))
