"""Prefix caching on against off: requests that share a long prefix.

  python -m scripts.bench_prefix_cache --workdir=W [--requests=256]
      [--prefix_len=512] [--suffix_len=8,32] [--new_tokens=16]
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
on and off, each compiled by a warm-up pass over a trace of the same
shapes but another prefix (so the timed pass finds nothing of its own
prefix cached before it starts), then timed --repeats times, taking turns.
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
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import numpy as np

from infra import provenance
from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       int_list, positive_int)
from infra.errors import UserError
from lm import inference
from lm.sampling_params import SamplingParams
from serve import engine as engine_lib
from serve import pages


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


def timed(engine: engine_lib.Engine, trace) -> dict:
  """One pass: wall seconds, prefill tokens computed and found cached, and
  each request's tokens."""
  start = time.perf_counter()
  outputs = list(engine.run(trace))
  seconds = time.perf_counter() - start
  errors = [o.error for o in outputs if o.error]
  if errors:
    raise UserError(f'{len(errors)} requests refused ({errors[0]}); raise '
                    '--kv_memory or shorten the requests')
  s = engine.stats
  return {'seconds': seconds, 'prefill_tokens': s.prefill_tokens,
          'cached_tokens': s.cached_tokens, 'preemptions': s.preemptions,
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
  warm_up = make_trace(np.random.default_rng(args.seed + 1), *shape)
  for engine in engines.values():
    list(engine.run(warm_up))
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
  return '\n'.join(rows)


def parse(argv=None):
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--requests', type=positive_int, default=256)
  parser.add_argument('--prefix_len', type=positive_int, default=512)
  parser.add_argument('--suffix_len', type=int_list, default=[8, 32])
  parser.add_argument('--new_tokens', type=positive_int, default=16)
  parser.add_argument('--kv_memory', default='64MiB')
  parser.add_argument('--slots', type=positive_int, default=32)
  parser.add_argument('--repeats', type=positive_int, default=3)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default=None)
  args = parser.parse_args(argv)
  if len(args.suffix_len) != 2 or args.suffix_len[0] > args.suffix_len[1]:
    raise UserError(f'--suffix_len={args.suffix_len}: give LOW,HIGH with '
                    'LOW <= HIGH')
  if args.out:
    check_output_dir(args.out)
  return args


def main(argv=None) -> int:
  args = parse(argv)
  load_before = [round(x, 2) for x in os.getloadavg()]
  result = run(args)
  result = {**provenance.record('scripts.bench_prefix_cache', args.out or '',
                                argv=argv),
            'load_before': load_before,
            'load_after': [round(x, 2) for x in os.getloadavg()], **result}
  print(report(result, args))
  if args.out:
    path = pathlib.Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / 'bench_prefix_cache.json').write_text(json.dumps(result, indent=1))
  return 0 if result['identical'] else 1


if __name__ == '__main__':
  exit_on_user_error(lambda: sys.exit(main()))
