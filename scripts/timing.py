"""How the scripts time things: medians taken in turns, the machine's read
bandwidth, and a model's decode step as `train.sample` runs it."""

from __future__ import annotations

import dataclasses
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from train import loop
from lm import inference
from lm import sampling
from lm.model import Transformer, unroll_layers


def median_time(fn, repeats: int) -> float:
  return median_times({'fn': fn}, repeats)['fn']


def median_times(fns: dict, repeats: int, self_timed: dict | None = None
                 ) -> dict:
  """{name: median seconds}, the fns timed in turn, round after round.

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
  return {name: float(np.median(t)) for name, t in times.items()}


def read_test():
  """(bytes, fn): a jitted sum over 1 GiB of float32, read at full rate."""
  x = jnp.ones((2**28,), jnp.float32)
  total = jax.jit(jnp.sum)
  return x.nbytes, lambda: total(x)


def read_bandwidth(repeats: int) -> float:
  """Bytes/s of the read test: the machine's read rate."""
  nbytes, fn = read_test()
  return nbytes / median_time(fn, repeats)


def decode_step_seconds(mc, batch: int, context: int, repeats: int,
                        steps: int = 8) -> float:
  """Median time per decoded token (all sequences), cache filled to
  `context` (`decode_steps`)."""
  return median_time(decode_steps(mc, batch, context, steps), repeats) / steps


def decode_steps(mc, batch: int, context: int, steps: int = 8):
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
