"""Serving throughput against K at one KV-memory budget: continuous batching
over the paged cache, with one-request-at-a-time `train.sample` beside it.

  python -m scripts.bench_serve [--config=gqa_small]
      [--kv_heads=8,2,1 | --variants=K2,TPA2 --no_hf]
      [--kv_memory=4MiB] [--slots=32] [--requests=32] [--page_size=16]
      [--prompt_len=8,96] [--output_len=8,64] [--length_step=1] [--seed=0]
      [--repeats=3] [--no_hf] [--llama_cpp] [--out=DIR]

The trace: --requests requests, all arriving at the start (an offline
batch); prompt and output lengths drawn uniformly from LOW, LOW + step, ...
up to HIGH of the inclusive ranges --prompt_len and --output_len (step
--length_step: a coarser step means fewer shapes for the one-at-a-time peer
to compile) with numpy's generator seeded by --seed; the prompt tokens
uniform over the vocabulary. --variants names layouts in
`studies.variants`' grammar (bench_decode's) (K<k>, GTA<k>, MLA<a>, GLA<a>g<g>, TPA<r>,
TPAKV<r>) in place of --kv_heads' K<k>; the transformers peer computes
grouped-query attention only, so other layouts need --no_hf. Each K (or
variant) gets a random model
(speed does not depend on the weights) and the same trace, served by
`serve.engine.Engine` in --slots slots over --kv_memory bytes of pages: with
fewer K/V heads a page holds more tokens' worth of memory, so more sequences
fit in flight. Reported per K: tokens/s, sequences in flight (mean over the
decode steps), the pool's high-water mark, and each request's time to first
token and per-token latency (medians). Compiling is done before timing
(a warm-up pass over the same trace).

Peers, in the same run, taking turns with the engine for each K:
  one at a time  the same requests one after another through
                 `lm.inference.generate` (its prefill and `lax.scan` decode),
                 in this process, each shape compiled before the clock starts
  static batches the same dense-cache `lm.inference.generate` on batches of
                 as many requests as --kv_memory holds dense caches for (each
                 reserving the trace's longest request; at most --slots), in
                 the trace's order, left-padded to the batch's longest
                 prompt and decoded to its longest output: what the engine
                 adds over batching alone (paging, continuous batching)
  transformers   the same model written as a Hugging Face folder by
                 `python -m train.convert --to_hf` (from a step-0 workdir of
                 the same parameters), loaded by
                 `AutoModelForCausalLM.from_pretrained` in a process of its
                 own (`--hf_worker`; no two frameworks' thread pools in one
                 process) with torch's threads set to the cores JAX uses:
                 the trace in its order cut into batches of --slots, each
                 batch left-padded and greedily `generate()`d to its
                 longest max_new_tokens (a request's tokens past its own are
                 computed but not counted: static batching's cost), after a
                 warm-up batch
  llama.cpp      with --llama_cpp: the same model as GGUF (the same weight
                 dtype; `studies.llama_cpp_peer`, a process of its own on
                 the same threads), the trace through continuous batching
                 over llama.cpp's batch API: one unified KV cache of as many
                 tokens as --kv_memory holds (in our cache's dtype), at most
                 --slots sequences, each llama_decode carrying every running
                 sequence's next token and the waiting prompts that fit, a
                 request admitted when its prompt and output fit (our
                 'reserve' admission). llama.cpp computes SwiGLU MLPs only,
                 so with --llama_cpp the model, ours too, is the config with
                 model.mlp_activation='silu'.
Each contestant is compiled (or loaded) once, then timed --repeats times,
the three taking turns (engine, one at a time, transformers, engine, ...):
the report gives medians, and each ratio, paired within a turn, as its
median and range, since runs on a shared VM move by 10-50% from one to the
next. Tokens/s counts each request's max_new_tokens, the same tokens for all
three. Wall and CPU seconds (this process's or the worker's, all threads)
are both reported: on a shared machine the CPU time is the steadier one.
Writes serve.json, report.md and serve.png under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import operator
import pathlib
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import numpy as np

from serve import engine as engine_lib, pages, runner
from train import loop
from lm import checkpoint
from lm import config_lib
from infra import provenance
from lm import model as model_lib
from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       int_list, int_range, positive_int)
from infra.errors import UserError
from lm.model import Transformer
from studies import llama_cpp_peer
from studies.report import table
from studies.variants import GRAMMAR, Variant, variant_list
# The peers and the machine, shared with bench_generate.
from studies.timing import alone_runner, generate_runner, jax_threads, machine


def main():
  args = _parser().parse_args()
  if args.hf_worker:
    hf_worker(args)
    return
  check_output_dir(args.out)
  variants = _variants(args)
  kv_memory = pages.parse_bytes(args.kv_memory)
  config = config_lib.load(args.config)
  if args.llama_cpp:  # The MLP llama.cpp computes, for every contestant.
    llama_cpp_peer.check_installed()
    config.model.mlp_activation = 'silu'
  trace = make_trace(args, config.model.vocab_size, config.model.max_len)
  check_fits(config, variants, trace, kv_memory, args)
  rows = []
  out = pathlib.Path(args.out)
  for v in variants:
    v.apply_to(config.model)
    rows.append({'variant': v.name,
                 **summarize(turns(config, trace, kv_memory, args))})
    print(f'{v.label}: {_said(rows[-1], args)}', flush=True)
    results = _results(rows, args)
    # After each variant: a late failure loses none.
    out.mkdir(parents=True, exist_ok=True)
    (out / 'serve.json').write_text(json.dumps(results, indent=1))
  (out / 'report.md').write_text(report(results, args))
  plot(rows, out / 'serve.png')
  print(f'wrote {out}/serve.json, report.md and serve.png')


def _parser() -> ArgumentParser:
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='gqa_small')
  parser.add_argument('--kv_heads', type=int_list, default=None,
                      help='K of each grouped-query model (default 8,2,1)')
  parser.add_argument('--variants', type=variant_list,
                      help='layouts in place of --kv_heads: '
                      f'{GRAMMAR}')
  parser.add_argument('--kv_memory', default='4MiB')
  parser.add_argument('--slots', type=positive_int, default=32)
  parser.add_argument('--requests', type=positive_int, default=32)
  parser.add_argument('--page_size', type=positive_int, default=16)
  parser.add_argument('--prompt_len', type=int_range, default=[8, 96])
  parser.add_argument('--output_len', type=int_range, default=[8, 64])
  parser.add_argument('--length_step', type=positive_int, default=1)
  parser.add_argument('--admission', choices=['reserve', 'optimistic'],
                      default='reserve', help="the engine's (serve.engine)")
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--repeats', type=positive_int, default=3,
                      help='timed runs of each contestant, taking turns; '
                      'the report gives medians and the ratios\' range')
  parser.add_argument('--out', default='out/serve')
  parser.add_argument('--no_hf', action='store_true',
                      help='leave out the transformers peer')
  parser.add_argument('--llama_cpp', action='store_true',
                      help='add llama.cpp serving the same trace at the same '
                      'KV memory (studies.llama_cpp_peer; the model with '
                      'SwiGLU)')
  parser.add_argument('--hf_worker', help=argparse.SUPPRESS)
  parser.add_argument('--trace_file', help=argparse.SUPPRESS)
  return parser


def _results(rows: list[dict], args) -> dict:
  """serve.json: the rows so far, the command, its commit and the
  machine."""
  return {'command': 'python -m scripts.bench_serve ' + ' '.join(
      sys.argv[1:]), 'date': time.strftime('%Y-%m-%d'), 'rows': rows,
          'commit': provenance.commit(), 'out': args.out,
          'repeats': args.repeats,
          'trace': {'requests': args.requests, 'prompt_len': args.prompt_len,
                    'output_len': args.output_len,
                    'length_step': args.length_step, 'seed': args.seed},
          'machine': machine()}


def check_fits(config, variants, trace, kv_memory: int, args):
  """Every variant's config refused, if bad, before any run: invalid, or a pool
  of --kv_memory too small for the trace's longest request."""
  longest = max(len(prompt) + new for prompt, new in trace)
  for v in variants:
    v.apply_to(config.model)
    try:
      config_lib.validate(config, batch_shards=1)
    except UserError as e:
      raise UserError(f'--variants={v.name}: {e}') from None
    mc = config_lib.model_config(config)
    usable = engine_lib.pool_pages(mc, kv_memory, args.page_size) - 1
    need = pages.pages_for(longest, args.page_size)
    if need > usable:
      raise UserError(
          f'{v.label}: the trace\'s longest request ({longest} tokens) '
          f'needs {need} pages of {args.page_size} tokens, and --kv_memory='
          f'{args.kv_memory} holds {usable}; give --kv_memory of at least '
          f'{(need + 1) * runner.page_bytes(mc, args.page_size):,} bytes, or '
          'shorter --prompt_len/--output_len')


def turns(config, trace, kv_memory: int, args) -> list[dict]:
  """The engine and each peer on a random model of CONFIG (its variant set),
  taking turns --repeats times: each turn's numbers."""
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=0))
  with contextlib.ExitStack() as stack:
    contestants = [engine_runner(mc, params, trace, kv_memory, args),
                   alone_runner(mc, params, trace),
                   static_runner(mc, params, trace, kv_memory, args.slots)]
    if not args.no_hf:
      contestants.append(stack.enter_context(
          transformers_runner(config, params, trace, args.slots)))
    if args.llama_cpp:
      contestants.append(stack.enter_context(
          llama_cpp_runner(config, params, trace, kv_memory, args.slots)))
    # Taking turns: each repeat runs the engine, then each peer.
    return [functools.reduce(operator.or_, (run() for run in contestants))
            for _ in range(args.repeats)]


def _said(row: dict, args) -> str:
  """A variant's row, as the progress line says it."""
  return (f'{row["tokens_per_sec"]:,.1f} tokens/s, '
          f'{row["mean_in_flight"]:.1f} in flight (high-water '
          f'{row["high_water_pages"]}/{row["usable_pages"]} pages); one at a '
          f'time {row["alone_tokens_per_sec"]:,.1f} tokens/s, engine over it '
          f'{_speedup(row, "alone")}; static batches of '
          f'{row["static_batch"]} {row["static_tokens_per_sec"]:,.1f} '
          f'tokens/s, engine over it {_speedup(row, "static")}' + (
              '' if args.no_hf else
              f'; transformers {row["hf_tokens_per_sec"]:,.1f} tokens/s, '
              f'engine over it {_speedup(row, "hf")}')
          + ('' if not args.llama_cpp else
             f'; llama.cpp {row["llama_cpp_tokens_per_sec"]:,.1f} tokens/s, '
             f'engine over it {_speedup(row, "llama_cpp")}')
          + f' (medians of {args.repeats} turns)')


def _variants(args) -> list:
  """The layouts to serve: --variants, or --kv_heads' K<k> (8,2,1 by
  default); UserError for both, or for a layout transformers cannot compute
  without --no_hf."""
  if args.variants and args.kv_heads:
    raise UserError('give --kv_heads or --variants, not both (K<k> in '
                    '--variants is --kv_heads\' k)')
  variants = args.variants or [Variant.parse(f'K{k}')
                               for k in args.kv_heads or (8, 2, 1)]
  others = [v.name for v in variants if not v.is_gqa]
  if others and not args.no_hf:
    raise UserError(f'--variants={",".join(others)}: the transformers peer '
                    'computes grouped-query attention only; add --no_hf')
  return variants


def make_trace(args, vocab_size: int, max_len: int) -> list:
  """[(prompt tokens, output length)], seeded; lengths uniform in range."""
  if args.prompt_len[1] + args.output_len[1] > max_len:
    raise UserError(f'--prompt_len and --output_len reach '
                    f'{args.prompt_len[1] + args.output_len[1]} tokens, past '
                    f'model.max_len ({max_len}); lower their highs')
  rng = np.random.default_rng(args.seed)
  step = getattr(args, 'length_step', 1)
  draw = lambda low, high: low + step * int(rng.integers(
      0, (high - low) // step + 1))
  return [(rng.integers(0, vocab_size, draw(*args.prompt_len)).astype(
      np.int32), draw(*args.output_len)) for _ in range(args.requests)]


def engine_runner(mc, params, trace, kv_memory: int, args):
  """A function timing the trace through the engine once (compiled here,
  by a warm-up pass over the same trace) and returning its numbers."""
  served = engine_lib.Engine(mc, params, kv_memory=kv_memory,
                             page_size=args.page_size, slots=args.slots,
                             admission=getattr(args, 'admission', 'reserve'))
  requests = [engine_lib.Request(i, p, new) for i, (p, new) in
              enumerate(trace)]
  list(served.run(requests))  # Compiles every prefill and batch size used.

  def run() -> dict:
    cpu = time.process_time()
    # The whole trace arrives at once: each request's time to first token
    # counts from here, though the engine takes requests as it has room.
    now = time.perf_counter()
    results = list(served.run(dataclasses.replace(r, arrival=now)
                              for r in requests))
    cpu = time.process_time() - cpu
    s = served.stats
    refused = [r.error for r in results if r.error]
    if refused:  # Checked before any run; a bug if it happens.
      raise RuntimeError(f'K={mc.num_kv_heads}: {len(refused)} requests '
                         f'refused ({refused[0]})')
    return {
        'num_kv_heads': mc.num_kv_heads, 'page_bytes': s.page_bytes,
        'usable_pages': s.usable_pages,
        'high_water_pages': s.high_water_pages,
        'tokens': s.tokens, 'seconds': s.seconds, 'cpu_seconds': cpu,
        'tokens_per_sec': s.tokens / s.seconds,
        'tokens_per_cpu_sec': s.tokens / cpu,
        'mean_in_flight': s.mean_in_flight, 'preemptions': s.preemptions,
        'time_to_first_token_s': float(np.median(
            [r.time_to_first_token_s for r in results])),
        'per_token_s': float(np.median(
            [r.per_token_s for r in results if r.per_token_s is not None]))}
  return run


def static_batch(mc, trace, kv_memory: int, slots: int) -> int:
  """The static-batch peer's batch: as many sequences as --kv_memory holds
  dense caches for, each as long as the trace's longest request (a static
  batch reserves that much per row), at most --slots."""
  longest = max(len(prompt) + new for prompt, new in trace)
  return max(1, min(slots, len(trace), kv_memory // model_lib.kv_cache_bytes(
      mc, 1, longest)))


def static_runner(mc, params, trace, kv_memory: int, slots: int):
  """The trace through lm.inference.generate in static batches
  (`static_batch` rows each, in the trace's order): each batch left-padded
  to its longest prompt and decoded to its longest output, a request's
  tokens past its own computed but not counted (static batching's cost; no
  mask is passed, so the padding is attended: the cost is measured, not the
  text)."""
  B = static_batch(mc, trace, kv_memory, slots)
  prompts, news = [], []
  for i in range(0, len(trace), B):
    batch = trace[i:i + B]
    P = max(len(p) for p, _ in batch)
    prompts_BP = np.zeros((len(batch), P), np.int32)
    for row, (prompt, _) in enumerate(batch):
      prompts_BP[row, P - len(prompt):] = prompt
    prompts.append(prompts_BP)
    news.append(max(n for _, n in batch))
  return generate_runner(mc, params, prompts, news, 'static',
                         tokens=sum(new for _, new in trace), static_batch=B)


def summarize(runs: list[dict]) -> dict:
  """One row from the repeats' numbers: each number's median, each ratio
  of the engine to a peer (per repeat: they took turns) as its median and
  range ('<peer>_speedup', '<peer>_speedup_range'; per CPU-second
  '<peer>_cpu_speedup'), and the runs themselves."""
  row = {key: (float(np.median([r[key] for r in runs]))
               if isinstance(value, float) else value)
         for key, value in runs[0].items()}
  for peer in ('alone', 'static', 'hf', 'llama_cpp'):
    if f'{peer}_tokens_per_sec' not in row:
      continue
    for unit, name in (('sec', 'speedup'), ('cpu_sec', 'cpu_speedup')):
      ratios = [r[f'tokens_per_{unit}'] / r[f'{peer}_tokens_per_{unit}']
                for r in runs]
      row[f'{peer}_{name}'] = float(np.median(ratios))
      row[f'{peer}_{name}_range'] = [min(ratios), max(ratios)]
  row['runs'] = runs
  return row


@contextlib.contextmanager
def llama_cpp_runner(config, params, trace, kv_memory: int, slots: int):
  """Yields a function serving the trace once through llama.cpp
  (`studies.llama_cpp_peer`, serve) in as many KV cells as kv_memory holds
  (whole blocks of 256, which llama.cpp rounds a context up to), in
  --slots sequences; its numbers are 'llama_cpp_*'."""
  mc = config_lib.model_config(config)
  per_token = model_lib.kv_cache_bytes(mc, 1, 1)
  n_ctx = kv_memory // per_token // 256 * 256
  kv_dtype = np.dtype(mc.kv_cache_dtype or mc.dtype).name
  with llama_cpp_peer.started(config, params) as peer:
    def run() -> dict:
      r = peer.serve(trace, n_ctx, slots, kv_dtype)
      return {'llama_cpp_seconds': r['seconds'],
              'llama_cpp_cpu_seconds': r['cpu_seconds'],
              'llama_cpp_tokens_per_sec': r['tokens'] / r['seconds'],
              'llama_cpp_tokens_per_cpu_sec': r['tokens'] / r['cpu_seconds'],
              'llama_cpp_mean_in_flight': r['mean_in_flight'],
              'llama_cpp_time_to_first_token_s': r['time_to_first_token_s'],
              'llama_cpp_per_token_s': r['per_token_s'],
              'llama_cpp_kv_tokens': r['n_ctx'],
              'llama_cpp_kv_bytes': r['n_ctx'] * per_token,
              'llama_cpp': llama_cpp_peer.version(),
              'wait_policy': llama_cpp_peer.wait_policy()}
    run()  # Warm-up: the context made, every kernel run once.
    yield run


@contextlib.contextmanager
def transformers_runner(config, params, trace, slots: int):
  """Yields a function timing the trace once through transformers'
  `generate()` on the same parameters, exported here by
  `train.convert --to_hf`, in a process of its own."""
  with tempfile.TemporaryDirectory() as tmp:
    workdir, hf_dir = pathlib.Path(tmp, 'workdir'), pathlib.Path(tmp, 'hf')
    checkpoint.save_params(workdir, params)  # A step-0 workdir, as
    (workdir / 'config.json').write_text(config.to_json(indent=2))  # imports.
    _run([sys.executable, '-m', 'train.convert', f'--source={workdir}',
          f'--to_hf={hf_dir}'])
    trace_file = pathlib.Path(tmp, 'trace.json')
    trace_file.write_text(json.dumps([[p.tolist(), new] for p, new in trace]))
    yield lambda: json.loads(_run([
        sys.executable, '-m', 'scripts.bench_serve', f'--hf_worker={hf_dir}',
        f'--trace_file={trace_file}', f'--slots={slots}'
    ]).strip().splitlines()[-1])


def _run(command: list[str]) -> str:
  result = subprocess.run(command, capture_output=True, text=True,
                          check=False)
  if result.returncode:
    raise RuntimeError(f'{" ".join(command[1:4])} failed:\n'
                       f'{result.stderr[-3000:]}')
  return result.stdout


def hf_worker(args):
  """Prints the transformers peer's numbers as one JSON line (`--hf_worker`
  names the exported folder, `--trace_file` the trace)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(jax_threads())
  model = transformers.AutoModelForCausalLM.from_pretrained(
      args.hf_worker, torch_dtype=torch.float32).eval()
  trace = json.loads(pathlib.Path(args.trace_file).read_text())
  batches = [trace[i:i + args.slots] for i in range(0, len(trace),
                                                    args.slots)]

  class FirstToken(transformers.LogitsProcessor):
    """Notes when each step's logits are ready (the first: the prefill's)."""

    def __init__(self):
      self.times = []

    def __call__(self, input_ids, scores):
      self.times.append(time.perf_counter())
      return scores

  def generate(batch, new: int, stamps: FirstToken):
    P = max(len(p) for p, _ in batch)
    ids = torch.zeros((len(batch), P), dtype=torch.long)
    mask = torch.zeros((len(batch), P), dtype=torch.long)
    for row, (prompt, _) in enumerate(batch):  # Padded on the left.
      ids[row, P - len(prompt):] = torch.tensor(prompt)
      mask[row, P - len(prompt):] = 1
    with torch.no_grad():
      model.generate(ids, attention_mask=mask, max_new_tokens=new,
                     do_sample=False, eos_token_id=None,
                     pad_token_id=0, logits_processor=[stamps])

  generate(batches[0], 4, FirstToken())  # Warm-up: allocations, caches.
  start, cpu = time.perf_counter(), time.process_time()
  ttft, per_token = [], []
  for batch in batches:
    stamps = FirstToken()
    longest = max(new for _, new in batch)
    generate(batch, longest, stamps)
    first = stamps.times[0]
    for _, new in batch:  # A request's tokens are done at its step.
      ttft.append(first - start)
      if new > 1:
        per_token.append((stamps.times[new - 1] - first) / (new - 1))
  seconds = time.perf_counter() - start
  cpu = time.process_time() - cpu
  tokens = sum(new for _, new in trace)
  print(json.dumps({
      'hf_seconds': seconds, 'hf_cpu_seconds': cpu,
      'hf_tokens_per_sec': tokens / seconds,
      'hf_tokens_per_cpu_sec': tokens / cpu, 'hf_threads': jax_threads(),
      'hf_time_to_first_token_s': float(np.median(ttft)),
      'hf_per_token_s': float(np.median(per_token)) if per_token else None,
      'transformers': transformers.__version__, 'torch': torch.__version__}))


_LOADED = ('Measured under load (a machine shared with other jobs): wall-clock '
           'tokens/s depend on what else ran; the ratios are within one run, '
           'the peers taking turns with the engine for each K, and tokens per '
           "CPU-second (this process's or the peer's, all threads) are the "
           'steadier figure.')
_IDLE = ('Measured on an otherwise idle machine (a 1-minute load average '
         'within the core count: this benchmark alone); the peers take turns '
         'with the engine for each K.')


def _loaded(machine: dict) -> bool:
  """Whether more ran than this benchmark: a 1-minute load average above
  the cores (or unknown)."""
  load, cores = machine.get('load_average'), machine.get('cores')
  return not (load and cores) or load[0] > cores


def report(results, args) -> str:
  """report.md: the trace and the peers, the machine and its load, then a
  row per variant."""
  hf = all('hf_tokens_per_sec' in r for r in results['rows'])
  llama = all('llama_cpp_tokens_per_sec' in r for r in results['rows'])
  return '\n'.join([
      '# Serving throughput against K at one KV-memory budget', '',
      _setting(results, args, hf, llama), '',
      _machine_line(results.get('machine', {}), hf), '',
      'Columns: usable pages (the pool less its scratch page) and the most '
      'in use at once; mean sequences in flight over the decode steps; '
      'tokens/s (tokens per CPU-second); the median over requests of the '
      'time to first token (its wait in the queue included) and of the '
      'time per later token.', '', *_table(results['rows'], hf, llama)]
      ) + '\n\n![tokens/s against K](serve.png)\n'


def _setting(results, args, hf: bool, llama: bool) -> str:
  """The command, the trace, the peers and how the turns are read."""
  first = results['rows'][0]
  return (
      f'`{results["command"]}` at commit {results.get("commit", "?")} on '
      f'{results["date"]}. Trace: {args.requests} requests at once, prompt '
      f'lengths uniform in {args.prompt_len[0]}..{args.prompt_len[1]}, '
      f'outputs in {args.output_len[0]}..{args.output_len[1]} tokens (step '
      f'{getattr(args, "length_step", 1)}, seed {args.seed}); {args.slots} '
      f'slots, --kv_memory={args.kv_memory}, pages of {args.page_size} '
      'tokens. Compile time excluded. Peers: "one at a time" is the same '
      'requests one after another through `lm.inference.generate` in this '
      'process; "static batches" the same dense-cache generate on batches '
      'of as many requests as --kv_memory holds caches for (each the '
      'trace\'s longest request), padded to the batch\'s longest prompt and '
      'output' + (", transformers is `generate()` in batches of --slots on "
                   'the same weights in a process of its own' if hf else '')
      + (f', llama.cpp is llama-cpp-python {first["llama_cpp"]} '
         'on the same model as GGUF (SwiGLU for every contestant), continuous '
         'batching over one unified KV cache of '
         f'{first["llama_cpp_kv_tokens"]:,} tokens at K='
         f'{first["num_kv_heads"]} (--kv_memory\'s bytes, each '
         'K its own), in a process of its own (OMP_WAIT_POLICY '
         f'{first["wait_policy"] or "default"})' if llama else '')
      + f'. {results.get("repeats", 1)} timed run(s) of each, taking turns: '
      'every number is the median over them; a ratio is the engine\'s '
      'tokens/s over the peer\'s within each turn, given as the median of '
      'those ratios (so not the quotient of the medians shown) and their '
      'range, in wall time and per CPU-second.')


def _machine_line(m: dict, hf: bool) -> str:
  """The CPU, its cores and the load, and whether it ran alone."""
  load = m.get('load_average')
  return (f'CPU: {m.get("cpu", "?")} (avx2: {m.get("avx2", "?")}, avx512f: '
          f'{m.get("avx512f", "?")}), {m.get("cores", "?")} cores for JAX'
          + (' and for torch' if hf else '') + '; load average '
          + (', '.join(f'{x:.2f}' for x in load) + ' (1, 5, 15 min)' if load
             else '?') + ' at the end. '
          + (_LOADED if _loaded(m) else _IDLE))


def _table(rows: list[dict], hf: bool, llama: bool) -> list[str]:
  """A row per variant: the engine's pages, flight and speed, then each
  peer's speed and the engine's ratio over it."""
  head = ['variant', 'K', 'page bytes', 'usable pages', 'high-water (pages)',
          'mean in flight', 'tokens/s (per CPU-s)', 'median TTFT',
          'median per-token', 'one at a time tokens/s (per CPU-s)',
          'vs one at a time', 'static batch (rows) tokens/s (per CPU-s)',
          'vs static batches']
  if hf:
    head += ['transformers tokens/s (per CPU-s)', 'its TTFT, per-token',
             'vs transformers']
  if llama:
    head += ['llama.cpp tokens/s (per CPU-s)',
             'its mean in flight, TTFT, per-token', 'vs llama.cpp']
  cells = []
  for r in rows:
    row = [r.get('variant', f'K{r["num_kv_heads"]}'), r['num_kv_heads'],
           f'{r["page_bytes"]:,}', r['usable_pages'],
           r['high_water_pages'], f'{r["mean_in_flight"]:.1f}',
           f'{r["tokens_per_sec"]:,.0f} '
           f'({r.get("tokens_per_cpu_sec", 0):,.0f})',
           f'{r["time_to_first_token_s"]:.2f} s',
           f'{1e3 * r["per_token_s"]:.1f} ms',
           f'{r["alone_tokens_per_sec"]:,.0f} '
           f'({r.get("alone_tokens_per_cpu_sec", 0):,.0f})',
           _speedup(r, 'alone'),
           f'({r["static_batch"]}) {r["static_tokens_per_sec"]:,.0f} '
           f'({r.get("static_tokens_per_cpu_sec", 0):,.0f})',
           _speedup(r, 'static')]
    if hf:
      row += [f'{r["hf_tokens_per_sec"]:,.0f} '
              f'({r["hf_tokens_per_cpu_sec"]:,.0f})',
              f'{r["hf_time_to_first_token_s"]:.2f} s, '
              f'{1e3 * (r["hf_per_token_s"] or 0):.1f} ms',
              _speedup(r, 'hf')]
    if llama:
      row += [f'{r["llama_cpp_tokens_per_sec"]:,.0f} '
              f'({r["llama_cpp_tokens_per_cpu_sec"]:,.0f})',
              f'{r["llama_cpp_mean_in_flight"]:.1f}, '
              f'{r["llama_cpp_time_to_first_token_s"]:.2f} s, '
              f'{1e3 * (r["llama_cpp_per_token_s"] or 0):.1f} ms',
              _speedup(r, 'llama_cpp')]
    cells.append(row)
  return table(head, cells)


def _speedup(row, peer: str) -> str:
  """The engine's tokens/s over the peer's, in wall time and per
  CPU-second, each the median over the turns with its range:
  'wall 2.91x (2.55 to 3.10), CPU 2.10x (1.90 to 2.20)'."""
  def ratio(name):
    low, high = row[f'{peer}_{name}_range']
    spread = (f' ({low:.2f} to {high:.2f})' if len(row.get('runs', ())) > 1
              else '')
    return f'{row[f"{peer}_{name}"]:.2f}x{spread}'
  return f'wall {ratio("speedup")}, CPU {ratio("cpu_speedup")}'


def plot(rows, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
  labels = [f'{r.get("variant", "K" + str(r["num_kv_heads"]))}\n'
            f'{r["mean_in_flight"]:.1f} in flight' for r in rows]
  x = np.arange(len(rows))
  bars = [('', 'continuous batching'), ('alone_', 'one at a time '
                                        '(train.sample)')]
  if all('hf_tokens_per_sec' in r for r in rows):
    bars.append(('hf_', 'transformers generate()'))
  width = 0.8 / len(bars)
  for ax, unit in zip(axes, ('sec', 'cpu_sec')):
    for j, (prefix, label) in enumerate(bars):
      ax.bar(x + (j - (len(bars) - 1) / 2) * width,
             [r.get(f'{prefix}tokens_per_{unit}', 0) for r in rows], width,
             label=label)
    ax.set_xticks(x, labels)
    ax.set_ylabel('tokens/s' if unit == 'sec' else 'tokens per CPU-second')
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == '__main__':
  exit_on_user_error(main)
