"""Specification of the KV-memory options: local/global layer patterns (a
local layer caches its window only, as a ring buffer), K/V shared across
layers, and bfloat16/int8 caches; each decodes as the full pass does."""

import json

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from tests.test_sample import _greedy_by_full_passes, _sample
from lm import config_lib
from lm import inference
from train import convert, loop
from train.convert import hf
from lm import model as model_lib
from infra.errors import UserError
from lm.model import Transformer, unroll_layers

WINDOW = 5
# (attention_pattern, local_window, kv_share, scan_layers).
LAYOUTS = {
    'global': ('G', None, 1, True),
    'all_local': ('L', WINDOW, 1, True),
    'gemma2_LG': ('LG', WINDOW, 1, True),
    'gemma3_LLLG_unscanned': ('LLLG', WINDOW, 1, False),
    'cla2': ('G', None, 2, True),
    'cla2_local_pairs': ('LLGG', WINDOW, 2, True),
    'cla2_local_pairs_unscanned': ('LLGG', WINDOW, 2, False),
    'gemma3_conventions': ('LG', WINDOW, 1, True),
}
# Gemma 2/3's settings (train.convert.hf's imports): post-norms, QK-norm, a
# query scale, both soft caps (low enough to bend the logits), a local RoPE
# base.
CONVENTIONS = {'gemma3_conventions': dict(
    post_norms=True, qk_norm=True, query_pre_attn_scalar=24.0,
    logits_soft_cap=2.0, final_logits_soft_cap=3.0, local_rope_base=100.0)}


def _config(layout, num_layers=4, kv_cache_dtype=None, **model):
  pattern, window, share, scan = LAYOUTS[layout]
  config = tiny.get_config()
  config.model.update(num_layers=num_layers, attention_pattern=pattern,
                      local_window=window, kv_share=share, scan_layers=scan,
                      kv_cache_dtype=kv_cache_dtype,
                      **{**CONVENTIONS.get(layout, {}), **model})
  config_lib.validate(config, batch_shards=1)
  return config


# Both compiled (one program per chunk length), as users run them: the
# model's operations dispatched one at a time cost several times the CPU.
def _full_pass(mc, params, tokens_BT):
  """[B, T, V] logits of the model without a cache."""
  return jax.jit(Transformer(mc).apply)({'params': params}, tokens_BT)


def _decode_in_chunks(mc, params, tokens_BT, chunks):
  """Logits of feeding tokens_BT through the cache, `chunks` at a time."""
  model, params = unroll_layers(Transformer(mc, decode=True), params)
  cache = inference.empty_cache(model, tokens_BT.shape[0])
  step = jax.jit(lambda params, cache, tokens: model.apply(
      {'params': params, 'cache': cache}, tokens, mutable=['cache']))
  outs, start = [], 0
  for n in chunks:
    logits, mutated = step(params, cache, tokens_BT[:, start:start + n])
    cache, start = mutated['cache'], start + n
    outs.append(logits)
  return jnp.concatenate(outs, axis=1), cache


# One layout covers the ring buffers, sharing and scanned groups in the
# quick check (-m "not slow"); the rest run with the slow tests.
FAST = ('cla2_local_pairs',)


@pytest.mark.parametrize('layout', [
    layout if layout in FAST else pytest.param(layout, marks=pytest.mark.slow)
    for layout in LAYOUTS])
def test_cached_decoding_equals_the_full_pass(layout):
  """Logits at every position, fed in chunks that wrap the local layers'
  ring buffers (a 7-token prefill past the 5-token window, single tokens,
  then chunks of 6 and 4), and greedy generation, equal the full pass."""
  mc = config_lib.model_config(_config(layout))
  params = nn.unbox(loop.init_params(Transformer(mc), seed=1))
  tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, mc.vocab_size)
  full = _full_pass(mc, params, tokens)
  cached, _ = _decode_in_chunks(mc, params, tokens, [7, 1, 1, 6, 1, 4])
  chex.assert_trees_all_close(cached, full, atol=1e-5)

  prompt = tokens[:, :6]
  generated = inference.generate(params, prompt,
                                 model=Transformer(mc, decode=True),
                                 max_new_tokens=12)
  np.testing.assert_array_equal(
      generated, _greedy_by_full_passes(Transformer(mc), params, prompt, 12))


@pytest.mark.slow
@pytest.mark.parametrize('kv_cache_dtype, tolerance', [
    ('bfloat16', 0.005), ('int8', 0.01)])
def test_low_precision_caches_decode_within_a_stated_tolerance(
    kv_cache_dtype, tolerance):
  """bfloat16 and int8 caches (float32 model) change the logits by less
  than `tolerance` x their spread (max |error| / std of the logits; measured
  here: bfloat16 0.0014, int8 0.0028, every greedy prediction kept), and
  leave at least 95% of the greedy predictions where they were."""
  config = _config('gemma2_LG', kv_cache_dtype=kv_cache_dtype)
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=1))
  tokens = jax.random.randint(jax.random.key(2), (4, 32), 0, mc.vocab_size)
  full = _full_pass(mc, params, tokens)
  cached, cache = _decode_in_chunks(mc, params, tokens, [8] + [1] * 24)
  stored = cache['layers_0']['attention']['cached_key'].dtype
  assert stored == jnp.dtype(kv_cache_dtype)
  error = float(jnp.max(jnp.abs(cached - full)) / jnp.std(full))
  assert 0 < error < tolerance
  agree = float(jnp.mean(cached.argmax(-1) == full.argmax(-1)))
  assert agree >= 0.95


@pytest.mark.parametrize('layout, kv_cache_dtype', [
    ('global', None), ('all_local', None), ('gemma2_LG', None),
    ('cla2', None), ('cla2_local_pairs', 'int8'), ('global', 'bfloat16')])
def test_kv_bytes_per_token_is_what_the_decode_cache_holds(layout,
                                                           kv_cache_dtype):
  mc = config_lib.model_config(_config(layout, kv_cache_dtype=kv_cache_dtype))
  model, _ = unroll_layers(Transformer(mc, decode=True),
                           nn.unbox(loop.init_params(Transformer(mc), 0)))
  cache = inference.empty_cache(model, batch=1)
  held = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(
      cache) if 'index' not in jax.tree_util.keystr(path))
  assert model_lib.kv_bytes_per_token(mc) == held / mc.max_len


def test_kv_bytes_per_token_by_formula():
  """max_len M = 32, window w = 5, 4 layers, K = 2, H = 8, float32: a
  global layer holds 2·K·H·4 = 128 B per token of context."""
  per_layer = 2 * 2 * 8 * 4
  bytes_of = lambda layout, **kw: model_lib.kv_bytes_per_token(
      config_lib.model_config(_config(layout, **kw)))
  assert bytes_of('global') == 4 * per_layer
  assert bytes_of('all_local') == 4 * per_layer * WINDOW / 32
  assert bytes_of('gemma2_LG') == 2 * per_layer * (1 + WINDOW / 32)
  assert bytes_of('cla2') == 2 * per_layer
  assert bytes_of('global', kv_cache_dtype='bfloat16') == 2 * per_layer
  # int8: a byte per feature and a float32 scale per token, head, K and V.
  assert bytes_of('global', kv_cache_dtype='int8') == 4 * 2 * 2 * (8 + 4)


@pytest.mark.slow
def test_gemma_conventions_train_and_their_loss_falls(tmp_path):
  config = _config('gemma3_conventions', num_layers=2)
  config.train.update(steps=40)
  record = loop.train_and_evaluate(config, str(tmp_path))
  losses = [json.loads(line)['loss'] for line in
            (tmp_path / 'metrics.jsonl').read_text().splitlines()
            if '"loss"' in line]
  assert losses[-1] < losses[0] - 1.0
  assert record['eval_loss'] < np.log(256) - 1.0


@pytest.mark.slow
def test_train_main_writes_kv_bytes_per_token(tmp_path):
  config = _config('cla2_local_pairs', kv_cache_dtype='int8')
  config.train.update(steps=2, eval_every=2, checkpoint_every=2, log_every=1,
                      warmup_steps=1)
  record = loop.train_and_evaluate(config, str(tmp_path))
  final = json.loads((tmp_path / 'final.json').read_text())
  mc = config_lib.model_config(config)
  assert final['kv_bytes_per_token'] == model_lib.kv_bytes_per_token(mc)
  assert record['kv_bytes_per_token'] == final['kv_bytes_per_token']
  assert np.isfinite(final['eval_loss'])


@pytest.mark.slow
def test_sample_decodes_with_an_int8_cache_on_request(tmp_path):
  """train.sample --kv_cache_dtype=int8 on a float32 workdir; a bad value is
  one line."""
  config = _config('gemma2_LG')
  config.train.update(steps=4, eval_every=4, checkpoint_every=4)
  loop.train_and_evaluate(config, str(tmp_path))
  result = _sample(tmp_path, '--prompt=def ', '--max_new_tokens=8',
                   '--temperature=0', '--kv_cache_dtype=int8')
  assert result.returncode == 0, result.stderr.decode()
  assert b'tokens/s' in result.stderr
  result = _sample(tmp_path, '--kv_cache_dtype=int4')
  assert result.returncode == 1
  assert result.stderr.decode().strip().splitlines() == [
      "error: --kv_cache_dtype='int4'; use one of float32, bfloat16, int8"]


@pytest.mark.parametrize('fields, message', [
    (dict(attention_pattern='GX'), "attention_pattern='GX' must be a string "
     'of G'),
    (dict(attention_pattern='LG'), r'local \(L\) layers need a window'),
    (dict(local_window=8), 'a window needs L layers'),
    (dict(kv_share=3), 'kv_share=3 does not divide model.num_layers=4'),
    (dict(attention_pattern='LG', local_window=8, kv_share=2),
     "layers sharing a cache must be all local or all global \\(e.g. "
     "attention_pattern='LLGG'\\)"),
    (dict(attention_pattern='LLG', local_window=8),
     'num_layers=4 is not a multiple of 3.*scan_layers=False'),
    (dict(kv_cache_dtype='int4'), "kv_cache_dtype='int4'; use one of None, "
     "'float32', 'bfloat16', 'int8'"),
    (dict(local_rope_base=1e4), 'model.local_rope_base=10000.0 applies to '
     "local \\(L\\) layers, but attention_pattern='G' has none"),
    (dict(final_logits_soft_cap=0.0),
     'model.final_logits_soft_cap=0.0 must be a number > 0 \\(or None\\)'),
    (dict(query_pre_attn_scalar=-1.0),
     'model.query_pre_attn_scalar=-1.0 must be a number > 0'),
])
def test_bad_kv_memory_options_are_refused_in_one_line(fields, message):
  config = tiny.get_config()
  config.model.update(num_layers=4, **fields)
  with pytest.raises(UserError, match=message):
    config_lib.validate(config, batch_shards=1)


def test_a_workdir_written_when_a_window_meant_every_layer_loads_as_all_local(
    tmp_path):
  config = tiny.get_config()
  config.model.local_window = 8
  saved = json.loads(config.to_json())
  del saved['model']['attention_pattern']
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  loaded = config_lib.load(str(tmp_path))
  assert loaded.model.attention_pattern == 'L'
  config_lib.validate(loaded, batch_shards=1)


@pytest.mark.slow
def test_pooling_kv_heads_converts_every_layer_that_owns_k_and_v():
  """MHA -> MQA on local/global pairs sharing K/V: the owners' K/V are
  pooled, the sharers have none, and the converted model runs."""
  mc = config_lib.model_config(_config('cla2_local_pairs', num_kv_heads=4))
  params = nn.unbox(loop.init_params(Transformer(mc), seed=0))
  converted, new_mc = convert.convert_params(params, mc, 1, 'mean')
  layers = converted['layers']
  for j, owner in enumerate([True, False, True, False]):
    attention = layers[f'block_{j}']['attention']
    assert ('key' in attention) == owner
    if owner:
      chex.assert_shape(attention['key'], (1, mc.d_model, 1, mc.head_dim))
      np.testing.assert_allclose(
          attention['key'],
          params['layers'][f'block_{j}']['attention']['key'].mean(
              2, keepdims=True), rtol=1e-6)
  logits = Transformer(new_mc).apply({'params': converted},
                                     jnp.zeros((1, 8), jnp.int32))
  assert np.all(np.isfinite(logits))


def test_hugging_face_export_takes_local_layers_but_not_shared_kv():
  """Mixed local/global layers export as Gemma 2/3 (with their post-norms)
  or Ministral; Gemma 1 has no window, and no HF family shares K/V."""
  assert hf.family_of(config_lib.model_config(_config(
      'gemma2_LG', post_norms=True))) == 'gemma2'
  gemma3 = config_lib.model_config(_config('gemma3_conventions',
                                           logits_soft_cap=None))
  assert hf.family_of(gemma3) == 'gemma3_text'
  llama = dict(mlp_activation='silu', norm_scale_offset=0.0,
               embed_scale=False, tied_logits_scale=False)
  assert hf.family_of(config_lib.model_config(_config(
      'gemma2_LG', **llama))) == 'ministral'
  for layout, named in (('gemma2_LG', 'model.local_window in a gemma model'),
                        ('cla2', 'kv_share=2')):
    mc = config_lib.model_config(_config(layout))
    with pytest.raises(UserError, match=named):
      hf.family_of(mc)
