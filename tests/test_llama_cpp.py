"""GGUF exports run by llama.cpp (through llama-cpp-python) compute what
we compute: next-token logits equal to ours at every position, the same
greedy text through its KV cache, the same tokens from text.

The models: a tiny GQA model trained here (SwiGLU, with Gemma's norm offset
and embedding scale, which the export folds), random MHA (fused QKV) and MQA
models with tied embeddings (scaled, and not), linear RoPE scaling, and
Hugging Face Llama (3.1's RoPE scaling) and Qwen2 (Q/K/V biases) imported
from random configs. Skipped, saying so, where llama-cpp-python is not installed (CI
installs it in a step of its own, .ci/run).
"""

import contextlib
import dataclasses
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

llama_cpp = pytest.importorskip(
    'llama_cpp', reason="llama-cpp-python is not installed (pip install -e "
    "'.[llama-cpp]', which builds llama.cpp, ~6 min): GGUF exports are not "
    'run by llama.cpp')

from configs import tiny  # pylint: disable=wrong-import-position
from tests import gguf_models  # pylint: disable=wrong-import-position
from lm import checkpoint, inference  # pylint: disable=wrong-import-position
from lm import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position
from lm.model import Transformer  # pylint: disable=wrong-import-position
from train import convert, loop  # pylint: disable=wrong-import-position
from train.convert import to_gguf  # pylint: disable=wrong-import-position

HF = dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128,
          vocab_size=300, max_len=512, init_std=0.1)
CASES = {  # Name -> how its workdir is made.
    'trained-gqa': 'trained',
    'mha-tied-scaled-fused': dict(num_kv_heads=4, tie_embeddings=True,
                                  tied_logits_scale=True, fused_qkv=True,
                                  max_len=128, **gguf_models.SILU),
    'mqa-tied-linear-rope': dict(
        num_kv_heads=1, tie_embeddings=True, max_len=128,
        rope_scaling=dict(kind='linear', factor=4.0), **gguf_models.LLAMA),
    'hf-llama3.1': dict(family='llama', rope_scaling=dict(
        rope_type='llama3', factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64)),
    'hf-qwen2-bias': dict(family='qwen2'),
}


def _make(root: pathlib.Path, case: str) -> pathlib.Path:
  how = CASES[case]
  workdir = root / 'workdir'
  if how == 'trained':
    config = tiny.get_config()
    config.model.update(gguf_models.SILU)
    loop.train_and_evaluate(config, str(workdir))
  elif 'family' in how:
    from scripts import make_hf_model  # pylint: disable=import-outside-toplevel
    pytest.importorskip('transformers', reason='transformers builds the '
                        'Hugging Face models (the test extra)')
    make_hf_model.make(str(root / 'hf'), **HF, **how)
    convert.import_hf(str(root / 'hf'), str(workdir))
  else:
    gguf_models.random_workdir(workdir, seed=1, **how)
  return workdir


@pytest.fixture(scope='module', params=list(CASES))
def exported(request, tmp_path_factory):
  """(workdir, its GGUF file) per case."""
  root = tmp_path_factory.mktemp(request.param)
  workdir = _make(root, request.param)
  to_gguf.export(str(workdir), str(root / 'model.gguf'))
  return workdir, root / 'model.gguf'


@contextlib.contextmanager
def _llama(path, n_ctx: int = 512, **kwargs):
  """llama.cpp on 2 threads with a float32 KV cache and every position's
  logits (its defaults round K and V to float16)."""
  f32 = llama_cpp.GGML_TYPE_F32
  llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=2,
                        logits_all=True, type_k=f32, type_v=f32,
                        flash_attn=False, verbose=False, **kwargs)
  try:
    yield llm
  finally:
    llm.close()


def _ours(workdir, tokens_T):
  mc, params, _ = checkpoint.load_workdir(str(workdir))
  return np.asarray(jax.jit(Transformer(mc).apply)(
      {'params': params}, jnp.asarray(tokens_T)[None]))[0]


def _theirs(path, tokens_T):
  with _llama(path) as llm:
    llm.eval([int(t) for t in tokens_T])
    return np.array(llm.scores[:len(tokens_T)])


def _prompt(workdir, length: int, seed: int = 0):
  mc, _, _ = checkpoint.load_workdir(str(workdir))
  length = min(length, mc.max_len)
  return np.random.default_rng(seed).integers(0, mc.vocab_size, length)


@pytest.mark.slow
def test_next_token_logits_equal_ours_at_every_position(exported):
  workdir, path = exported
  for seed in range(3):
    tokens_T = _prompt(workdir, 300, seed)  # Past Llama 3.1's 64.
    ours = _ours(workdir, tokens_T)
    np.testing.assert_allclose(_theirs(path, tokens_T), ours, atol=1e-4,
                               rtol=0)
    assert np.abs(ours).max() > 0.1  # Logits that could differ.


@pytest.mark.slow
@pytest.mark.parametrize('exported', ['trained-gqa', 'hf-llama3.1'],
                         indirect=True)
def test_without_the_rope_permutation_the_logits_differ(exported, tmp_path,
                                                        monkeypatch):
  """The control: q/k rows left in our order, llama's adjacent-pair RoPE
  turns the wrong pairs, far beyond the tolerance above."""
  workdir, _ = exported
  monkeypatch.setattr(to_gguf, 'interleave_rope', lambda w, heads: w)
  to_gguf.export(str(workdir), str(tmp_path / 'wrong.gguf'))
  tokens_T = _prompt(workdir, 300)
  assert np.abs(_theirs(tmp_path / 'wrong.gguf', tokens_T)
                - _ours(workdir, tokens_T)).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize('exported', ['hf-qwen2-bias'], indirect=True)
def test_qwen2_written_as_llama_with_interleaved_biases_computes_the_same(
    exported, tmp_path, monkeypatch):
  """Both RoPE conventions: the same model as llama's graph (rows and
  biases interleaved) gives qwen2's logits."""
  workdir, path = exported
  monkeypatch.setattr(to_gguf, 'architecture', lambda mc: 'llama')
  to_gguf.export(str(workdir), str(tmp_path / 'as_llama.gguf'))
  tokens_T = _prompt(workdir, 200)
  np.testing.assert_allclose(_theirs(tmp_path / 'as_llama.gguf', tokens_T),
                             _theirs(path, tokens_T), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_greedy_text_through_the_kv_cache_equals_ours(exported):
  """llama.cpp decoding one token at a time (its KV cache) picks the
  tokens `lm.inference.generate` picks."""
  workdir, path = exported
  mc, params, _ = checkpoint.load_workdir(str(workdir))
  prompt_T, new = _prompt(workdir, 8, seed=5), 16
  mc = dataclasses.replace(mc, max_len=len(prompt_T) + new)
  ours = np.asarray(inference.generate(
      params, jnp.asarray(prompt_T)[None], model=Transformer(mc, decode=True),
      max_new_tokens=new))[0]
  theirs = []
  with _llama(path) as llm:
    llm.eval([int(t) for t in prompt_T])
    for _ in range(new):
      theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
      llm.eval([theirs[-1]])
  np.testing.assert_array_equal(theirs, ours)


@pytest.mark.slow
@pytest.mark.parametrize('dtype', ['f16', 'bf16'])
def test_half_precision_exports_stay_near_ours(tmp_path, dtype):
  """Rounded weights (and llama.cpp's half-precision matmuls): logits
  within a few hundredths, the same next token nearly everywhere."""
  workdir = _make(tmp_path, 'mha-tied-scaled-fused')
  to_gguf.export(str(workdir), str(tmp_path / 'm.gguf'), dtype)
  tokens_T = _prompt(workdir, 128)
  ours, theirs = _ours(workdir, tokens_T), _theirs(tmp_path / 'm.gguf',
                                                  tokens_T)
  assert np.abs(ours - theirs).max() < 0.05 * np.abs(ours).max()
  assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.9


TEXTS = ['Hello world', "I'm sure they'll say don't", 'pi is 3.14159 or 22/7',
         '  two\n\nlines\tand  spaces  ', 'naïve café — 日本語 🙂',
         'def f(x):\n    return x ** 2\n']


@pytest.mark.slow
@pytest.mark.parametrize('pre', ['bytes', *gguf_models.PRE_TOKENIZERS])
def test_llama_cpp_tokenizes_text_as_we_do(tmp_path, pre):
  """The byte vocabulary, and byte-level BPEs with each pre-tokenizer:
  llama.cpp's tokens equal ours, with and without the BOS, and decode back
  to the text."""
  tokenizer = None if pre == 'bytes' else gguf_models.bpe_tokenizer(
      tmp_path / 'tokenizer.json', pre)
  gguf_models.random_workdir(tmp_path / 'w', tokenizer=tokenizer,
                             vocab_size=256 if pre == 'bytes' else 400,
                             **gguf_models.LLAMA)
  to_gguf.export(str(tmp_path / 'w'), str(tmp_path / 'm.gguf'))
  ours = tokenizer_lib.of_workdir(tmp_path / 'w')
  with _llama(tmp_path / 'm.gguf', vocab_only=True) as llm:
    for text in TEXTS:
      plain = llm.tokenize(text.encode(), add_bos=False, special=False)
      assert plain == ours.encode(text, special=False).tolist(), text
      assert llm.tokenize(text.encode(), add_bos=True) == ours.encode(
          text).tolist(), text
      assert llm.detokenize(plain).decode() == text
      if pre == 'bytes':
        assert plain == list(text.encode())


@pytest.mark.slow
@pytest.mark.parametrize('exported', ['trained-gqa'], indirect=True)
def test_a_text_completion_is_our_greedy_text(exported):
  """What a user runs: text in, llama-cpp-python's completion at
  temperature 0 (its own sampler) out, the text our greedy decoding of
  the same bytes gives."""
  workdir, path = exported
  mc, params, _ = checkpoint.load_workdir(str(workdir))
  prompt, new = 'def main(', 12
  prompt_T = np.frombuffer(prompt.encode(), np.uint8).astype(np.int32)
  mc = dataclasses.replace(mc, max_len=len(prompt_T) + new)
  ours = np.asarray(inference.generate(
      params, jnp.asarray(prompt_T)[None], model=Transformer(mc, decode=True),
      max_new_tokens=new))[0]
  with _llama(path, n_ctx=64) as llm:
    out = llm.create_completion(prompt, max_tokens=new, temperature=0.0)
  assert out['choices'][0]['text'] == bytes(ours.tolist()).decode(
      'utf-8', 'replace')


@pytest.mark.slow
def test_the_benchmarks_llama_cpp_peer_serves_our_greedy_tokens(tmp_path):
  """studies.llama_cpp_peer's continuous batching (3 slots for 6 requests
  in one unified cache, cells freed as requests end) gives each request
  the tokens `lm.inference.generate` gives it alone."""
  from studies import llama_cpp_peer  # pylint: disable=import-outside-toplevel
  config = gguf_models.tiny_config(**gguf_models.SILU)
  mc = gguf_models.model_config(**gguf_models.SILU)
  params = jax.device_get(nn.unbox(loop.init_params(Transformer(mc), seed=2)))
  rng = np.random.default_rng(7)
  trace = [(rng.integers(0, 256, int(rng.integers(3, 20))),
            int(rng.integers(1, 12))) for _ in range(6)]
  with llama_cpp_peer.started(config, params) as peer:
    got = peer.serve(trace, n_ctx=256, slots=3, kv_dtype='float32',
                     outputs=True)
  for (prompt_T, new), theirs in zip(trace, got['outputs']):
    model = Transformer(dataclasses.replace(mc, max_len=len(prompt_T) + new),
                        decode=True)
    ours = inference.generate(params, jnp.asarray(prompt_T)[None], model=model,
                           max_new_tokens=new)
    assert theirs == np.asarray(ours)[0].tolist()
  assert got['tokens'] == sum(new for _, new in trace)
