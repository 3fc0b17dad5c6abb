"""Generates text from a trained workdir with the KV cache.

  python -m train.sample --workdir=DIR --prompt=TEXT --max_new_tokens=200 \
      [--temperature=0.8] [--top_k=40] [--seed=0]

Prefills the prompt in one pass, then decodes one token per step in a jitted,
fixed-shape `lax.scan` over the cache. The generated text alone goes to
stdout (so it pipes); timings go to stderr. --temperature=0 is greedy.
"""

import functools
import sys
import time

from absl import flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from train import checkpoint, generate
from train.errors import UserError, run_app
from train.model import Transformer

_WORKDIR = flags.DEFINE_string('workdir', None, 'a train.main workdir')
_PROMPT = flags.DEFINE_string('prompt', '', 'text to continue')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 200, 'tokens to generate')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, '0 = greedy')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'sample among the k likeliest; 0 = all')
_SEED = flags.DEFINE_integer('seed', 0, 'sampling seed')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  mc, params, config = checkpoint.load_workdir(_WORKDIR.value)
  if config.data.get('task', 'lm') != 'lm':
    raise UserError(f'this model was trained on data.task='
                    f'{config.data.task!r}, not text; sample from a language '
                    'model')
  if mc.vocab_size != 256 or config.data.path.endswith('.bin'):
    raise UserError('this model reads token ids (data.path='
                    f'{config.data.path!r}), not bytes; text prompts need a '
                    'byte-level model')
  prompt = np.frombuffer(_PROMPT.value.encode(), np.uint8).astype(np.int32)
  if not len(prompt):
    prompt = np.array([ord('\n')], np.int32)  # Start from a line break.
  total = len(prompt) + _MAX_NEW.value
  if _MAX_NEW.value < 1 or total > mc.max_len:
    raise UserError(f'prompt ({len(prompt)} bytes) + max_new_tokens '
                    f'({_MAX_NEW.value}) must be within 1..model.max_len '
                    f'({mc.max_len}); shorten one')
  if _TEMPERATURE.value < 0 or not 0 <= _TOP_K.value <= mc.vocab_size:
    raise UserError(f'--temperature must be >= 0 and --top_k in '
                    f'0..{mc.vocab_size} (the vocabulary; 0 = all)')
  run = functools.partial(
      generate.generate, model=Transformer(mc, decode=True),
      max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value,
      top_k=_TOP_K.value)
  args = (params, jnp.asarray(prompt)[None], jax.random.key(_SEED.value))
  start = time.perf_counter()
  compiled = jax.jit(run).lower(*args).compile()
  compile_s = time.perf_counter() - start
  start = time.perf_counter()
  tokens = np.asarray(compiled(*args))[0]
  seconds = time.perf_counter() - start
  sys.stdout.write(bytes(tokens.astype(np.uint8)).decode('utf-8', 'replace'))
  sys.stdout.write('\n')
  print(f'{_MAX_NEW.value} tokens in {seconds:.2f}s '
        f'({_MAX_NEW.value / seconds:,.0f} tokens/s, prefill included; '
        f'compile {compile_s:.1f}s)', file=sys.stderr)


if __name__ == '__main__':
  run_app(main, required=['workdir'])
