"""Specification of DeepSeek-V2/V3 (dense) checkpoints in and out: a random
DeepSeek-V3-style model made by transformers (nothing downloaded) imports
with logits within 1e-4 of transformers' at every position and the same
greedy tokens as generate(), and exports back to the same logits."""

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from scripts import make_hf_model  # pylint: disable=wrong-import-position
from tests.test_faults import _one_line_error, _run  # pylint: disable=wrong-import-position
from lm import checkpoint  # pylint: disable=wrong-import-position
from lm import inference  # pylint: disable=wrong-import-position
from train import convert  # pylint: disable=wrong-import-position
from train.convert import hf  # pylint: disable=wrong-import-position
from infra.errors import UserError  # pylint: disable=wrong-import-position
from lm.model import Transformer  # pylint: disable=wrong-import-position

# All layers dense (first_k_dense_replace = 2 layers), though experts are
# configured: what a dense DeepSeek-V3-style checkpoint looks like.
DEEPSEEK = dict(family='deepseek_v3', d_model=32, num_layers=2, num_heads=4,
                num_kv_heads=4, head_dim=4, mlp_dim=64, vocab_size=300,
                max_len=512, init_std=0.1, tokenizer=False, kv_lora_rank=12,
                qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
                first_k_dense_replace=2, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, n_group=1,
                topk_group=1)


# DeepSeek-V3's own RoPE scaling, YaRN, with a factor the 512 positions
# reach past and mscales that move both the rotated features and the
# softmax scale.
YARN = dict(rope_type='yarn', factor=4.0, original_max_position_embeddings=64,
            beta_fast=32.0, beta_slow=1.0, mscale=0.8, mscale_all_dim=1.0)
VARIANTS = {'no_q_lora': dict(q_lora_rank=None), 'q_lora': dict(q_lora_rank=10),
            'yarn': dict(q_lora_rank=None, rope_scaling=YARN)}


@pytest.fixture(scope='module', params=VARIANTS)
def imported(request, tmp_path_factory):
  root = tmp_path_factory.mktemp('deepseek')
  model = make_hf_model.make(str(root / 'hf'), **VARIANTS[request.param],
                             **DEEPSEEK)
  convert.import_hf(str(root / 'hf'), str(root / 'ours'))
  return model, root


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def _ours(workdir, tokens, **changes):
  mc, params, _ = checkpoint.load_workdir(str(workdir))
  mc = dataclasses.replace(mc, **changes)
  return np.asarray(jax.jit(Transformer(mc).apply)(  # One program.
      {'params': params}, jnp.asarray(tokens)))


@pytest.mark.slow
def test_imported_logits_and_greedy_tokens_equal_transformers(imported):
  model, root = imported
  tokens = np.random.default_rng(0).integers(0, 300, (1, 512))
  expected = _hf_logits(model, tokens)
  chex.assert_trees_all_close(_ours(root / 'ours', tokens), expected,
                              atol=1e-4, rtol=0)
  mc, params, _ = checkpoint.load_workdir(str(root / 'ours'))
  assert mc.layout.name == 'mla' and mc.layout.kv_lora_rank == 12
  assert mc.layout.latent_norm
  if mc.rope_scaling is not None:  # The control: YaRN's mscales matter.
    assert mc.rope_scaling.kind == 'yarn'
    unscaled = dataclasses.replace(mc.rope_scaling, mscale=0.0,
                                   mscale_all_dim=0.0)
    assert np.abs(_ours(root / 'ours', tokens, rope_scaling=unscaled)
                  - expected).max() > 1e-2
  prompt = np.random.default_rng(1).integers(2, 300, (2, 7))
  with torch.no_grad():
    greedy = model.generate(torch.tensor(prompt), max_new_tokens=12,
                            do_sample=False, eos_token_id=None,
                            pad_token_id=0).numpy()[:, 7:]
  ours = inference.generate(params, jnp.asarray(prompt),
                            model=Transformer(dataclasses.replace(
                                mc, max_len=19), decode=True),
                            max_new_tokens=12)
  np.testing.assert_array_equal(np.asarray(ours), greedy)


@pytest.mark.slow
def test_export_gives_transformers_the_same_logits_and_reimports(imported):
  model, root = imported
  assert convert.export_hf(str(root / 'ours'), str(root / 'out')) == (
      'deepseek_v3')
  exported = transformers.AutoModelForCausalLM.from_pretrained(
      root / 'out', dtype=torch.float32).eval()
  tokens = np.random.default_rng(2).integers(0, 300, (1, 256))
  chex.assert_trees_all_close(_hf_logits(exported, tokens),
                              _hf_logits(model, tokens), atol=1e-5, rtol=0)
  convert.import_hf(str(root / 'out'), str(root / 'again'))
  _, first, _ = checkpoint.load_workdir(str(root / 'ours'))
  _, again, _ = checkpoint.load_workdir(str(root / 'again'))
  chex.assert_trees_all_equal(first, again)


@pytest.mark.slow
def test_the_rope_pair_order_is_what_the_comparison_checks(tmp_path):
  """The control: read as if its RoPE dims were not interleaved, the same
  checkpoint's logits are far from transformers'."""
  model = make_hf_model.make(str(tmp_path / 'hf'), q_lora_rank=None,
                             **DEEPSEEK)
  config = hf.read_config(tmp_path / 'hf')
  assert config['rope_interleave'] is True
  config['rope_interleave'] = False
  (tmp_path / 'hf' / 'config.json').write_text(json.dumps(config))
  convert.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'ours'))
  tokens = np.random.default_rng(0).integers(0, 300, (1, 64))
  assert np.abs(_ours(tmp_path / 'ours', tokens)
                - _hf_logits(model, tokens)).max() > 1e-2


@pytest.mark.slow
def test_mixture_of_experts_layers_are_refused_in_one_line(tmp_path):
  make_hf_model.make(str(tmp_path / 'hf'), q_lora_rank=None,
                     **{**DEEPSEEK, 'first_k_dense_replace': 1})
  result = _run('train.convert', f'--from_hf={tmp_path / "hf"}',
                f'--workdir={tmp_path / "ours"}')
  _one_line_error(result, 'mixture-of-experts layers (first_k_dense_replace'
                  '=1 < num_hidden_layers=2)')
  assert not (tmp_path / 'ours').exists()


def test_mla_models_that_deepseek_does_not_compute_refuse_export():
  from tests.test_latent import _config  # pylint: disable=import-outside-toplevel
  from lm import config_lib  # pylint: disable=import-outside-toplevel
  mc = config_lib.model_config(_config(
      mlp_activation='silu', norm_scale_offset=0.0, embed_scale=False))
  assert hf.family_of(mc) == 'deepseek_v3'
  with pytest.raises(UserError, match=r'model\.mla\.latent_norm=False '
                     r'\(DeepSeek normalises the latent\)'):
    hf.family_of(dataclasses.replace(
        mc, layout=dataclasses.replace(mc.layout, latent_norm=False)))
  with pytest.raises(UserError, match="Gemma's conventions; DeepSeek's are Llama's"):
    hf.family_of(config_lib.model_config(_config()))
