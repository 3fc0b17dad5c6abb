"""Specification of grouped latent attention (GLA, Zadouri, Strauss & Dao
2025; `attention.latent` with latent_groups G > 1): head n reads latent
group n // (N/G), which an independent reference and an MLA with a
block-structured kv_up both confirm; cached decoding (absorbed per group)
equals the full pass through every cache (dense, ring buffer, int8, paged);
the cache holds A + Y numbers per token whatever G, with G int8 scales; the
conversion keeps a model's logits at full rank; bad options are one line;
and a GLA model trains and decodes over tensor parallelism as on one device.
"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import cpu_kernel, kv_cache, latent, layer
from attention.rope import apply_rope
from configs import tiny
from serve import engine, runner as paged
from tests import hlo, host_devices, test_mesh
from tests.test_kv_memory import _decode_in_chunks, _full_pass
from tests.test_latent import _decode_step_hlo, _expanding_attention
from tests.test_latent import _per_head_kv
from tests.test_sample import _greedy_by_full_passes
from tests.test_serve import _alone
from lm import checkpoint, config_lib, flops, sharding
from lm import inference
from train import loop
from train.convert import hf
from train.convert import to_mla
from lm import model as model_lib
from infra.errors import UserError
from lm.model import Transformer, unroll_layers

# test_latent's widths (A widened to split in 1, 2 and 4 groups): A latent,
# Y RoPE key, I and U a head's key (without RoPE) and value, N heads.
A, Y, I, U, N = 12, 4, 8, 6, 4
WIDTHS = dict(kv_lora_rank=A, qk_rope_head_dim=Y, qk_nope_head_dim=I,
              v_head_dim=U)
GROUPS = [2, N]  # Two heads per latent, and one (G = N).
VARIANTS = {
    'global': {},
    # Local layers' ring buffers (window 5), a query latent and kv_share.
    'local_query_latent_sharing': dict(
        mla=dict(q_lora_rank=12), num_layers=4, attention_pattern='LLGG',
        local_window=5, kv_share=2),
    'nope_no_latent_norm': dict(
        use_rope=False, mla=dict(qk_rope_head_dim=0, latent_norm=False),
        logits_soft_cap=2.0),
}


def _config(G, mla=None, **model):
  """`tiny` as GLA: WIDTHS in G latent groups, the MLA settings `mla`, the
  model fields."""
  config = tiny.get_config()
  config.model.update(attention='mla', num_kv_heads=N, mla={
      **WIDTHS, 'latent_groups': G, **(mla or {})}, **model)
  config_lib.validate(config, batch_shards=1)
  return config


def _model(G, seed=1, **model):
  mc = config_lib.model_config(_config(G, **model))
  return mc, nn.unbox(loop.init_params(Transformer(mc), seed=seed))


def _options(G, latent_norm=True, **given):
  return layer.Options(num_heads=N, num_kv_heads=N, head_dim=I,
                       layout=latent.MLA(**WIDTHS, latent_groups=G,
                                         latent_norm=latent_norm), **given)


def _params(options, D, seed=0):
  params = {name: jax.random.normal(jax.random.key(seed + i), shape) * 0.3
            for i, (name, shape) in enumerate(
                options.param_shapes(D).items())}
  if 'kv_norm' in params:
    params['kv_norm'] = params['kv_norm'] + 1.0
  return params


@pytest.mark.parametrize('G', GROUPS)
def test_the_layer_matches_an_independent_reference(G):
  """One layer's full pass against GLA written out head by head: each
  group's latent sliced from x·kv_down and RMS-normed by itself, head n's
  key and value from group n // (N/G)'s latent."""
  options = _options(G, norm_scale_offset=0.0)
  D, T, F, M = 16, 9, A // G, N // G
  params = _params(options, D)
  chex.assert_shape(params['kv_up'], (F, N, I + U))
  x = jax.random.normal(jax.random.key(9), (2, T, D))
  out, _, _ = layer.apply(options, params, x)
  ck = x @ params['kv_down']
  k_rope = apply_rope(ck[..., A:][:, :, None], jnp.arange(T))[:, :, 0]
  q = jnp.einsum('BTD,DNH->BTNH', x, params['query'])
  q = jnp.concatenate([q[..., :I], apply_rope(q[..., I:], jnp.arange(T))], -1)
  heads = []
  for n in range(N):
    g = n // M
    c = ck[..., g * F:(g + 1) * F]
    c = c / jnp.sqrt(jnp.mean(c * c, -1, keepdims=True) + 1e-6) * (
        params['kv_norm'][g * F:(g + 1) * F])
    k = jnp.concatenate([c @ params['kv_up'][:, n, :I], k_rope], -1)
    v = c @ params['kv_up'][:, n, I:]
    logits = jnp.einsum('BTH,BSH->BTS', q[:, :, n], k) / np.sqrt(I + Y)
    logits = jnp.where(jnp.tril(jnp.ones((T, T), bool)), logits, -jnp.inf)
    heads.append(jax.nn.softmax(logits, -1) @ v)
  expected = jnp.einsum('BTNU,NUD->BTD', jnp.stack(heads, 2), params['out'])
  chex.assert_trees_all_close(out, expected, atol=1e-5)


def test_gla_is_mla_with_each_heads_kv_up_zero_outside_its_group():
  """Without the latent's norm (per group in GLA, whole in MLA), GLA equals
  the MLA over the same A-wide latent whose kv_up reads only the head's
  group's features: in the full pass and decoding a cache token by token.
  A kv_up that puts head n in another group is caught."""
  G, D, T = 2, 16, 7
  F, M = A // G, N // G
  gla = _options(G, latent_norm=False)
  mla = _options(1, latent_norm=False)
  params = _params(gla, D)
  x = jax.random.normal(jax.random.key(9), (2, T, D))

  def block_kv_up(group_of):  # [F, N, W] -> [A, N, W], zero elsewhere.
    kv_up = np.zeros((A, N, I + U), np.float32)
    for n in range(N):
      g = group_of(n)
      kv_up[g * F:(g + 1) * F, n] = params['kv_up'][:, n]
    return kv_up

  def decoded(options, params):
    cache = options.cache_spec(2, T, jnp.float32)
    cache = {name: jnp.zeros(s.shape, s.dtype) for name, s in cache.items()}
    outs = []
    for t in range(T):
      out, cache, _ = layer.apply(options, params, x[:, t:t + 1], cache=cache)
      outs.append(out)
    return jnp.concatenate(outs, 1)

  full = layer.apply(gla, params, x)[0]
  as_mla = {**params, 'kv_up': block_kv_up(lambda n: n // M)}
  chex.assert_trees_all_close(full, layer.apply(mla, as_mla, x)[0],
                              atol=1e-5)
  chex.assert_trees_all_close(decoded(gla, params), full, atol=1e-5)
  chex.assert_trees_all_close(decoded(mla, as_mla), full, atol=1e-5)
  swapped = {**params, 'kv_up': block_kv_up(lambda n: G - 1 - n // M)}
  assert float(jnp.max(jnp.abs(layer.apply(mla, swapped, x)[0] - full))
               ) > 1e-2


@pytest.mark.parametrize('G', GROUPS)
@pytest.mark.parametrize('variant', [
    variant if variant == 'global' else pytest.param(
        variant, marks=pytest.mark.slow) for variant in VARIANTS])
def test_cached_decoding_equals_the_full_pass(G, variant):
  """Logits at every position, fed through the cache token by token and in
  chunks that wrap the local layers' ring buffers, equal the full pass
  (which expands K/V per head); greedy generation equals argmax over full
  passes."""
  mc, params = _model(G, **VARIANTS[variant])
  tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, mc.vocab_size)
  full = _full_pass(mc, params, tokens)
  for chunks in ([1] * 20, [7, 1, 1, 6, 1, 4]):
    cached, cache = _decode_in_chunks(mc, params, tokens, chunks)
    chex.assert_trees_all_close(cached, full, atol=1e-5)
  S = mc.local_window if mc.local_window else mc.max_len
  chex.assert_shape(cache['layers_0']['attention']['cached_latent'],
                    (2 * G, S, A // G))
  prompt = tokens[:1, :6]
  generated = inference.generate(params, prompt,
                                 model=Transformer(mc, decode=True),
                                 max_new_tokens=8)
  np.testing.assert_array_equal(
      generated, _greedy_by_full_passes(Transformer(mc), params, prompt, 8))


@pytest.mark.parametrize('G', GROUPS)
def test_an_int8_grouped_cache_decodes_within_a_stated_tolerance(G):
  """int8 latents, one float32 scale per token and group, change the
  logits by less than 1% of their spread (measured: 0.2-0.3%)."""
  mc, params = _model(G, kv_cache_dtype='int8')
  tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, mc.vocab_size)
  full = _full_pass(mc, params, tokens)
  cached, cache = _decode_in_chunks(mc, params, tokens, [7] + [1] * 13)
  held = cache['layers_0']['attention']
  assert held['cached_latent'].dtype == jnp.int8
  chex.assert_shape(held['latent_scale'], (2 * G, mc.max_len))
  error = float(jnp.max(jnp.abs(cached - full)) / jnp.std(full))
  assert 0 < error < 0.01


def test_one_group_keeps_mlas_parameters_and_cache():
  """latent_groups=1 is MLA as it was: kv_up [A, N, I + U], kv_norm [A],
  one latent of A per token ([B, S, A] dense, [1, P, p, A] paged). (Its
  numbers: test_latent's MLA tests, unchanged.)"""
  options = _options(1)
  assert options.param_shapes(16) == {
      'query': (16, N, I + Y), 'kv_down': (16, A + Y), 'kv_norm': (A,),
      'kv_up': (A, N, I + U), 'out': (N, U, 16)}
  assert options.cache_spec(2, 9, jnp.float32)['cached_latent'].shape == (
      2, 9, A)
  assert kv_cache.paged_spec(options, 5, 4, jnp.float32)[
      'cached_latent'].shape == (1, 5, 4, A)


@pytest.mark.parametrize('G', [1, 2, N])
def test_the_cache_holds_the_latents_a_numbers_whatever_the_groups(G):
  """Per token and layer: A + Y numbers (G latents of A/G and the RoPE
  key); int8: a byte each, and G + 1 float32 scales (one per latent group,
  one for the key); what the decode cache and a paged pool hold."""
  for dtype, expected in ((None, (A + Y) * 4), ('bfloat16', (A + Y) * 2),
                          ('int8', A + Y + 4 * (G + 1))):
    mc = config_lib.model_config(_config(G, kv_cache_dtype=dtype))
    assert model_lib.kv_bytes_per_token(mc) == expected * mc.num_layers
    cache = inference.empty_cache(Transformer(dataclasses.replace(
        mc, scan_layers=False), decode=True), batch=1)
    held = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(
        cache) if 'index' not in jax.tree_util.keystr(path))
    assert held == expected * mc.num_layers * mc.max_len
  pool = kv_cache.paged_spec(mc.attention(0), 5, 4, jnp.float32)
  assert pool['cached_latent'].shape == (G, 5, 4, A // G)
  assert pool['latent_scale'].shape == (G, 5, 4)


def test_flops_count_a_heads_group_latent():
  """Each head expands, and decoding absorbs, its group's A/G features."""
  G = 2
  mc = config_lib.model_config(_config(G, num_layers=1))
  D, F, V = mc.d_model, mc.mlp_dim, mc.vocab_size
  C, W = 8, A // G
  common = 2 * D * V + 3 * 2 * D * F + 2 * D * N * (I + Y) + 2 * D * (A + Y) + (
      2 * N * U * D)
  assert flops.forward_flops_per_token(mc, 2 * C - 1) == common + (
      2 * W * N * (I + U) + 2 * N * (I + Y) * C + 2 * N * U * C)
  assert flops.decode_flops_per_token(mc, C - 1) == common + (
      2 * N * I * W + 2 * N * W * U + 2 * N * (W + Y) * C + 2 * N * W * C)


@pytest.mark.slow
def test_the_decode_step_builds_no_per_head_keys_or_values(monkeypatch):
  """As MLA's (test_latent): the compiled GLA decode step holds no per-head
  K/V over the cached positions; the control expanding them is caught."""
  mc, params = _model(N, max_len=40)
  assert not _per_head_kv(_decode_step_hlo(mc, params), 2, mc.max_len)
  with cpu_kernel.disabled():
    assert not _per_head_kv(_decode_step_hlo(mc, params), 2, mc.max_len)
    monkeypatch.setattr(latent, 'absorbed_attention', _expanding_attention)
    assert _per_head_kv(_decode_step_hlo(mc, params), 2, mc.max_len)


@pytest.mark.slow
@pytest.mark.parametrize('kv_cache_dtype', [None, 'int8'])
def test_gla_is_served_from_a_paged_grouped_cache(kv_cache_dtype):
  """The serving engine's paged pool ([G, P, p, A/G] latents) gives each
  request train.sample's greedy tokens for its prompt alone."""
  mc, params = _model(2, seed=1, kv_cache_dtype=kv_cache_dtype)
  pool = paged.empty_pool(mc, 3, 4)
  assert pool['layers_0']['attention']['cached_latent'].shape == (
      2, 3, 4, A // 2)
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=4, slots=2,
                         prefill_chunk=4)
  requests = [engine.Request(0, np.arange(1, 12, dtype=np.int32) * 7, 10),
              engine.Request(1, np.array([5, 2], np.int32), 6)]
  results = {r.id: r.tokens for r in served.run(requests)}
  for r in requests:
    assert results[r.id] == _alone(mc, params, r.prompt, r.max_new_tokens)


@pytest.mark.parametrize('mla, message', [
    (dict(latent_groups=3), r'model\.mla\.latent_groups=3 must divide '
     r'num_heads=4 and mla\.kv_lora_rank=12 .*; pick latent_groups in '
     r'\[1, 2, 4\]'),
    (dict(latent_groups=4, kv_lora_rank=10), r'model\.mla\.latent_groups=4 '
     r'must divide num_heads=4 and mla\.kv_lora_rank=10 .*pick latent_groups '
     r'in \[1, 2\]'),
    (dict(latent_groups=0), r'model\.mla\.latent_groups=0 must be an integer '
     r'>= 1'),
])
def test_bad_latent_groups_are_refused_in_one_line(mla, message):
  config = tiny.get_config()
  config.model.update(attention='mla', num_kv_heads=N,
                      mla={**WIDTHS, **mla})
  with pytest.raises(UserError, match=message):
    config_lib.validate(config, batch_shards=1)
  with pytest.raises(ValueError, match=message.removeprefix(r'model\.')):
    config_lib.model_config(config).attention(0)


def test_latent_groups_without_mla_are_refused_in_one_line():
  """Groups of a latent the layout has not (before named layouts: groups
  without kv_lora_rank) would be ignored."""
  config = tiny.get_config()
  config.model.update(mla=dict(latent_groups=2))
  with pytest.raises(UserError, match=(
      r"^model\.mla\.latent_groups=2 set, but model\.attention='gqa': "
      r"another layout's settings; set --config\.model\.attention=mla, or "
      r'leave model\.mla at its defaults$')):
    config_lib.validate(config, batch_shards=1)


def test_hugging_face_export_refuses_grouped_latents():
  """DeepSeek's format has one latent: G > 1 is refused by name; the same
  model with G = 1 exports."""
  fields = dict(mlp_activation='silu', norm_scale_offset=0.0,
                embed_scale=False)
  assert hf.family_of(config_lib.model_config(_config(1, **fields))) == (
      'deepseek_v3')
  with pytest.raises(UserError, match=r"computes model\.mla\.latent_groups=2 "
                     r"\(grouped latents: DeepSeek's format has one\) in an "
                     r'MLA \(deepseek\) model'):
    hf.family_of(config_lib.model_config(_config(2, **fields)))


def test_latent_groups_split_over_tensor_only_when_it_divides_them():
  """As K/V heads: kv_norm's groups split over tensor when it divides G,
  else whole on every shard; kv_up's heads follow the query heads'; kv_down
  stays whole on tensor."""
  mesh = lambda t: jax.sharding.AbstractMesh((1, 1, t), sharding.AXES)
  mc = config_lib.model_config(_config(2))
  assert dict(sharding.rules(mc, mesh(2)))['latent_groups'] == 'tensor'
  assert dict(sharding.rules(mc, mesh(4)))['latent_groups'] is None
  mla = config_lib.model_config(_config(1))
  assert dict(sharding.rules(mla, mesh(2)))['latent_groups'] is None
  boxed = jax.eval_shape(lambda: loop.init_params(Transformer(mc), 0))
  specs = nn.get_partition_spec(boxed)['layers']['attention']
  spec = lambda name, t: nn.logical_to_mesh_axes(
      specs[name], sharding.rules(mc, mesh(t)))
  assert spec('kv_norm', 2) == jax.P(None, 'tensor')  # [L, A].
  assert spec('kv_norm', 4) == jax.P(None, None)
  assert spec('kv_up', 4) == jax.P(None, None, 'tensor', None)
  assert 'tensor' not in spec('kv_down', 2)


# --- Tensor parallelism (8 simulated devices, tests/gla_mesh_runs.py) -----

def mesh_config(mesh, **model):
  """tests/gla_mesh_runs.py's run: a G=2 GLA model trained 4 steps."""
  config = _config(2, **model)
  config.train.update(steps=4, log_every=1, eval_every=4, checkpoint_every=4,
                      warmup_steps=1)
  config.mesh.update({**dict(data=1, fsdp=1, tensor=1), **mesh})
  return config


def decode_outputs(mc, params):
  """(logits fed through the cache in chunks, greedy tokens) of a prompt."""
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, mc.vocab_size)
  logits, _ = _decode_in_chunks(mc, params, tokens, [6, 1, 1, 8])
  generated = inference.generate(params, tokens[:, :5],
                                 model=Transformer(mc, decode=True),
                                 max_new_tokens=6)
  return np.asarray(logits), np.asarray(generated)


@pytest.mark.slow
@pytest.mark.slowest  # 20-28 s on 2 cores.
@pytest.mark.cpu_only  # Simulated host devices.
def test_gla_trains_and_decodes_over_tensor_as_on_one_device(tmp_path):
  """data=2, fsdp=2, tensor=2 with G=2: the losses and parameters of 4
  steps are one device's; the compiled step holds kv_norm and kv_up split
  over tensor (and with tensor=4 > G, the control, kv_norm whole); decoding
  with the parameters so sharded gives one device's logits and tokens."""
  env = host_devices.env(8)
  result = subprocess.run(
      [sys.executable, '-m', 'tests.gla_mesh_runs', str(tmp_path)], env=env,
      cwd=pathlib.Path(__file__).parent.parent, capture_output=True,
      text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  got = json.loads(result.stdout.strip().splitlines()[-1])
  assert 'tensor' in got['specs']['kv_norm'], got['specs']
  assert 'tensor' in got['specs']['kv_up'], got['specs']
  assert 'tensor' not in got['specs']['kv_down'], got['specs']
  assert 'tensor' not in got['control_specs']['kv_norm'], got
  one, sharded = tmp_path / 'one_device', tmp_path / 'mesh'
  loop.train_and_evaluate(mesh_config(dict(data=1)), str(one))
  expected, got_run = test_mesh.summary(one), test_mesh.summary(sharded)
  np.testing.assert_allclose(got['losses'], expected['losses'], rtol=2e-4)
  assert len(expected['losses']) == 4
  np.testing.assert_allclose(got_run['eval_loss'], expected['eval_loss'],
                             rtol=2e-4)
  np.testing.assert_allclose(got_run['param_sum'], expected['param_sum'],
                             rtol=1e-4)
  mesh_params = checkpoint.restore_latest(sharded)[1]['params']
  mc = config_lib.model_config(mesh_config(dict(data=1)))
  logits, tokens = decode_outputs(mc, mesh_params)  # One device here.
  with np.load(tmp_path / 'decoded.npz') as sharded:
    np.testing.assert_allclose(sharded['logits'], logits, atol=1e-5)
    np.testing.assert_array_equal(sharded['tokens'], tokens)


# --- Conversion (train.convert.to_mla, train.convert --to_mla --latent_groups)

@pytest.mark.parametrize('model, rope_dims', [
    (dict(use_rope=False), 0), ({}, 16)],
    ids=['nope_gqa', 'rope_gqa_every_pair'])
def test_a_gqa_model_converted_at_a_groups_full_rank_keeps_its_logits(
    model, rope_dims):
  """The identity control for GLA: tiny GQA (K = 2, H = 8) into G = 2
  latents, each of its own KV head's 2·H - Y/2 features (a group's full
  rank), keeps energy 1 and the logits within 1e-4, and the cache's bytes;
  half that rank moves the logits. G = 1 gives MLA's conversion."""
  config = tiny.get_config()
  config.model.update(**model)
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=3))
  tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, mc.vocab_size)
  source = _full_pass(mc, params, tokens)
  scores = to_mla.calibration_scores(mc, params, tokens) if mc.use_rope else (
      None)
  full = 2 * mc.num_kv_heads * mc.head_dim - rope_dims
  converted, new_mc, energy = to_mla.convert_params(
      params, mc, full, rope_dims, scores, latent_groups=2)
  assert new_mc.layout.latent_groups == 2
  assert new_mc.layout.kv_lora_rank == full
  assert model_lib.kv_bytes_per_token(new_mc) == model_lib.kv_bytes_per_token(
      mc)
  np.testing.assert_allclose(energy, 1.0, rtol=1e-9)
  chex.assert_trees_all_close(_full_pass(new_mc, converted, tokens), source,
                              atol=1e-4)
  low, low_mc, low_energy = to_mla.convert_params(
      params, mc, full // 2, rope_dims, scores, latent_groups=2)
  assert all(e < 1 for e in low_energy)
  assert float(jnp.max(jnp.abs(_full_pass(low_mc, low, tokens) - source))
               ) > 1e-2
  one = to_mla.convert_params(params, mc, full // 2, rope_dims, scores)
  mla = to_mla.convert_params(params, mc, full // 2, rope_dims, scores,
                              latent_groups=1)
  chex.assert_trees_all_equal(one[0], mla[0])
  assert one[1] == mla[1] and one[1].layout.latent_groups == 1


@pytest.mark.parametrize('model, flags, message', [
    ({}, [8, 4, 3], r"--latent_groups=3: give a divisor of the source's K=2 "
     r'KV heads \(1, 2\)'),
    (dict(use_rope=False), [9, 0, 2], r'--kv_lora_rank=9 with '
     r'--latent_groups=2: give a multiple of 2 from 2 to 32, 2 times a '
     r"group's full rank: min\(d_model = 32, \(2·K·H - --qk_rope_head_dim\) "
     r'/ 2 = 16\)'),
    ({}, [30, 4, 2], r'--kv_lora_rank=30 with --latent_groups=2: give a '
     r'multiple of 2 from 2 to 28'),
])
def test_to_gla_refuses_what_it_cannot_convert_in_one_line(model, flags,
                                                           message):
  config = tiny.get_config()
  config.model.update(**model)
  mc = config_lib.model_config(config)
  with pytest.raises(UserError, match=message):
    to_mla.check_source(mc, *flags)


@pytest.mark.slow  # A subprocess: 2-5 s.
def test_latent_groups_without_to_mla_is_refused_in_one_line(tmp_path):
  from tests.test_faults import _one_line_error, _run  # pylint: disable=import-outside-toplevel
  result = _run('train.convert', f'--source={tmp_path / "src"}',
                f'--workdir={tmp_path / "new"}', '--latent_groups=2')
  _one_line_error(result, '--latent_groups splits the latent of --to_mla; '
                  'give it with --to_mla')
  assert not (tmp_path / 'new').exists()


# --- Accelerators ----------------------------------------------------------

@pytest.mark.slow
def test_the_gla_train_and_decode_steps_lower_for_tpu_and_cuda():
  """jax.export lowers a bfloat16 G=2 model's train step and decode step
  (int8 latents too) for TPU and CUDA on this host; for TPU the decode step
  transposes, broadcasts, copies or converts nothing of the latent cache's
  size (its groups are read in place), which the control, a converted
  copy, fails."""
  G, batch = 2, 4
  config = _config(G, mla=dict(q_lora_rank=12), dtype='bfloat16',
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
  size = batch * mc.max_len * A
  for kv_cache_dtype in (None, 'int8'):
    mc_ = dataclasses.replace(mc, kv_cache_dtype=kv_cache_dtype)
    decoder, params = unroll_layers(
        Transformer(mc_, decode=True),
        nn.unbox(loop.init_params(Transformer(mc_), 0)))
    cache = inference.empty_cache(decoder, batch)
    assert cache['layers_0']['attention']['cached_latent'].shape == (
        batch * G, mc.max_len, A // G)
    decode = lambda params, cache, token: decoder.apply(
        {'params': params, 'cache': cache}, token, mutable=['cache'])
    token = jnp.zeros((batch, 1), jnp.int32)
    assert 'dot_general' in hlo.lowered(decode, params, cache, token,
                                        platform='cuda')
    text = hlo.lowered(decode, params, cache, token, platform='tpu')
    assert not hlo.big_shapes(text, size)
  assert hlo.big_shapes(hlo.lowered(
      lambda c: c.astype(jnp.bfloat16) * 2,
      jnp.zeros((batch * G, mc.max_len, A // G), jnp.int8), platform='tpu'),
                        size)
