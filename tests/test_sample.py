"""Specification of generation with the KV cache (`train.sample`)."""

import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from train import config_lib, generate, loop
from train.model import Transformer, unroll_layers

REPO = pathlib.Path(__file__).parent.parent


@pytest.mark.parametrize('num_kv_heads', [4, 2, 1])
def test_greedy_decoding_with_the_cache_equals_full_passes(num_kv_heads):
  config = tiny.get_config()
  config.model.num_kv_heads = num_kv_heads
  mc = config_lib.model_config(config)
  model = Transformer(mc)
  params = nn.unbox(loop.init_params(model, seed=1))
  prompt = jnp.array([[10, 20, 30, 40, 50], [7, 7, 7, 7, 7]], jnp.int32)
  new = 12
  cached = generate.generate(params, prompt, jax.random.key(0),
                           model=Transformer(mc, decode=True),
                           max_new_tokens=new, temperature=0.0, top_k=0)
  tokens = prompt
  for _ in range(new):  # No cache: rerun the whole sequence every step.
    logits = model.apply({'params': params}, tokens)
    tokens = jnp.concatenate([tokens, logits[:, -1].argmax(-1)[:, None]], 1)
  np.testing.assert_array_equal(cached, tokens[:, prompt.shape[1]:])


def test_unrolled_layers_are_the_same_network():
  mc = config_lib.model_config(tiny.get_config())
  assert mc.scan_layers
  model = Transformer(mc)
  params = nn.unbox(loop.init_params(model, seed=1))
  unrolled, unrolled_params = unroll_layers(model, params)
  assert not unrolled.config.scan_layers
  assert 'layers' not in unrolled_params
  tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
  np.testing.assert_allclose(
      unrolled.apply({'params': unrolled_params}, tokens),
      model.apply({'params': params}, tokens), rtol=1e-5, atol=1e-5)


def test_top_k_samples_only_among_the_k_likeliest():
  logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]]))
  draws = jax.vmap(lambda r: generate.sample_logits(r, logits, 1.0, 2))(
      jax.random.split(jax.random.key(0), 200))
  assert set(np.unique(draws)) == {2, 3}


def _sample(workdir, *args):
  return subprocess.run(
      [sys.executable, '-m', 'train.sample', f'--workdir={workdir}', *args],
      cwd=REPO, capture_output=True, timeout=120)


def test_cli_prints_only_the_generated_text_and_greedy_repeats(trained):
  args = ('--prompt=def ', '--max_new_tokens=10', '--temperature=0')
  first, second = _sample(trained, *args), _sample(trained, *args)
  assert first.returncode == 0, first.stderr.decode()
  assert first.stdout == second.stdout
  text = first.stdout.decode('utf-8')
  assert 1 <= len(text.rstrip('\n').encode('utf-8', 'replace')) <= 30
  assert b'tokens/s' in first.stderr and b'tokens/s' not in first.stdout


def test_cli_refuses_a_prompt_past_max_len_in_one_line(trained):
  result = _sample(trained, '--prompt=' + 'x' * 30, '--max_new_tokens=10')
  assert result.returncode == 1
  assert result.stderr.decode().strip().splitlines() == [
      'error: prompt (30 bytes) + max_new_tokens (10) must be within '
      '1..model.max_len (32); shorten one']
