"""Generates text from a trained workdir with the KV cache.

  python -m train.sample --workdir=DIR --prompt=TEXT --max_new_tokens=200 \
      [--temperature=0.8] [--top_k=40] [--top_p=0.95] [--seed=0] [--stop=STR]

Text goes through the workdir's tokenizer (tokenizer.json; bytes if none),
and stops at the model's end-of-sequence token when it has one, or at the
first --stop string. Sampling is `train.sampling`'s: the same settings and
seed give the same text here as from serve.generate and the lm_eval model.

Prefills the prompt in one pass, then decodes one token per step in a jitted,
fixed-shape `lax.scan` over the cache. The generated text alone goes to
stdout (so it pipes); timings go to stderr. --temperature=0 is greedy.
"""

import dataclasses
import functools
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attention import layer
from train import checkpoint
from train import sampling
from train import tokenizer as tokenizer_lib
from train.errors import UserError
from train.cli import run_app
from train.model import Transformer, unroll_layers


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


def empty_cache(model: Transformer, batch: int, length: int | None = None):
  """Zeroed KV caches of every layer for `batch` sequences of `length`
  positions (default model.max_len): the cache is sized by what a call needs,
  the model (its position table, its max_len) stays as trained."""
  length = model.config.max_len if length is None else length
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((batch, length), jnp.int32))
  return jax.tree.map(jnp.zeros_like, nn.unbox(shapes['cache']))


def decode(model: Transformer, params, cache, token_B, settings: sampling.Rows,
           index: int, steps: int):
  """Feeds token_B (the `index`-th token of each row's generation, 0 for
  the first), then each token sampled after it, `steps` times.

  One fixed-shape `lax.scan` step per token: the cache is updated in place
  (use an unrolled model, `unroll_layers`). Returns (the `steps` tokens
  sampled after token_B as [B, steps], the cache).
  """
  B = token_B.shape[0]

  def step(carry, index):
    cache, token_B = carry
    logits_B1V, mutated = model.apply({'params': params, 'cache': cache},
                                      token_B[:, None], mutable=['cache'])
    next_B = sampling.sample(logits_B1V[:, 0], settings,
                             jnp.full((B,), index))
    return (mutated['cache'], next_B), next_B

  indices = index + 1 + jnp.arange(steps)
  (cache, _), sampled = jax.lax.scan(step, (cache, token_B), indices)
  return sampled.T, cache  # The scan stacks steps first.


@functools.partial(jax.jit, static_argnames=('model', 'max_new_tokens'))
def generate(params, prompt_BT, settings: sampling.Rows | None = None, *,
             model: Transformer, max_new_tokens: int):
  """[B, T] prompt tokens -> [B, max_new_tokens] generated tokens, row b
  sampled by its settings (`sampling.sample`: the key of each token is its
  row's seed and its index in the generation, 0 for the first); None:
  greedy."""
  model, params = unroll_layers(model, params)
  B, T = prompt_BT.shape
  if settings is None:
    settings = sampling.rows([sampling.SamplingParams()] * B)
  cache = empty_cache(model, B, T + max_new_tokens)
  logits_BTV, mutated = model.apply({'params': params, 'cache': cache},
                                    prompt_BT, mutable=['cache'])
  first_B = sampling.sample(logits_BTV[:, -1], settings, jnp.zeros((B,)))
  rest, _ = decode(model, params, mutated['cache'], first_B, settings, 0,
                   max_new_tokens - 1)
  return jnp.concatenate([first_B[:, None], rest], axis=1)


def load_language_model(workdir: str, with_step: bool = False):
  """(ModelConfig, params, tokenizer) of a WORKDIR trained on text (and the
  checkpoint's step, with_step), or a UserError saying why its model cannot
  take text prompts."""
  mc, params, config, step = checkpoint.load_workdir_step(workdir)
  if config.data.get('task', 'lm') != 'lm':
    raise UserError(f'this model was trained on data.task='
                    f'{config.data.task!r}, not text; sample from a language '
                    'model')
  tokenizer = tokenizer_lib.for_text(workdir, mc, config)
  return (mc, params, tokenizer, step) if with_step else (mc, params,
                                                          tokenizer)


def define_sampling_flags(temperature: float):
  """The sampling flags every generating command takes (absl), `--temperature`
  defaulting to `temperature`."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_float('temperature', temperature, '0 = greedy')
  flags.DEFINE_integer('top_k', 0, 'sample among the k likeliest; 0 = all')
  flags.DEFINE_float('top_p', 1.0, 'sample among the likeliest tokens '
                     'holding probability top_p (nucleus); 1 = all')
  flags.DEFINE_integer('seed', 0, 'sampling seed: a request\'s random '
                       'stream (its i-th token drawn with fold_in(key(seed), '
                       'i))')
  flags.DEFINE_multi_string('stop', [], 'a string that ends a text (not '
                            'included); repeat the flag for several')


def settings_from_flags(f) -> sampling.SamplingParams:
  """The `define_sampling_flags` flags as one request's settings, unchecked
  (`SamplingParams.check` once the vocabulary is known)."""
  return sampling.SamplingParams(
      temperature=f.temperature, top_k=f.top_k, top_p=f.top_p, seed=f.seed,
      stop=tuple(f.stop or ()))


def check_decode_flags(f):
  """--max_new_tokens and --kv_cache_dtype in range, before any compiling."""
  if f.max_new_tokens < 1:
    raise UserError(f'--max_new_tokens={f.max_new_tokens} must be >= 1')
  if f.kv_cache_dtype not in (None, *layer.KV_CACHE_DTYPES):
    raise UserError(f'--kv_cache_dtype={f.kv_cache_dtype!r}; use one of '
                    f'{", ".join(layer.KV_CACHE_DTYPES)}')


def sampling_flags(f, vocab_size: int) -> sampling.SamplingParams:
  """The sampling flags as one request's settings, every flag in its range
  (a UserError naming the first that is not), before any compiling."""
  check_decode_flags(f)
  return settings_from_flags(f).check(vocab_size)


def main(argv):
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  del argv
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  mc, params, tokenizer = load_language_model(f.workdir)
  settings = sampling_flags(f, mc.vocab_size)
  try:
    prompt = tokenizer.encode(f.prompt)
  except UnicodeEncodeError:  # Undecodable argv bytes arrive as surrogates.
    raise UserError('--prompt is not valid UTF-8 text; give the prompt in '
                    'UTF-8 (check the terminal\'s or file\'s encoding)'
                    ) from None
  if not len(prompt):
    prompt = tokenizer.encode('\n')  # Start from a line break.
  why = sampling.length_refusal(len(prompt), f.max_new_tokens, mc.max_len)
  if why:
    raise UserError(why)
  # The model as trained (its max_len, its position table); the cache sized
  # by this call (`generate`).
  if f.kv_cache_dtype:
    mc = dataclasses.replace(mc, kv_cache_dtype=f.kv_cache_dtype)
  run = functools.partial(generate, model=Transformer(mc, decode=True),
                          max_new_tokens=f.max_new_tokens)
  args = (params, jnp.asarray(prompt)[None], sampling.rows([settings]))
  start = time.perf_counter()
  compiled = jax.jit(run, compiler_options=compiler_options()).lower(
      *args).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  tokens = np.asarray(compiled(*args))[0]
  seconds = time.perf_counter() - start
  done = sampling.cut(tokens, eos_ids=tokenizer.eos_ids,
                      decode=tokenizer.decode, stop=settings.stop)
  sys.stdout.write(done.text)
  sys.stdout.write('\n')
  print(f'{f.max_new_tokens} tokens in {seconds:.2f}s '
        f'({f.max_new_tokens / seconds:,.0f} tokens/s, prefill included; '
        f'compile {compile_s:.1f}s){_kept(done, f.max_new_tokens)}',
        file=sys.stderr)


def _kept(done: sampling.Finished, generated: int) -> str:
  """What of the `generated` tokens the text keeps, when not all."""
  if done.reason == 'eos':
    return (f'; the text keeps {len(done.tokens)}, up to the '
            'end-of-sequence token')
  if done.reason == 'stop':
    return '; the text ends at the first --stop string'
  return ''


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('workdir', None, 'a train.main workdir')
  flags.DEFINE_string('prompt', '', 'text to continue (empty: from a line '
                      'break)')
  flags.DEFINE_integer('max_new_tokens', 200, 'tokens to generate')
  define_sampling_flags(temperature=0.8)
  flags.DEFINE_string('kv_cache_dtype', None, 'how the decode cache stores '
                      'K/V: float32, bfloat16 or int8 (default: the '
                      "workdir's model.kv_cache_dtype, else model.dtype)")
  run_app(main, required=['workdir'])


if __name__ == '__main__':
  run()
