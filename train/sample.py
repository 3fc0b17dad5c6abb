r"""Generates text from a trained workdir with the KV cache.

  python -m train.sample --workdir=DIR --prompt=TEXT --max_new_tokens=200 \
      [--temperature=0.8] [--top_k=40] [--top_p=0.95] [--seed=0] [--stop=STR]

Text goes through the workdir's tokenizer (tokenizer.json; bytes if none),
and stops at the model's end-of-sequence token when it has one, or at the
first --stop string. Sampling is `lm.sampling`'s: the same settings and
seed give the same text here as from serve.generate and the lm_eval model.

Prefills the prompt in one pass, then decodes one token per step in a jitted,
fixed-shape `lax.scan` over the cache. The generated text alone goes to
stdout (so it pipes); timings go to stderr. --temperature=0 is greedy.
"""

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from infra.cli import run_app
from infra.errors import UserError
from lm import inference, sampling
from lm.model import Transformer


def main(argv):
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  del argv
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  mc, params, tokenizer = inference.load_language_model(f.workdir)
  settings = inference.sampling_flags(f, mc.vocab_size)
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
  # by this call (`inference.generate`).
  if f.kv_cache_dtype:
    mc = dataclasses.replace(mc, kv_cache_dtype=f.kv_cache_dtype)
  run = functools.partial(inference.generate,
                          model=Transformer(mc, decode=True),
                          max_new_tokens=f.max_new_tokens)
  args = (params, jnp.asarray(prompt)[None], sampling.rows([settings]))
  start = time.perf_counter()
  compiled = jax.jit(run, compiler_options=inference.compiler_options()
                     ).lower(*args).compile()
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
  inference.define_sampling_flags(temperature=0.8)
  flags.adopt_module_key_flags(inference)  # So that --help lists them.
  flags.DEFINE_string('kv_cache_dtype', None, 'how the decode cache stores '
                      'K/V: float32, bfloat16 or int8 (default: the '
                      "workdir's model.kv_cache_dtype, else model.dtype)")
  run_app(main, required=['workdir'])


if __name__ == '__main__':
  run()
