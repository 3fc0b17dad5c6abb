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
from lm import checkpoint, config_lib
from lm import inference
from train import loop
from lm.model import Transformer

REPO = pathlib.Path(__file__).parent.parent


def _greedy_by_full_passes(model, params, prompt_BP, new):
  """Greedy decoding without a cache: the whole sequence, every step.

  The sequence is kept at its final length, zeros after the tokens so far:
  attention is causal, so they cannot change the logits read at t - 1, and
  one compiled forward pass serves every step.
  """
  B, P = prompt_BP.shape
  tokens = jnp.zeros((B, P + new), jnp.int32).at[:, :P].set(prompt_BP)
  forward = jax.jit(lambda tokens: model.apply({'params': params}, tokens))
  for t in range(P, P + new):
    tokens = tokens.at[:, t].set(forward(tokens)[:, t - 1].argmax(-1))
  return tokens[:, P:]


@pytest.mark.slow
@pytest.mark.parametrize('num_kv_heads, use_rope, learned_positions, more', [
    (4, True, False, {}), (2, True, False, {}), (1, True, False, {}),
    (2, False, True, {}), (2, True, True, {}),  # Learned: the index too.
    (2, False, False, {}),  # No positions at all (NoPE).
    (2, True, False, dict(kv_cache_dtype='int8')),
    (2, True, False, dict(num_layers=4, attention_pattern='LG',
                          local_window=4)),  # A ring cache below max_len.
    (4, True, False, dict(attention='mla', mla=dict(
        kv_lora_rank=8, qk_rope_head_dim=4))),  # MLA.
    (4, False, False, dict(attention='mla', mla=dict(
        kv_lora_rank=8, qk_rope_head_dim=0))),  # NoPE MLA.
    (4, False, True, dict(attention='mla', mla=dict(
        kv_lora_rank=8, qk_rope_head_dim=0)))])
@pytest.mark.parametrize('new', [12, 27])  # Below max_len (32), and at it.
def test_greedy_decoding_with_the_cache_equals_full_passes(
    num_kv_heads, use_rope, learned_positions, more, new):
  """Issue 52: the cache sized by the call (prompt + new), the model as
  trained (max_len 32, its position table): every position scheme, kind and
  cache dtype, below and at max_len."""
  config = tiny.get_config()
  config.model.update(num_kv_heads=num_kv_heads, use_rope=use_rope,
                      learned_positions=learned_positions, **more)
  mc = config_lib.model_config(config)
  model = Transformer(mc)
  params = nn.unbox(loop.init_params(model, seed=1))
  prompt = jnp.array([[10, 20, 30, 40, 50], [7, 7, 7, 7, 7]], jnp.int32)
  cached = inference.generate(params, prompt,
                              model=Transformer(mc, decode=True),
                              max_new_tokens=new)
  expected = _greedy_by_full_passes(model, params, prompt, new)
  if mc.kv_cache_dtype == 'int8':  # Quantized K/V: the same but for ties.
    assert (np.asarray(cached) == np.asarray(expected)).mean() > 0.8
  else:
    np.testing.assert_array_equal(cached, expected)


def _sample(workdir, *args):
  return subprocess.run(
      [sys.executable, '-m', 'train.sample', f'--workdir={workdir}', *args],
      cwd=REPO, capture_output=True, timeout=120)


@pytest.mark.slow
def test_cli_prints_only_the_text_of_an_independent_greedy_decode(trained):
  result = _sample(trained, '--prompt=def ', '--max_new_tokens=10',
                   '--temperature=0')
  assert result.returncode == 0, result.stderr.decode()
  assert b'tokens/s' in result.stderr and b'tokens/s' not in result.stdout
  mc, params, _ = checkpoint.load_workdir(str(trained))
  prompt = jnp.array([list(b'def ')], jnp.int32)
  expected = _greedy_by_full_passes(Transformer(mc), params, prompt, 10)
  text = bytes(np.asarray(expected[0], np.uint8)).decode('utf-8', 'replace')
  assert result.stdout.decode('utf-8') == text + '\n'


def test_cli_refuses_a_prompt_past_max_len_in_one_line(trained):
  result = _sample(trained, '--prompt=' + 'x' * 30, '--max_new_tokens=10')
  assert result.returncode == 1
  assert result.stderr.decode().strip().splitlines() == [
      'error: prompt (30 tokens) + max_new_tokens (10) must be within '
      '1..model.max_len (32); shorten one']


@pytest.fixture(scope='module')
def learned_positions(tmp_path_factory):
  """A tiny model with a learned position table and no RoPE (max_len 32),
  trained for 3 steps."""
  config = tiny.get_config()
  config.model.update(use_rope=False, learned_positions=True)
  config.train.update(steps=3, warmup_steps=1)
  workdir = tmp_path_factory.mktemp('learned')
  loop.train_and_evaluate(config, str(workdir))
  return workdir


@pytest.mark.slow
@pytest.mark.parametrize('new', [10, 28])  # Below max_len, and up to it.
def test_cli_samples_a_learned_position_model_below_its_max_len(
    learned_positions, new):
  """Issue 52: the cache is sized by the call, the model stays as trained
  (its [max_len, D] position table), so a call shorter than max_len works."""
  result = _sample(learned_positions, '--prompt=def ', f'--max_new_tokens={new}',
                   '--temperature=0')
  assert result.returncode == 0, result.stderr.decode()
  mc, params, _ = checkpoint.load_workdir(str(learned_positions))
  expected = _greedy_by_full_passes(
      Transformer(mc), params, jnp.array([list(b'def ')], jnp.int32), new)
  text = bytes(np.asarray(expected[0], np.uint8)).decode('utf-8', 'replace')
  assert result.stdout.decode('utf-8') == text + '\n'


def test_cli_refuses_a_bad_sampling_flag_in_one_line(trained):
  result = _sample(trained, '--prompt=a', '--top_p=0', '--temperature=1')
  assert result.returncode == 1
  assert result.stderr.decode().strip().splitlines() == [
      'error: --top_p=0.0 must be in (0, 1] (1 = all)']


@pytest.mark.slow
def test_cli_ends_the_text_at_a_stop_string(trained):
  full = _sample(trained, '--prompt=def ', '--max_new_tokens=12',
                 '--temperature=0')
  assert full.returncode == 0, full.stderr.decode()
  text = full.stdout.decode('utf-8')[:-1]
  stop = text[3:5]  # Two characters from the middle of the greedy text.
  cut = _sample(trained, '--prompt=def ', '--max_new_tokens=12',
                '--temperature=0', f'--stop={stop}')
  assert cut.returncode == 0, cut.stderr.decode()
  assert cut.stdout.decode('utf-8') == text[:text.find(stop)] + '\n'
  # The count on stderr is of the tokens generated; it says the text ends
  # at the stop string (the full run's does not).
  assert b'12 tokens in ' in cut.stderr
  assert b'ends at the first --stop string' in cut.stderr
  assert b'--stop' not in full.stderr
