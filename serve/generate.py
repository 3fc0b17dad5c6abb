"""Generates continuations of many prompts at once, over a paged KV cache.

  python -m serve.generate --workdir=DIR --prompts=FILE.jsonl --out=OUT.jsonl \
      --kv_memory=256MiB --max_new_tokens=N [--temperature=0] [--top_k=0] \
      [--top_p=1] [--seed=0] [--stop=STR] [--slots=128] [--page_size=16] \
      [--prefill_chunk=64] [--admission=reserve] [--kv_cache_dtype=int8]

A thin loop over `serve.engine.Engine` (add_request, step): the prompts are
added as the engine has room for them, and each result is written as its
request finishes. A prompt line is {"id": ..., "prompt": "..."} (optionally
"max_new_tokens"); each result line, appended to OUT as its request
finishes, is {"id", "text" (the continuation, as train.sample prints it: up
to an end-of-sequence token or a --stop string), "tokens" (the ids generated,
up to an end-of-sequence token: a stop string's kept),
"finish_reason" ("length", "eos" or "stop"), "time_to_first_token_s" (from
the run's start, queueing included), "per_token_s"}, or {"id", "error"} (one
line) for a request refused: a malformed line (then "id" is null and "line"
its number), an empty prompt, one past the model's max_len, one needing more
pages than --kv_memory holds. The other requests go on, and the run exits 1
when any was refused. Sampling is `lm.sampling`'s: request id's tokens
are sampled with --seed and each token's position, so the text does not
depend on --slots, on what shares a batch, or on the order of the file, and
equals train.sample's with the same settings.

Nothing lost: OUT is written a line at a time; a rerun into the same OUT
(after a kill, a full disk, or a fix to a refused line) skips the requests
it holds results for, retries those it holds errors for, and drops a line
cut short. OUT's settings (the model's checkpoint, sampling, max_new_tokens,
cache dtype) are kept beside it in OUT.settings.json, and a rerun under
other settings is refused, naming the difference, rather than mixed into it.
One process writes an OUT at a time (OUT.lock). Duplicate ids and --out equal
to --prompts are refused before anything is written. For a pipe, --prompts=-
reads stdin and --out=- streams the result lines to stdout (nothing to
resume, so no OUT.settings.json or lock). Progress (requests
done, tokens/s, sequences in flight, pages) goes to stderr.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import sys
import time

import numpy as np

from serve import engine as engine_lib
from serve import pages
from lm import sampling
from lm import inference
from infra.errors import UserError


# What a prompt line may hold.
LINE_KEYS = frozenset({'id', 'prompt', 'max_new_tokens'})
STDIO = '-'  # --prompts=- reads stdin; --out=- streams to stdout.


def read_prompts(path: pathlib.Path, tokenizer, max_new_tokens: int,
                 settings: sampling.SamplingParams = sampling.SamplingParams()):
  """(requests, refusals, defaulted): the prompt file's lines as engine
  Requests, a result line for each malformed one (keyed by id, or by its line
  when it has none), and the ids (as JSON) of the requests taking
  max_new_tokens rather than a "max_new_tokens" of their own. A UserError
  when two lines share an id (the results could not be told apart)."""
  requests, refusals, seen, defaulted = [], [], {}, set()
  try:
    lines = (sys.stdin.read() if str(path) == STDIO
             else path.read_text(encoding='utf-8')).splitlines()
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
    if not isinstance(entry, dict) or 'id' not in entry:
      refuse('needs an "id" and a "prompt" string; write '
             '{"id": ..., "prompt": "..."}')
      continue
    key = json.dumps(entry['id'])
    unknown = sorted(set(entry) - LINE_KEYS)
    if not isinstance(entry.get('prompt'), str) or unknown:
      if key in seen:
        raise UserError(f'--prompts={path}: id {key} is on lines {seen[key]} '
                        f'and {n}; give each prompt its own id (nothing was '
                        'written)')
      seen[key] = n
      refusals.append({'id': entry['id'], 'error': (
          f'line {n}: unknown key(s) {", ".join(unknown)}; a line takes '
          '"id", "prompt" and "max_new_tokens" (sampling is set by the '
          'flags)') if unknown else (
              f'line {n}: needs a "prompt" string; write '
              '{"id": ..., "prompt": "..."}')})
      continue
    if key in seen:
      raise UserError(f'--prompts={path}: id {key} is on lines {seen[key]} '
                      f'and {n}; give each prompt its own id (nothing was '
                      'written)')
    seen[key] = n
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
                                       sampling=settings))
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


def check_paths(prompts: pathlib.Path, out: pathlib.Path):
  """--out must not be --prompts (a rerun would read results as prompts),
  nor a device (OUT.lock and OUT.settings.json go beside OUT)."""
  if str(out) == STDIO:
    return
  if out.absolute().parts[1:2] in (('dev',), ('proc',)):
    raise UserError(f'--out={out} is a device; give a file for the results, '
                    'or --out=- to stream them to stdout (no resuming)')
  if str(prompts) == STDIO:
    return
  if out.resolve() == prompts.resolve() or (
      out.exists() and prompts.exists() and out.samefile(prompts)):
    raise UserError(f'--out={out} is the --prompts file; give another file '
                    'for the results')
  if out.exists() and not out.is_file():
    raise UserError(f'--out={out} is not a file; give a file for the results')


def settings_path(out: pathlib.Path) -> pathlib.Path:
  return out.with_name(out.name + '.settings.json')


def check_settings(out: pathlib.Path, settings: dict, holds_results: bool):
  """Refuses (one line naming the first difference) an OUT holding results
  made under other settings (OUT.settings.json records them), and an OUT
  holding anything without that record (not this command's: not to be
  appended to)."""
  path = settings_path(out)
  if not path.exists() and out.exists() and out.stat().st_size:
    raise UserError(f'--out={out} is a file this command did not write (no '
                    f'{path.name} beside it); give a new file for the '
                    'results')
  if not holds_results:
    return  # A new OUT, or one holding only errors (they are retried).
  try:
    made = json.loads(path.read_text(encoding='utf-8'))
  except FileNotFoundError:
    raise UserError(f'--out={out} holds results with no record of their '
                    f'settings ({path.name}); give another --out') from None
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f'{path} cannot be read ({e}); give another --out'
                    ) from None
  for name, value in settings.items():
    if made.get(name) != value:
      raise UserError(
          f'--out={out} holds results made with {name}={made.get(name)!r}, '
          f'not {value!r}; rerun with the same settings or give another '
          '--out')


class _Lock:
  """OUT.lock held (flock) while a run writes OUT: a second is refused."""

  def __init__(self, out: pathlib.Path):
    self.path = out.with_name(out.name + '.lock')

  def __enter__(self):
    self.file = self.path.open('a+', encoding='utf-8')
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      self.file.seek(0)
      holder = self.file.read().strip() or 'another process'
      self.file.close()
      raise UserError(f'{self.path.name[:-5]} is being written by '
                      f'{holder}; wait for it to end or give another --out'
                      ) from None
    self.file.seek(0)
    self.file.truncate()
    self.file.write(f'serve.generate pid {os.getpid()}\n')
    self.file.flush()
    return self

  def __exit__(self, *exc):
    self.file.close()  # Releases the lock.


def _disk_full(out: pathlib.Path, e: OSError) -> UserError:
  return UserError(f'cannot write {out} ({e.strerror or e}); free space and '
                   'rerun the same command: the results written are kept '
                   'and the rest are done')


def generate_file(workdir: str, prompts: str, out: str, *, kv_memory: str,
                  max_new_tokens: int,
                  settings: sampling.SamplingParams = sampling.SamplingParams(),
                  slots: int = 128, page_size: int = 16,
                  prefill_chunk: int = 64, admission: str = 'reserve',
                  kv_cache_dtype=None, progress_every: float = 10.0,
                  check=lambda config: None) -> engine_lib.Stats | None:
  """Runs every request of PROMPTS without a result in OUT, appending its
  line; the run's Stats (None when nothing was left to do), `refused`
  counting the malformed lines too. check(model config): raises a UserError
  for flags the model cannot take. Every check is made before OUT is
  touched."""
  memory = pages.parse_bytes(kv_memory)
  out_path, prompts_path = pathlib.Path(out), pathlib.Path(prompts)
  check_paths(prompts_path, out_path)
  mc, params, tokenizer, step = inference.load_language_model(workdir,
                                                              with_step=True)
  check(mc)
  settings = settings.check(mc.vocab_size)
  requests, refusals, defaulted = read_prompts(prompts_path, tokenizer,
                                               max_new_tokens, settings)
  if not requests and not refusals:
    raise UserError(f'--prompts={prompts} holds no prompts; write '
                    '{"id": ..., "prompt": "..."} lines')
  greedy = settings.temperature == 0  # Then top_k, top_p and seed do not
  record = {'workdir': str(pathlib.Path(workdir).resolve()), 'step': step,
            'max_new_tokens': max_new_tokens,  # change a text.
            'kv_cache_dtype': kv_cache_dtype or mc.kv_cache_dtype or np.dtype(
                mc.dtype).name,
            'temperature': settings.temperature,
            'top_k': None if greedy else settings.top_k,
            'top_p': None if greedy else settings.top_p,
            'seed': None if greedy else settings.seed,
            'stop': list(settings.stop)}
  try:
    engine = engine_lib.Engine(
        mc, params, kv_memory=memory, page_size=page_size, slots=slots,
        prefill_chunk=prefill_chunk, eos_ids=tokenizer.eos_ids,
        kv_cache_dtype=kv_cache_dtype, detokenize=tokenizer.decode,
        admission=admission)
  except engine_lib.PoolSizeError as e:
    raise UserError(f'--kv_memory={kv_memory}: {e}') from None
  check_max_new_tokens(max_new_tokens, mc.max_len, [
      r.id for r in requests if json.dumps(r.id) in defaulted])
  if out == STDIO:  # A stream: nothing kept to resume, so no lock either.
    return _write_all(sys.stdout, engine, requests, refusals, tokenizer,
                      settings, progress_every)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  with _Lock(out_path):
    kept, done = read_out(out_path)
    check_settings(out_path, record, bool(done))
    requests = [r for r in requests if json.dumps(r.id) not in done]
    refusals = [r for r in refusals if _key(r) not in done]
    try:
      rewrite(settings_path(out_path), json.dumps(record, indent=1) + '\n')
      if out_path.exists() and kept != out_path.read_text(encoding='utf-8'):
        rewrite(out_path, kept)  # Errors dropped: they are retried below.
      total = len(requests) + len(refusals)
      if not total:
        print(f'generate: all requests are already in {out}',
              file=sys.stderr)
        return None
      with out_path.open('a', encoding='utf-8') as f:
        return _write_all(f, engine, requests, refusals, tokenizer, settings,
                          progress_every)
    except OSError as e:
      if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise _disk_full(out_path, e) from None
      raise


def _write_all(f, engine: engine_lib.Engine, requests, refusals, tokenizer,
               settings: sampling.SamplingParams, progress_every: float
               ) -> engine_lib.Stats:
  """Writes the refusals' lines, then each request's as it finishes, to f
  (flushed a line at a time); progress to stderr. The run's Stats,
  `refused` counting the refusals too."""
  write = lambda entry: (f.write(json.dumps(entry) + '\n'), f.flush())
  for entry in refusals:
    write(entry)
  total = len(requests) + len(refusals)
  count, last = len(refusals), time.perf_counter()
  for result in engine.run(requests):
    write(_entry(result, tokenizer, settings))
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


def _entry(result: engine_lib.Output, tokenizer,
           settings: sampling.SamplingParams) -> dict:
  if result.error:  # The engine's pool is this command's --kv_memory.
    return {'id': result.id, 'error': result.error.replace(
        'give the pool more pages', 'raise --kv_memory')}
  done = sampling.cut(result.tokens, eos_ids=(), decode=tokenizer.decode,
                      stop=settings.stop)
  return {'id': result.id, 'text': done.text, 'tokens': result.tokens,
          'finish_reason': result.finish_reason,
          'time_to_first_token_s': round(result.time_to_first_token_s, 6),
          'per_token_s': (None if result.per_token_s is None
                          else round(result.per_token_s, 6))}


def _progress(count: int, total: int, engine: engine_lib.Engine) -> str:
  s, a = engine.stats, engine.pages
  seconds = time.perf_counter() - (engine.started or time.perf_counter())
  return (f'generate: {count}/{total} requests, {s.tokens:,} tokens, '
          f'{s.tokens / max(seconds, 1e-9):,.1f} tokens/s, '
          f'{s.mean_in_flight:.1f} in flight, pages {a.in_use}/{a.usable} '
          f'(high-water {a.high_water}), {s.preemptions} preempted')


def main(argv):
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  del argv
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  settings = inference.settings_from_flags(f)  # Checked by generate_file.
  stats = generate_file(
      f.workdir, f.prompts, f.out, kv_memory=f.kv_memory,
      max_new_tokens=f.max_new_tokens, settings=settings, slots=f.slots,
      page_size=f.page_size, prefill_chunk=f.prefill_chunk,
      admission=f.admission,
      kv_cache_dtype=f.kv_cache_dtype,
      check=lambda mc: inference.check_decode_flags(f))
  return report(stats, f.out) if stats else 0  # app.run's exit status.


def report(stats: engine_lib.Stats, out: str) -> int:
  """Prints the run's summary to stderr; the exit status: 1 when a request
  was refused (a rerun retries it, once its line or the flags are fixed)."""
  print(f'generate: {stats.tokens:,} tokens in {stats.seconds:.1f}s '
        f'({stats.tokens / max(stats.seconds, 1e-9):,.1f} tokens/s, '
        f'compiling included), {stats.mean_in_flight:.1f} sequences in '
        f'flight on average, pool high-water {stats.high_water_pages} of '
        f'{stats.usable_pages} pages of {stats.page_bytes:,} bytes, '
        f'{stats.preemptions} preemption(s)', file=sys.stderr)
  where = 'stdout' if out == STDIO else out
  print(f'generate: {stats.done} done, {stats.refused} refused (see '
        f'{where})', file=sys.stderr)
  return 1 if stats.refused else 0


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from infra.cli import run_app  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('workdir', None, 'a train.main workdir')
  flags.DEFINE_string('prompts', None, 'JSON lines: {"id": ..., "prompt": '
                      '...}; - reads stdin')
  flags.DEFINE_string('out', None, 'JSON lines written as requests finish; '
                      '- streams them to stdout (a file can be resumed)')
  flags.DEFINE_string('kv_memory', '256MiB', "the paged cache's bytes "
                      '(e.g. 256MiB, 1GB)')
  flags.DEFINE_integer('max_new_tokens', 200, 'tokens to generate per prompt')
  inference.define_sampling_flags(temperature=0.0)
  flags.adopt_module_key_flags(inference)  # So that --help lists them.
  flags.DEFINE_integer('slots', 128, 'sequences in flight at most (decoded '
                       'together; fewer when --kv_memory holds fewer)',
                       lower_bound=1)
  flags.DEFINE_integer('page_size', 16, 'tokens per page', lower_bound=1)
  flags.DEFINE_integer('prefill_chunk', 64, 'prompt tokens a sequence feeds '
                       'per step (the rest in later steps, beside the '
                       'decoding ones)', lower_bound=1)
  flags.DEFINE_enum('admission', 'reserve', ['reserve', 'optimistic'],
                    'reserve: admit a request when the pool can carry it and '
                    'the running ones to their max_new_tokens (no '
                    'recompute); optimistic: on its first chunk\'s pages, '
                    'preempting the newest when the pool runs out')
  flags.DEFINE_string('kv_cache_dtype', None, 'how the pages store K/V: '
                      'float32, bfloat16 or int8 (default: the model\'s)')
  run_app(main, required=['workdir', 'prompts', 'out'])


if __name__ == '__main__':
  run()
