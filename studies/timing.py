"""How the benchmarks and studies time things: medians taken in turns, the
machine's read bandwidth, and a model's decode step as `train.sample` runs
it."""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from infra import provenance
from infra.errors import UserError
from lm import inference
from lm import sampling
from train import loop
from lm.model import Transformer, unroll_layers


# XLA programs compiled in this process since `compiles` was first called
# (jax.monitoring's backend-compile event, which fires once per program).
_COMPILED = []


def compiles() -> int:
  """Programs XLA has compiled in this process since the first call: a
  benchmark's timed pass that compiled is not a steady-state number."""
  if not _COMPILED:
    _COMPILED.append(0)

    def count(event: str, duration: float, **kwargs):
      del duration, kwargs
      if event == '/jax/core/compile/backend_compile_duration':
        _COMPILED[0] += 1
    jax.monitoring.register_event_duration_secs_listener(count)
  return _COMPILED[0]


def median_time(fn, repeats: int) -> float:
  return median_times({'fn': fn}, repeats)['fn']


def median_times(fns: dict, repeats: int, self_timed: dict | None = None
                 ) -> dict:
  """{name: median seconds}, the fns timed in turn, round after round
  (`all_times`)."""
  return {name: float(np.median(t))
          for name, t in all_times(fns, repeats, self_timed).items()}


def all_times(fns: dict, repeats: int, self_timed: dict | None = None
              ) -> dict:
  """{name: [seconds of each round]}, the fns timed in turn, round after
  round.

  Interleaving puts every contestant under the same drift of the machine's
  load (on a shared 2-core VM, identical runs vary up to 2x over minutes).
  self_timed: {name: fn} taking turns with them, each returning its own
  seconds (a peer in another process, which times itself there).
  """
  self_timed = self_timed or {}
  for fn in (*fns.values(), *self_timed.values()):
    jax.block_until_ready(fn())  # Compile and warm up.
  times = {name: [] for name in (*fns, *self_timed)}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
    for name, fn in self_timed.items():
      times[name].append(fn())
  return times


def read_test():
  """(bytes, fn): a jitted sum over 1 GiB of float32, read at full rate."""
  x = jnp.ones((2**28,), jnp.float32)
  total = jax.jit(jnp.sum)
  return x.nbytes, lambda: total(x)


def read_bandwidth(repeats: int) -> float:
  """Bytes/s of the read test: the machine's read rate."""
  nbytes, fn = read_test()
  return nbytes / median_time(fn, repeats)


DECODE_STEPS = 8  # Tokens a call of `decode_steps` decodes, by default.


def decode_step_seconds(mc, batch: int, context: int, repeats: int,
                        steps: int = DECODE_STEPS) -> float:
  """Median time per decoded token (all sequences), cache filled to
  `context` (`decode_steps`)."""
  return median_time(decode_steps(mc, batch, context, steps), repeats) / steps


def decode_steps(mc, batch: int, context: int,
                 steps: int = DECODE_STEPS):
  """A function decoding `steps` greedy tokens for `batch` sequences whose
  cache is filled to `context`, each call from the same place.

  It runs `lm.inference.decode`, the loop that train.sample runs, so the
  cache is updated in place rather than copied: it is donated to each call
  and handed to the next, its positions set back to `context` (an undonated
  input would be copied whole into the loop first, on every call).
  """
  mc = dataclasses.replace(mc, max_len=context + steps)
  model, params = unroll_layers(
      Transformer(mc, decode=True),
      nn.unbox(loop.init_params(Transformer(mc), seed=0)))
  refill = lambda cache: jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.full_like(x, context)
      if jax.tree_util.keystr(path).endswith(("['cache_index']",
                                              "['position_index']")) else x,
      cache)
  greedy = sampling.rows([sampling.SamplingParams()] * batch)

  def run(cache, token_B):
    sampled, cache = inference.decode(model, params, cache, token_B, greedy, 0,
                                   steps)
    return sampled, refill(cache)

  run = jax.jit(run, donate_argnums=0,
                compiler_options=inference.compiler_options())
  state = {'cache': refill(inference.empty_cache(model, batch))}
  token = jnp.zeros((batch,), jnp.int32)

  def go():
    sampled, state['cache'] = run(state['cache'], token)
    return sampled
  return go


def ascii_prompts(args) -> list[str]:
  """--requests prompts of printable ASCII, lengths uniform in
  --prompt_len (LOW,HIGH), seeded by --seed: the serving benchmarks'
  JSONL prompts."""
  low, high = args.prompt_len
  if low < 1 or low > high:
    raise UserError(f'--prompt_len={low},{high} must be LOW,HIGH with '
                    '1 <= LOW <= HIGH')
  rng = np.random.default_rng(args.seed)
  return [rng.integers(32, 127, int(rng.integers(low, high + 1))).astype(
      np.uint8).tobytes().decode() for _ in range(args.requests)]


def jax_threads() -> int:
  """The cores this process (and so JAX's CPU thread pool) may run on."""
  return len(os.sched_getaffinity(0))


def machine() -> dict:
  """The CPU family, its vector extensions and the cores used
  (`infra.provenance.machine`), and the load: what a benchmark's figures
  are printed beside."""
  return {**provenance.machine(), 'cores': jax_threads(),
          'load_average': list(os.getloadavg())}


def generate_runner(mc, params, prompts: list[np.ndarray], news: list[int],
                    name: str, **fields):
  """A function timing lm.inference.generate once over each of `prompts`
  ([B, P] batches, left-padded) with its `news` tokens, one call after
  another, each shape compiled here before any clock; its numbers are
  '<name>_seconds', ... (and `fields`). Tokens counted: the trace's."""
  model = Transformer(mc, decode=True)
  compiled, calls = {}, []
  for prompts_BP, new in zip(prompts, news):
    args = (params, jnp.asarray(prompts_BP))
    if (prompts_BP.shape, new) not in compiled:
      compiled[prompts_BP.shape, new] = jax.jit(functools.partial(
          inference.generate, model=model, max_new_tokens=new),
          compiler_options=inference.compiler_options()).lower(*args).compile()
    calls.append((compiled[prompts_BP.shape, new], args))
  tokens = fields.pop('tokens')

  def run() -> dict:
    start, cpu = time.perf_counter(), time.process_time()
    for fn, args in calls:
      np.asarray(fn(*args))
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    return {f'{name}_seconds': seconds, f'{name}_cpu_seconds': cpu,
            f'{name}_tokens_per_sec': tokens / seconds,
            f'{name}_tokens_per_cpu_sec': tokens / cpu, **fields}
  return run


def alone_runner(mc, params, trace):
  """The trace (prompt, new tokens) one request after another through
  lm.inference.generate (`generate_runner`): the one-at-a-time peer of
  the serving benchmarks."""
  return generate_runner(mc, params, [p[None] for p, _ in trace],
                         [new for _, new in trace], 'alone',
                         tokens=sum(new for _, new in trace))


def replace_section(path: str, title: str, body: str):
  """Writes `## title` + body into the markdown file at path, replacing that
  section (up to the next `## `) if present, else appending it."""
  p = pathlib.Path(path)
  text = p.read_text() if p.exists() else ''
  head = f'## {title}\n'
  block = f'{head}\n{body.rstrip()}\n'
  if head in text:
    start = text.index(head)
    end = text.find('\n## ', start + len(head))
    # A blank line before the next section, as the file had it.
    text = text[:start] + block + (f'\n{text[end + 1:]}' if end >= 0 else '')
  else:
    text = text.rstrip('\n') + ('\n\n' if text else '') + block
  p.write_text(text)
