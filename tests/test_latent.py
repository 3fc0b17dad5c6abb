"""Specification of multi-head latent attention (MLA, `attention.latent`):
its options are validated in one line, cached decoding (from the latent,
absorbed) equals the full pass (per-head K/V expanded), the decode step
builds no per-head K/V, and the cache holds (A + Y) numbers per token and
layer."""

import dataclasses
import json
import re

import chex
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import Attention, cpu_kernel, latent, layer
from attention import nnx as attention_nnx
from attention.rope import apply_rope
from configs import tiny
from tests import hlo, reference
from tests.test_kv_memory import _decode_in_chunks, _full_pass
from tests.test_faults import _one_line_error, _run
from tests.test_sample import _greedy_by_full_passes, _sample
from lm import config_lib, flops
from lm import inference
from train import loop
from train.convert import to_mla
from lm import model as model_lib
from infra.errors import UserError
from lm.model import Transformer, unroll_layers

# Widths all different, so that each shape below names one thing: A latent,
# Y RoPE key, I and U a head's key (without RoPE) and value, N heads.
A, Y, I, U, N = 10, 4, 8, 6, 4
WIDTHS = dict(kv_lora_rank=A, qk_rope_head_dim=Y, qk_nope_head_dim=I,
              v_head_dim=U)
# Variants beyond tests/test_layouts.py's MLA at its defaults: widths that
# all differ (U != I: the full pass pads the values), a query latent with
# local layers and kv_share, no RoPE key, no latent norm and a soft cap.
VARIANTS = {
    'global': {},
    'query_latent_local_pairs_sharing': dict(
        mla=dict(q_lora_rank=12), num_layers=4, attention_pattern='LLGG',
        local_window=5, kv_share=2),
    'nope_no_latent_norm': dict(
        use_rope=False, mla=dict(qk_rope_head_dim=0, latent_norm=False),
        logits_soft_cap=2.0),
}


def _config(mla=None, **model):
  """`tiny` as MLA with WIDTHS, the settings `mla` and the model fields."""
  config = tiny.get_config()
  config.model.update(attention='mla', num_kv_heads=N,
                      mla={**WIDTHS, **(mla or {})}, **model)
  config_lib.validate(config, batch_shards=1)
  return config


def _model(seed=1, **model):
  mc = config_lib.model_config(_config(**model))
  return mc, nn.unbox(loop.init_params(Transformer(mc), seed=seed))


@pytest.mark.parametrize('variant', [
    variant if variant == 'global' else pytest.param(
        variant, marks=pytest.mark.slow) for variant in VARIANTS])
def test_cached_decoding_from_the_latent_equals_the_full_pass(variant):
  """Logits at every position, fed through the cache in chunks that wrap
  the local layers' ring buffers, equal the full pass (which expands K/V);
  greedy generation equals argmax over full passes."""
  mc, params = _model(**VARIANTS[variant])
  tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, mc.vocab_size)
  full = _full_pass(mc, params, tokens)
  cached, _ = _decode_in_chunks(mc, params, tokens, [7, 1, 1, 6, 1, 4])
  chex.assert_trees_all_close(cached, full, atol=1e-5)
  prompt = tokens[:1, :6]
  generated = inference.generate(params, prompt,
                                 model=Transformer(mc, decode=True),
                                 max_new_tokens=8)
  np.testing.assert_array_equal(
      generated, _greedy_by_full_passes(Transformer(mc), params, prompt, 8))


@pytest.mark.slow
def test_the_layer_matches_an_independent_reference():
  """One layer's full pass against DeepSeek's formula written out with
  per-head keys and values and the repeat-free reference attention."""
  options = layer.Options(num_heads=N, num_kv_heads=N, head_dim=I,
                          layout=latent.MLA(**WIDTHS),
                          norm_scale_offset=0.0)  # DeepSeek's RMSNorm.
  D, T = 16, 9
  params = {name: jax.random.normal(jax.random.key(i), shape) * 0.3
            for i, (name, shape) in enumerate(
                options.param_shapes(D).items())}
  params['kv_norm'] = params['kv_norm'] + 1.0
  x = jax.random.normal(jax.random.key(9), (2, T, D))
  out, _, _ = layer.apply(options, params, x)
  # DeepSeek-V2's equations (9)-(19), head by head.
  ck = x @ params['kv_down']
  c = ck[..., :A]
  c = c / jnp.sqrt(jnp.mean(c * c, -1, keepdims=True) + 1e-6) * params[
      'kv_norm']
  k_rope = apply_rope(ck[..., A:][:, :, None], jnp.arange(T))
  q = jnp.einsum('BTD,DNH->BTNH', x, params['query'])
  q = jnp.concatenate([q[..., :I], apply_rope(q[..., I:], jnp.arange(T))], -1)
  key_up, value_up = params['kv_up'][..., :I], params['kv_up'][..., I:]
  k = jnp.concatenate([jnp.einsum('BTA,ANI->BTNI', c, key_up),
                       jnp.repeat(k_rope, N, 2)], -1)
  v = jnp.einsum('BTA,ANU->BTNU', c, value_up)
  logits = jnp.einsum('BTNH,BSNH->BNTS', q, k) / np.sqrt(I + Y)
  logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -jnp.inf)
  o = jnp.einsum('BNTS,BSNU->BTNU', jax.nn.softmax(logits, -1), v)
  expected = jnp.einsum('BTNU,NUD->BTD', o, params['out'])
  chex.assert_trees_all_close(out, expected, atol=1e-5)


@pytest.mark.slow
def test_linen_and_nnx_shells_compute_the_same_and_decode_alike():
  opts = dict(num_heads=N, num_kv_heads=N, head_dim=I,
              layout=latent.MLA(**WIDTHS, q_lora_rank=12))
  x = jax.random.normal(jax.random.key(0), (2, 7, 16))
  linen = Attention(**opts)
  params = linen.init(jax.random.key(1), x)['params']
  ours = attention_nnx.Attention.from_linen(linen, params)
  chex.assert_trees_all_close(ours(x), linen.apply({'params': params}, x),
                              atol=1e-6)
  ours.init_cache(2, 7)
  steps = [ours(x[:, :3])] + [ours(x[:, t:t + 1]) for t in range(3, 7)]
  chex.assert_trees_all_close(jnp.concatenate(steps, 1),
                              linen.apply({'params': params}, x), atol=1e-5)
  assert set(nnx.state(ours, nnx.Param)) == set(params)


def test_kv_bytes_per_token_is_the_latent_and_rope_key_per_layer():
  """(A + Y) x layers x 4 bytes (float32); the sharers of kv_share hold
  none; int8: a byte each and a float32 scale for the latent and the key;
  and what the decode cache holds."""
  for model, expected in (
      ({}, (A + Y) * 2 * 4),
      (dict(num_layers=4, kv_share=2), (A + Y) * 2 * 4),
      (dict(kv_cache_dtype='int8'), (A + Y + 2 * 4) * 2),
      (dict(kv_cache_dtype='bfloat16'), (A + Y) * 2 * 2)):
    mc = config_lib.model_config(_config(**model))
    assert model_lib.kv_bytes_per_token(mc) == expected, model
    cache = inference.empty_cache(Transformer(dataclasses.replace(
        mc, scan_layers=False), decode=True), batch=1)
    held = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(
        cache) if 'index' not in jax.tree_util.keystr(path))
    assert held == expected * mc.max_len


def test_flops_count_the_expanded_pass_and_the_absorbed_decode():
  mc = config_lib.model_config(_config(num_layers=1))
  D, F, V = mc.d_model, mc.mlp_dim, mc.vocab_size
  C = 8
  common = 2 * D * V + 3 * 2 * D * F + 2 * D * N * (I + Y) + 2 * D * (A + Y) + (
      2 * N * U * D)
  assert flops.forward_flops_per_token(mc, 2 * C - 1) == common + (
      2 * A * N * (I + U) + 2 * N * (I + Y) * C + 2 * N * U * C)
  assert flops.decode_flops_per_token(mc, C - 1) == common + (
      2 * N * I * A + 2 * N * A * U + 2 * N * (A + Y) * C + 2 * N * A * C)


def _expanding_attention(q_BTNI, q_BTNY, key_up, value_up, latent_ZSF,
                         rope_key_BSY, visible, *, scale, logits_soft_cap,
                         latent_scale_ZS=None, rope_key_scale_BS=None):
  """The control: decoding as MaxText and transformers' DeepseekV3 do,
  per-head K and V rebuilt from the cached latent(s) at every step."""
  del logits_soft_cap, latent_scale_ZS, rope_key_scale_BS
  B, (Z, S, F) = q_BTNI.shape[0], latent_ZSF.shape
  c_BSGF = latent_ZSF.reshape(B, Z // B, S, F).transpose(0, 2, 1, 3)
  k_BSNH, v_BSNU = latent.expand(key_up, value_up, c_BSGF, rope_key_BSY)
  q_BTNH = jnp.concatenate([q_BTNI, q_BTNY], -1)
  return reference.attention_repeated(q_BTNH, k_BSNH, v_BSNU, visible,
                                      scale=scale)


def _decode_step_hlo(mc, params) -> str:
  model, params = unroll_layers(Transformer(mc, decode=True), params)
  cache = inference.empty_cache(model, batch=2)
  step = jax.jit(lambda params, cache, token: model.apply(
      {'params': params, 'cache': cache}, token, mutable=['cache']))
  return step.lower(params, cache, jnp.zeros((2, 1), jnp.int32)).compile(
      ).as_text()


def _per_head_kv(text: str, B: int, S: int) -> set:
  """Arrays of per-head keys or values over the S cached positions: a shape
  holding S, N and a head's width, or the element count of one."""
  widths = (I, U, I + Y)
  counts = {B * S * N * w for w in widths}
  shapes = {tuple(int(d) for d in dims.split(',')) for dims in re.findall(
      r'\bf32\[([\d,]+)\]', text)}
  return {s for s in shapes if int(np.prod(s)) in counts or (
      S in s and N in s and set(widths) & set(s))}


@pytest.mark.slow
def test_the_decode_step_builds_no_per_head_keys_or_values(monkeypatch):
  """The compiled decode step of an MLA model holds no [.., S, N, I]- or
  [.., S, N, U]-like array, with the CPU kernel (where built) and by the
  pure-JAX path; the control, the JAX path expanding the cached latent
  into per-head K/V, is caught by the same check."""
  mc, params = _model(max_len=40)
  S = mc.max_len
  assert not _per_head_kv(_decode_step_hlo(mc, params), 2, S)
  with cpu_kernel.disabled():
    assert not _per_head_kv(_decode_step_hlo(mc, params), 2, S)
    monkeypatch.setattr(latent, 'absorbed_attention', _expanding_attention)
    assert _per_head_kv(_decode_step_hlo(mc, params), 2, S)


@pytest.mark.slow
def test_train_main_writes_the_latent_kv_bytes_per_token(tmp_path):
  config = _config()
  config.train.update(steps=2, eval_every=2, checkpoint_every=2, log_every=1,
                      warmup_steps=1)
  loop.train_and_evaluate(config, str(tmp_path))
  final = json.loads((tmp_path / 'final.json').read_text())
  assert final['kv_bytes_per_token'] == (A + Y) * 2 * 4
  assert np.isfinite(final['eval_loss'])


@pytest.mark.parametrize('fields, message', [
    (dict(num_kv_heads=2), "model.num_kv_heads=2 with attention='mla': .* "
     'set num_kv_heads=4'),
    (dict(qk_norm=True), "model.qk_norm=True with attention='mla': .*set "
     'qk_norm=False'),
    (dict(mla=dict(qk_rope_head_dim=0)),
     'model.mla.qk_rope_head_dim=0 with use_rope=True'),
    (dict(mla=dict(qk_rope_head_dim=3)),
     'model.mla.qk_rope_head_dim=3 with use_rope=True'),
    (dict(use_rope=False), 'model.mla.qk_rope_head_dim=4 with use_rope=False: '
     '.*set qk_rope_head_dim=0'),
    # Not MLA is model.attention's other names, not a zero rank.
    (dict(mla=dict(kv_lora_rank=0)),
     'model.mla.kv_lora_rank=0 must be an integer >= 1$'),
    (dict(mla=dict(kv_lora_rank=-2)),
     'model.mla.kv_lora_rank=-2 must be an integer >= 1$'),
    (dict(mla=dict(q_lora_rank=0)),
     'model.mla.q_lora_rank=0 must be an integer >= 1, or None'),
])
def test_bad_latent_options_are_refused_in_one_line(fields, message):
  config = tiny.get_config()
  config.model.update(attention='mla', num_kv_heads=N, mla=WIDTHS)
  config.model.update(**fields)
  with pytest.raises(UserError, match=message):
    config_lib.validate(config, batch_shards=1)


def test_latent_settings_under_another_layout_are_refused_in_one_line():
  """model.mla set while model.attention names another layout would be
  ignored; an unknown layout name is refused with the known ones."""
  config = tiny.get_config()
  config.model.update(mla=dict(kv_lora_rank=8))
  with pytest.raises(UserError, match=(
      r"^model\.mla\.kv_lora_rank=8 set, but model\.attention='gqa': another "
      r"layout's settings; set --config\.model\.attention=mla, or leave "
      r'model\.mla at its defaults$')):
    config_lib.validate(config, batch_shards=1)
  config = tiny.get_config()
  config.model.attention = 'latent'
  with pytest.raises(UserError, match=(
      r"^model\.attention='latent' is no layout; use one of 'gqa', 'mla', "
      r"'gta'")):
    config_lib.validate(config, batch_shards=1)


# --- Conversion into MLA (train.convert.to_mla, train.convert --to_mla) -------

@pytest.mark.parametrize('model, rope_dims', [
    (dict(use_rope=False), 0), (dict(use_rope=False, num_layers=4,
                                     kv_share=2), 0),
    ({}, 16)], ids=['nope_gqa', 'nope_gqa_cla2', 'rope_gqa_every_pair'])
def test_a_gqa_model_converted_at_full_rank_keeps_its_logits(model,
                                                             rope_dims):
  """The identity controls: a GQA model without RoPE at kv_lora_rank =
  2·K·H, or with RoPE keeping every pair (Y = K·H, the rest K·H), keeps
  every K/V direction (energy 1) and its logits within 1e-4; a lower rank
  moves them and keeps less energy."""
  config = tiny.get_config()  # K = 2, H = 8: 2·K·H = 32 = D.
  config.model.update(**model)
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=3))
  tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, mc.vocab_size)
  source = _full_pass(mc, params, tokens)
  scores = to_mla.calibration_scores(mc, params, tokens) if mc.use_rope else (
      None)
  full = 2 * mc.num_kv_heads * mc.head_dim - rope_dims
  converted, new_mc, energy = to_mla.convert_params(params, mc, full,
                                                    rope_dims, scores)
  assert new_mc.layout.kv_lora_rank == full
  assert not new_mc.layout.latent_norm
  assert model_lib.kv_bytes_per_token(new_mc) == model_lib.kv_bytes_per_token(
      mc)  # 2·K·H either way, at full rank.
  np.testing.assert_allclose([e for e in energy if e is not None], 1.0,
                             rtol=1e-9)
  assert (energy[1] is None) == ('kv_share' in model)
  logits = _full_pass(new_mc, converted, tokens)
  chex.assert_trees_all_close(logits, source, atol=1e-4)
  low, low_mc, low_energy = to_mla.convert_params(params, mc, full // 4,
                                                  rope_dims, scores)
  assert all(e < 1 for e in low_energy if e is not None)
  assert float(jnp.max(jnp.abs(_full_pass(low_mc, low, tokens)
                               - source))) > 1e-2


def test_partial_rope_keeps_each_kv_heads_highest_scoring_pairs():
  """MHA2MLA's 2-norm criterion: per KV head, the pairs of the largest
  mean ‖q_i‖ · ‖k_i‖; and the score of a pair is that product."""
  scores = np.array([[0.1, 0.9, 0.5, 0.2], [0.7, 0.1, 0.1, 0.8]])
  np.testing.assert_array_equal(to_mla.select_pairs(scores, 8),
                                [[1, 2], [0, 3]])
  q = np.zeros((3, 2, 4))
  k = np.zeros((3, 1, 4))
  q[:, 0, 0], q[:, 0, 2], q[:, 1, 1] = 3.0, 4.0, 1.0  # Pair 0: norm 5.
  k[:, 0, 0], k[:, 0, 1] = 2.0, 1.0
  np.testing.assert_allclose(to_mla.pair_scores(q, k), [[10.0, 1.0]])


@pytest.mark.parametrize('model, flags, message', [
    ({}, [8, 0], r'no --qk_rope_head_dim: the source uses RoPE, so '
     r'--qk_rope_head_dim, the RoPE dims kept, must be 2·r·K for r pairs per KV head '
     r'\(K=2\): a multiple of 4 from 4 to K·H = 16'),
    ({}, [8, 6], '--qk_rope_head_dim=6: the source uses RoPE'),
    (dict(use_rope=False), [8, 4], '--qk_rope_head_dim=4: the source has no '
     'RoPE'),
    (dict(use_rope=False), [33, 0], r'--kv_lora_rank=33: give 1 to 32, the '
     r'full rank: min\(d_model = 32, 2·K·H - --qk_rope_head_dim = 32 - 0\)'),
    ({}, [29, 4], r'--kv_lora_rank=29: give 1 to 28, the full rank: min\('
     r'd_model = 32, 2·K·H - --qk_rope_head_dim = 32 - 4\), the key and '
     'value features left to the latent'),
    (dict(use_rope=False, qk_norm=True), [8, 0],
     'the source has model.qk_norm=True'),
])
def test_to_mla_refuses_what_it_cannot_convert_in_one_line(model, flags,
                                                           message):
  config = tiny.get_config()
  config.model.update(**model)
  mc = config_lib.model_config(config)
  with pytest.raises(UserError, match=message):
    to_mla.check_source(mc, *flags)


@pytest.mark.slow  # A subprocess: 2-5 s.
def test_to_mla_refuses_the_flags_it_does_not_use_in_one_line(tmp_path):
  """--num_kv_heads, --method, --seed, --optimizer, --param_dtype belong to
  a GQA conversion or an import: given with --to_mla they would be ignored,
  so they are refused before anything is read."""
  result = _run('train.convert', f'--source={tmp_path / "src"}',
                f'--workdir={tmp_path / "new"}', '--to_mla',
                '--kv_lora_rank=8', '--num_kv_heads=1', '--method=mean',
                '--optimizer=pooled')
  _one_line_error(result, '--to_mla takes no --num_kv_heads, --method, '
                  "--optimizer (a GQA conversion's or an import's); leave "
                  'them out')
  assert not (tmp_path / 'new').exists()


def test_an_unknown_config_names_every_kind_of_config_taken():
  with pytest.raises(UserError, match=r"unknown config 'nope'; known: .* \(or "
                     r'a path to a .py or .json file, or a workdir\)'):
    config_lib.resolve(['--config=nope'])


@pytest.mark.slowest
@pytest.mark.slow
def test_a_reduced_rank_conversion_of_a_trained_model_trains_and_samples(
    trained, tmp_path):
  """train.convert --to_mla on the trained tiny GQA workdir (RoPE), keeping
  one RoPE pair per KV head and a 16-wide latent: convert.json records the
  pairs kept, the energy kept per layer and the held-out loss before
  uptraining; the workdir trains on with
  its recipe and decodes with train.sample."""
  target = tmp_path / 'mla'
  result = _run('train.convert', f'--source={trained}', f'--workdir={target}',
                '--to_mla', '--kv_lora_rank=16', '--qk_rope_head_dim=4')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'before uptraining' in result.stdout
  info = json.loads((target / 'convert.json').read_text())
  assert len(info['energy_kept']) == 2
  assert all(0 < e < 1 for e in info['energy_kept'])
  assert len(info['rope_pairs']) == 2 and info['calibration']
  assert info['kv_bytes_per_token'] == (16 + 4) * 2 * 4
  assert info['source_kv_bytes_per_token'] == 2 * 2 * 8 * 2 * 4
  # The source's loss is its own run's (the same evaluator); the converted
  # model's is another, finite (on this undertrained source, measured: 3.3163
  # -> 3.3127, no worse).
  source_final = json.loads((trained / 'final.json').read_text())
  assert info['source_eval_loss'] == pytest.approx(source_final['eval_loss'],
                                                   abs=1e-4)
  assert np.isfinite(info['eval_loss_before_uptraining'])
  assert info['eval_loss_before_uptraining'] != info['source_eval_loss']
  uptrain = config_lib.load(str(target))
  assert uptrain.model.attention == 'mla'
  assert uptrain.model.mla.kv_lora_rank == 16
  assert list(uptrain.model.mla.rope_pairs) == info['rope_pairs']
  uptrain.train.update(steps=6, eval_every=6, checkpoint_every=6,
                       warmup_steps=1)
  record = loop.train_and_evaluate(uptrain, str(target))
  assert np.isfinite(record['eval_loss'])
  result = _sample(target, '--prompt=def ', '--max_new_tokens=8',
                   '--temperature=0')
  assert result.returncode == 0, result.stderr.decode()[-3000:]


# --- Accelerators ---------------------------------------------------------

@pytest.mark.slow
def test_the_mla_train_and_decode_steps_lower_for_tpu_and_cuda():
  """jax.export lowers a bfloat16 MLA model's train step and decode step
  (int8 latent too) for TPU and CUDA on this host; for TPU the decode step
  transposes, broadcasts, copies or converts nothing of the latent cache's
  size: its operands are read in place. (JAX's CUDA lowering converts an
  int8 operand of a mixed-dtype matmul to float32, as for K/V caches.)"""
  config = _config(mla=dict(q_lora_rank=12), dtype='bfloat16',
                   param_dtype='bfloat16', max_len=1024)
  config.data.seq_len = 128
  mc = config_lib.model_config(config)
  model = Transformer(mc)
  tx, _ = loop.make_optimizer(config.train)
  state = jax.eval_shape(lambda: loop.init_state(model, tx, 0))
  tokens = jax.ShapeDtypeStruct((4, config.data.seq_len + 1), jnp.int32)
  step = lambda s, b: loop.train_step(s, b, model=model, tx=tx,
                                      accum_steps=1)
  for platform in ('tpu', 'cuda'):
    assert 'dot_general' in hlo.lowered(step, state, tokens,
                                        platform=platform)
  batch = 4
  for kv_cache_dtype in (None, 'int8'):
    mc_ = dataclasses.replace(mc, kv_cache_dtype=kv_cache_dtype)
    decoder, params = unroll_layers(
        Transformer(mc_, decode=True),
        nn.unbox(loop.init_params(Transformer(mc_), 0)))
    cache = inference.empty_cache(decoder, batch)
    decode = lambda params, cache, token: decoder.apply(
        {'params': params, 'cache': cache}, token, mutable=['cache'])
    token = jnp.zeros((batch, 1), jnp.int32)
    assert 'dot_general' in hlo.lowered(decode, params, cache, token,
                                        platform='cuda')
    text = hlo.lowered(decode, params, cache, token, platform='tpu')
    assert not hlo.big_shapes(text, batch * mc.max_len * A)
  # The control: a converted (dequantized) copy of the latent is caught.
  assert hlo.big_shapes(hlo.lowered(
      lambda c: c.astype(jnp.bfloat16) * 2,
      jnp.zeros((batch, mc.max_len, A), jnp.int8), platform='tpu'),
                        batch * mc.max_len * A)
