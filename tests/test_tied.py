"""Specification of grouped-tied attention (GTA, `attention.tied`): the full
pass equals per-query-head keys and values assembled by hand; cached
decoding equals the full pass for the variants beyond tests/test_layouts.py's
GTA at its defaults (MHA and MQA, no RoPE, a soft cap, an int8 MQA cache,
local layers sharing K/V, a paged pool serving requests side by side); the
cache holds (K·H + Y) / (2·K·H) of grouped-query attention's bytes; the
decode step reads the cache in place on TPU, and on the CPU runs the tied
kernel (tests/test_cpu_kernel.py holds it to the einsum path); bad options
and conversions are one line; train.convert --to_gta ties an MHA/GQA
model."""

import dataclasses
import fractions
import json

import chex
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import Attention, cpu_kernel, kv_cache, layer, tied
from attention import nnx as attention_nnx
from attention.rope import apply_rope
from configs import tiny
from serve import engine
from tests import hlo, reference
from tests.test_faults import _one_line_error, _run
from tests.test_kv_memory import _decode_in_chunks, _full_pass
from tests.test_serve import _alone
from lm import config_lib, flops
from lm import inference
from train import convert, loop
from train.convert import hf, to_gta, to_mla
from lm import model as model_lib
from infra.errors import UserError
from lm.model import Transformer, unroll_layers

# N query heads of H features from D-wide inputs; Y the default RoPE key.
N, H, D = 8, 8, 16
Y = H // 2


def _options(K, **fields):
  """A GTA layer's options: K tied heads, GTA's default RoPE key."""
  return layer.Options(num_heads=N, num_kv_heads=K, head_dim=H,
                       layout=tied.GTA(), **fields)


def _params(options, seed=0):
  return {name: jax.random.normal(jax.random.key(seed + i), shape) * 0.4
          for i, (name, shape) in enumerate(options.param_shapes(D).items())}


def _by_hand(params, x_BTD, K, rope: bool, local_window=None):
  """The layer written out head by head: every query head's key and value
  assembled from its KV head's tied state (jnp.repeat) and the one RoPE
  key, then the repeat-free reference attention."""
  B, T, _ = x_BTD.shape
  G, Y_ = N // K, (Y if rope else 0)
  I = H - Y_
  t = jnp.einsum('BTD,DKH->BTKH', x_BTD, params['kv'])
  q = jnp.einsum('BTD,DNH->BTNH', x_BTD, params['query'])
  k = v = jnp.repeat(t, G, axis=2)
  if rope:
    r = apply_rope((x_BTD @ params['rope_key'])[:, :, None], jnp.arange(T))
    q = jnp.concatenate([q[..., :I], apply_rope(q[..., I:], jnp.arange(T))],
                        -1)
    k = jnp.concatenate([k[..., :I], jnp.repeat(r, N, axis=2)], -1)
  allowed = reference.allowed_positions(B, N, T, T, is_causal=True,
                                        local_window=local_window)
  o = reference.attention_repeated(q, k, v, allowed, scale=H ** -0.5)
  return jnp.einsum('BTNH,NHD->BTD', o, params['out'])


@pytest.mark.parametrize('rope', [True, False], ids=['rope', 'nope'])
@pytest.mark.parametrize('K', [8, 2, 1])
def test_the_full_pass_and_its_gradients_equal_keys_built_per_query_head(
    K, rope):
  options = _options(K, use_rope=rope)
  params = _params(options)
  assert set(params) == {'query', 'kv', 'out'} | ({'rope_key'} if rope
                                                  else set())
  x = jax.random.normal(jax.random.key(9), (2, 7, D))
  out, _, kv = layer.apply(options, params, x)
  chex.assert_shape(out, (2, 7, D))
  chex.assert_shape(kv.key, (2, 7, K, H))  # Tied states, one per KV head.
  chex.assert_trees_all_close(out, _by_hand(params, x, K, rope), atol=1e-5)
  cotangent = jax.random.normal(jax.random.key(3), out.shape)
  grads = [jax.grad(lambda p, f=f: jnp.sum(f(p) * cotangent))(params)
           for f in (lambda p: layer.apply(options, p, x)[0],
                     lambda p: _by_hand(p, x, K, rope))]
  chex.assert_trees_all_close(*grads, atol=1e-4)


def _decode(module, params, x, chunks):
  """[B, T, D]: x fed through the module's cache `chunks` at a time."""
  variables = module.init(jax.random.key(0), x)  # The [B, max_len] cache.
  cache, outs, start = variables['cache'], [], 0
  for n in chunks:
    out, mutated = module.apply({'params': params, 'cache': cache},
                                x[:, start:start + n], mutable=['cache'])
    cache, start = mutated['cache'], start + n
    outs.append(out)
  return jnp.concatenate(outs, axis=1), cache


# GQA-like K = 2 with RoPE, global and local, is test_layouts' GTA.
@pytest.mark.parametrize('K, fields', [
    (8, {}), (1, {}), (2, dict(use_rope=False)),
    (1, dict(local_window=3, logits_soft_cap=2.0))],
    ids=['mha', 'mqa', 'gqa_nope', 'mqa_ring_softcap'])
def test_cached_decoding_equals_the_full_pass(K, fields):
  """A 4-token prefill (past a 3-slot ring buffer's end), then one token at
  a time, against the full pass; the cache holds tied states of K heads
  and one RoPE key, nothing per query head."""
  options = _options(K, **fields)
  params = _params(options)
  x = jax.random.normal(jax.random.key(5), (2, 9, D))
  full = layer.apply(options, params, x)[0]
  cached, cache = _decode(Attention.from_options(options, decode=True),
                          params, x, [4, 1, 1, 1, 1, 1])
  chex.assert_trees_all_close(cached, full, atol=1e-5)
  S = options.cache_length(9)
  chex.assert_shape(cache['cached_tied'], (2 * K, S, H))
  assert ('cached_rope_key' in cache) == options.use_rope
  if options.use_rope:
    chex.assert_shape(cache['cached_rope_key'], (2, S, Y))


def test_an_int8_mqa_cache_decodes_within_a_stated_tolerance():
  """int8 tied states and RoPE keys (a float32 scale per token and head) of
  one tied head move the outputs by less than 5% of their spread (max
  |error| / std; measured on three inputs 1.2-2.8%, and 1.4-2.8% for a
  grouped-query layer's int8 cache of the same K: these small random layers
  move that much under int8). K = 2 is test_layouts' GTA."""
  K = 1
  options = _options(K, kv_cache_dtype='int8')
  params = _params(options)
  x = jax.random.normal(jax.random.key(5), (2, 9, D))
  full = layer.apply(options, params, x)[0]
  cached, cache = _decode(Attention.from_options(options, decode=True),
                          params, x, [4, 1, 1, 1, 1, 1])
  assert cache['cached_tied'].dtype == jnp.int8
  chex.assert_shape(cache['tied_scale'], (2 * K, 9))
  chex.assert_shape(cache['rope_key_scale'], (2, 9))
  error = float(jnp.max(jnp.abs(cached - full)) / jnp.std(full))
  assert 0 < error < 0.05, error


def _config(**model):
  config = tiny.get_config()  # N = 4, K = 2, H = 8, 2 layers.
  config.model.update(**{'attention': 'gta', **model})
  config_lib.validate(config, batch_shards=1)
  return config


def _model(seed=1, **model):
  mc = config_lib.model_config(_config(**model))
  return mc, nn.unbox(loop.init_params(Transformer(mc), seed=seed))


@pytest.mark.slow
def test_a_model_with_local_layers_and_shared_kv_decodes_as_its_full_pass():
  """Gemma 2's LG pattern (ring buffers of 5) with pairs of layers sharing
  one tied cache (kv_share=2), fed in chunks that wrap the rings."""
  mc, params = _model(num_layers=4, attention_pattern='LLGG', local_window=5,
                      kv_share=2)
  tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, mc.vocab_size)
  cached, cache = _decode_in_chunks(mc, params, tokens, [7, 1, 1, 6, 1, 4])
  chex.assert_trees_all_close(cached, _full_pass(mc, params, tokens),
                              atol=1e-5)
  assert set(cache) == {'layers_0', 'layers_2'}  # The owners only.
  assert 'kv' not in params['layers']['block_1']['attention']


@pytest.mark.slow
def test_linen_and_nnx_shells_compute_the_same_and_decode_alike():
  x = jax.random.normal(jax.random.key(0), (2, 7, D))
  linen = Attention(num_heads=N, num_kv_heads=2, head_dim=H,
                    layout=tied.GTA())
  params = linen.init(jax.random.key(1), x)['params']
  ours = attention_nnx.Attention.from_linen(linen, params)
  full = linen.apply({'params': params}, x)
  chex.assert_trees_all_close(ours(x), full, atol=1e-6)
  ours.init_cache(2, 7)
  steps = [ours(x[:, :3])] + [ours(x[:, t:t + 1]) for t in range(3, 7)]
  chex.assert_trees_all_close(jnp.concatenate(steps, 1), full, atol=1e-5)
  assert set(nnx.state(ours, nnx.Param)) == set(params)
  assert ours.cached_tied is not None and not hasattr(ours, 'cached_key')


@pytest.mark.slow
def test_gta_is_served_from_a_paged_tied_cache():
  """The serving engine (paged pool, chunked prefill beside decoding) gives
  each request the tokens of decoding it alone from a dense cache, for one
  int8 tied head (K = 2 in float32: test_layouts' paged pool and serving
  of GTA)."""
  mc, params = _model(num_kv_heads=1, kv_cache_dtype='int8')
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=4, slots=2,
                         prefill_chunk=4)
  requests = [engine.Request(0, np.arange(1, 12, dtype=np.int32) * 7, 10),
              engine.Request(1, np.array([5, 2], np.int32), 6)]
  results = {r.id: r.tokens for r in served.run(requests)}
  for r in requests:
    assert results[r.id] == _alone(mc, params, r.prompt, r.max_new_tokens)
  spec = kv_cache.paged_spec(mc.attention(0), 3, 4, jnp.float32)
  K = mc.num_kv_heads
  assert spec['cached_tied'].shape == (K, 3, 4, H)
  assert spec['cached_rope_key'].shape == (1, 3, 4, Y)


@pytest.mark.parametrize('rope', [True, False], ids=['rope', 'nope'])
@pytest.mark.parametrize('K', [8, 2, 1])
def test_the_cache_is_k_h_plus_y_over_2_k_h_of_gqas(K, rope):
  tied = _options(K, use_rope=rope)
  grouped = layer.Options(num_heads=N, num_kv_heads=K, head_dim=H,
                          use_rope=rope)
  ratio = fractions.Fraction(layer.kv_cache_bytes(tied, 3, 40, jnp.float32),
                             layer.kv_cache_bytes(grouped, 3, 40, jnp.float32))
  assert ratio == fractions.Fraction(K * H + (Y if rope else 0), 2 * K * H)


def test_kv_bytes_per_token_is_the_tied_states_and_rope_key_per_layer():
  """(K·H + Y) x layers x 4 bytes (float32); int8 a byte each and a float32
  scale per tied head and for the key; what the decode cache holds."""
  K = 2
  for model, expected in (
      ({}, (K * H + Y) * 2 * 4),
      (dict(use_rope=False), K * H * 2 * 4),
      (dict(num_layers=4, kv_share=2), (K * H + Y) * 2 * 4),
      (dict(kv_cache_dtype='int8'), (K * H + Y + (K + 1) * 4) * 2)):
    mc = config_lib.model_config(_config(**model))
    assert model_lib.kv_bytes_per_token(mc) == expected, model
    cache = inference.empty_cache(Transformer(dataclasses.replace(
        mc, scan_layers=False), decode=True), batch=1)
    held = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(
        cache) if 'index' not in jax.tree_util.keystr(path))
    assert held == expected * mc.max_len


def test_flops_count_the_tied_projection_once():
  mc = config_lib.model_config(_config(num_layers=1))
  Dm, F, V, Nm, K = mc.d_model, mc.mlp_dim, mc.vocab_size, mc.num_heads, 2
  C = 8
  expected = (2 * Dm * V + 3 * 2 * Dm * F + 2 * Dm * Nm * H + 2 * Nm * H * Dm
              + 2 * Dm * (K * H + Y) + 2 * 2 * Nm * H * C)
  assert flops.forward_flops_per_token(mc, 2 * C - 1) == expected
  assert flops.decode_flops_per_token(mc, C - 1) == expected


@pytest.mark.parametrize('fields, gta, message', [
    (dict(fused_qkv=True), {}, "fused_qkv=True with attention='gta': .*set "
     'fused_qkv=False'),
    (dict(qkv_bias=True), {}, "qkv_bias=True with attention='gta': .*set "
     'qkv_bias=False'),
    (dict(qk_norm=True), {}, "qk_norm=True with attention='gta': .*set "
     'qk_norm=False'),
    ({}, dict(qk_rope_head_dim=3), r'gta\.qk_rope_head_dim=3 with '
     r'use_rope=True: .*even .*; set it \(None: head_dim / 2 = 4\)'),
    ({}, dict(qk_rope_head_dim=8), r'gta\.qk_rope_head_dim=8 with '
     'use_rope=True'),
    ({}, dict(qk_rope_head_dim=0), r'gta\.qk_rope_head_dim=0 with '
     'use_rope=True'),
    (dict(use_rope=False), dict(qk_rope_head_dim=4), r'gta\.qk_rope_head_dim=4 '
     'with use_rope=False: .*set qk_rope_head_dim=0'),
    ({}, dict(rope_pairs=(0,)), r'gta\.rope_pairs=\[0\] must list '
     'qk_rope_head_dim / 2 = 2 frequency indices'),
    # The layer's type check (the config's field is an int: ml_collections
    # refuses a string there).
    ({}, dict(qk_rope_head_dim='4'), r"gta\.qk_rope_head_dim='4' must be an "
     'integer$'),
])
def test_bad_options_are_refused_in_one_line_naming_the_fix(fields, gta,
                                                            message):
  with pytest.raises(ValueError, match=message):
    layer.Options(num_heads=N, num_kv_heads=2, head_dim=H,
                  layout=tied.GTA(**gta), **fields)
  if isinstance(gta.get('qk_rope_head_dim'), str):
    return
  config = tiny.get_config()
  config.model.update(attention='gta', **fields, gta={
      k: list(v) if isinstance(v, tuple) else v for k, v in gta.items()})
  with pytest.raises(UserError, match=f'^model\\.{message}'):
    config_lib.validate(config, batch_shards=1)


@pytest.mark.parametrize('mla', [
    dict(kv_lora_rank=8), dict(q_lora_rank=4), dict(latent_groups=2)])
def test_latent_settings_with_gta_are_refused_in_one_line(mla):
  """MLA's settings under model.attention='gta' would be ignored (before
  named layouts, tie_kv with MLA fields: the same mistake)."""
  config = tiny.get_config()
  config.model.update(attention='gta', mla=mla)
  (name, value), = mla.items()
  with pytest.raises(UserError, match=(
      rf"^model\.mla\.{name}={value} set, but model\.attention='gta': "
      r"another layout's settings; set --config\.model\.attention=mla, or "
      r'leave model\.mla at its defaults$')):
    config_lib.validate(config, batch_shards=1)


def test_the_cpu_kernel_takes_a_tied_cache(monkeypatch):
  """(The TPU's paged kernel is grouped-query attention's alone: a tied
  layer never asks it, tests/test_paged_attention.py.)"""
  monkeypatch.setenv(cpu_kernel.ENV, 'auto')  # Whatever the suite runs with.
  options = _options(2)
  if not cpu_kernel.available():
    pytest.skip('the CPU kernel is not built')
  kv = layer.KV(jnp.zeros((4, 5, H)), jnp.zeros((2, 5, Y)),
                positions_S=jnp.arange(5))
  assert cpu_kernel.refusal(options, kv, jnp.ones((1, 1, 1, 5), bool)) is None
  assert 'differs between heads' in cpu_kernel.refusal(
      options, kv, jnp.ones((1, N, 1, 5), bool))


@pytest.mark.slow
@pytest.mark.parametrize('model', [
    dict(num_kv_heads=2), dict(num_kv_heads=1, use_rope=False,
                               kv_cache_dtype='int8')],
    ids=['gqa', 'mqa_nope_int8'])
def test_the_decode_step_on_the_cpu_is_the_kernel_and_agrees_with_jax(
    model, monkeypatch):
  """A GTA model's decode step compiled for this CPU holds the tied kernel's
  custom call (`attention.cpu_kernel`), each step's logits those of the
  pure-JAX path; the control: with the kernel off, the step holds none."""
  monkeypatch.setenv(cpu_kernel.ENV, 'auto')  # Whatever the suite runs with.
  if not cpu_kernel.available():
    pytest.skip('the CPU kernel is not built')
  mc, params = _model(**model)
  decoder = Transformer(mc, decode=True)
  tokens = jax.random.randint(jax.random.key(2), (2, 4), 0, mc.vocab_size)

  def run():  # Traced here: the path the environment chooses now.
    step = jax.jit(lambda cache, token: decoder.apply(
        {'params': params, 'cache': cache}, token, mutable=['cache']))
    cache = inference.empty_cache(decoder, batch=2)
    text = step.lower(cache, tokens[:, :1]).compile().as_text()
    logits = []
    for t in range(tokens.shape[1]):
      out, mutated = step(cache, tokens[:, t:t + 1])
      cache = mutated['cache']
      logits.append(out)
    return text, jnp.concatenate(logits, axis=1)

  text, kernel_logits = run()
  assert cpu_kernel.DENSE_TIED_TARGET in text
  with cpu_kernel.disabled():
    text, jax_logits = run()
  assert cpu_kernel.DENSE_TIED_TARGET not in text  # The control.
  chex.assert_trees_all_close(kernel_logits, jax_logits, atol=1e-5)


@pytest.mark.slow
def test_the_decode_step_lowers_for_tpu_and_cuda_reading_the_cache_in_place():
  """jax.export lowers a bfloat16 GTA model's decode step (and with an int8
  cache) for TPU and CUDA on this host; for TPU nothing of the tied cache's
  size is transposed, broadcast, copied or converted. The control: a
  per-query-head copy of the tied cache is caught by the same check."""
  config = _config(dtype='bfloat16', param_dtype='bfloat16', max_len=1024,
                   num_heads=8, num_kv_heads=2)
  mc = config_lib.model_config(config)
  batch, K = 4, 2
  tied_size = batch * K * mc.max_len * H
  for kv_cache_dtype in (None, 'int8'):
    mc_ = dataclasses.replace(mc, kv_cache_dtype=kv_cache_dtype)
    decoder, params = unroll_layers(
        Transformer(mc_, decode=True),
        nn.unbox(loop.init_params(Transformer(mc_), 0)))
    cache = inference.empty_cache(decoder, batch)
    assert cache['layers_0']['attention']['cached_tied'].size == tied_size
    step = lambda params, cache, token, d=decoder: d.apply(
        {'params': params, 'cache': cache}, token, mutable=['cache'])
    token = jnp.zeros((batch, 1), jnp.int32)
    assert 'dot_general' in hlo.lowered(step, params, cache, token,
                                        platform='cuda')
    text = hlo.lowered(step, params, cache, token, platform='tpu')
    assert 'dot_general' in text
    assert not hlo.big_shapes(text, tied_size), kv_cache_dtype
  repeat = lambda c: jnp.repeat(c.reshape(batch, K, mc.max_len, H), 4, 1)
  assert hlo.big_shapes(hlo.lowered(
      repeat, jnp.zeros((batch * K, mc.max_len, H), jnp.bfloat16),
      platform='tpu'), tied_size)


@pytest.mark.slow
def test_train_main_writes_the_tied_kv_bytes_per_token(tmp_path):
  config = _config()
  config.train.update(steps=2, eval_every=2, checkpoint_every=2, log_every=1,
                      warmup_steps=1)
  loop.train_and_evaluate(config, str(tmp_path))
  final = json.loads((tmp_path / 'final.json').read_text())
  assert final['kv_bytes_per_token'] == (2 * H + Y) * 2 * 4  # 2 layers.
  assert np.isfinite(final['eval_loss'])


# --- Conversion into GTA (train.convert.to_gta, train.convert --to_gta) -------

def _source(seed=3, **model):
  config = tiny.get_config()
  config.model.update(**model)
  mc = config_lib.model_config(config)
  return mc, jax.tree.map(np.asarray, nn.unbox(
      loop.init_params(Transformer(mc), seed=seed)))


def _tied_by_construction(params, zero_pair=None):
  """params with every value kernel replaced by its key kernel (K/V already
  tied) and, given zero_pair, the queries' features at that RoPE pair
  zeroed (it carries no logit)."""
  def edit(tree):
    if not isinstance(tree, dict):
      return tree
    tree = {k: edit(v) for k, v in tree.items()}
    if 'query' in tree and 'out' in tree:
      if 'key' in tree:
        tree['value'] = tree['key'].copy()
      if zero_pair is not None:
        tree['query'] = tree['query'].copy()
        tree['query'][..., [zero_pair, zero_pair + H // 2]] = 0.0
    return tree
  return edit(params)


@pytest.mark.parametrize('model, rope_dims, zero_pair', [
    (dict(use_rope=False), 0, None),
    (dict(use_rope=False, num_layers=4, kv_share=2), 0, None),
    (dict(num_kv_heads=1), H - 2, 1)], ids=['nope', 'nope_cla2',
                                            'rope_mqa_one_pair_unused'])
def test_a_source_with_tied_kv_converts_exactly(model, rope_dims, zero_pair):
  """The identity controls: a source whose values equal its keys keeps its
  logits (1e-5) when it has no RoPE, or one KV head and queries that give
  the one pair left out no weight (the shared key is then its key, and the
  calibration scores leave that pair out). The same conversion of the
  untied source moves the logits."""
  mc, untied = _source(**model)
  params = _tied_by_construction(untied, zero_pair)
  tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, mc.vocab_size)
  scores = (to_mla.calibration_scores(mc, params, tokens) if mc.use_rope
            else None)
  converted, new_mc = to_gta.convert_params(params, mc, rope_dims, scores)
  assert new_mc.layout.name == 'gta'
  assert new_mc.layout.qk_rope_head_dim == rope_dims
  if mc.use_rope:
    assert zero_pair not in new_mc.layout.rope_pairs
  chex.assert_trees_all_close(_full_pass(new_mc, converted, tokens),
                              _full_pass(mc, params, tokens), atol=1e-5)
  lossy, lossy_mc = to_gta.convert_params(untied, mc, rope_dims, scores)
  assert float(jnp.max(jnp.abs(_full_pass(lossy_mc, lossy, tokens)
                               - _full_pass(mc, untied, tokens)))) > 1e-2


def test_conversion_gives_the_documented_parameters():
  """query [D, N, H] and out [N, H, D] in GTA's feature order, kv [D, K, H]
  the values in it, rope_key [D, Y] the keys' chosen pairs averaged over
  the KV heads; the tree is a tied model's, whose loss is finite."""
  mc, params = _source()  # K = 2, H = 8, N = 4, d_model = 32.
  tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, mc.vocab_size)
  scores = to_mla.calibration_scores(mc, params, tokens)
  converted, new_mc = to_gta.convert_params(params, mc, Y, scores)
  pairs = np.array(new_mc.layout.rope_pairs)
  assert len(pairs) == Y // 2 and list(pairs) == sorted(pairs)
  np.testing.assert_array_equal(pairs, to_mla.select_pairs(
      scores.sum(0, keepdims=True), Y)[0])
  assert jax.tree.map(np.shape, converted) == jax.tree.map(
      np.shape, model_lib.parameter_shapes(new_mc))
  L, Dm = mc.num_layers, mc.d_model
  before, after = params['layers']['attention'], converted['layers'][
      'attention']
  assert {k: v.shape for k, v in after.items()} == {
      'query': (L, Dm, 4, H), 'kv': (L, Dm, 2, H), 'rope_key': (L, Dm, Y),
      'out': (L, 4, H, Dm)}
  kept = np.concatenate([pairs, pairs + H // 2])
  order = np.concatenate([np.setdiff1d(np.arange(H), kept), kept])
  np.testing.assert_array_equal(after['kv'], before['value'][..., order])
  np.testing.assert_array_equal(after['query'], before['query'][..., order])
  np.testing.assert_array_equal(after['out'], before['out'][:, :, order])
  np.testing.assert_allclose(after['rope_key'],
                             before['key'][..., kept].mean(2), rtol=1e-6)
  logits = _full_pass(new_mc, converted, tokens)
  assert np.isfinite(float(_next_token_loss(logits, tokens)))


def _next_token_loss(logits_BTV, tokens_BT):
  """Mean next-token cross-entropy."""
  logp = jax.nn.log_softmax(logits_BTV[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens_BT[:, 1:, None], -1))


@pytest.mark.parametrize('model, rope_dims, message', [
    (dict(attention='gta'), 4, r"--source is model\.attention='gta' \(GTA: "
     r'2 tied KV heads x 8 \+ a RoPE key of 4\); --to_gta converts MHA/GQA '
     'models'),
    (dict(attention='mla', num_kv_heads=4,
          mla=dict(kv_lora_rank=8, qk_rope_head_dim=4)), 4,
     r"--source is model\.attention='mla' \(MLA: a latent of 8 \+ a RoPE key "
     r'of 4\); --to_gta converts MHA/GQA'),
    ({}, 0, r"no --qk_rope_head_dim: the source uses RoPE, so "
     r"--qk_rope_head_dim, the shared RoPE key's width, must be even, from 2 "
     r"to head_dim - 2 = 6 \(GTA's default is head_dim / 2 = 4\)"),
    ({}, 3, '--qk_rope_head_dim=3: the source uses RoPE'),
    ({}, 8, '--qk_rope_head_dim=8: the source uses RoPE'),
    (dict(use_rope=False), 4, r'--qk_rope_head_dim=4: the source has no '
     r'RoPE \(model.use_rope=False\); give 0'),
    (dict(qk_norm=True), 4, 'the source has model.qk_norm=True'),
])
def test_to_gta_refuses_what_it_cannot_convert_in_one_line(model, rope_dims,
                                                           message):
  config = tiny.get_config()
  config.model.update(**model)
  with pytest.raises(UserError, match=message):
    to_gta.check_source(config_lib.model_config(config), rope_dims)


def test_other_conversions_and_hugging_face_refuse_a_gta_model():
  mc = config_lib.model_config(_config())
  described = r'\(GTA: 2 tied KV heads x 8 \+ a RoPE key of 4\)'
  gta = rf"model\.attention='gta' {described}"
  with pytest.raises(UserError, match=rf'^no Hugging Face architecture '
                     rf'computes {gta}; keep the workdir, or export the '
                     'MHA/GQA model it was converted from$'):
    hf.family_of(mc)
  with pytest.raises(UserError, match=rf'^--source is {gta}; --to_mla '
                     'converts MHA/GQA models'):
    to_mla.check_source(mc, 8, 4)
  with pytest.raises(UserError, match=(
      rf'^--num_kv_heads pools the K/V heads of grouped-query attention, '
      rf"which a model\.attention='gta' model {described} has not; convert "
      r'its MHA/GQA source instead \(--to_gta --num_kv_heads=K pools, then '
      r'ties\)$')):
    convert.convert_params({}, mc, 1, 'mean')


@pytest.mark.slow  # A subprocess: 2-5 s.
def test_to_gta_refuses_the_flags_it_does_not_use_in_one_line(tmp_path):
  result = _run('train.convert', f'--source={tmp_path / "src"}',
                f'--workdir={tmp_path / "new"}', '--to_gta',
                '--kv_lora_rank=8', '--optimizer=pooled')
  _one_line_error(result, '--to_gta takes no --kv_lora_rank, --optimizer')
  assert not (tmp_path / 'new').exists()


@pytest.mark.slowest
@pytest.mark.slow
def test_a_trained_gqa_model_converts_trains_on_and_refuses_export(
    trained, tmp_path):
  """train.convert --to_gta on the trained tiny GQA workdir (K = 2 -> 1, a
  RoPE key of 4): convert.json records the pairs, the cache bytes and a
  finite held-out loss before uptraining; the workdir trains on with its
  recipe; --to_hf refuses it, and so does a second --to_gta."""
  target = tmp_path / 'gta'
  result = _run('train.convert', f'--source={trained}', f'--workdir={target}',
                '--to_gta', '--num_kv_heads=1', '--qk_rope_head_dim=4')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'GTA, 2 -> 1 KV heads by mean' in result.stdout
  info = json.loads((target / 'convert.json').read_text())
  assert info['kv_bytes_per_token'] == (1 * H + 4) * 2 * 4
  assert info['source_kv_bytes_per_token'] == 2 * 2 * H * 2 * 4
  assert len(info['rope_pairs']) == 2 and info['calibration']
  assert np.isfinite(info['eval_loss_before_uptraining'])
  uptrain = config_lib.load(str(target))
  assert uptrain.model.attention == 'gta' and uptrain.model.num_kv_heads == 1
  assert list(uptrain.model.gta.rope_pairs) == info['rope_pairs']
  uptrain.train.update(steps=4, eval_every=4, checkpoint_every=4,
                       warmup_steps=1)
  assert np.isfinite(loop.train_and_evaluate(uptrain, str(target))[
      'eval_loss'])
  _one_line_error(_run('train.convert', f'--source={target}',
                       f'--to_hf={tmp_path / "hf"}'),
                  "no Hugging Face architecture computes model.attention="
                  "'gta' (GTA: 1 tied KV heads x 8 + a RoPE key of 4)")
  _one_line_error(_run('train.convert', f'--source={target}',
                       f'--workdir={tmp_path / "again"}', '--to_gta',
                       '--qk_rope_head_dim=4'),
                  "--source is model.attention='gta' (GTA: 1 tied KV heads "
                  'x 8 + a RoPE key of 4); --to_gta converts MHA/GQA models')
