"""Specification of Hugging Face checkpoints in and out (`train.convert`).

Models are built by `transformers` from configs with random weights (nothing
is downloaded): each family imports to logits equal to transformers' own, at
positions into the thousands, greedy generation equal to `generate()`, and
import -> export -> import is bit-exact.
"""

import json
import os
import pathlib
import re
import struct
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from scripts import make_hf_model  # pylint: disable=wrong-import-position
from lm import model as model_lib  # pylint: disable=wrong-import-position
from lm import checkpoint, config_lib, tokenizer  # pylint: disable=wrong-import-position
from lm import inference  # pylint: disable=wrong-import-position
from train import convert, loop, prepare_data  # pylint: disable=wrong-import-position
from train.convert import hf, safetensors_io  # pylint: disable=wrong-import-position
from infra.errors import UserError  # pylint: disable=wrong-import-position
from lm.model import Transformer  # pylint: disable=wrong-import-position

REPO = pathlib.Path(__file__).parent.parent
SMALL = dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
             mlp_dim=128, vocab_size=300, max_len=4096, init_std=0.1,
             tokenizer=False)
FAMILIES = {
    'llama': dict(family='llama'),
    'llama3.1': dict(family='llama', rope_scaling=dict(
        rope_type='llama3', factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=512)),
    'mistral': dict(family='mistral', sliding_window=300),
    'qwen2': dict(family='qwen2'),
    'qwen3': dict(family='qwen3', head_dim=32),
    'gemma': dict(family='gemma', head_dim=32),
    # Local/global layers with a window the 23 generated tokens overrun.
    'gemma2': dict(family='gemma2', head_dim=32, sliding_window=16,
                   query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                   final_logit_softcapping=10.0),
    # 3 layers of pattern LG (unscanned: 2 does not divide 3); 10k local and
    # 1M linearly scaled global RoPE.
    'gemma3': dict(family='gemma3_text', head_dim=32, num_layers=3,
                   sliding_window=16, sliding_window_pattern=2,
                   final_logit_softcapping=10.0, rope_scaling=dict(
                       rope_type='linear', factor=8.0)),
    'qwen3-mixed': dict(family='qwen3', head_dim=32, sliding_window=16,
                        layer_types=['sliding_attention', 'full_attention']),
    # A pattern with no period shorter than the model: GGL, one scan step.
    'ministral': dict(family='ministral', num_layers=3, sliding_window=16,
                      layer_types=['full_attention', 'full_attention',
                                   'sliding_attention']),
}


# Each family's tests on one xdist worker, which builds its model once.
@pytest.fixture(scope='module', params=[
    pytest.param(f, marks=pytest.mark.xdist_group(f'hf-{f}')) for f in FAMILIES])
def imported(request, tmp_path_factory):
  """(HF model, its folder, our workdir) per family."""
  root = tmp_path_factory.mktemp(request.param)
  model = make_hf_model.make(str(root / 'hf'),
                             **{**SMALL, **FAMILIES[request.param]})
  convert.import_hf(str(root / 'hf'), str(root / 'ours'))
  return model, root / 'hf', root / 'ours'


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def _our_logits(workdir, tokens, **changes):
  mc, params, _ = checkpoint.load_workdir(str(workdir))
  import dataclasses  # pylint: disable=import-outside-toplevel
  mc = dataclasses.replace(mc, **changes)
  return np.asarray(jax.jit(Transformer(mc).apply)({'params': params},
                                                   jnp.asarray(tokens)))


@pytest.mark.slow
def test_logits_equal_transformers_at_every_position(imported):
  model, _, workdir = imported
  tokens_BT = np.random.default_rng(0).integers(0, 300, (1, 3072))
  expected = _hf_logits(model, tokens_BT)
  ours = _our_logits(workdir, tokens_BT)
  chex.assert_trees_all_close(ours, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize('imported, wrong', [
    ('llama3.1', dict(rope_scaling=None)),
    ('gemma3', dict(local_rope_base=None)),  # 1M, scaled, in local layers.
    ('gemma2', dict(final_logits_soft_cap=None)),
    ('gemma2', dict(logits_soft_cap=None)),
    ('gemma2', dict(query_pre_attn_scalar=None)),
    ('gemma2', dict(post_norms=False)),
    ('ministral', dict(local_window=15)),  # One key short.
], indirect=['imported'])
@pytest.mark.slow
def test_the_logit_comparison_can_tell_each_setting_missing(imported, wrong):
  """The controls: without each setting the import reads, far above 1e-4."""
  model, _, workdir = imported
  tokens_BT = np.random.default_rng(0).integers(0, 300, (1, 1024))
  ours = _our_logits(workdir, tokens_BT, **wrong)  # Unused params ignored.
  assert np.abs(ours - _hf_logits(model, tokens_BT)).max() > 1e-2


@pytest.mark.slow
def test_greedy_generation_equals_generate(imported):
  model, _, workdir = imported
  mc, params, _ = checkpoint.load_workdir(str(workdir))
  prompt_BT = np.random.default_rng(1).integers(2, 300, (2, 7))
  with torch.no_grad():
    expected = model.generate(
        torch.tensor(prompt_BT), max_new_tokens=16, do_sample=False,
        eos_token_id=None, pad_token_id=0).numpy()[:, 7:]
  import dataclasses  # pylint: disable=import-outside-toplevel
  mc = dataclasses.replace(mc, max_len=7 + 16)
  ours = inference.generate(params, jnp.asarray(prompt_BT),
                            model=Transformer(mc, decode=True),
                            max_new_tokens=16)
  np.testing.assert_array_equal(np.asarray(ours), expected)


@pytest.mark.slow
def test_import_export_import_is_bit_exact(imported, tmp_path):
  model, source, workdir = imported
  out = tmp_path / 'exported'
  convert.export_hf(str(workdir), str(out))
  reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
      out, output_loading_info=True)
  assert not any(info.values()), info  # No missing or unexpected keys.
  tokens_BT = np.random.default_rng(2).integers(0, 300, (1, 64))
  np.testing.assert_array_equal(_hf_logits(reloaded.eval(), tokens_BT),
                                _hf_logits(model, tokens_BT))
  convert.import_hf(str(out), str(tmp_path / 'again'))
  mc_a, params_a, config_a = checkpoint.load_workdir(str(workdir))
  mc_b, params_b, config_b = checkpoint.load_workdir(str(tmp_path / 'again'))
  assert mc_a == mc_b and config_a == config_b
  chex.assert_trees_all_equal(params_a, params_b)
  chex.assert_trees_all_equal_dtypes(params_a, params_b)
  original = json.loads((source / 'config.json').read_text())
  exported = json.loads((out / 'config.json').read_text())
  assert exported['model_type'] == original['model_type']


@pytest.mark.parametrize('family', ['llama', 'gemma3'])
def test_mha_import_with_fewer_kv_heads_mean_pools_them(tmp_path, family):
  model = make_hf_model.make(str(tmp_path / 'hf'), **{
      **SMALL, **FAMILIES[family], 'num_kv_heads': 4})
  convert.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'gqa'),
                    num_kv_heads=2, method='mean')
  mc, params, _ = checkpoint.load_workdir(str(tmp_path / 'gqa'))
  assert mc.num_kv_heads == 2
  D, H = mc.d_model, mc.head_dim
  layers = model_lib.layer_subtrees(mc, params)
  for i in range(mc.num_layers):
    for name, ours in (('k_proj', 'key'), ('v_proj', 'value')):
      w = getattr(model.model.layers[i].self_attn, name).weight.detach().numpy()
      heads_KHD = w.reshape(4, H, D)
      pooled_DKH = heads_KHD.reshape(2, 2, H, D).mean(1).transpose(2, 0, 1)
      np.testing.assert_allclose(layers[i]['attention'][ours], pooled_DKH,
                                 rtol=1e-6, atol=1e-7)
  export = tmp_path / 'exported'
  convert.export_hf(str(tmp_path / 'gqa'), str(export))
  assert json.loads((export / 'config.json').read_text())[
      'num_key_value_heads'] == 2
  tokens_BT = np.random.default_rng(3).integers(0, 300, (1, 48))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
  np.testing.assert_allclose(_hf_logits(reloaded, tokens_BT),
                             _our_logits(tmp_path / 'gqa', tokens_BT),
                             atol=1e-4)


def test_our_own_model_exports_as_gemma(trained, tmp_path):
  convert.export_hf(str(trained), str(tmp_path / 'out'))
  config = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert config['model_type'] == 'gemma'
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / 'out', output_loading_info=True)
  assert not any(info.values()), info
  tokens_BT = np.random.default_rng(4).integers(0, 256, (2, 32))
  np.testing.assert_allclose(_hf_logits(model.eval(), tokens_BT),
                             _our_logits(trained, tokens_BT), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('family, model', [
    ('gemma2', dict(post_norms=True, logits_soft_cap=5.0,
                    final_logits_soft_cap=3.0, query_pre_attn_scalar=12.0)),
    ('gemma3_text', dict(post_norms=True, qk_norm=True, local_rope_base=100.0,
                         final_logits_soft_cap=3.0))])
def test_our_own_local_global_models_export_as_gemma_2_and_3(tmp_path, family,
                                                            model):
  """A model trained here with Gemma 2's or 3's conventions and LG layers
  (window 8, shorter than the 32 tokens compared) exports as that family,
  with transformers' logits equal to ours."""
  config = config_lib.load('tiny')
  config.model.update(attention_pattern='LG', local_window=8, **model)
  config.train.update(steps=4, warmup_steps=1, eval_every=4,
                      checkpoint_every=4)
  loop.train_and_evaluate(config, str(tmp_path / 'w'))
  convert.export_hf(str(tmp_path / 'w'), str(tmp_path / 'out'))
  exported = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert exported['model_type'] == family
  assert exported['layer_types'] == ['sliding_attention', 'full_attention']
  hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / 'out', output_loading_info=True, attn_implementation='eager')
  assert not any(info.values()), info
  tokens_BT = np.random.default_rng(5).integers(0, 256, (2, 32))
  np.testing.assert_allclose(_hf_logits(hf_model.eval(), tokens_BT),
                             _our_logits(tmp_path / 'w', tokens_BT), atol=1e-4)


def test_bf16_checkpoints_get_float32_master_weights_unless_asked(tmp_path):
  make_hf_model.make(str(tmp_path / 'hf'), **{**SMALL, 'max_len': 64},
                     dtype='bfloat16')
  convert.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'bf16'),
                    param_dtype='bfloat16')
  mc, params, _ = checkpoint.load_workdir(str(tmp_path / 'bf16'))
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(jnp.bfloat16)}
  convert.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'f32'))
  _, params32, _ = checkpoint.load_workdir(str(tmp_path / 'f32'))
  assert {x.dtype for x in jax.tree.leaves(params32)} == {np.dtype(np.float32)}
  chex.assert_trees_all_equal(jax.tree.map(
      lambda x: np.asarray(x, np.float32), params), params32)


@pytest.mark.slow
def test_an_imported_workdir_uptrains_on_a_prepared_corpus_by_the_recipe(
    tmp_path, capsys):
  make_hf_model.make(str(tmp_path / 'hf'), **{**SMALL, 'max_len': 64,
                                              'tokenizer': True})
  convert.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'w'))
  config = config_lib.from_json(tmp_path / 'w' / 'config.json')
  recipe = json.loads((tmp_path / 'w' / 'convert.json').read_text())['recipe']
  assert config.train.learning_rate == recipe['train.learning_rate'] == (
      convert.HF_UPTRAINING_LEARNING_RATE)
  assert config.train.warmup_steps == recipe['train.warmup_steps'] < 30
  assert config.model.param_dtype == 'float32'  # Master weights.
  import pydoc_data.topics  # pylint: disable=import-outside-toplevel
  (tmp_path / 'docs').mkdir()
  for name, text in sorted(pydoc_data.topics.topics.items())[:40]:
    (tmp_path / 'docs' / f'{name}.txt').write_text(text)
  meta = prepare_data.prepare([str(tmp_path / 'docs')], str(tmp_path / 'w'),
                              str(tmp_path / 'corpus'), val_fraction=0.1)
  assert meta['eos_id'] == 1 and meta['bos_id'] == 0  # config.json's, <s>.
  config.data.update(path=str(tmp_path / 'corpus'), seq_len=32)
  config.train.update(steps=4, warmup_steps=1, eval_every=4, eval_batches=1,
                      batch_size=4, learning_rate=1e-3)
  record = loop.train_and_evaluate(config, str(tmp_path / 'w'))
  assert np.isfinite(record['eval_loss']) and 'eval_bpb' in record
  assert "warning: train.learning_rate=0.001 is above the uptraining " \
      "recipe's 3e-05" in capsys.readouterr().err


@pytest.mark.parametrize('changes, message', [
    (dict(model_type='falcon'), "model_type 'falcon' is not supported"),
    (dict(rope_parameters={'rope_type': 'dynamic', 'rope_theta': 1e4,
                           'factor': 4.0}), "rope scaling 'dynamic'"),
    (dict(layer_types=['sliding_attention', 'bidirectional'],
          use_sliding_window=True, sliding_window=64),
     "layer_types ['sliding_attention', 'bidirectional'] (one of "
     'sliding_attention, full_attention per layer, 2 layers)'),
    (dict(model_type='mistral', sliding_window=64, layer_types=[
        'sliding_attention', 'full_attention']),
     "transformers' Mistral ignores (model_type 'ministral' reads them)"),
    (dict(model_type='gemma3'), "model_type 'gemma3' is Gemma 3 with vision "
     '(Gemma3ForConditionalGeneration), which is not supported; convert a '
     "text-only Gemma 3 checkpoint (model_type 'gemma3_text', e.g. "
     'google/gemma-3-1b-pt) instead'),
    (dict(model_type='gemma3_text', attn_logit_softcapping=50.0),
     "attn_logit_softcapping, which transformers' Gemma 3 does not apply"),
    (dict(model_type='gemma3_text', rope_parameters={
        'full_attention': {'rope_type': 'default', 'rope_theta': 1e6},
        'sliding_attention': {'rope_type': 'linear', 'factor': 2.0,
                              'rope_theta': 1e4}}),
     "rope_type 'linear' in the sliding-window layers"),
    (dict(model_type='gemma2', use_bidirectional_attention=True),
     'use_bidirectional_attention=true'),
    (dict(num_hidden_layers=3, layer_types=...), 'missing model.layers.2.'),
    (dict(hidden_size=32), 'model.embed_tokens.weight is [300, 64] in the '
     'safetensors, but config.json implies [300, 32]'),
    (dict(hidden_size=...), 'config.json has no hidden_size'),
    (dict(num_hidden_layers='2'),
     "config.json: num_hidden_layers='2' must be an integer >= 1"),
    (dict(rms_norm_eps=[1e-6]), 'config.json: rms_norm_eps=[1e-06] must be a '
     'number > 0'),
])
def test_unsupported_checkpoints_are_refused_before_writing(
    qwen2_folder, tmp_path, changes, message):
  source = _linked_copy(qwen2_folder, tmp_path / 'hf', 'config.json')
  config = json.loads((qwen2_folder / 'config.json').read_text())
  config = {k: v for k, v in {**config, **changes}.items() if v is not ...}
  (source / 'config.json').write_text(json.dumps(config))
  with pytest.raises(UserError, match=re.escape(message)):
    convert.import_hf(str(source), str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()  # Nothing half-written.


def _linked_copy(folder, target, *except_names):
  """`folder`'s files linked into `target`, except those to be rewritten."""
  target.mkdir()
  for f in folder.iterdir():
    if f.name not in except_names:
      (target / f.name).symlink_to(f)
  return target


def _damaged(data: bytes, damage: str, tmp_path) -> bytes:
  size = struct.unpack('<Q', data[:8])[0]
  header = data[8:8 + size]
  if damage == 'absurd_header_length':
    return struct.pack('<Q', 1 << 60) + data[8:]
  if damage == 'header_is_a_list':
    listed = b'[]'.ljust(size)
    return data[:8] + listed + data[8 + size:]
  if damage == 'f16_for_f32_bytes':
    return data[:8] + header.replace(b'"F32"', b'"F16"', 1) + data[8 + size:]
  # A transposed gate_proj: the same bytes, shape [D, F] for [F, D].
  original = tmp_path / 'original.safetensors'
  original.write_bytes(data)
  source = safetensors_io.File(original)
  name = 'model.layers.0.mlp.gate_proj.weight'
  tensors = [(n, source.read(n).T if n == name else source.read(n))
             for n in source.entries]
  shapes = {n: (a.dtype, a.shape) for n, a in tensors}
  safetensors_io.write(tmp_path, iter(tensors), shapes)
  return (tmp_path / 'model.safetensors').read_bytes()


@pytest.mark.parametrize('damage, message', [
    ('absurd_header_length', 'header length 1,152,921,504,606,846,976 exceeds'),
    ('header_is_a_list', 'has an inconsistent safetensors header (its header '
     'is a JSON list, not an object)'),
    ('f16_for_f32_bytes', 'bytes, but its data_offsets span'),
    ('transposed_gate_proj', 'model.layers.0.mlp.gate_proj.weight is [64, '
     '128] in the safetensors, but config.json implies [128, 64]'),
])
def test_damaged_safetensors_are_refused_before_writing(
    qwen2_folder, tmp_path, damage, message):
  source = _linked_copy(qwen2_folder, tmp_path / 'hf', 'model.safetensors')
  work = tmp_path / 'work'
  work.mkdir()
  (source / 'model.safetensors').write_bytes(_damaged(
      (qwen2_folder / 'model.safetensors').read_bytes(), damage, work))
  with pytest.raises(UserError, match=re.escape(message)):
    convert.import_hf(str(source), str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()


def test_a_garbage_tokenizer_is_refused_before_writing(qwen2_folder,
                                                        tmp_path):
  source = _linked_copy(qwen2_folder, tmp_path / 'hf')
  (source / 'tokenizer.json').write_text('{"not": "a tokenizer"}')
  with pytest.raises(UserError, match='tokenizer.json is not a Hugging Face '
                     'tokenizer.json'):
    convert.import_hf(str(source), str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()


def test_an_import_without_a_tokenizer_is_loud_and_refuses_bytes(
    qwen2_folder, tmp_path):
  result = subprocess.run(
      [sys.executable, '-m', 'train.convert', f'--from_hf={qwen2_folder}',
       f'--workdir={tmp_path}/out'], cwd=REPO, capture_output=True, text=True,
      timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'warning: {qwen2_folder} has no tokenizer.json, so ' in result.stderr
  assert 'reading weights ' in result.stderr  # The progress line.
  config = config_lib.from_json(tmp_path / 'out' / 'config.json')
  with pytest.raises(UserError, match=r'read as UTF-8 bytes \(256 ids\), but '
                     'model.vocab_size=300'):
    loop.train_and_evaluate(config, str(tmp_path / 'out'))


def test_a_refused_import_is_one_line_on_the_command_line(
    qwen2_folder, tmp_path):
  result = subprocess.run(
      [sys.executable, '-m', 'train.convert', f'--from_hf={qwen2_folder}',
       f'--workdir={tmp_path}/out', '--num_kv_heads=3'], cwd=REPO,
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      'error: --num_kv_heads=3: the source has 2 KV heads; pick a divisor of '
      '2 or -1']
  assert not (tmp_path / 'out').exists()


@pytest.fixture(scope='module')
def qwen2_folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp('qwen2') / 'hf'
  make_hf_model.make(str(folder), **{**SMALL, 'max_len': 64}, family='qwen2')
  return folder


@pytest.mark.parametrize('field, value', [
    ('logits_soft_cap', 30.0), ('use_rope', False),
    ('learned_positions', True)])
def test_export_refuses_what_no_architecture_computes(trained, tmp_path, field,
                                                      value):
  config = json.loads((trained / 'config.json').read_text())
  config['model'][field] = value
  copy = tmp_path / 'changed'
  copy.mkdir()
  (copy / 'config.json').write_text(json.dumps(config))
  (copy / 'checkpoints').symlink_to(trained / 'checkpoints')
  with pytest.raises(UserError, match=f'model.{field}'):
    convert.export_hf(str(copy), str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()


def test_text_is_tokenized_once_into_uint16_or_uint32(tmp_path, capsys):
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  from lm import data  # pylint: disable=import-outside-toplevel
  text = tmp_path / 'text.txt'
  text.write_text(' '.join(f'w{i % 97} w{70_000 - i % 89}'
                           for i in range(2000)))
  for size, dtype in ((1000, np.uint16), (70_001, np.uint32)):
    vocab = {f'w{i}': i for i in range(size - 1)} | {'[UNK]': size - 1}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / f'tokenizer{size}.json'
    word_level.save(str(path))
    loaded = data.load(str(text), val_fraction=0.1, seq_len=16,
                       cache_dir=str(tmp_path / 'cache'),
                       tokenizer=tokenizer.load(path))
    assert loaded.train.dtype == dtype and loaded.vocab_size == size
    assert loaded.bytes_per_token == pytest.approx(
        text.stat().st_size / 4000, rel=0.01)
    ids = tokenizer.load(path).encode(text.read_text())
    np.testing.assert_array_equal(
        np.concatenate([loaded.train, loaded.val])[:100], ids[:100])
  assert len(list((tmp_path / 'cache').iterdir())) == 2  # One per tokenizer.
  progress = capsys.readouterr().err
  assert progress.count('tokenizing train.bin ') == 2, progress
  assert 'M chars/s' in progress and 'ETA 0:00' in progress


@pytest.mark.slow
def test_import_streams_in_about_one_copy_of_memory(tmp_path):
  """A ~100M-parameter Llama checkpoint in 3 shards imports with a peak of
  at most 1.5x its size above the process's baseline (imports and JAX)."""
  L, D, F, V, N, H = 12, 768, 2048, 16000, 12, 64
  config = {'model_type': 'llama', 'hidden_size': D, 'intermediate_size': F,
            'num_hidden_layers': L, 'num_attention_heads': N,
            'num_key_value_heads': N, 'vocab_size': V, 'rms_norm_eps': 1e-5,
            'max_position_embeddings': 1024, 'tie_word_embeddings': False}
  shapes = {'model.embed_tokens.weight': (V, D), 'model.norm.weight': (D,),
            'lm_head.weight': (V, D)}
  for i in range(L):
    for name, shape in (('self_attn.q_proj', (D, D)), ('self_attn.k_proj', (D, D)),
                        ('self_attn.v_proj', (D, D)), ('self_attn.o_proj', (D, D)),
                        ('mlp.gate_proj', (F, D)), ('mlp.up_proj', (F, D)),
                        ('mlp.down_proj', (D, F)), ('input_layernorm', (D,)),
                        ('post_attention_layernorm', (D,))):
      shapes[f'model.layers.{i}.{name}.weight'] = shape
  source = tmp_path / 'hf'
  source.mkdir()
  (source / 'config.json').write_text(json.dumps(config))
  rng = np.random.default_rng(0)
  safetensors_io.write(
      source, ((n, rng.standard_normal(s, np.float32)) for n, s in shapes.items()),
      {n: (np.dtype(np.float32), s) for n, s in shapes.items()},
      max_shard_bytes=150 << 20)
  count = sum(int(np.prod(s)) for s in shapes.values())
  assert 90e6 < count < 130e6
  files = list(source.glob('*.safetensors'))
  size = sum(p.stat().st_size for p in files)
  assert len(files) >= 3 and (source / 'model.safetensors.index.json').exists()
  measure = f'''
import resource, jax
from train import convert
jax.numpy.zeros(1).block_until_ready()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert.import_hf({str(source)!r}, {str(tmp_path / "ours")!r})
print(base * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
'''
  result = subprocess.run([sys.executable, '-c', measure], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  base, peak = map(int, result.stdout.split()[-2:])
  assert peak - base <= 1.5 * size, (peak - base) / size
  _, params, _ = checkpoint.load_workdir(str(tmp_path / 'ours'))
  name = f'model.layers.{L - 1}.mlp.down_proj.weight'
  [holder] = [f for f in map(safetensors_io.File, files) if name in f.entries]
  np.testing.assert_array_equal(params['layers']['mlp']['down'][L - 1],
                                holder.read(name).T)  # The weights arrived.


@pytest.mark.slowest
@pytest.mark.slow
def test_the_readme_workflow_runs_on_this_machine(tmp_path):
  """docs/hugging_face.md: make an MHA model, import it as GQA, prepare the
  corpus with its tokenizer, uptrain, sample, export; the exported model
  loads in transformers with the new K/V head count."""
  page = (REPO / 'docs' / 'hugging_face.md').read_text()
  block = page.split('The same commands on this machine')[1]
  commands = block.split('```bash\n')[1].split('\n```')[0].splitlines()
  assert len(commands) == 6
  # `python` is this interpreter, as in the environment the README activates.
  path = f'{pathlib.Path(sys.executable).parent}:{os.environ["PATH"]}'
  # The one warning, which the page explains after the commands.
  explained = re.search(r'and warns that\s+`(.*?)`', block, re.S).group(1)
  for command in commands:
    result = subprocess.run(command, shell=True, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, 'PATH': path})
    assert result.returncode == 0, (command, result.stderr[-2000:])
    warnings = [line for line in result.stderr.splitlines()
                if 'warning' in line.lower()]
    assert warnings == ([f'warning: {" ".join(explained.split())} for this '
                         f'converted checkpoint ({tmp_path}/runs/hf_gqa/'
                         'convert.json); '
                         'a from-scratch rate can undo what it learnt']
                        if 'train.main' in command else []), command
  from train.metrics import read_metrics  # pylint: disable=import-outside-toplevel
  assert read_metrics(tmp_path / 'runs/hf_gqa')[-1]['step'] == 20
  meta = json.loads((tmp_path / 'runs/corpus/meta.json').read_text())
  assert meta['dtype'] == 'uint16' and meta['eos_id'] == 1
  final = json.loads((tmp_path / 'runs/hf_gqa/final.json').read_text())
  assert np.isfinite(final['eval_loss'])
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / 'runs/hf_gqa_exported', output_loading_info=True)
  assert not any(info.values()), info
  assert model.config.num_key_value_heads == 2
  assert (tmp_path / 'runs/hf_gqa_exported/tokenizer.json').exists()


def test_transformers_4_gemma_configs_read_as_5_writes_them():
  """Hub checkpoints of Gemma 2 and 3 carry transformers 4's config.json:
  rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern
  in place of rope_parameters per layer type and layer_types."""
  common = dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                num_hidden_layers=26, num_attention_heads=4,
                num_key_value_heads=1, head_dim=32, sliding_window=512,
                query_pre_attn_scalar=32, rms_norm_eps=1e-6)
  gemma3_v4 = dict(common, model_type='gemma3_text', rope_theta=1e6,
                   rope_local_base_freq=1e4, sliding_window_pattern=6,
                   rope_scaling={'rope_type': 'linear', 'factor': 8.0},
                   attn_logit_softcapping=None, final_logit_softcapping=None)
  kinds = ['full_attention' if (i + 1) % 6 == 0 else 'sliding_attention'
           for i in range(26)]
  gemma3_v5 = dict(common, model_type='gemma3_text', layer_types=kinds,
                   rope_parameters={
                       'full_attention': {'rope_type': 'linear',
                                          'factor': 8.0, 'rope_theta': 1e6},
                       'sliding_attention': {'rope_type': 'default',
                                             'rope_theta': 1e4}})
  fields = hf.model_fields(gemma3_v4)
  assert fields == hf.model_fields(gemma3_v5)
  assert (fields['attention_pattern'], fields['local_window'],
          fields['local_rope_base'], fields['rope_base'],
          fields['rope_scaling'], fields['scan_layers']) == (
              'LLLLLG', 512, 1e4, 1e6, {'kind': 'linear', 'factor': 8.0},
              False)  # 6 does not divide 26.
  gemma2_v4 = dict(common, model_type='gemma2', rope_theta=1e4,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
  fields = hf.model_fields(gemma2_v4)
  assert (fields['attention_pattern'], fields['logits_soft_cap'],
          fields['final_logits_soft_cap'], fields['post_norms'],
          fields['qk_norm'], fields['scan_layers']) == (
              'LG', 50.0, 30.0, True, False, True)


def test_a_gemma_config_leaving_keys_out_reads_as_transformers_fills_them():
  """A config.json without the query scalar, soft caps, window or RoPE bases
  means transformers' defaults (Gemma 2: 256, 50, 30, 4096), not none; an
  explicit null stays null."""
  common = dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4)
  gemma2 = hf.model_fields(dict(common, model_type='gemma2'))
  assert (gemma2['query_pre_attn_scalar'], gemma2['logits_soft_cap'],
          gemma2['final_logits_soft_cap'], gemma2['local_window'],
          gemma2['attention_pattern']) == (256.0, 50.0, 30.0, 4096, 'LG')
  uncapped = hf.model_fields(dict(common, model_type='gemma2',
                                  attn_logit_softcapping=None))
  assert uncapped['logits_soft_cap'] is None
  gemma3 = hf.model_fields(dict(common, model_type='gemma3_text'))
  assert (gemma3['rope_base'], gemma3['local_rope_base']) == (1e6, 1e4)
  for family, fields in (('gemma2', gemma2), ('gemma3_text', gemma3)):
    config = transformers.AutoConfig.for_model(family, **common)  # Theirs.
    assert config.query_pre_attn_scalar == fields['query_pre_attn_scalar']
    assert config.sliding_window == fields['local_window']
