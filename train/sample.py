"""Generates text from a trained workdir with the KV cache.

  python -m train.sample --workdir=DIR --prompt=TEXT --max_new_tokens=200 \
      [--temperature=0.8] [--top_k=40] [--seed=0]

Text goes through the workdir's tokenizer (tokenizer.json; bytes if none),
and stops at the model's end-of-sequence token when it has one.

Prefills the prompt in one pass, then decodes one token per step in a jitted,
fixed-shape `lax.scan` over the cache. The generated text alone goes to
stdout (so it pipes); timings go to stderr. --temperature=0 is greedy.
"""

import dataclasses
import functools
import math
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention import layer
from train import checkpoint
from train import tokenizer as tokenizer_lib
from train.errors import UserError
from train.cli import run_app
from train.model import Transformer, unroll_layers


def sample_logits(rng, logits_BV, temperature: float, top_k: int):
  """Greedy when temperature is 0, else softmax sampling, optionally top-k."""
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1)
  logits_BV = logits_BV / temperature
  if top_k:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(rng, logits_BV, axis=-1)


# Decoding's XLA options on a CPU: its matmuls by XLA's own runtime (Eigen),
# reductions still by YNNPACK. XLA hands both to YNNPACK by default, which
# runs a decode batch's [B, 256] x [256, 768] matmul at 15-19 GFLOP/s for
# B = 16 where Eigen reaches 41-43 (one core of this lab's CPU, jax 0.10.2),
# while its reductions run several times faster than XLA's loops. On
# `gqa_small` this decodes GQA and MQA batches of 16 10-19% faster
# (bench_decode) and serves 16-25% more tokens/s (bench_serve).
CPU_COMPILER_OPTIONS = {
    'xla_cpu_experimental_ynn_fusion_type': 'LIBRARY_FUSION_TYPE_REDUCE'}


def compiler_options() -> dict | None:
  """The XLA options a decoding jit is compiled with on this host's default
  device: CPU_COMPILER_OPTIONS on a CPU, none elsewhere."""
  return CPU_COMPILER_OPTIONS if jax.devices()[0].platform == 'cpu' else None


def empty_cache(model: Transformer, batch: int):
  """Zeroed KV caches of every layer for `batch` sequences of model.max_len."""
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((batch, model.config.max_len), jnp.int32))
  return jax.tree.map(jnp.zeros_like, nn.unbox(shapes['cache']))


def decode(model: Transformer, params, cache, token_B, rngs, *,
           temperature: float, top_k: int):
  """Feeds token_B, then each sampled token, once per key in `rngs`.

  One fixed-shape `lax.scan` step per token: the cache is updated in place
  (use an unrolled model, `unroll_layers`). Returns (the len(rngs) tokens
  sampled after token_B as [B, len(rngs)], the cache).
  """
  def step(carry, rng):
    cache, token_B = carry
    logits_B1V, mutated = model.apply({'params': params, 'cache': cache},
                                      token_B[:, None], mutable=['cache'])
    next_B = sample_logits(rng, logits_B1V[:, 0], temperature, top_k)
    return (mutated['cache'], next_B), next_B

  (cache, _), sampled = jax.lax.scan(step, (cache, token_B), rngs)
  return sampled.T, cache  # The scan stacks steps first.


@functools.partial(jax.jit, static_argnames=('model', 'max_new_tokens',
                                             'temperature', 'top_k'))
def generate(params, prompt_BT, rng, *, model: Transformer,
             max_new_tokens: int, temperature: float, top_k: int):
  """[B, T] prompt tokens -> [B, max_new_tokens] generated tokens."""
  model, params = unroll_layers(model, params)
  cache = empty_cache(model, prompt_BT.shape[0])
  logits_BTV, mutated = model.apply({'params': params, 'cache': cache},
                                    prompt_BT, mutable=['cache'])
  rngs = jax.random.split(rng, max_new_tokens)
  first_B = sample_logits(rngs[0], logits_BTV[:, -1], temperature, top_k)
  rest, _ = decode(model, params, mutated['cache'], first_B, rngs[1:],
                   temperature=temperature, top_k=top_k)
  return jnp.concatenate([first_B[:, None], rest], axis=1)


def load_language_model(workdir: str):
  """(ModelConfig, params, tokenizer) of a WORKDIR trained on text, or a
  UserError saying why its model cannot take text prompts."""
  mc, params, config = checkpoint.load_workdir(workdir)
  if config.data.get('task', 'lm') != 'lm':
    raise UserError(f'this model was trained on data.task='
                    f'{config.data.task!r}, not text; sample from a language '
                    'model')
  tokenizer = tokenizer_lib.for_text(workdir, mc, config)
  return mc, params, tokenizer


def check_flags(f, vocab_size: int):
  """Every sampling flag in its range, before the model is compiled."""
  if not (math.isfinite(f.temperature) and f.temperature >= 0):
    raise UserError(f'--temperature={f.temperature} must be a number >= 0 '
                    '(0 = greedy)')
  if not 0 <= f.top_k <= vocab_size:
    raise UserError(f'--top_k={f.top_k} must be in 0..{vocab_size} (the '
                    'vocabulary; 0 = all)')
  if f.max_new_tokens < 1:
    raise UserError(f'--max_new_tokens={f.max_new_tokens} must be >= 1')
  if not 0 <= f.seed < 1 << 32:
    raise UserError(f'--seed={f.seed} must be in 0..2**32 - 1')
  if f.kv_cache_dtype not in (None, *layer.KV_CACHE_DTYPES):
    raise UserError(f'--kv_cache_dtype={f.kv_cache_dtype!r}; use one of '
                    f'{", ".join(layer.KV_CACHE_DTYPES)}')


def main(argv):
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  del argv
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  mc, params, tokenizer = load_language_model(f.workdir)
  check_flags(f, mc.vocab_size)
  try:
    prompt = tokenizer.encode(f.prompt)
  except UnicodeEncodeError:  # Undecodable argv bytes arrive as surrogates.
    raise UserError('--prompt is not valid UTF-8 text; give the prompt in '
                    'UTF-8 (check the terminal\'s or file\'s encoding)'
                    ) from None
  if not len(prompt):
    prompt = tokenizer.encode('\n')  # Start from a line break.
  total = len(prompt) + f.max_new_tokens
  if f.max_new_tokens < 1 or total > mc.max_len:
    raise UserError(f'prompt ({len(prompt)} tokens) + max_new_tokens '
                    f'({f.max_new_tokens}) must be within 1..model.max_len '
                    f'({mc.max_len}); shorten one')
  # The KV cache holds what this call needs, not the model's longest context.
  mc = dataclasses.replace(mc, max_len=total, kv_cache_dtype=(
      f.kv_cache_dtype or mc.kv_cache_dtype))
  run = functools.partial(
      generate, model=Transformer(mc, decode=True),
      max_new_tokens=f.max_new_tokens, temperature=f.temperature,
      top_k=f.top_k)
  args = (params, jnp.asarray(prompt)[None], jax.random.key(f.seed))
  start = time.perf_counter()
  compiled = jax.jit(run, compiler_options=compiler_options()).lower(
      *args).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  tokens = np.asarray(compiled(*args))[0]
  seconds = time.perf_counter() - start
  ends = np.flatnonzero(np.isin(tokens, tokenizer.eos_ids))
  if len(ends):  # Up to the first end-of-sequence token.
    tokens = tokens[:ends[0]]
  sys.stdout.write(tokenizer.decode(tokens))
  sys.stdout.write('\n')
  print(f'{f.max_new_tokens} tokens in {seconds:.2f}s '
        f'({f.max_new_tokens / seconds:,.0f} tokens/s, prefill included; '
        f'compile {compile_s:.1f}s)', file=sys.stderr)


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('workdir', None, 'a train.main workdir')
  flags.DEFINE_string('prompt', '', 'text to continue')
  flags.DEFINE_integer('max_new_tokens', 200, 'tokens to generate')
  flags.DEFINE_float('temperature', 0.8, '0 = greedy')
  flags.DEFINE_integer('top_k', 0, 'sample among the k likeliest; 0 = all')
  flags.DEFINE_integer('seed', 0, 'sampling seed')
  flags.DEFINE_string('kv_cache_dtype', None, 'how the decode cache stores '
                      'K/V: float32, bfloat16 or int8 (default: the '
                      "workdir's model.kv_cache_dtype, else model.dtype)")
  run_app(main, required=['workdir'])


if __name__ == '__main__':
  run()
