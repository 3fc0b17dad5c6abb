"""Generates continuations of many prompts at once, over a paged KV cache.

  python -m serve.generate --workdir=DIR --prompts=FILE.jsonl --out=OUT.jsonl \
      --kv_memory=256MiB --max_new_tokens=N [--temperature=0] [--top_k=0] \
      [--seed=0] [--slots=8] [--page_size=16] [--kv_cache_dtype=int8]

A prompt line is {"id": ..., "prompt": "..."} (optionally "max_new_tokens");
each result line, appended to OUT as its request finishes, is {"id", "text"
(the continuation, as train.sample prints it), "tokens" (their ids),
"time_to_first_token_s" (from the run's start, queueing included),
"per_token_s"}, or {"id", "error"} (one line) for a request refused: a
malformed line (then "id" is null and "line" its number), an empty prompt,
one past the model's max_len, one needing more pages than --kv_memory holds.
The other requests go on, and the run exits 1 when any was refused. A rerun
into the same OUT skips the requests it holds results for and retries those
it holds errors for (their old lines are dropped first). Progress (requests
done, tokens/s, sequences in flight, pages) goes to stderr.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from serve import engine as engine_lib
from serve import pages
from train import sample
from train.errors import UserError


def read_prompts(path: pathlib.Path, tokenizer, max_new_tokens: int):
  """(requests, refusals, defaulted): the prompt file's lines as engine
  Requests, a result line for each malformed one (keyed by id, or by its line
  when it has none), and the ids (as JSON) of the requests taking
  max_new_tokens rather than a "max_new_tokens" of their own."""
  requests, refusals, seen, defaulted = [], [], set(), set()
  try:
    lines = path.read_text(encoding='utf-8').splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f'--prompts={path} cannot be read ({e}); give a UTF-8 '
                    'JSON-lines file') from None
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    refuse = lambda why: refusals.append({'id': None, 'line': n, 'error':
                                          f'line {n}: {why}'})
    try:
      entry = json.loads(line)
    except json.JSONDecodeError as e:
      refuse(f'not JSON ({e.msg}); write {{"id": ..., "prompt": "..."}}')
      continue
    if not isinstance(entry, dict) or 'id' not in entry or not isinstance(
        entry.get('prompt'), str):
      refuse('needs an "id" and a "prompt" string; write '
             '{"id": ..., "prompt": "..."}')
      continue
    key = json.dumps(entry['id'])
    if key in seen:
      refuse(f'id {key} appears earlier; give each prompt its own id')
      continue
    seen.add(key)
    new = entry.get('max_new_tokens', max_new_tokens)
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
      refusals.append({'id': entry['id'], 'error': f'max_new_tokens={new!r} '
                       'must be an integer >= 1'})
      continue
    try:
      tokens = tokenizer.encode(entry['prompt'])
    except UnicodeEncodeError:
      refusals.append({'id': entry['id'], 'error': 'the prompt is not valid '
                       'UTF-8 text (a lone surrogate); fix its escapes'})
      continue
    if 'max_new_tokens' not in entry:
      defaulted.add(key)
    requests.append(engine_lib.Request(entry['id'], tokens, new,
                                       sample_index=n))
  return requests, refusals, defaulted


def read_out(out: pathlib.Path) -> tuple[str, set[str]]:
  """(the text OUT keeps on a rerun, the requests it holds results for: ids
  as JSON). A request whose line is an error is not done: its line is not
  kept, so that the rerun retries it and OUT ends with one line per request.
  A last line cut short by a kill is not kept either, so it is redone."""
  if not out.exists():
    return '', set()
  text = out.read_text(encoding='utf-8')
  kept, keys = [], set()
  for line in text.splitlines(keepends=True):
    if not line.endswith('\n'):
      break  # Cut short.
    try:
      entry = json.loads(line)
    except json.JSONDecodeError:
      entry = None
    if isinstance(entry, dict) and 'error' in entry:
      continue
    kept.append(line)
    if isinstance(entry, dict):
      keys.add(_key(entry))
  return ''.join(kept), keys


def rewrite(out: pathlib.Path, text: str):
  """OUT replaced by `text` at once (a temporary file renamed over it), so a
  kill leaves either the old file or the new one."""
  tmp = out.with_name(f'.{out.name}.tmp')
  tmp.write_text(text, encoding='utf-8')
  os.replace(tmp, out)


def _key(entry: dict) -> str:
  return (f'line {entry["line"]}' if entry.get('id') is None and 'line' in
          entry else json.dumps(entry.get('id')))


def generate_file(workdir: str, prompts: str, out: str, *, kv_memory: str,
                  max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, seed: int = 0, slots: int = 8,
                  page_size: int = 16, kv_cache_dtype=None,
                  progress_every: float = 10.0,
                  check=lambda config: None) -> engine_lib.Stats | None:
  """Runs every request of PROMPTS without a result in OUT, appending its
  line; the run's Stats (None when nothing was left to do), `refused`
  counting the malformed lines too. check(model config): raises a UserError
  for flags the model cannot take. Every check is made before OUT is
  touched."""
  memory = pages.parse_bytes(kv_memory)
  mc, params, tokenizer = sample.load_language_model(workdir)
  check(mc)
  out_path = pathlib.Path(out)
  requests, refusals, defaulted = read_prompts(pathlib.Path(prompts),
                                               tokenizer, max_new_tokens)
  kept, done = read_out(out_path)
  requests = [r for r in requests if json.dumps(r.id) not in done]
  refusals = [r for r in refusals if _key(r) not in done]
  engine = engine_lib.Engine(
      mc, params, kv_memory=memory, page_size=page_size, slots=slots,
      temperature=temperature, top_k=top_k, seed=seed,
      eos_ids=tokenizer.eos_ids, kv_cache_dtype=kv_cache_dtype)
  check_max_new_tokens(max_new_tokens, mc.max_len, [
      r.id for r in requests if json.dumps(r.id) in defaulted])
  if out_path.exists() and kept != out_path.read_text(encoding='utf-8'):
    rewrite(out_path, kept)  # Errors dropped: they are retried below.
  total = len(requests) + len(refusals)
  if not total:
    print(f'generate: all requests are already in {out}', file=sys.stderr)
    return None
  out_path.parent.mkdir(parents=True, exist_ok=True)
  with out_path.open('a', encoding='utf-8') as f:
    write = lambda entry: (f.write(json.dumps(entry) + '\n'), f.flush())
    for entry in refusals:
      write(entry)
    count, last = len(refusals), time.perf_counter()
    for result in engine.run(requests):
      write(_entry(result, tokenizer))
      count += 1
      if time.perf_counter() - last >= progress_every or count == total:
        last = time.perf_counter()
        print(_progress(count, total, engine), file=sys.stderr, flush=True)
  engine.stats.refused += len(refusals)
  return engine.stats


def check_max_new_tokens(max_new_tokens: int, max_len: int, ids: list):
  """A UserError, before any work, when --max_new_tokens leaves no room in
  the model's max_len for even a one-token prompt and some requests (ids)
  take it rather than a "max_new_tokens" of their own."""
  if ids and max_new_tokens > max_len - 1:
    raise UserError(
        f'--max_new_tokens={max_new_tokens} leaves no room for a prompt in '
        f'model.max_len ({max_len}), so {len(ids)} request(s) taking it '
        f'(id {json.dumps(ids[0])} first) could never run; give at most '
        f'{max_len - 1}, or a "max_new_tokens" on their lines')


def _entry(result: engine_lib.Result, tokenizer) -> dict:
  if result.error:
    return {'id': result.id, 'error': result.error}
  return {'id': result.id, 'text': tokenizer.decode(result.tokens),
          'tokens': result.tokens,
          'time_to_first_token_s': round(result.time_to_first_token_s, 6),
          'per_token_s': (None if result.per_token_s is None
                          else round(result.per_token_s, 6))}


def _progress(count: int, total: int, engine: engine_lib.Engine) -> str:
  s, a = engine.stats, engine.allocator
  seconds = time.perf_counter() - engine.started
  return (f'generate: {count}/{total} requests, {s.tokens:,} tokens, '
          f'{s.tokens / max(seconds, 1e-9):,.1f} tokens/s, '
          f'{s.mean_in_flight:.1f} in flight, pages {a.in_use}/{a.usable} '
          f'(high-water {a.high_water})')


def main(argv):
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  del argv
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  stats = generate_file(
      f.workdir, f.prompts, f.out, kv_memory=f.kv_memory,
      max_new_tokens=f.max_new_tokens, temperature=f.temperature,
      top_k=f.top_k, seed=f.seed, slots=f.slots, page_size=f.page_size,
      kv_cache_dtype=f.kv_cache_dtype,
      check=lambda mc: sample.check_flags(f, mc.vocab_size))
  return report(stats, f.out) if stats else 0  # app.run's exit status.


def report(stats: engine_lib.Stats, out: str) -> int:
  """Prints the run's summary to stderr; the exit status: 1 when a request
  was refused (a rerun retries it, once its line or the flags are fixed)."""
  print(f'generate: {stats.tokens:,} tokens in {stats.seconds:.1f}s '
        f'({stats.tokens / max(stats.seconds, 1e-9):,.1f} tokens/s, '
        f'compiling included), {stats.mean_in_flight:.1f} sequences in '
        f'flight on average, pool high-water {stats.high_water_pages} of '
        f'{stats.usable_pages} pages of {stats.page_bytes:,} bytes',
        file=sys.stderr)
  print(f'generate: {stats.done} done, {stats.refused} refused (see {out})',
        file=sys.stderr)
  return 1 if stats.refused else 0


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from train.cli import run_app  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('workdir', None, 'a train.main workdir')
  flags.DEFINE_string('prompts', None, 'JSON lines: {"id": ..., "prompt": ...}')
  flags.DEFINE_string('out', None, 'JSON lines written as requests finish')
  flags.DEFINE_string('kv_memory', '256MiB', "the paged cache's bytes "
                      '(e.g. 256MiB, 1GB)')
  flags.DEFINE_integer('max_new_tokens', 200, 'tokens to generate per prompt')
  flags.DEFINE_float('temperature', 0.0, '0 = greedy')
  flags.DEFINE_integer('top_k', 0, 'sample among the k likeliest; 0 = all')
  flags.DEFINE_integer('seed', 0, 'sampling seed')
  flags.DEFINE_integer('slots', 8, 'sequences decoded together',
                       lower_bound=1)
  flags.DEFINE_integer('page_size', 16, 'tokens per page', lower_bound=1)
  flags.DEFINE_string('kv_cache_dtype', None, 'how the pages store K/V: '
                      'float32, bfloat16 or int8 (default: the model\'s)')
  run_app(main, required=['workdir', 'prompts', 'out'])


if __name__ == '__main__':
  run()
