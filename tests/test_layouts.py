"""Every registered layout passes the same checks, with no code of its own.

The registry (`attention.layout`) holds the built-in layouts ('gqa', 'mla',
'gta') and, imported here, tests/toy_layout.py's 'toy_concat', which lives
in the tests alone. Each is run at its defaults on the `tiny` model (K = 2
KV heads, or as many as the query heads where the layout takes no other):

  cached decoding, prompt fed in chunks, equals the full pass (global and
  local layers); a paged pool equals the dense cache; an int8 cache stays
  close; the KV byte count equals the bytes the caches allocate; the train
  and decode steps lower for TPU and CUDA (jax.export); it trains, samples,
  serves and evaluates (`layout_runs`); and a tensor=2 mesh trains to one
  device's losses (tests/layout_mesh_runs.py, 2 simulated devices).
"""

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import layout as layout_lib
from configs import tiny
from serve import engine as engine_lib
from serve import runner as paged
from tests import hlo, host_devices, toy_layout  # pylint: disable=unused-import
from lm import checkpoint, config_lib, evaluator, sampling
from lm import inference as sample
from lm import model as model_lib
from train import loop

LAYOUTS = layout_lib.names()
PROMPT_CHUNKS = (5, 1, 1, 5)  # 12 tokens: a prefill, two steps, a chunk.


def config_for(name: str, **model):
  """`tiny` with layout `name` at its defaults: K = 2 KV heads, or num_heads
  where the layout refuses 2 (MLA rebuilds every head's K/V)."""
  for kv_heads in (2, tiny.get_config().model.num_heads):
    config = tiny.get_config()
    config.model.update(attention=name, num_kv_heads=kv_heads, **model)
    try:
      config_lib.validate(config, batch_shards=1)
      return config
    except Exception:  # pylint: disable=broad-except
      continue
  config_lib.validate(config, batch_shards=1)  # Raises: the layout's reason.
  return config


def params_for(mc, seed: int = 0):
  return nn.unbox(loop.init_params(model_lib.Transformer(mc), seed))


def tokens_for(mc, B: int = 2, T: int = sum(PROMPT_CHUNKS), seed: int = 1):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, mc.vocab_size)


def full_logits(mc, params, tokens_BT):
  return model_lib.Transformer(mc).apply({'params': params}, tokens_BT)


def chunked_logits(mc, params, tokens_BT, chunks=PROMPT_CHUNKS):
  """The logits of tokens_BT fed through the dense cache in chunks."""
  model, params = model_lib.unroll_layers(
      model_lib.Transformer(mc, decode=True), params)
  cache = sample.empty_cache(model, tokens_BT.shape[0], tokens_BT.shape[1])
  out, start = [], 0
  for size in chunks:
    logits, mutated = model.apply({'params': params, 'cache': cache},
                                  tokens_BT[:, start:start + size],
                                  mutable=['cache'])
    cache, start = mutated['cache'], start + size
    out.append(logits)
  return jnp.concatenate(out, axis=1), cache


def paged_logits(mc, params, tokens_BT, page_size: int = 4):
  """The logits of tokens_BT fed through a paged pool in PROMPT_CHUNKS, each
  row's pages scattered over the pool in reverse order."""
  B, T = tokens_BT.shape
  M = -(-T // page_size)
  model, params = paged.serving_model(mc, params)
  pool = paged.empty_pool(model.config, 1 + B * M, page_size)
  table_BM = (1 + jnp.arange(B * M)[::-1]).reshape(B, M)
  out, start = [], 0
  for size in PROMPT_CHUNKS:
    logits, pool = paged.forward(model, params, pool,
                                 tokens_BT[:, start:start + size], table_BM,
                                 jnp.full((B,), start))
    out.append(logits)
    start += size
  return jnp.concatenate(out, axis=1)


def test_the_registry_holds_the_built_in_layouts_and_the_toy():
  assert {'gqa', 'mla', 'gta', 'toy_concat'} <= set(LAYOUTS)
  with pytest.raises(ValueError, match="attention='nope' is no layout; use "
                     "one of 'gqa', 'mla', 'gta'"):
    layout_lib.get('nope')
  with pytest.raises(ValueError, match="'gqa' is registered already"):
    layout_lib.register(type('Again', (toy_layout.ToyConcat,), {
        'name': 'gqa', '__annotations__': {}}))


@pytest.mark.parametrize('name', LAYOUTS)
@pytest.mark.parametrize('model', [
    {}, dict(attention_pattern='LG', local_window=4)], ids=['global', 'local'])
def test_cached_decoding_equals_the_full_pass(name, model):
  mc = config_lib.model_config(config_for(name, **model))
  params, tokens = params_for(mc), tokens_for(mc)
  got, _ = chunked_logits(mc, params, tokens)
  chex.assert_trees_all_close(got, full_logits(mc, params, tokens),
                              atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('name', LAYOUTS)
def test_a_paged_pool_equals_the_dense_cache(name):
  mc = config_lib.model_config(config_for(name))
  params, tokens = params_for(mc), tokens_for(mc)
  chex.assert_trees_all_close(paged_logits(mc, params, tokens),
                              chunked_logits(mc, params, tokens)[0],
                              atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('name', LAYOUTS)
def test_an_int8_cache_stays_close_to_the_float_one(name):
  mc = config_lib.model_config(config_for(name))
  params, tokens = params_for(mc), tokens_for(mc)
  exact = full_logits(mc, params, tokens)
  int8 = dataclasses.replace(mc, kv_cache_dtype='int8')
  dense, cache = chunked_logits(int8, params, tokens)
  assert {leaf.dtype for leaf in jax.tree.leaves(cache)} >= {
      jnp.dtype(jnp.int8)}
  for got in (dense, paged_logits(int8, params, tokens)):
    error = float(jnp.max(jnp.abs(got - exact)))
    assert 0 < error < 0.05 * float(jnp.max(jnp.abs(exact))), error


@pytest.mark.parametrize('name', LAYOUTS)
@pytest.mark.parametrize('kv_cache_dtype', [None, 'int8'])
def test_the_byte_count_is_what_the_caches_allocate(name, kv_cache_dtype):
  config = config_for(name, attention_pattern='LG', local_window=4,
                      kv_cache_dtype=kv_cache_dtype)
  mc = config_lib.model_config(config)
  B, L = 3, mc.max_len
  cache = sample.empty_cache(model_lib.Transformer(mc, decode=True), B, L)
  allocated = sum(x.nbytes for path, x in jax.tree.leaves_with_path(cache)
                  if 'cache_index' not in jax.tree_util.keystr(path))
  assert model_lib.kv_cache_bytes(mc, B, L) == allocated
  pool = paged.empty_pool(mc, 7, 4)
  assert paged.page_bytes(mc, 4) * 7 == sum(
      x.nbytes for x in jax.tree.leaves(pool))


@pytest.mark.slow
@pytest.mark.parametrize('name', LAYOUTS)
def test_the_train_and_decode_steps_lower_for_tpu_and_cuda(name):
  config = config_for(name)
  config.model.update(dtype='bfloat16')
  mc = config_lib.model_config(config)
  model = model_lib.Transformer(mc)
  tx, _ = loop.make_optimizer(config.train)
  state = jax.eval_shape(lambda: loop.init_state(model, tx, 0))
  tokens = jax.ShapeDtypeStruct((4, config.data.seq_len + 1), jnp.int32)
  train_step = lambda s, b: loop.train_step(s, b, model=model, tx=tx,
                                            accum_steps=1)
  decoder, params = model_lib.unroll_layers(
      model_lib.Transformer(mc, decode=True), params_for(mc))
  cache = jax.eval_shape(lambda: sample.empty_cache(decoder, 2, 16))
  decode_step = lambda p, c, t: decoder.apply(
      {'params': p, 'cache': c}, t, mutable=['cache'])
  token = jax.ShapeDtypeStruct((2, 1), jnp.int32)
  for platform in ('tpu', 'cuda'):
    assert 'func.func public @main' in hlo.lowered(
        train_step, state, tokens, platform=platform)
    assert 'func.func public @main' in hlo.lowered(
        decode_step, params, cache, token, platform=platform)


@pytest.fixture(scope='module')
def layout_runs(tmp_path_factory):
  """{name: workdir}: each layout's `tiny` trained 8 steps."""
  runs = {}
  for name in LAYOUTS:
    config = config_for(name)
    config.train.update(steps=8, eval_every=8, checkpoint_every=8,
                        log_every=4, warmup_steps=2)
    workdir = tmp_path_factory.mktemp(name)
    loop.train_and_evaluate(config, str(workdir))
    runs[name] = workdir
  return runs


@pytest.mark.slow
@pytest.mark.parametrize('name', LAYOUTS)
def test_it_trains_samples_serves_and_evaluates(name, layout_runs):
  workdir = layout_runs[name]
  losses = [json.loads(line)['loss'] for line in
            (workdir / 'metrics.jsonl').read_text().splitlines()
            if 'loss' in json.loads(line)]
  assert len(losses) >= 2 and np.all(np.isfinite(losses))
  assert losses[-1] < losses[0]
  mc, params, _ = checkpoint.load_workdir(str(workdir))
  assert mc.layout.name == name
  prompt = tokens_for(mc, B=1, T=6, seed=4)
  settings = sampling.rows([sampling.SamplingParams(temperature=1.0, seed=3)])
  sampled = np.asarray(sample.generate(
      params, prompt, settings, model=model_lib.Transformer(mc, decode=True),
      max_new_tokens=5))[0]
  engine = engine_lib.Engine(mc, params, kv_memory=64 * 2**10, page_size=4)
  outputs = list(engine.run([engine_lib.Request(
      'r', np.asarray(prompt[0]), 5,
      sampling.SamplingParams(temperature=1.0, seed=3))]))
  assert [o.tokens for o in outputs] == [list(sampled)]
  held_out = evaluator.evaluate_workdir(str(workdir))
  through_cache = evaluator.evaluate_workdir(str(workdir), through_cache=True)
  assert np.isfinite(held_out['eval_loss'])
  np.testing.assert_allclose(through_cache['eval_loss'],
                             held_out['eval_loss'], rtol=1e-4)


@pytest.mark.slow
@pytest.mark.slowest  # 20-28 s on 2 cores.
@pytest.mark.cpu_only  # Simulated host devices.
def test_a_tensor_parallel_mesh_trains_every_layout_as_one_device(tmp_path):
  """tensor=2 over 2 simulated devices (K/V heads, latent groups split
  where it divides them) gives one device's losses and held-out loss."""
  result = subprocess.run(
      [sys.executable, '-m', 'tests.layout_mesh_runs', str(tmp_path),
       *LAYOUTS], env=host_devices.env(2),
      cwd=pathlib.Path(__file__).parent.parent, capture_output=True,
      text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  got = json.loads(result.stdout.strip().splitlines()[-1])
  assert sorted(got) == sorted(LAYOUTS)
  for name in LAYOUTS:
    config = mesh_config(name, dict(data=1))
    one = tmp_path / f'{name}_one'
    loop.train_and_evaluate(config, str(one))
    expected = _summary(one)
    np.testing.assert_allclose(got[name]['losses'], expected['losses'],
                               rtol=2e-4, err_msg=name)
    np.testing.assert_allclose(got[name]['eval_loss'],
                               expected['eval_loss'], rtol=2e-4,
                               err_msg=name)


def mesh_config(name: str, mesh: dict):
  """tests/layout_mesh_runs.py's run of layout `name`: 4 steps on `mesh`."""
  config = config_for(name)
  config.train.update(steps=4, log_every=1, eval_every=4, checkpoint_every=4,
                      warmup_steps=1)
  config.mesh.update({**dict(data=1, fsdp=1, tensor=1), **mesh})
  return config


def _summary(workdir) -> dict:
  rows = [json.loads(line) for line in
          (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]
  return {'losses': [r['loss'] for r in rows if 'loss' in r],
          'eval_loss': [r['eval_loss'] for r in rows if 'eval_loss' in r][-1]}


# --- Workdirs written before layouts had names -----------------------------

FIXTURES = pathlib.Path(__file__).parent / 'fixtures'


@pytest.mark.parametrize('name, expected', [
    ('legacy_mla_workdir', "MLA(kv_lora_rank=16, q_lora_rank=None, "
     "qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, latent_groups=1, "
     "latent_norm=True, rope_pairs=None)"),
    ('legacy_gta_workdir', 'GTA(qk_rope_head_dim=4, rope_pairs=None)')])
def test_a_workdir_written_before_named_layouts_loads_and_samples(
    name, expected, tmp_path):
  """tests/fixtures/: `tiny` MLA and GTA runs of 4 steps written at 0af2894
  (config.json with the flat kv_lora_rank / tie_kv fields), with the
  logits and greedy tokens that commit computed: the same today."""
  workdir = tmp_path / name
  shutil.copytree(FIXTURES / name, workdir)
  assert 'kv_lora_rank' in (workdir / 'config.json').read_text()
  mc, params, tokenizer = sample.load_language_model(str(workdir))
  assert repr(mc.attention(0).layout) == expected
  record = json.loads((workdir / 'expected.json').read_text())
  tokens = jnp.asarray([tokenizer.encode(record['logits_of'])])
  np.testing.assert_allclose(
      full_logits(mc, params, tokens)[0],
      np.load(workdir / 'expected_logits.npy'), atol=1e-5)
  prompt = jnp.asarray([tokenizer.encode(record['prompt'])])
  greedy = sample.generate(params, prompt,
                           model=model_lib.Transformer(mc, decode=True),
                           max_new_tokens=len(record['greedy_tokens']))
  assert np.asarray(greedy)[0].tolist() == record['greedy_tokens']
