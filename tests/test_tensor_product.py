"""Specification of tensor product attention (TPA, `attention.tensor_product`)
beyond tests/test_layouts.py's checks at its defaults: the layer and its
gradients equal the paper's equations written out (every head's query, key
and value built from its factors); decoding from the factors equals
attending to keys and values built per head (float and int8 caches, soft
caps, masks, several queries); cached decoding of the variants (TPA-KV-only,
head-factor biases, no RoPE, local layers, ranks 1 and 3); the cache holds
the factors alone, (R_K + R_V)(N + H) numbers per token and layer; the
FLOPs are exactly the contractions they count; bad settings are one line;
and train.convert --to_tpa writes an MHA/GQA model as TPA with one-hot head
factors that computes its logits exactly (the paper's Section 4)."""

import json

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import Attention, kv_cache, layer, tensor_product
from attention.rope import apply_rope
from configs import tiny
from infra.errors import UserError
from lm import checkpoint, config_lib, flops
from lm import model as model_lib
from lm.model import Transformer
from tests import reference
from tests.test_faults import _one_line_error, _run
from tests.test_kv_memory import _decode_in_chunks, _full_pass
from train import convert, loop
from train.convert import hf, to_gta, to_mla, to_tpa

# N heads of H features from D-wide inputs.
N, H, D = 4, 8, 16


def _options(**fields):
  tpa = {k: fields.pop(k) for k in ('q_rank', 'k_rank', 'v_rank',
                                     'head_bias') if k in fields}
  return layer.Options(num_heads=N, head_dim=H,
                       layout=tensor_product.TPA(**tpa), **fields)


def _params(options, seed=0):
  """Normal parameters (biases too, so that they count)."""
  return {name: jax.random.normal(jax.random.key(seed + i), shape) * 0.4
          for i, (name, shape) in enumerate(options.param_shapes(D).items())}


def _by_the_papers_equations(params, x_BTD, options):
  """The layer as the paper writes it (its eqs. 3.1-3.5), token by token:
  a_r(x) = W_a,r x (+ the head bias), b_r(x) = W_b,r x, RoPE on the b's of
  Q and K, Q_t = (1/R_Q) Σ_r a_r(x_t) b_r(x_t)ᵀ [N, H] (or x_t W_Q per
  head, KV-only), likewise K_t and V_t; then every head's attention
  (`tests.reference`, no code shared with attention.core) and the output
  projection."""
  tpa = options.layout
  B, T, _ = x_BTD.shape
  positions = jnp.arange(T)
  rope = ((lambda b: apply_rope(b, positions)) if options.use_rope
          else (lambda b: b))

  def per_head(kind, turn):
    a = jnp.einsum('btd,drn->btrn', x_BTD, params[f'{kind}_head_factors'])
    if tpa.head_bias:
      a = a + params[f'{kind}_head_factors_bias']
    b = jnp.einsum('btd,drh->btrh', x_BTD, params[f'{kind}_token_factors'])
    b = turn(b)
    R = a.shape[2]
    heads = jnp.zeros((B, T, N, H))
    for r in range(R):  # The sum of R rank-1 products, one at a time.
      heads = heads + a[:, :, r, :, None] * b[:, :, r, None, :]
    return heads / R

  q = (rope(jnp.einsum('btd,dnh->btnh', x_BTD, params['query']))
       if not tpa.q_rank else per_head('query', rope))
  k, v = per_head('key', rope), per_head('value', lambda b: b)
  allowed = reference.allowed_positions(B, N, T, T, is_causal=True,
                                        local_window=options.local_window)
  o = reference.attention_repeated(q, k, v, allowed, scale=H ** -0.5)
  return jnp.einsum('btnh,nhd->btd', o, params['out'])


VARIANTS = {
    't6': {}, 'kv_only': dict(q_rank=0),
    'biased': dict(head_bias=True, k_rank=3, v_rank=1),
    'kv_only_biased_nope': dict(q_rank=0, head_bias=True,
                                use_rope=False),
}


@pytest.mark.parametrize('fields', VARIANTS.values(), ids=VARIANTS)
def test_the_layer_and_its_gradients_equal_the_papers_equations(fields):
  options = _options(**fields)
  params = _params(options)
  x = jax.random.normal(jax.random.key(9), (2, 7, D))
  out, _, kv = layer.apply(options, params, x)
  tpa = options.layout
  chex.assert_shape(kv.key, (2, 7, tpa.k_rank, N + H))  # The factors only.
  chex.assert_shape(kv.value, (2, 7, tpa.v_rank, N + H))
  chex.assert_trees_all_close(out, _by_the_papers_equations(params, x,
                                                            options),
                              atol=1e-5)
  cotangent = jax.random.normal(jax.random.key(3), out.shape)
  grads = [jax.grad(lambda p, f=f: jnp.sum(f(p) * cotangent))(params)
           for f in (lambda p: layer.apply(options, p, x)[0],
                     lambda p: _by_the_papers_equations(p, x, options))]
  chex.assert_trees_all_close(*grads, atol=1e-4)
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(
      grads[0]))  # Every parameter, the biases too, reaches the output.


def _pairs(seed, B, S, R, scale_a=1.0):
  """Factor pairs [B·R, S, N + H], heads-major (the dense cache stores each
  row transposed, [N + H, S])."""
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (B * R, S, N)) * scale_a
  b = jax.random.normal(kb, (B * R, S, H))
  return jnp.concatenate([a, b], -1)


def _built(pairs_ZSF, B):
  """[B, S, N, H]: the cached pairs' per-head keys or values, (1/R) Σ_r
  a_r ⊗ b_r, built one rank at a time."""
  Z, S, _ = pairs_ZSF.shape
  R = Z // B
  pairs = pairs_ZSF.reshape(B, R, S, N + H)
  return sum(pairs[:, r, :, :N, None] * pairs[:, r, :, None, N:]
             for r in range(R)) / R


@pytest.mark.parametrize('q_rank', [6, 0], ids=['factored', 'kv_only'])
@pytest.mark.parametrize('T, soft_cap', [(1, None), (3, 2.0)])
@pytest.mark.parametrize('int8', [False, True], ids=['float', 'int8'])
def test_decoding_from_the_factors_equals_building_keys_and_values(
    q_rank, T, soft_cap, int8):
  """factor_attention (FlashTPA's order) against every head's keys and
  values built from the same cached pairs (int8: as stored, int8 times
  their scale), with a random mask."""
  B, S, Rk, Rv = 2, 11, 2, 3
  keys, values = _pairs(1, B, S, Rk), _pairs(2, B, S, Rv)
  scales = {}
  if int8:
    (keys, scales['key_scale_ZS']), (values, scales['value_scale_ZS']) = (
        kv_cache.quantize(keys, axis=2), kv_cache.quantize(values, axis=2))
  dequantized = lambda x, s: x if s is None else x * s[..., None]
  k_BSNH = _built(dequantized(keys, scales.get('key_scale_ZS')), B)
  v_BSNH = _built(dequantized(values, scales.get('value_scale_ZS')), B)
  kq, kr, km = jax.random.split(jax.random.key(7), 3)
  if not q_rank:
    heads, rows = None, jax.random.normal(kr, (B, T, N, H))
    q_BTNH = rows
  else:
    heads = jax.random.normal(kq, (B, T, q_rank, N))
    rows = jax.random.normal(kr, (B, T, q_rank, H))
    q_BTNH = jnp.einsum('BTqN,BTqH->BTNH', heads, rows) / q_rank
  visible = jax.random.bernoulli(km, 0.7, (B, 1, T, S)).at[..., 0].set(True)
  as_stored = lambda pairs_ZSF: jnp.swapaxes(pairs_ZSF, 1, 2)  # [Z, F, S].
  got = tensor_product.factor_attention(
      heads, rows, as_stored(keys), as_stored(values), visible, scale=0.3,
      logits_soft_cap=soft_cap, **scales)
  expected = reference.attention_repeated(
      q_BTNH, k_BSNH, v_BSNH, np.broadcast_to(visible, (B, N, T, S)),
      scale=0.3, logits_soft_cap=soft_cap)
  chex.assert_trees_all_close(got, expected, atol=2e-5, rtol=2e-5)


def _decode(module, params, x, chunks):
  variables = module.init(jax.random.key(0), x)  # The [B, max_len] cache.
  cache, outs, start = variables['cache'], [], 0
  for n in chunks:
    out, mutated = module.apply({'params': params, 'cache': cache},
                                x[:, start:start + n], mutable=['cache'])
    cache, start = mutated['cache'], start + n
    outs.append(out)
  return jnp.concatenate(outs, axis=1), cache


# T6 at its defaults, global and local, is test_layouts'.
@pytest.mark.parametrize('fields', [
    dict(q_rank=0), dict(head_bias=True, q_rank=3, k_rank=1, v_rank=3),
    dict(use_rope=False),
    dict(q_rank=0, local_window=3, logits_soft_cap=2.0)],
    ids=['kv_only', 'biased_ranks_3_1_3', 'nope', 'kv_only_ring_softcap'])
def test_cached_decoding_equals_the_full_pass(fields):
  """A 4-token prefill (past a 3-slot ring's end), then one token at a
  time; the cache holds the factor pairs, nothing per head."""
  options = _options(**fields)
  params = _params(options)
  x = jax.random.normal(jax.random.key(5), (2, 9, D))
  full = layer.apply(options, params, x)[0]
  cached, cache = _decode(Attention.from_options(options, decode=True),
                          params, x, [4, 1, 1, 1, 1, 1])
  chex.assert_trees_all_close(cached, full, atol=1e-5)
  S, tpa = options.cache_length(9), options.layout
  assert set(cache) == {'cached_key_factors', 'cached_value_factors',
                        'cache_index'}
  chex.assert_shape(cache['cached_key_factors'], (2 * tpa.k_rank, N + H, S))
  chex.assert_shape(cache['cached_value_factors'],
                    (2 * tpa.v_rank, N + H, S))


@pytest.mark.slow  # Two int8 decodes of 6 steps each.
def test_an_int8_cache_balances_each_pair_to_share_one_scale(monkeypatch):
  """Head factors 300x larger and token factors 300x smaller (the same
  layer: a ⊗ b is unchanged; a converted model's one-hots can dwarf its
  keys so): balanced, one int8 scale per pair serves both, within 5% of
  the outputs' spread; the same pairs stored unbalanced lose the token
  factors to rounding (the control)."""
  options = _options(kv_cache_dtype='int8', head_bias=True)
  params = _params(options)
  for kind in ('key', 'value'):
    for name in (f'{kind}_head_factors', f'{kind}_head_factors_bias'):
      params[name] = params[name] * 300
    params[f'{kind}_token_factors'] = params[f'{kind}_token_factors'] / 300
  x = jax.random.normal(jax.random.key(5), (2, 9, D))
  full = layer.apply(options, params, x)[0]
  module = Attention.from_options(options, decode=True)
  cached, cache = _decode(module, params, x, [4, 1, 1, 1, 1, 1])
  error = lambda y: float(jnp.max(jnp.abs(y - full)) / jnp.std(full))
  assert cache['cached_key_factors'].dtype == jnp.int8
  assert 0 < error(cached) < 0.05, error(cached)
  monkeypatch.setattr(tensor_product, 'balanced', lambda a, b: (a, b))
  control, _ = _decode(module, params, x, [4, 1, 1, 1, 1, 1])
  assert error(control) > 4 * error(cached), (error(control), error(cached))


def test_balancing_keeps_each_product_and_equalises_the_factors_absmax():
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (2, 3, 2, N)) * 300
  b = jax.random.normal(kb, (2, 3, 2, H)).at[0, 0, 0].set(0.0)  # c = 1.
  a_c, b_c = tensor_product.balanced(a, b)
  chex.assert_trees_all_close(a_c[..., :, None] * b_c[..., None, :],
                              a[..., :, None] * b[..., None, :], rtol=1e-5)
  chex.assert_trees_all_close(jnp.abs(a_c).max(-1)[1:],
                              jnp.abs(b_c).max(-1)[1:], rtol=1e-5)
  chex.assert_trees_all_equal(a_c[0, 0, 0], a[0, 0, 0])


@pytest.mark.parametrize('Rk, Rv, N_, H_', [(2, 2, 4, 8), (1, 3, 8, 32),
                                            (6, 2, 16, 64)])
@pytest.mark.parametrize('kv_cache_dtype, itemsize', [
    (None, 4), ('bfloat16', 2), ('int8', 1)])
def test_the_cache_is_the_factors_r_k_plus_r_v_times_n_plus_h(
    Rk, Rv, N_, H_, kv_cache_dtype, itemsize):
  """(R_K + R_V)(N + H) numbers per token and layer (int8: and a float32
  scale per rank), whatever the query rank."""
  for q_rank in (6, 0):
    options = layer.Options(
        num_heads=N_, head_dim=H_, kv_cache_dtype=kv_cache_dtype,
        layout=tensor_product.TPA(q_rank=q_rank, k_rank=Rk, v_rank=Rv))
    per_token = (Rk + Rv) * (N_ + H_) * itemsize + (
        4 * (Rk + Rv) if kv_cache_dtype == 'int8' else 0)
    assert layer.kv_cache_bytes(options, 3, 5, jnp.float32) == 15 * per_token


def test_kv_bytes_per_token_is_the_factors_of_every_layer_owning_a_cache():
  config = tiny.get_config()  # N = 4, H = 8.
  config.model.update(attention='tpa', num_kv_heads=4, num_layers=4,
                      kv_share=2, tpa=dict(k_rank=3, v_rank=1))
  mc = config_lib.model_config(config)
  assert model_lib.kv_bytes_per_token(mc) == 2 * (3 + 1) * (4 + 8) * 4


def test_decode_flops_per_key_are_the_contractions_xla_counts():
  """attention_flops_per_key(absorbed=True) is FlashTPA's arithmetic per
  query token and key: XLA's count (cost_analysis) of its contractions
  (each sum a dot, 2 FLOPs per multiply-add) and the one weighting product
  (p·a_V, 1 FLOP), unpadded; the full pass's is MHA's 2·2·N·H."""
  B, T, S = 2, 3, 16

  def chain(rows, heads, b_k, a_k, p, a_v, b_v):
    c = jnp.einsum('BTqH,BrSH->BTqrS', rows, b_k)
    u = c if heads is None else jnp.einsum('BTqN,BTqrS->BTNrS', heads, c)
    logits = jnp.einsum('BTNrS,BrSN->BTNS', u, a_k)
    weights = p[:, :, :, None] * a_v.transpose(0, 3, 1, 2)[:, None]
    return logits, jnp.einsum('BTNvS,BvSH->BTNH', weights, b_v)

  for q_rank, Rk, Rv in ((6, 2, 2), (0, 3, 1), (2, 1, 4)):
    options = _options(q_rank=q_rank, k_rank=Rk, v_rank=Rv)
    q = q_rank or N
    shapes = [(B, T, q, H), (B, T, q, N) if q_rank else None,
              (B, Rk, S, H), (B, Rk, S, N), (B, T, N, S), (B, Rv, S, N),
              (B, Rv, S, H)]
    args = [None if s is None else jnp.ones(s) for s in shapes]
    counted = jax.jit(chain).lower(*args).cost_analysis()['flops']
    assert flops.attention_flops_per_key(options, absorbed=True) == (
        counted / (B * T * S))
    assert flops.attention_flops_per_key(options) == 2 * 2 * N * H


def test_projection_flops_are_twice_the_kernels_and_the_builds():
  """With no keys, a token's FLOPs are its matmuls' (2 per kernel
  parameter), plus, in the full pass, building Q, K and V per head from
  the factors (2·R·N·H each, KV-only queries none); a layer sharing K/V
  has no K/V factors."""
  for fields in ({}, dict(q_rank=0), dict(head_bias=True, k_rank=3)):
    options = _options(**fields)
    tpa = options.layout
    for shared in (False, True):
      shapes = options.param_shapes(D, shared_kv=shared)
      kernels = sum(int(np.prod(s)) for name, s in shapes.items()
                    if not name.endswith('_bias'))
      builds = sum(2 * R * N * H for kind, R in tpa.ranks().items()
                   if R is not None and not (shared and kind != 'query'))
      per_token = lambda absorbed, s=shared: tpa.flops_per_token(
          options, D, 0, s, absorbed)
      assert per_token(True) == 2 * kernels
      assert per_token(False) == 2 * kernels + builds


@pytest.mark.parametrize('tpa, model, message', [
    (dict(k_rank=0), {}, "tpa.k_rank=0 must be an integer >= 1"),
    (dict(q_rank=-1), {}, r"tpa.q_rank=-1 must be an integer >= 1, or 0 "
     r"\(per-head queries: TPA-KV-only\)"),
    ({}, dict(num_kv_heads=2), r"num_kv_heads=2 with attention='tpa': TPA "
     r"builds every query head's key and value from its factors; set "
     r"num_kv_heads=4 \(num_heads\)"),
    ({}, dict(qk_norm=True), "qk_norm=True with attention='tpa': tensor "
     'product attention has its own projections; set qk_norm=False'),
])
def test_bad_settings_are_refused_in_one_line_naming_the_fix(tpa, model,
                                                             message):
  config = tiny.get_config()
  config.model.update(attention='tpa', **{'num_kv_heads': 4, **model})
  config.model.tpa.update(tpa)
  with pytest.raises(UserError, match=f'^model.{message}$'):
    config_lib.validate(config, batch_shards=1)


@pytest.mark.parametrize('tpa, message', [
    (dict(v_rank=1.5), 'tpa.v_rank=1.5 must be an integer >= 1'),
    (dict(k_rank=True), 'tpa.k_rank=True must be an integer >= 1'),
    (dict(head_bias=1), 'tpa.head_bias=1 must be True or False'),
    (dict(q_rank=None), r'tpa.q_rank=None must be an integer >= 1, or 0 '
     r'\(per-head queries: TPA-KV-only\)')])
def test_bad_types_are_refused_by_the_layout_in_one_line(tpa, message):
  """What the config's typed fields cannot hold, the layout refuses when it
  is built in code."""
  with pytest.raises(ValueError, match=f'^{message}$'):
    _options(**tpa)


def test_another_layouts_config_with_tpa_settings_is_refused():
  config = tiny.get_config()
  config.model.tpa.update(k_rank=3)
  with pytest.raises(UserError, match=(
      r"^model.tpa.k_rank=3 set, but model.attention='gqa': another "
      r"layout's settings; set --config.model.attention=tpa")):
    config_lib.validate(config, batch_shards=1)


def test_tensor_parallel_axes_split_the_heads_and_keep_the_factors_whole():
  """Every parameter has axis names; the head factors and out split over
  the query heads (tensor), the token factors and ranks stay whole."""
  tpa = tensor_product.TPA(head_bias=True)
  names = set(_options(head_bias=True).param_shapes(D)) | set(
      _options(q_rank=0).param_shapes(D))
  assert names <= set(tpa.logical_axes)
  for name in names:
    axes = tpa.logical_axes[name]
    assert ('q_heads' in axes) == ('head' in name or name in ('query',
                                                                'out'))
    assert 'kv_heads' not in axes


# --- Conversion into TPA (train.convert.to_tpa, train.convert --to_tpa) -----

def _source(seed=3, **model):
  config = tiny.get_config()  # N = 4, K = 2, H = 8, d_model 32, 2 layers.
  config.model.update(**model)
  mc = config_lib.model_config(config)
  return mc, jax.tree.map(np.asarray, nn.unbox(
      loop.init_params(Transformer(mc), seed=seed)))


@pytest.mark.slow  # A model's full pass and decoding compiled, twice.
@pytest.mark.parametrize('model', [
    {}, dict(num_kv_heads=4), dict(num_kv_heads=1),
    dict(num_layers=4, kv_share=2, attention_pattern='LLGG', local_window=8),
    dict(use_rope=False)], ids=['gqa2', 'mha', 'mqa', 'cla2_local', 'nope'])
def test_an_mha_or_gqa_model_converts_exactly(model):
  """The paper's Section 4: rank K with one-hot head factors computes the
  source's logits (1e-5), through the full pass and decoding."""
  mc, params = _source(**model)
  converted, new_mc = to_tpa.convert_params(params, mc)
  K = mc.num_kv_heads
  assert new_mc.layout == tensor_product.TPA(q_rank=0, k_rank=K,
                                             v_rank=K, head_bias=True)
  assert jax.tree.map(np.shape, converted) == jax.tree.map(
      np.shape, model_lib.parameter_shapes(new_mc))
  tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, mc.vocab_size)
  expected = _full_pass(mc, params, tokens)
  chex.assert_trees_all_close(_full_pass(new_mc, converted, tokens),
                              expected, atol=1e-5)
  decoded, _ = _decode_in_chunks(new_mc, converted, tokens, [9, 1, 1, 13])
  chex.assert_trees_all_close(decoded, expected, atol=1e-5)
  # The control: a head factor one-hot at the wrong heads moves the logits.
  wrong = jax.tree_util.tree_map_with_path(
      lambda path, x: (x[..., ::-1] if 'key_head_factors_bias'
                       in jax.tree_util.keystr(path) else x), converted)
  if K > 1:
    assert float(jnp.max(jnp.abs(_full_pass(new_mc, wrong, tokens)
                                 - expected))) > 1e-2


def test_conversion_gives_the_documented_parameters():
  mc, params = _source()
  converted, _ = to_tpa.convert_params(params, mc)
  before, after = params['layers']['attention'], converted['layers'][
      'attention']
  L, Dm, K = mc.num_layers, mc.d_model, mc.num_kv_heads
  assert {k: v.shape for k, v in after.items()} == {
      'query': (L, Dm, N, H), 'out': (L, N, H, Dm),
      **{f'{kind}_{part}': shape for kind in ('key', 'value')
         for part, shape in (('token_factors', (L, Dm, K, H)),
                             ('head_factors', (L, Dm, K, N)),
                             ('head_factors_bias', (L, K, N)))}}
  for kind in ('key', 'value'):
    np.testing.assert_array_equal(after[f'{kind}_token_factors'],
                                  before[kind])
    assert not np.any(after[f'{kind}_head_factors'])
    np.testing.assert_array_equal(
        after[f'{kind}_head_factors_bias'][0],
        [[2, 2, 0, 0], [0, 0, 2, 2]])  # K·one-hot of each rank's heads.
  for name in ('query', 'out'):
    np.testing.assert_array_equal(after[name], before[name])


@pytest.mark.parametrize('model, message', [
    (dict(attention='gta'), r"--source is model\.attention='gta' \(GTA: 2 "
     r'tied KV heads x 8 \+ a RoPE key of 4\); --to_tpa converts MHA/GQA '
     'models: convert the model it came from'),
    (dict(qk_norm=True), r"--to_tpa: the source has model\.qk_norm=True, "
     "which TPA's factors cannot take; convert a model without it"),
    (dict(qkv_bias=True), r'--to_tpa: the source has model\.qkv_bias=True'),
])
def test_to_tpa_refuses_what_it_cannot_convert_in_one_line(model, message):
  config = tiny.get_config()
  config.model.update(**model)
  with pytest.raises(UserError, match=f'^{message}'):
    to_tpa.check_source(config_lib.model_config(config))


def test_other_conversions_and_hugging_face_refuse_a_tpa_model():
  mc, params = _source()
  _, new_mc = to_tpa.convert_params(params, mc)
  tpa = (r"model\.attention='tpa' \(TPA: K and V of rank 2 and 2 over 4 "
         r'heads x 8, factors of 4 \+ 8; per-head queries \(KV-only\), '
         r'head-factor biases\)')
  with pytest.raises(UserError, match=rf'^no Hugging Face architecture '
                     rf'computes {tpa}'):
    hf.family_of(new_mc)
  for check in (lambda: to_mla.check_source(new_mc, 8, 4),
                lambda: to_gta.check_source(new_mc, 4),
                lambda: to_tpa.check_source(new_mc)):
    with pytest.raises(UserError, match=rf'^--source is {tpa}; --to_'):
      check()
  with pytest.raises(UserError, match=(
      r"^--num_kv_heads pools the K/V heads of grouped-query attention, "
      r"which a model\.attention='tpa' model \(TPA: ")):
    convert.convert_params({}, new_mc, 1, 'mean')


@pytest.mark.slow  # Subprocesses: 2-5 s each.
@pytest.mark.parametrize('flags, message', [
    (['--to_tpa', '--kv_lora_rank=8', '--optimizer=pooled'],
     '--to_tpa takes no --kv_lora_rank, --optimizer'),
    (['--to_tpa', '--qk_rope_head_dim=4'],
     '--to_tpa takes no --qk_rope_head_dim'),
    (['--to_tpa', '--to_gta'], 'give one of --to_gta, --to_tpa'),
], ids=['mla_flags', 'gta_flag', 'two_targets'])
def test_to_tpa_refuses_the_flags_it_does_not_use_in_one_line(
    tmp_path, flags, message):
  result = _run('train.convert', f'--source={tmp_path / "src"}',
                f'--workdir={tmp_path / "new"}', *flags)
  _one_line_error(result, message)
  assert not (tmp_path / 'new').exists()


@pytest.mark.slowest
@pytest.mark.slow
def test_a_trained_gqa_model_converts_exactly_uptrains_and_refuses_export(
    trained, tmp_path):
  """train.convert --to_tpa on the trained tiny GQA workdir (K = 2): the
  held-out loss before uptraining is the source's; convert.json records
  the cache bytes, 2·K·(N + H) numbers a token and layer; the workdir
  trains on with its recipe and its head factors become contextual;
  --to_hf refuses it."""
  target = tmp_path / 'tpa'
  result = _run('train.convert', f'--source={trained}', f'--workdir={target}',
                '--to_tpa')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'TPA, 2 KV heads, copied unchanged as factors of rank 2' in (
      result.stdout)
  info = json.loads((target / 'convert.json').read_text())
  assert info['kv_bytes_per_token'] == 2 * 2 * 2 * (N + H) * 4
  assert info['source_kv_bytes_per_token'] == 2 * 2 * 2 * H * 4
  np.testing.assert_allclose(info['eval_loss_before_uptraining'],
                             info['source_eval_loss'], rtol=1e-5)
  uptrain = config_lib.load(str(target))
  assert uptrain.model.attention == 'tpa' and uptrain.model.num_kv_heads == N
  assert uptrain.model.tpa.to_dict() == dict(q_rank=0, k_rank=2, v_rank=2,
                                             head_bias=True)
  uptrain.train.update(steps=4, eval_every=4, checkpoint_every=4,
                       warmup_steps=1)
  assert np.isfinite(loop.train_and_evaluate(uptrain, str(target))[
      'eval_loss'])
  _, params, _ = checkpoint.load_workdir(str(target))
  assert np.any(params['layers']['attention']['key_head_factors'])
  _one_line_error(_run('train.convert', f'--source={target}',
                       f'--to_hf={tmp_path / "hf"}'),
                  "no Hugging Face architecture computes model.attention="
                  "'tpa'")
