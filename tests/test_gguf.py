"""Specification of GGUF export (`train.convert.to_gguf`, `gguf_vocab`), read
back with the gguf package's reader; llama.cpp itself runs the exports in
tests/test_llama_cpp.py."""

import errno
import math
import subprocess
import sys

import chex
import numpy as np
import pytest

gguf = pytest.importorskip(
    'gguf', reason="the gguf package is not installed (pip install -e "
    "'.[gguf]'): GGUF export is not tested")

from attention import rope  # pylint: disable=wrong-import-position
from tests import gguf_models  # pylint: disable=wrong-import-position
from infra.errors import UserError  # pylint: disable=wrong-import-position
from lm import checkpoint  # pylint: disable=wrong-import-position
from lm import model as model_lib  # pylint: disable=wrong-import-position
from train.convert import gguf_vocab, to_gguf  # pylint: disable=wrong-import-position


def _norm_rope(x_TEH, base: float):
  """llama.cpp's LLAMA_ROPE_TYPE_NORM, written from its definition: pairs
  (2i, 2i + 1) of each head turned by position · base^(-2i/H)."""
  T, _, H = x_TEH.shape
  theta_Ti = np.arange(T)[:, None] * base ** (-np.arange(0, H, 2) / H)
  cos, sin = np.cos(theta_Ti)[:, None], np.sin(theta_Ti)[:, None]
  even, odd = x_TEH[..., 0::2], x_TEH[..., 1::2]
  out = np.empty_like(x_TEH)
  out[..., 0::2] = even * cos - odd * sin
  out[..., 1::2] = even * sin + odd * cos
  return out


def test_interleaved_rows_turn_under_llama_cpps_rope_as_ours_do():
  """The q/k permutation: our half-split RoPE, then the rows interleaved,
  equals the rows interleaved, then llama.cpp's adjacent-pair RoPE; and
  without the permutation the two differ (the control)."""
  T, E, H = 9, 3, 8
  x_TEH = np.random.default_rng(0).standard_normal((T, E, H)).astype(np.float32)
  ours = np.asarray(rope.apply_rope(x_TEH[None], np.arange(T), base=100.0))[0]
  interleave = lambda y: to_gguf.interleave_rope(
      y.reshape(T, E * H).T, E).T.reshape(T, E, H)
  np.testing.assert_allclose(interleave(ours),
                             _norm_rope(interleave(x_TEH), 100.0), atol=1e-5)
  assert np.abs(ours - _norm_rope(x_TEH, 100.0)).max() > 0.1


def test_llama3_rope_freqs_are_the_divisors_llama_cpps_converter_writes():
  s = rope.RopeScaling('llama3', factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_len=64)
  mc = model_lib.ModelConfig.__new__(model_lib.ModelConfig)
  object.__setattr__(mc, 'rope_scaling', s)
  object.__setattr__(mc, 'head_dim', 32)
  object.__setattr__(mc, 'rope_base', 10_000.0)
  expected = []  # convert_hf_to_gguf.py's LlamaModel, piece by piece.
  for freq in 1.0 / 10_000.0 ** (np.arange(0, 32, 2) / 32):
    wavelen = 2 * math.pi / freq
    if wavelen < 64 / 4.0:
      expected.append(1.0)
    elif wavelen > 64 / 1.0:
      expected.append(8.0)
    else:
      smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
      expected.append(1 / ((1 - smooth) / 8.0 + smooth))
  factors = to_gguf.rope_factors(mc)
  np.testing.assert_allclose(factors, expected, rtol=1e-5)
  assert len(set(np.round(factors, 3))) > 2  # All three pieces present.


def _read(path):
  reader = gguf.GGUFReader(path)
  fields = {name: f.contents() for name, f in reader.fields.items()}
  tensors = {t.name: t for t in reader.tensors}
  return fields, tensors


def _values(tensor):
  """A tensor's values as float32, in numpy's (Hugging Face's) shape."""
  data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  return data.astype(np.float32).reshape(tuple(reversed(tensor.shape)))


def test_a_tied_model_with_gemmas_scales_reads_back_folded(tmp_path):
  """Our default conventions with SwiGLU and tied embeddings: the norms
  written as 1 + w, the token embedding times √D, a separate output of
  embedding / √D; the query and key rows interleaved per head; every key
  llama.cpp reads."""
  mc = gguf_models.random_workdir(tmp_path / 'w', tie_embeddings=True,
                                  **gguf_models.SILU)
  to_gguf.export(str(tmp_path / 'w'), str(tmp_path / 'm.gguf'))
  fields, tensors = _read(tmp_path / 'm.gguf')
  assert fields['general.architecture'] == 'llama'
  assert fields['general.file_type'] == gguf.LlamaFileType.ALL_F32
  for key, value in {'context_length': mc.max_len, 'block_count': 2,
                     'embedding_length': mc.d_model,
                     'feed_forward_length': mc.mlp_dim,
                     'attention.head_count': 4, 'attention.head_count_kv': 2,
                     'attention.key_length': mc.head_dim,
                     'rope.dimension_count': mc.head_dim,
                     'rope.freq_base': mc.rope_base}.items():
    assert fields[f'llama.{key}'] == value, key
  assert fields['llama.attention.layer_norm_rms_epsilon'] == pytest.approx(
      mc.norm_eps)
  _, params, _ = checkpoint.load_workdir(str(tmp_path / 'w'))
  embedding = np.asarray(params['embed']['embedding'])
  sqrt_d = np.float32(mc.d_model ** 0.5)
  np.testing.assert_array_equal(_values(tensors['token_embd.weight']),
                                embedding * sqrt_d)
  np.testing.assert_allclose(_values(tensors['output.weight']),
                             embedding / sqrt_d, rtol=1e-6)
  layer0 = model_lib.layer_subtrees(mc, params)[0]
  norm = np.asarray(layer0['attention_norm']['scale'])
  np.testing.assert_array_equal(_values(tensors['blk.0.attn_norm.weight']),
                                1.0 + norm)
  H = mc.head_dim
  query_DNH = np.asarray(layer0['attention']['query'])
  rows = _values(tensors['blk.0.attn_q.weight']).reshape(4, H // 2, 2, -1)
  np.testing.assert_array_equal(  # Row 2i + s is feature s·H/2 + i.
      rows.transpose(0, 2, 1, 3).reshape(4, H, -1),
      query_DNH.transpose(1, 2, 0))
  assert 'rope_freqs.weight' not in tensors


def test_qkv_biases_write_qwen2_with_rows_as_they_are(tmp_path):
  mc = gguf_models.random_workdir(tmp_path / 'w', qkv_bias=True,
                                  **gguf_models.LLAMA)
  to_gguf.export(str(tmp_path / 'w'), str(tmp_path / 'm.gguf'))
  fields, tensors = _read(tmp_path / 'm.gguf')
  assert fields['general.architecture'] == 'qwen2'
  _, params, _ = checkpoint.load_workdir(str(tmp_path / 'w'))
  layer0 = model_lib.layer_subtrees(mc, params)[0]['attention']
  np.testing.assert_array_equal(_values(tensors['blk.0.attn_k.bias']),
                                np.asarray(layer0['key_bias']).reshape(-1))
  assert 'output.weight' in tensors  # Untied.


@pytest.mark.parametrize('dtype, param_dtype, ggml', [
    ('bf16', 'float32', 'BF16'), ('f16', 'float32', 'F16'),
    (None, 'bfloat16', 'BF16')])
def test_matrices_take_the_dtype_asked_and_norms_stay_float32(
    tmp_path, dtype, param_dtype, ggml):
  """--dtype, or by default the checkpoint's param_dtype."""
  gguf_models.random_workdir(tmp_path / 'w', param_dtype=param_dtype,
                             **gguf_models.LLAMA)
  info = to_gguf.export(str(tmp_path / 'w'), str(tmp_path / 'm.gguf'), dtype)
  assert info['dtype'] == (dtype or 'bf16')
  _, tensors = _read(tmp_path / 'm.gguf')
  kinds = {name: t.tensor_type.name for name, t in tensors.items()}
  assert kinds['blk.1.ffn_down.weight'] == kinds['token_embd.weight'] == ggml
  assert kinds['blk.1.ffn_norm.weight'] == 'F32'
  _, params, _ = checkpoint.load_workdir(str(tmp_path / 'w'))
  np_dtype = to_gguf.DTYPES[info['dtype']][0]
  expected = np.asarray(params['embed']['embedding']).astype(np_dtype)
  np.testing.assert_array_equal(_values(tensors['token_embd.weight']),
                                expected.astype(np.float32))


@pytest.mark.parametrize('fields, named', [
    ({}, "model.mlp_activation='gelu_tanh'"),
    (dict(attention='mla', mla=dict(kv_lora_rank=16), num_kv_heads=4,
          **gguf_models.SILU), "model.attention='mla'"),
    (dict(attention='mla', mla=dict(kv_lora_rank=16, latent_groups=2),
          num_kv_heads=4, **gguf_models.SILU), "model.attention='mla'"),
    (dict(attention='gta', **gguf_models.SILU), "model.attention='gta'"),
    (dict(attention_pattern='LG', local_window=8, **gguf_models.SILU),
     'model.local_window=8'),
    (dict(logits_soft_cap=30.0, **gguf_models.SILU), 'model.logits_soft_cap'),
    (dict(final_logits_soft_cap=30.0, **gguf_models.SILU),
     'model.final_logits_soft_cap'),
    (dict(post_norms=True, **gguf_models.SILU), 'model.post_norms'),
    (dict(qk_norm=True, **gguf_models.SILU), 'model.qk_norm'),
    (dict(learned_positions=True, **gguf_models.SILU),
     'model.learned_positions'),
    (dict(use_rope=False, **gguf_models.SILU), 'model.use_rope=False'),
    (dict(kv_share=2, **gguf_models.SILU), 'model.kv_share=2'),
    (dict(query_pre_attn_scalar=4.0, **gguf_models.SILU),
     'model.query_pre_attn_scalar=4.0'),
    (dict(rope_scaling=dict(kind='yarn', factor=4.0), **gguf_models.SILU),
     "model.rope_scaling.kind='yarn'"),
])
def test_what_llama_cpp_cannot_compute_is_named(fields, named):
  found = to_gguf.problems(gguf_models.model_config(**fields))
  assert len(found) == 1 and found[0].startswith(named), found


def test_a_model_llama_cpp_cannot_compute_is_refused_before_writing(
    tmp_path):
  gguf_models.random_workdir(tmp_path / 'w', qk_norm=True, logits_soft_cap=5.0)
  with pytest.raises(UserError, match='model.logits_soft_cap; model.qk_norm'
                     ) as e:
    to_gguf.export(str(tmp_path / 'w'), str(tmp_path / 'm.gguf'))
  assert '\n' not in str(e.value) and 'mlp_activation' in str(e.value)
  assert list(tmp_path.iterdir()) == [tmp_path / 'w']  # Nothing written.


def test_a_window_longer_than_the_model_is_no_window(tmp_path):
  """Mistral's 4096 in a model of 32 positions never binds: exported."""
  gguf_models.random_workdir(tmp_path / 'w', attention_pattern='L',
                             local_window=32, **gguf_models.SILU)
  assert to_gguf.export(str(tmp_path / 'w'), str(tmp_path / 'm.gguf'))[
      'arch'] == 'llama'


@pytest.mark.slow
def test_bad_exports_are_one_line_a_failure_and_leave_no_file(tmp_path):
  """On the command line: a bad --dtype, an unwritable or existing
  --to_gguf, a refused layout, a flag of another conversion."""
  gguf_models.random_workdir(tmp_path / 'ok', **gguf_models.SILU)
  gguf_models.random_workdir(tmp_path / 'gelu')
  (tmp_path / 'out').mkdir()
  (tmp_path / 'out' / 'taken.gguf').write_bytes(b'x')
  cases = {
      '--dtype=q4': ['--source=ok', '--to_gguf=out/m.gguf', '--dtype=q4'],
      'cannot write into': ['--source=ok', '--to_gguf=missing/m.gguf'],
      'exists': ['--source=ok', '--to_gguf=out/taken.gguf'],
      'model.mlp_activation': ['--source=gelu', '--to_gguf=out/m.gguf'],
      'takes no --num_kv_heads': ['--source=ok', '--to_gguf=out/m.gguf',
                                  '--num_kv_heads=1'],
      'give it with --to_gguf': ['--source=ok', '--workdir=new',
                                 '--dtype=f16']}
  running = {says: subprocess.Popen(  # Together: each mostly imports jax.
      [sys.executable, '-m', 'train.convert', *args], cwd=tmp_path,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for says, args in cases.items()}
  for says, process in running.items():
    _, stderr = process.communicate()
    assert process.returncode == 1, (says, stderr)
    assert stderr.count('\n') == 1 and says in stderr, (says, stderr)
  assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == [
      'taken.gguf']
  assert not (tmp_path / 'new').exists()


def test_a_failure_while_writing_leaves_no_file(tmp_path, monkeypatch):
  gguf_models.random_workdir(tmp_path / 'w', **gguf_models.SILU)
  written = []

  def fail_on_the_third(self, tensor, *args, **kwargs):
    written.append(tensor.shape)
    if len(written) == 3:
      raise OSError(errno.ENOSPC, 'No space left on device')
    return original(self, tensor, *args, **kwargs)
  original = gguf.GGUFWriter.write_tensor_data
  monkeypatch.setattr(gguf.GGUFWriter, 'write_tensor_data', fail_on_the_third)
  (tmp_path / 'out').mkdir()
  out = tmp_path / 'out' / 'm.gguf'
  with pytest.raises(UserError) as raised:  # Not a traceback.
    to_gguf.export(str(tmp_path / 'w'), str(out))
  assert str(raised.value) == (
      f'--to_gguf={out}: writing {out} failed (No space left on device); '
      'nothing was left there: free space or choose another disk, and rerun')
  assert len(written) == 3 and not any((tmp_path / 'out').iterdir())


@pytest.mark.parametrize('folder', ['/sys', '/proc'])
def test_a_folder_that_takes_no_file_is_one_line(tmp_path, folder):
  """As root, os.access says /sys and /proc are writable; creating the
  temporary file there fails (EACCES, ENOENT): still one line."""
  gguf_models.random_workdir(tmp_path / 'w', **gguf_models.SILU)
  with pytest.raises(UserError, match=f'--to_gguf={folder}/x.gguf: cannot '
                                      f'(create a file in|write into) '
                                      f'{folder}[;( ]'):
    to_gguf.export(str(tmp_path / 'w'), f'{folder}/x.gguf')


def test_the_byte_alphabet_is_byte_level_bpes():
  """Token i of the byte vocabulary is how tokenizers' ByteLevel spells
  byte i, so llama.cpp's byte-level BPE reads byte i as token i."""
  from tokenizers import pre_tokenizers  # pylint: disable=import-outside-toplevel
  alphabet = gguf_vocab.byte_alphabet()
  assert sorted(alphabet) == sorted(pre_tokenizers.ByteLevel.alphabet())
  spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  text = bytes(range(32, 127)).decode() + ' é\n\t'
  (spelled, _), = spell.pre_tokenize_str(text)
  assert spelled == ''.join(alphabet[b] for b in text.encode())


def test_a_workdir_without_a_tokenizer_writes_the_bytes_padded(tmp_path):
  gguf_models.random_workdir(tmp_path / 'w', vocab_size=300,
                             **gguf_models.LLAMA)
  vocab = gguf_vocab.of_workdir(tmp_path / 'w', 300)
  assert vocab.tokens[:256] == gguf_vocab.byte_alphabet()
  assert vocab.tokens[256:] == [f'[PAD{i}]' for i in range(256, 300)]
  assert vocab.types == [gguf_vocab.NORMAL] * 256 + [gguf_vocab.UNUSED] * 44
  assert (vocab.bos, vocab.eos, vocab.add_bos) == (0, 0, False)


@pytest.mark.parametrize('pre', list(gguf_models.PRE_TOKENIZERS))
def test_byte_level_bpe_tokenizers_keep_their_tokens_and_specials(
    tmp_path, pre):
  path = gguf_models.bpe_tokenizer(tmp_path / 'tokenizer.json', pre)
  gguf_models.random_workdir(tmp_path / 'w', vocab_size=410, tokenizer=path,
                             **gguf_models.LLAMA)
  vocab = gguf_vocab.of_workdir(tmp_path / 'w', 410)
  assert vocab.pre == pre
  assert vocab.tokens[:2] == ['<s>', '</s>'] and vocab.types[:2] == [
      gguf_vocab.CONTROL] * 2
  assert (vocab.bos, vocab.eos, vocab.add_bos, vocab.add_eos) == (
      0, 1, True, False)
  assert vocab.tokens[400:] == [f'[PAD{i}]' for i in range(400, 410)]
  assert len(vocab.merges) > 100 and all(
      m.count(' ') == 1 for m in vocab.merges)


def test_a_tokenizer_llama_cpp_would_read_differently_is_refused(tmp_path):
  """A SentencePiece-style BPE (Metaspace, byte fallback): one line."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  tokenizer = Tokenizer(models.BPE(vocab={'a': 0, '▁': 1}, merges=[],
                                   byte_fallback=True))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
  tokenizer.decoder = decoders.Metaspace()
  tokenizer.save(str(tmp_path / 'tokenizer.json'))
  gguf_models.random_workdir(tmp_path / 'w', tokenizer=tmp_path /
                             'tokenizer.json', **gguf_models.LLAMA)
  with pytest.raises(UserError, match='byte_fallback') as e:
    to_gguf.export(str(tmp_path / 'w'), str(tmp_path / 'm.gguf'))
  assert '\n' not in str(e.value) and not (tmp_path / 'm.gguf').exists()
  chex.assert_equal(sorted(p.name for p in tmp_path.iterdir()),
                    ['tokenizer.json', 'w'])
