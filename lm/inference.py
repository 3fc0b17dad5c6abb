"""Running a trained language model: a workdir's model, its prefill and
decode over the KV cache, and the sampling flags every generating command
takes (`python -m train.sample`, `python -m serve.generate`).

Prefills the prompt in one pass, then decodes one token per step in a jitted,
fixed-shape `lax.scan` over the cache (`generate`), each row sampled by its
own settings (`lm.sampling`).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from attention import layer
from infra.errors import UserError
from lm import checkpoint
from lm import sampling
from lm import tokenizer as tokenizer_lib
from lm.model import Transformer, unroll_layers


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
