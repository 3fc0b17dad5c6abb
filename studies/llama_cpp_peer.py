"""llama.cpp as a benchmarks' peer: the same model as a GGUF file
(`train.convert.to_gguf`, the same weight dtype), run through llama-cpp-python's
low-level API (llama_batch, llama_decode) in a process of its own, with
as many threads as JAX's CPU pool (no two frameworks' thread pools in one
process). The process answers one JSON line per JSON command on its stdin
and times itself, so a round's time is llama.cpp's alone.

  decode   `batch` sequences, each in its own KV stream (kv_unified off:
           a sequence attends to its own cache only) filled with `context`
           tokens, then `steps` greedy tokens for all of them in one
           llama_decode each: seconds per step, median over rounds that
           take turns with ours; after each round the cache is cut back to
           `context`.
  serve    a trace of requests (prompt, output length) through continuous
           batching over one unified KV cache of `n_ctx` tokens (the memory
           of our engine's pages), in at most `slots` sequences at once, as
           llama-server batches: each llama_decode carries every running
           sequence's next token and as much of the waiting prompts as fits
           in n_batch; a request is admitted when its prompt and output fit
           beside those of the requests running (our engine's 'reserve'
           admission), and its cells freed when it ends.

Threads: llama.cpp's (OpenMP's) spin at every barrier by default, which
on a machine busier than its cores stalls a step while a spinning thread
waits for one descheduled (measured on the shared 2-core VM at a load of
9: 12 tokens/s on 2 threads, 600 on 1); OMP_WAIT_POLICY=passive, in the
environment of the command, makes them sleep instead (910 tokens/s). The
default is what users get on an idle machine; the reports record the
policy (`wait_policy`).

The KV cache stores what ours does: float32 (ggml F32), bfloat16 (BF16), or
for int8 llama.cpp's Q8_0 (int8 with a scale per 32 numbers rather than per
token and head). Greedy tokens are the argmax of each row of logits.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from infra.errors import UserError, pip_install
from lm import checkpoint
from train.convert import to_gguf

# Our cache's dtype -> ggml's type of llama.cpp's (gguf.GGMLQuantizationType).
KV_TYPES = {'float32': 0, 'bfloat16': 30, 'int8': 8}
N_BATCH = 512  # Tokens per llama_decode at most (llama.cpp's default).


def check_installed():
  """UserError naming the install where llama-cpp-python is missing."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  if importlib.util.find_spec('llama_cpp') is None:
    raise UserError('--llama_cpp needs llama-cpp-python (it builds llama.cpp, '
                    f'~6 min): {pip_install("llama-cpp")}')


def wait_policy() -> str:
  """OMP_WAIT_POLICY as the worker inherits it ('' = OpenMP's default)."""
  return os.environ.get('OMP_WAIT_POLICY', '')


def version() -> str:
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  return importlib.metadata.version('llama-cpp-python')


@contextlib.contextmanager
def started(config, params, threads: int | None = None):
  """Yields a Peer running `params` (a model of `config`) exported as GGUF
  at its param_dtype, in a worker process of `threads` threads (None: the
  cores this process may run on, as JAX's pool)."""
  check_installed()
  threads = threads or len(os.sched_getaffinity(0))
  with tempfile.TemporaryDirectory() as tmp:
    workdir = pathlib.Path(tmp, 'workdir')
    checkpoint.save_params(workdir, params)  # A step-0 workdir, as imports.
    (workdir / 'config.json').write_text(config.to_json(indent=2))
    path = pathlib.Path(tmp, 'model.gguf')
    to_gguf.export(str(workdir), str(path))
    process = subprocess.Popen(
        [sys.executable, '-m', 'studies.llama_cpp_peer', f'--model={path}',
         f'--threads={threads}'], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, bufsize=1)
    try:
      yield Peer(process)
    finally:
      process.stdin.close()
      process.wait()


class Peer:
  """The worker's commands as methods; each returns its JSON answer."""

  def __init__(self, process):
    self._process = process

  def _ask(self, op: str, **args) -> dict:
    self._process.stdin.write(json.dumps({'op': op, 'args': args}) + '\n')
    answer = self._process.stdout.readline()
    if not answer:
      raise RuntimeError(f'the llama.cpp worker ended during {op} (exit '
                         f'{self._process.wait()})')
    return json.loads(answer)

  def decode_setup(self, batch: int, context: int, steps: int,
                   kv_dtype: str) -> dict:
    return self._ask('decode_setup', batch=batch, context=context,
                     steps=steps, kv_type=KV_TYPES[kv_dtype])

  def decode_round(self) -> float:
    """Seconds per decode step of one round (all `batch` sequences)."""
    return self._ask('decode_round')['seconds_per_step']

  def serve(self, trace, n_ctx: int, slots: int, kv_dtype: str,
            outputs: bool = False) -> dict:
    """One pass of the trace [(prompt tokens, output length)]: its numbers
    (tokens, seconds, cpu_seconds, mean_in_flight, time to first token and
    per-token medians; outputs: and each request's tokens)."""
    return self._ask('serve', trace=[[list(map(int, p)), int(n)]
                                     for p, n in trace],
                     n_ctx=n_ctx, slots=slots, kv_type=KV_TYPES[kv_dtype],
                     outputs=outputs)


# The worker (python -m studies.llama_cpp_peer --model=PATH --threads=N).

class Worker:
  """One model, one context at a time; commands from `Peer`."""

  def __init__(self, model_path: str, threads: int):
    import llama_cpp  # pylint: disable=import-outside-toplevel
    self.l = llama_cpp
    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
    params = llama_cpp.llama_model_default_params()
    self._progress = llama_cpp.llama_progress_callback(lambda *_: True)
    params.progress_callback = self._progress  # No dots while loading.
    self.model = llama_cpp.llama_model_load_from_file(model_path.encode(),
                                                      params)
    self.vocab = llama_cpp.llama_vocab_n_tokens(
        llama_cpp.llama_model_get_vocab(self.model))
    self.threads = threads
    self.ctx = None
    self.batch = llama_cpp.llama_batch_init(N_BATCH, 0, 1)

  def _context(self, n_ctx: int, n_seq: int, unified: bool, kv_type: int):
    if self.ctx is not None:
      self.l.llama_free(self.ctx)
    p = self.l.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch = n_ctx, N_BATCH, N_BATCH
    p.n_seq_max, p.kv_unified = n_seq, unified
    p.n_threads = p.n_threads_batch = self.threads
    p.type_k = p.type_v = kv_type
    p.no_perf = True
    self.ctx = self.l.llama_init_from_model(self.model, p)
    if not self.ctx:
      raise RuntimeError(f'llama.cpp made no context of {n_ctx} tokens')
    self.memory = self.l.llama_get_memory(self.ctx)

  def _decode(self, entries) -> list[int]:
    """One llama_decode of [(token, position, sequence, wants logits)];
    the greedy next token of each entry that wants logits, in order."""
    b = self.batch
    b.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
      b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
      b.seq_id[i][0], b.logits[i] = seq, logits
    status = self.l.llama_decode(self.ctx, b)
    if status:
      raise RuntimeError(f'llama_decode returned {status}')
    return [int(np.argmax(np.ctypeslib.as_array(
        self.l.llama_get_logits_ith(self.ctx, i), (self.vocab,))))
            for i, entry in enumerate(entries) if entry[3]]

  def decode_setup(self, batch, context, steps, kv_type):
    self._context(batch * (context + steps), batch, False, kv_type)
    rng = np.random.default_rng(0)
    for seq in range(batch):  # Filled sequence by sequence (not timed).
      tokens = rng.integers(0, self.vocab, context)
      for start in range(0, context, N_BATCH):
        chunk = tokens[start:start + N_BATCH]
        self._decode([(int(t), start + i, seq, start + i == context - 1)
                      for i, t in enumerate(chunk)])
    self.setting = (batch, context, steps)
    return {'n_ctx': self.l.llama_n_ctx(self.ctx)}

  def decode_round(self):
    batch, context, steps = self.setting
    tokens = [0] * batch
    start = time.perf_counter()
    for step in range(steps):
      tokens = self._decode([(tokens[s], context + step, s, True)
                             for s in range(batch)])
    seconds = time.perf_counter() - start
    for seq in range(batch):  # Back to `context` for the next round.
      self.l.llama_memory_seq_rm(self.memory, seq, context, -1)
    return {'seconds_per_step': seconds / steps}

  def serve(self, trace, n_ctx, slots, kv_type, outputs):
    self._context(n_ctx, slots, True, kv_type)
    return serve_trace(self, trace, n_ctx, slots, outputs)


def serve_trace(worker: Worker, trace, n_ctx: int, slots: int,
                outputs: bool = False) -> dict:
  """Continuous batching of `trace` (the module's docstring, serve)."""
  waiting = list(range(len(trace)))[::-1]  # Popped from the end: in order.
  running = {}  # Sequence -> [request, position, tokens made, last token].
  free, reserved = list(range(slots))[::-1], 0
  first, last, in_flight = {}, {}, []
  made_tokens = [[] for _ in trace]
  start, cpu = time.perf_counter(), time.process_time()
  need = lambda r: len(trace[r][0]) + trace[r][1]  # Cells it reserves.
  while waiting or running:
    while waiting and free and reserved + need(waiting[-1]) <= n_ctx:
      reserved += need(waiting[-1])
      running[free.pop()] = [waiting.pop(), 0, 0, None]
    if not running:
      raise ValueError(f'request {waiting[-1]} needs {need(waiting[-1])} '
                       f'cells, more than the {n_ctx} of the cache')
    entries, owners = _batch(running, trace)
    in_flight.append(sum(1 for s in running.values() if s[2]))
    tokens = worker._decode(entries)  # pylint: disable=protected-access
    now = time.perf_counter()
    for seq, token in zip(owners, tokens):
      state = running[seq]
      r = state[0]
      if state[2]:
        state[1] += 1
      state[2] += 1
      state[3] = token
      made_tokens[r].append(token)
      first.setdefault(r, now)
      if state[2] == trace[r][1]:  # Done: its cells and slot freed.
        last[r] = now
        worker.l.llama_memory_seq_rm(worker.memory, seq, -1, -1)
        reserved -= need(r)
        del running[seq]
        free.append(seq)
  seconds = time.perf_counter() - start
  per_token = [(last[r] - first[r]) / (n - 1)
               for r, (_, n) in enumerate(trace) if n > 1]
  return {'tokens': sum(n for _, n in trace), 'seconds': seconds,
          'cpu_seconds': time.process_time() - cpu,
          'mean_in_flight': float(np.mean(in_flight)),
          'time_to_first_token_s': float(np.median(
              [first[r] - start for r in range(len(trace))])),
          'per_token_s': float(np.median(per_token)) if per_token else None,
          'n_ctx': worker.l.llama_n_ctx(worker.ctx),
          **({'outputs': made_tokens} if outputs else {})}



def _batch(running: dict, trace) -> tuple[list, list]:
  """One llama_decode's batch from RUNNING (sequence -> [request,
  position, tokens made, last token]): every decoding sequence's last token,
  then the prompt chunks that fit beside them, their positions advanced.
  Returns the entries (token, position, sequence, logits wanted) and the
  sequences whose next tokens the logits give, in order."""
  entries, owners = [], []
  for seq, (r, pos, made, token) in running.items():
    if made:  # Decoding: its last token.
      entries.append((token, pos, seq, True))
      owners.append(seq)
  for seq, state in running.items():  # Prefill what fits beside them.
    r, pos, made, _ = state
    prompt = trace[r][0]
    if made or len(entries) >= N_BATCH:
      continue
    chunk = prompt[pos:pos + N_BATCH - len(entries)]
    ends = pos + len(chunk) == len(prompt)
    entries += [(t, pos + i, seq, ends and i == len(chunk) - 1)
                for i, t in enumerate(chunk)]
    state[1] = pos + len(chunk)
    owners += [seq] if ends else []
  return entries, owners

def _quiet(level, text, user_data):  # llama.cpp's log: errors only.
  del user_data
  if level >= 4:  # GGML_LOG_LEVEL_ERROR
    sys.stderr.write(text.decode(errors='replace'))


def _log_callback():
  import llama_cpp  # pylint: disable=import-outside-toplevel
  return llama_cpp.llama_log_callback(_quiet)


_QUIET = None


def main():
  global _QUIET  # pylint: disable=global-statement
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--model', required=True)
  parser.add_argument('--threads', type=int, required=True)
  args = parser.parse_args()
  _QUIET = _log_callback()  # Kept alive: llama.cpp holds the pointer.
  worker = Worker(args.model, args.threads)
  for line in sys.stdin:
    command = json.loads(line)
    answer = getattr(worker, command['op'])(**command['args'])
    print(json.dumps(answer), flush=True)


if __name__ == '__main__':
  main()
