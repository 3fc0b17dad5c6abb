r"""Generates continuations of many prompts at once, over a paged KV cache.

  python -m serve.generate --workdir=DIR --prompts=FILE.jsonl --out=OUT.jsonl \
      --kv_memory=256MiB --max_new_tokens=N [--temperature=0] [--top_k=0] \
      [--top_p=1] [--seed=0] [--stop=STR] [--slots=128] [--page_size=16] \
      [--prefill_chunk=64] [--admission=reserve] [--kv_cache_dtype=int8]

A thin loop over `serve.engine.Engine` (add_request, step): prompt lines are
read as the engine has room for them (`serve.prompts`), so the first result
comes in seconds whatever the file's length, and memory does not grow with
it; each result is written as its request finishes. A prompt line is {"id":
..., "prompt": "..."}, optionally with "max_new_tokens" and "seed" of its
own; each result line, appended to OUT as its request finishes, is {"id",
"text" (the continuation, as train.sample prints it: up to an
end-of-sequence token or a --stop string), "tokens" (the ids generated, up
to an end-of-sequence token: a stop string's kept), "finish_reason"
("length", "eos" or "stop"), "seed" (when sampling), "request" (the hash of
what decides the text: prompt, max_new_tokens, settings, seed),
"time_to_first_token_s" (from when its line was read, queueing included),
"per_token_s"}, or {"id", "error"} (one line) for a request refused: an
empty prompt, one past the model's max_len, one needing more pages than
--kv_memory holds, a bad "max_new_tokens" or "seed"; a line with no usable
id (not JSON, no "id") is {"line", "error"}, with no "id". The other
requests go on, and the run exits 1 when any was refused.

Sampling is `lm.sampling`'s, and a request's randomness is its own: its
i-th token is drawn with fold_in(key(seed), i), the seed its line's
"seed", else one derived from --seed and its id (`sampling.request_seed`),
which its result records. So the text does not depend on --slots, on what
shares a batch, or on the order of the file; one prompt under two ids
samples two independent texts; and a line's seed gives the text
`train.sample --seed` gives with the same settings.

Nothing lost, and nothing reused that does not match (`serve.results`): OUT
is written a line at a time; a rerun into the same OUT (after a kill, a
full disk, or a fix to a refused line) keeps each result whose request hash
is the same, regenerates a request whose hash changed (an edited prompt),
retries those it holds errors for, and drops a line cut short. OUT's
settings and the fingerprint of the checkpoint's parameters are kept beside
it in OUT.settings.json; a rerun under other settings, or with another
checkpoint (a workdir trained again), is refused, naming the difference,
rather than mixed into it. One process writes an OUT at a time (OUT.lock,
removed when it ends). Duplicate ids in a file and --out equal to --prompts
are refused before anything is written. For a pipe, --prompts=- reads
stdin as it comes (a duplicate id there is refused by its line) and --out=-
streams the result lines to stdout (nothing to resume, so no
OUT.settings.json or lock). Which checkpoint was loaded, and progress
(requests done, tokens/s, sequences in flight, pages), go to stderr.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np

from serve import engine as engine_lib
from serve import pages
from serve import prompts as prompts_lib
from serve import results as results_lib
from lm import checkpoint
from lm import inference
from lm.sampling_params import SamplingParams, cut
from infra.errors import UserError

STDIO = prompts_lib.STDIO


def generate_file(workdir: str, prompts: str, out: str, *, kv_memory: str,
                  max_new_tokens: int,
                  settings: SamplingParams = SamplingParams(),
                  slots: int = 128, page_size: int = 16,
                  prefill_chunk: int = 64, admission: str = 'reserve',
                  kv_cache_dtype=None, progress_every: float = 10.0,
                  check=lambda config: None) -> engine_lib.Stats | None:
  """Runs every request of PROMPTS without a result of the same request
  hash in OUT, appending its line; the run's Stats (None when nothing was
  left to do), `refused` counting the refused lines too. check(model
  config): raises a UserError for flags the model cannot take. Every check
  a file allows is made before OUT is touched."""
  memory = pages.parse_bytes(kv_memory)
  out_path, prompts_path = pathlib.Path(out), pathlib.Path(prompts)
  results_lib.check_paths(prompts_path, out_path)
  mc, params, tokenizer, step = inference.load_language_model(workdir,
                                                           with_step=True)
  check(mc)
  settings = settings.check(mc.vocab_size)
  record = _record(workdir, step, checkpoint.fingerprint(params), mc,
                   max_new_tokens, kv_cache_dtype, settings)
  try:
    engine = engine_lib.Engine(
        mc, params, kv_memory=memory, page_size=page_size, slots=slots,
        prefill_chunk=prefill_chunk, eos_ids=tokenizer.eos_ids,
        kv_cache_dtype=kv_cache_dtype, detokenize=tokenizer.decode,
        admission=admission)
  except engine_lib.PoolSizeError as e:
    raise UserError(f'--kv_memory={kv_memory}: {e}') from None
  run = _Run(engine, tokenizer, max_new_tokens, settings, progress_every)
  loaded = (f'generate: {workdir} at step {step} (parameters '
            f'{record["checkpoint"]})')
  if out == STDIO:  # A stream: nothing kept to resume, so no lock either.
    run.total = _scan(run, prompts, mc)
    print(loaded, file=sys.stderr, flush=True)
    return run.serve(sys.stdout, prompts_lib.Lines(prompts))
  return _serve_file(run, prompts, out, mc, record, loaded)


def _serve_file(run: '_Run', prompts: str, out: str, mc, record: dict,
                loaded: str) -> engine_lib.Stats | None:
  """Appends to OUT (locked, its settings checked against RECORD) the
  results of the requests without one; None when none was left."""
  out_path = pathlib.Path(out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  with results_lib.Lock(out_path):
    held = results_lib.plan(out_path, retry_errors=True)
    run.total = _scan(run, prompts, mc)
    results_lib.check_settings(out_path, record, bool(held.done))
    run.done = held.done
    try:
      results_lib.write_settings(out_path, record)
      results_lib.compact(out_path, held.drop)  # Errors: retried below.
      print(loaded, file=sys.stderr, flush=True)
      with out_path.open('a', encoding='utf-8') as f:
        stats = run.serve(f, prompts_lib.Lines(prompts))
      if run.replaced:  # Lines of requests generated again: the old go.
        results_lib.compact(
            out_path, results_lib.plan(out_path, retry_errors=False).drop)
      if not run.written:
        print(f'generate: all requests are already in {out}',
              file=sys.stderr)
        return None
      return stats
    except OSError as e:
      full = results_lib.disk_full(out_path, e)
      if full is None:
        raise
      raise full from None


def _record(workdir: str, step: int, fingerprint: str, mc, max_new_tokens,
            kv_cache_dtype, settings: SamplingParams) -> dict:
  """OUT.settings.json: what decides every text of the run (the
  checkpoint's parameters, sampling, max_new_tokens, cache dtype), and
  where the parameters were read (`results.INFORMATION`, not compared)."""
  greedy = settings.temperature == 0  # Then top_k, top_p and seed do not
  return {'workdir': str(pathlib.Path(workdir).resolve()), 'step': step,
          'checkpoint': fingerprint,  # change a text.
          'max_new_tokens': max_new_tokens,
          'kv_cache_dtype': kv_cache_dtype or mc.kv_cache_dtype or np.dtype(
              mc.dtype).name,
          'temperature': settings.temperature,
          'top_k': None if greedy else settings.top_k,
          'top_p': None if greedy else settings.top_p,
          'seed': None if greedy else settings.seed,
          'stop': list(settings.stop)}


def _scan(run: '_Run', prompts: str, mc) -> int | None:
  """A prompt file read once ahead (`prompts.scan`): duplicate ids and a
  --max_new_tokens leaving no room refused before anything is written;
  how many lines it holds. None for stdin (read as it comes)."""
  if prompts == STDIO:
    return None
  found = prompts_lib.scan(pathlib.Path(prompts))
  if not found.lines:
    raise UserError(f'--prompts={prompts} holds no prompts; write '
                    f'{prompts_lib.LINE_SHAPE} lines')
  check_max_new_tokens(run.max_new_tokens, mc.max_len, found.defaulted,
                       found.first_defaulted)
  return found.lines


class _Run:
  """One run's loop: lines read as the engine has room, each request's
  result (or refusal) written as it comes; progress to stderr."""

  def __init__(self, engine: engine_lib.Engine, tokenizer,
               max_new_tokens: int, settings: SamplingParams,
               progress_every: float):
    self.engine, self.tokenizer = engine, tokenizer
    self.max_new_tokens, self.settings = max_new_tokens, settings
    self.progress_every = progress_every
    self.total: int | None = None  # Lines; None: unknown (stdin).
    self.done: dict[int, str] = {}  # OUT's results: id digest -> request.
    self.ids = prompts_lib.Ids()
    self.in_flight: dict[str, prompts_lib.Line] = {}  # By id as JSON.
    self.count = self.written = self.refused = 0
    self.replaced = 0  # Results in OUT whose requests changed.

  def serve(self, f, lines: prompts_lib.Lines) -> engine_lib.Stats:
    """Every line of `lines` served or refused into f (flushed a line at
    a time); the run's Stats, `refused` counting the refused lines."""
    self._out = f
    engine = self.engine
    engine.reset_stats()
    self._last = time.perf_counter()
    more = True
    while more or engine.has_unfinished():
      while more and engine.wants_requests():
        item = lines.get(block=not engine.has_unfinished())
        if item is None:
          break  # Nothing read yet: step what the engine holds.
        if item is prompts_lib.END:
          more = False
          break
        self._add(*item)
      if engine.has_unfinished():
        for result in engine.step():
          self._finished(self._entry(result))
    engine.stats.refused += self.refused  # Beside the engine's own.
    return engine.stats

  def _add(self, number: int, text: str):
    line = prompts_lib.parse(number, text, self.max_new_tokens,
                             self.settings)
    if line is None:
      return
    first = line.has_id and self.ids.earlier(line.key, number)
    if first:  # Read as it came (stdin): refused by its line.
      return self._refuse({'line': number, 'error': (
          f'line {number}: id {line.key} is on line {first} too; give each '
          'prompt its own id')})
    # OUT's result for this id: kept if its request is this line's, else
    # replaced by what this line now gives (a result or a refusal).
    held = (self.done.get(prompts_lib.digest(line.key), False)
            if line.has_id else False)
    if line.error is None and held == line.request:
      return self._counted()
    self.replaced += held is not False
    if line.error:
      return self._refuse(line.record())
    try:
      tokens = self.tokenizer.encode(line.prompt)
    except UnicodeEncodeError:
      return self._refuse(line.record('the prompt is not valid UTF-8 text (a '
                                      'lone surrogate); fix its escapes'))
    try:
      self.engine.add_request(engine_lib.Request(
          line.id, tokens, line.max_new_tokens, sampling=line.settings))
    except engine_lib.RequestRefused as e:  # The engine's Stats count it.
      return self._finished(line.record(_flag_words(e.reason)))
    self.in_flight[line.key] = line

  def _refuse(self, entry: dict):
    """A line refused before it reached the engine: counted here."""
    self.refused += 1
    self._finished(entry)

  def _finished(self, entry: dict):
    self._out.write(json.dumps(entry) + '\n')
    self._out.flush()
    self.written += 1
    self._counted()

  def _counted(self):
    """One more line handled (written, or kept from OUT); progress."""
    self.count += 1
    now = time.perf_counter()
    if now - self._last >= self.progress_every or self.count == self.total:
      self._last = now
      print(_progress(self.count, self.total, self.engine), file=sys.stderr,
            flush=True)

  def _entry(self, result: engine_lib.Output) -> dict:
    line = self.in_flight.pop(json.dumps(result.id))
    done = cut(result.tokens, eos_ids=(),
                        decode=self.tokenizer.decode, stop=line.settings.stop)
    greedy = line.settings.temperature == 0
    return {'id': result.id, 'text': done.text, 'tokens': result.tokens,
            'finish_reason': result.finish_reason,
            **({} if greedy else {'seed': line.settings.seed}),
            'request': line.request,
            'time_to_first_token_s': round(result.time_to_first_token_s, 6),
            'per_token_s': (None if result.per_token_s is None
                            else round(result.per_token_s, 6))}


def _flag_words(reason: str) -> str:
  """An engine refusal in this command's words: its pool is --kv_memory."""
  return reason.replace('give the pool more pages', 'raise --kv_memory')


def check_max_new_tokens(max_new_tokens: int, max_len: int, count: int,
                         first_id=None):
  """A UserError, before any work, when --max_new_tokens leaves no room in
  the model's max_len for even a one-token prompt and `count` requests
  (first_id the first) take it rather than a "max_new_tokens" of their
  own."""
  if count and max_new_tokens > max_len - 1:
    raise UserError(
        f'--max_new_tokens={max_new_tokens} leaves no room for a prompt in '
        f'model.max_len ({max_len}), so {count} request(s) taking it '
        f'(id {json.dumps(first_id)} first) could never run; give at most '
        f'{max_len - 1}, or a "max_new_tokens" on their lines')


def _progress(count: int, total: int | None, engine: engine_lib.Engine
              ) -> str:
  s, a = engine.stats, engine.pages
  seconds = time.perf_counter() - (engine.started or time.perf_counter())
  of = '' if total is None else f'/{total}'
  return (f'generate: {count}{of} lines, {s.tokens:,} tokens, '
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
                      '..., optional "max_new_tokens" and "seed"}; - reads '
                      'stdin as it comes')
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
