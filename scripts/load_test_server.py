"""Load test of the completions server (`python -m serve.api`), against
`serve.generate` on the same requests.

  python -m scripts.load_test_server --workdir=W [--clients=200]
      [--disconnect=0.1] [--prompt_len=8,200] [--output_len=8,128]
      [--temperature=0.8] [--kv_memory=64MiB] [--slots=32] [--warmups=6]
      [--seed=0] [--out=DIR]

The trace: --clients requests, each its own streaming client on its own
connection, all let go at once; prompt lengths (characters of random
lower-case text) and max_tokens drawn uniformly from the inclusive ranges
--prompt_len and --output_len with numpy's generator seeded by --seed; each
request sampled at --temperature with a seed of its own. A --disconnect
fraction of them close their connection after their first chunk (mid-
stream: the server must abort them and free their pages).

The server runs in a process of its own (`python -m serve.api --port=0`,
--kv_memory and --slots as given). The trace is served to compile the
engine's step shapes (their buckets of rows, tokens and pages depend on
how the requests interleave, which moves from pass to pass, so one warm-up
pass leaves many to compile, each a second or more, in the next) until a
pass compiles nothing new (JAX's persistent compilation cache, which the
server writes, gained no program) or --warmups passes, then once timed,
the programs it still compiled counted in the report; then
`serve.generate` runs the same requests in this process, with the same
pool and slots, warmed up the same way.
Checked, on the timed pass (exit status 1 if any fails):
  - nothing lost or duplicated: every request answered once, under its own
    id; every client that stayed got finish_reason 'length' and max_tokens
    tokens; the server counts each request finished once;
  - every completed text equals serve.generate's for the same request;
  - the pool is back to empty: no pages held, nothing running or waiting;
  - SIGTERM then ends the server with exit status 0.
Reported for both: generated tokens per second of wall time (the server:
the tokens its clients received, first send to last answer; serve.generate:
all tokens of all requests, its engine's first request to last step), and
p50/p99 of time to first token and time per output token after the first,
and the programs each still compiled when timed. The server's are measured by
its clients (queueing and HTTP included); serve.generate's by its engine,
from when it read each line (it reads lines as its pool has room), so its
TTFT leaves out the wait for a line's turn. Printed with the CPU model and
vector extensions and the load average before and after: a shared machine
moves these numbers by tens of percent, so they are preliminary unless the
load average is near zero. Writes OUT/load_test.json.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import os
import pathlib
import re
import sys
import tempfile
import threading
import time

import numpy as np

from infra import provenance
from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       int_range, positive_int)
from infra.errors import UserError
from lm import inference
from lm.sampling_params import SamplingParams
from serve import generate
from serve import process

ALPHABET = np.array(list('abcdefghijklmnopqrstuvwxyz     '))


@dataclasses.dataclass
class Sent:
  """One client's request: its id (X-Request-Id), prompt, max_tokens,
  seed, and whether it leaves after its first chunk."""
  id: str
  prompt: str
  max_tokens: int
  seed: int
  leaves: bool = False


@dataclasses.dataclass
class Got:
  """What one client received: the completion ids of its chunks, its text,
  finish reason and token count (None if it left), and when (perf_counter
  seconds) it sent, got its first text and its last chunk."""
  id: str
  completion_ids: set
  text: str = ''
  finish_reason: str | None = None
  tokens: int | None = None
  sent_at: float = 0.0
  first_at: float | None = None
  last_at: float | None = None
  error: str | None = None


def make_trace(clients: int, disconnect: float, prompt_len, output_len,
               seed: int) -> list[Sent]:
  """--clients requests of mixed lengths, round(disconnect * clients) of
  them (drawn at random) leaving mid-stream."""
  rng = np.random.default_rng(seed)
  leaving = set(rng.choice(clients, round(disconnect * clients),
                           replace=False).tolist())
  trace = []
  for i in range(clients):
    length = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
    trace.append(Sent(
        f'load-{i}', ''.join(rng.choice(ALPHABET, length)).strip() or 'a',
        int(rng.integers(output_len[0], output_len[1] + 1)),
        int(rng.integers(1 << 31)), i in leaving))
  return trace


def ask(url: str, sent: Sent, temperature: float, go: threading.Event
        ) -> Got:
  """Streams one request once `go` is set; returns what came back."""
  host, port = url.split('//')[1].split(':')
  conn = http.client.HTTPConnection(host, int(port), timeout=600)
  got = Got(sent.id, set())
  body = json.dumps({'prompt': sent.prompt, 'max_tokens': sent.max_tokens,
                     'seed': sent.seed, 'temperature': temperature,
                     'stream': True,
                     'stream_options': {'include_usage': True}})
  go.wait()
  got.sent_at = time.perf_counter()
  try:
    conn.request('POST', '/v1/completions', body, {
        'Content-Type': 'application/json', 'X-Request-Id': sent.id})
    response = conn.getresponse()
    if response.status != 200:
      got.error = f'HTTP {response.status}: {response.read()[:200]!r}'
      return got
    for line in response:
      if not line.startswith(b'data: ') or line.strip() == b'data: [DONE]':
        continue
      event = json.loads(line[len(b'data: '):])
      got.last_at = time.perf_counter()
      if 'error' in event:
        got.error = event['error']['message']
        break
      got.completion_ids.add(event['id'])
      if event.get('usage'):
        got.tokens = event['usage']['completion_tokens']
      for choice in event['choices']:
        if choice['text'] and got.first_at is None:
          got.first_at = got.last_at
        got.text += choice['text']
        got.finish_reason = choice['finish_reason'] or got.finish_reason
      if sent.leaves and got.first_at is not None:
        break  # Mid-stream: closed below, unread.
  except (OSError, http.client.HTTPException) as e:
    got.error = f'{type(e).__name__}: {e}'
  finally:
    conn.close()
  return got


def drive(url: str, trace: list[Sent], temperature: float
          ) -> tuple[list[Got], float]:
  """Every request of the trace at once, one client thread each: (what
  each got, in the trace's order; wall seconds, first send to last)."""
  go = threading.Event()
  with concurrent.futures.ThreadPoolExecutor(len(trace)) as pool:
    futures = [pool.submit(ask, url, s, temperature, go) for s in trace]
    time.sleep(0.5)  # Every thread started and waiting.
    start = time.perf_counter()
    go.set()
    gots = [f.result() for f in futures]
  return gots, max(g.last_at or start for g in gots) - start


def server_state(url: str) -> dict:
  """From GET /metrics: pages in use, requests running and waiting, and
  requests finished (all reasons)."""
  host, port = url.split('//')[1].split(':')
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  conn.request('GET', '/metrics')
  text = conn.getresponse().read().decode()
  conn.close()

  def total(name):
    return sum(float(v) for v in re.findall(
        rf'^gqa_lab_{name}(?:{{[^}}]*}})? (\S+)$', text, re.M))
  return {'pages_in_use': total('kv_pages_in_use'),
          'running': total('num_requests_running'),
          'waiting': total('num_requests_waiting'),
          'finished': total('requests_finished_total')}


def wait_idle(url: str, timeout: float = 120) -> dict:
  """The server's state once nothing runs or waits (or at the timeout)."""
  deadline = time.monotonic() + timeout
  while True:
    state = server_state(url)
    if (not state['running'] and not state['waiting']) or (
        time.monotonic() > deadline):
      return state
    time.sleep(0.1)


def check(trace: list[Sent], gots: list[Got], reference: dict,
          before: dict, after: dict) -> list[str]:
  """Each failed check in one line ([] if all hold): lost or duplicated
  answers, a completed text unlike serve.generate's (reference: {id:
  text}), the server's counts, and its pool not back to empty."""
  failures = []
  if sorted(g.id for g in gots) != sorted(s.id for s in trace):
    failures.append('the answers are not one per request')
  seen = {}
  for g in gots:
    for cid in g.completion_ids:
      if seen.setdefault(cid, g.id) != g.id:
        failures.append(f'{g.id} and {seen[cid]} got one completion {cid}')
    if len(g.completion_ids) > 1:
      failures.append(f'{g.id} got chunks of {len(g.completion_ids)} '
                      'completions')
  by_id = {s.id: s for s in trace}
  for g in gots:
    sent = by_id.get(g.id)
    if g.error:
      failures.append(f'{g.id}: {g.error}')
    elif sent is None or sent.leaves:
      continue
    elif g.finish_reason != 'length' or g.tokens != sent.max_tokens:
      failures.append(f'{g.id} ended {g.finish_reason!r} after {g.tokens} '
                      f'of {sent.max_tokens} tokens')
    elif g.text != reference.get(g.id):
      failures.append(f'{g.id}: its text is not serve.generate\'s')
  finished = after['finished'] - before['finished']
  if finished != len(trace):
    failures.append(f'the server finished {finished:g} requests of '
                    f'{len(trace)}')
  if after['pages_in_use'] or after['running'] or after['waiting']:
    failures.append(f'the pool is not back to empty: {after}')
  return failures


def percentiles(values) -> dict:
  values = [v for v in values if v is not None]
  if not values:
    return {'p50': None, 'p99': None}
  return {'p50': float(np.percentile(values, 50)),
          'p99': float(np.percentile(values, 99))}


def server_summary(trace: list[Sent], gots: list[Got], seconds: float
                   ) -> dict:
  """Tokens/s received and the clients' TTFT and TPOT (those that stayed;
  a leaver's count is its chunks' bytes, roughly its tokens)."""
  stayed = [(s, g) for s, g in zip(trace, gots) if not s.leaves]
  tokens = sum(g.tokens or 0 for _, g in stayed) + sum(
      len(g.text.encode()) for s, g in zip(trace, gots) if s.leaves)
  return {'seconds': seconds, 'tokens': tokens,
          'tokens_per_s': tokens / seconds,
          'ttft_s': percentiles(g.first_at - g.sent_at for _, g in stayed
                                if g.first_at is not None),
          'tpot_s': percentiles((g.last_at - g.first_at) / (g.tokens - 1)
                                for _, g in stayed
                                if g.tokens and g.tokens > 1)}


def reference(workdir: str, trace: list[Sent], temperature: float,
              kv_memory: str, slots: int, folder: pathlib.Path,
              warmups: int = 6) -> tuple[dict, dict]:
  """serve.generate on the same requests, warmed up as the server is
  (`load`): ({id: text}, its summary). Its seconds are its engine's, first
  request to last step (Stats.seconds: loading the checkpoint and making
  the pool left out, as the server's are)."""
  prompts = folder / 'prompts.jsonl'
  prompts.write_text(''.join(json.dumps(
      {'id': s.id, 'prompt': s.prompt, 'max_new_tokens': s.max_tokens,
       'seed': s.seed}) + '\n' for s in trace))
  settings = SamplingParams(temperature=temperature)
  run = lambda out: generate.generate_file(
      workdir, str(prompts), str(out), kv_memory=kv_memory, slots=slots,
      max_new_tokens=1, settings=settings, progress_every=1e9)
  for i in range(warmups):
    known = programs()
    run(folder / f'warm_up_{i}.jsonl')
    if programs() == known:
      break
  known = programs()
  stats = run(folder / 'timed.jsonl')
  compiled = programs() - known
  lines = [json.loads(line) for line in
           (folder / 'timed.jsonl').read_text().splitlines()]
  lines = [line for line in lines if 'id' in line]
  return {line['id']: line['text'] for line in lines}, {
      'seconds': stats.seconds, 'tokens': stats.tokens,
      'tokens_per_s': stats.tokens / stats.seconds,
      'warmup_passes': i + 1, 'compiled_when_timed': compiled,
      'ttft_s': percentiles(line['time_to_first_token_s'] for line in lines),
      'tpot_s': percentiles(line['per_token_s'] for line in lines)}


def programs() -> int:
  """Programs in JAX's persistent compilation cache (0 if none is set)."""
  folder = os.environ.get('JAX_COMPILATION_CACHE_DIR')
  return len(os.listdir(folder)) if folder and os.path.isdir(folder) else 0


def load(url: str, trace: list[Sent], temperature: float,
         warmups: int = 6) -> dict:
  """The trace against a server until a pass compiles nothing new (at
  most warmups passes), then timed: the timed pass's answers, wall
  seconds, the server's state around it, and what warming up took."""
  passes = 0
  while passes < warmups:
    known = programs()
    drive(url, trace, temperature)
    passes += 1
    wait_idle(url)
    if programs() == known:
      break
  before = wait_idle(url)
  known = programs()
  gots, seconds = drive(url, trace, temperature)
  after = wait_idle(url)
  return {'gots': gots, 'seconds': seconds, 'before': before,
          'after': after, 'warmup_passes': passes,
          'compiled_when_timed': programs() - known}


def report(result: dict) -> str:
  m = result['machine']
  rows = [f'load test: {result["clients"]} clients, '
          f'{result["disconnects"]} leaving mid-stream; '
          f'{provenance.describe(m)}; load average before '
          f'{result["load_before"]}, after {result["load_after"]}',
          f'warm-up passes (programs still compiled when timed): server '
          f'{result["warmup_passes"]} ({result["compiled_when_timed"]}), '
          f'serve.generate {result["serve.generate"]["warmup_passes"]} '
          f'({result["serve.generate"]["compiled_when_timed"]})',
          f'{"":16}{"tokens/s":>10}{"TTFT p50":>10}{"p99":>9}'
          f'{"TPOT p50":>10}{"p99":>9}  (ms)']
  ms = lambda x: '-' if x is None else f'{1e3 * x:.1f}'
  for name in ('server', 'serve.generate'):
    r = result[name]
    rows.append(f'{name:16}{r["tokens_per_s"]:10.0f}'
                f'{ms(r["ttft_s"]["p50"]):>10}{ms(r["ttft_s"]["p99"]):>9}'
                f'{ms(r["tpot_s"]["p50"]):>10}{ms(r["tpot_s"]["p99"]):>9}')
  rows.append('checks: ' + ('all hold' if not result['failures'] else
                            '; '.join(result['failures'])))
  return '\n'.join(rows)


def parse(argv=None):
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--clients', type=positive_int, default=200)
  parser.add_argument('--disconnect', type=float, default=0.1)
  parser.add_argument('--prompt_len', type=int_range, default=[8, 200])
  parser.add_argument('--output_len', type=int_range, default=[8, 128])
  parser.add_argument('--temperature', type=float, default=0.8)
  parser.add_argument('--kv_memory', default='64MiB')
  parser.add_argument('--slots', type=positive_int, default=32)
  parser.add_argument('--warmups', type=int, default=6)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default=None)
  args = parser.parse_args(argv)
  if not 0 <= args.disconnect <= 1:
    raise UserError(f'--disconnect={args.disconnect} must be in 0..1')
  if args.out:
    check_output_dir(args.out)
  return args


def compile_once(folder: str):
  """JAX's persistent compilation cache in folder (unless one is set
  already), for this process and the server's: serve.generate's engines
  (one per run) load the programs their warm-up compiled."""
  import jax  # pylint: disable=import-outside-toplevel
  if os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    return
  os.environ['JAX_COMPILATION_CACHE_DIR'] = folder
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
  jax.config.update('jax_compilation_cache_dir', folder)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)


def main(argv=None) -> int:
  args = parse(argv)
  cache = tempfile.TemporaryDirectory()
  compile_once(cache.name)
  mc, _, _ = inference.load_language_model(args.workdir)
  if args.prompt_len[1] + args.output_len[1] > mc.max_len:
    raise UserError(f'--prompt_len and --output_len reach '
                    f'{args.prompt_len[1] + args.output_len[1]} tokens, past '
                    f'the model\'s max_len {mc.max_len}; lower their HIGH')
  trace = make_trace(args.clients, args.disconnect, args.prompt_len,
                     args.output_len, args.seed)
  load_before = [round(x, 2) for x in os.getloadavg()]
  server = process.ServerProcess(args.workdir,
                                 f'--kv_memory={args.kv_memory}',
                                 f'--slots={args.slots}')
  try:
    served = load(server.url, trace, args.temperature, args.warmups)
  finally:
    status = server.stop()
  with tempfile.TemporaryDirectory() as folder:
    texts, peer = reference(args.workdir, trace, args.temperature,
                            args.kv_memory, args.slots, pathlib.Path(folder),
                            max(args.warmups, 1))
  failures = check(trace, served['gots'], texts, served['before'],
                   served['after'])
  if status != 0:
    failures.append(f'the server exited {status} after SIGTERM')
  result = {
      **provenance.record('scripts.load_test_server', args.out or '',
                          argv=argv),
      'clients': len(trace), 'disconnects': sum(s.leaves for s in trace),
      'load_before': load_before,
      'load_after': [round(x, 2) for x in os.getloadavg()],
      'server': server_summary(trace, served['gots'], served['seconds']),
      'warmup_passes': served['warmup_passes'],
      'compiled_when_timed': served['compiled_when_timed'],
      'serve.generate': peer, 'failures': failures}
  print(report(result))
  if args.out:
    path = pathlib.Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / 'load_test.json').write_text(json.dumps(result, indent=1))
  cache.cleanup()
  return 1 if failures else 0


if __name__ == '__main__':
  exit_on_user_error(lambda: sys.exit(main()))
