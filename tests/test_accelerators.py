"""The TPU and GPU paths, proven on a CPU host.

Pallas kernels run here in interpret mode against the same repeat-K/V
reference as every other path; `jax.export` lowers for 'tpu' and 'cuda'
without the hardware, and the TPU module text must contain the kernel.
"""

import json
import pathlib
import re
import subprocess
import sys

from absl.testing import parameterized
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention import Attention, core, dot_product_attention, splash
from configs import gqa_base, mha_base, mqa_base
from tests import hlo, host_devices, reference
from tests.conftest import OPTIMIZED
from lm import config_lib
from lm import inference
from train import loop
from lm.model import Transformer, unroll_layers

B, N, H = 1, 8, 32
KERNEL = 'tpu_custom_call'  # How a Pallas TPU (Mosaic) kernel is lowered.


def _inputs(K, T, S, dtype=jnp.float32):
  return reference.inputs(B, T, S, N, K, H, dtype, seed=K * 1000 + T + S)


class SplashTest(chex.TestCase):

  @parameterized.named_parameters(
      ('mha_causal', 8, 128, 128, dict(is_causal=True)),
      ('gqa_causal_t_below_s', 2, 128, 256, dict(is_causal=True)),
      ('mqa_causal_window', 1, 256, 256, dict(is_causal=True,
                                              local_window=40)),
      ('gqa_window_both_sides', 4, 128, 128, dict(local_window=24)),
      ('gqa_soft_cap', 2, 128, 128, dict(is_causal=True, logits_soft_cap=2.0)),
      ('mqa_full_t_below_s', 1, 128, 256, {}),
  )
  @pytest.mark.slow
  def test_interpret_mode_matches_reference_forward_and_gradients(
      self, K, T, S, opts):
    q, k, v, ct = _inputs(K, T, S)
    ours = jax.jit(lambda q, k, v: dot_product_attention(
        q, k, v, implementation='splash', **opts))
    ref = lambda q, k, v: reference.reference_attention(q, k, v, **opts)
    chex.assert_trees_all_close(ours(q, k, v), ref(q, k, v), atol=2e-5)
    grads = [jax.grad(lambda q, k, v: jnp.vdot(ct, f(q, k, v)),
                      argnums=(0, 1, 2))(q, k, v) for f in (ours, ref)]
    chex.assert_shape(grads[0][1:], (B, S, K, H))  # dK, dV: K heads, summed.
    chex.assert_trees_all_close(grads[0], grads[1], atol=2e-4, rtol=2e-4)

  @pytest.mark.slow
  def test_lengths_off_the_block_go_to_the_dense_path(self):
    q, k, v, _ = _inputs(2, 200, 200)  # 200: no block of 128 divides it.
    with self.assertRaisesRegex(ValueError, "implementation='splash' cannot "
                                'take this call: T=200 and S=200 must be '
                                'multiples of 128'):
      dot_product_attention(q, k, v, is_causal=True, implementation='splash')
    auto = lambda q, k, v: dot_product_attention(q, k, v, is_causal=True)
    self.assertNotIn(KERNEL, hlo.lowered(auto, q, k, v, platform='tpu'))
    chex.assert_trees_all_close(
        auto(q, k, v), reference.reference_attention(q, k, v, is_causal=True),
        atol=2e-5)
    q, k, v, _ = _inputs(2, 256, 256)  # The control: a multiple of 128.
    self.assertIn(KERNEL, hlo.lowered(auto, q, k, v, platform='tpu'))

  def test_block_sizes_are_the_largest_that_divide(self):
    self.assertEqual(splash.block_size(8192), 512)
    self.assertEqual(splash.block_size(768), 256)
    self.assertEqual(splash.block_size(384), 128)
    self.assertIsNone(splash.block_size(100))

  def test_an_explicit_mask_is_refused_not_ignored(self):
    q, k, v, _ = _inputs(2, 128, 128)
    with self.assertRaisesRegex(ValueError, 'explicit mask'):
      dot_product_attention(q, k, v, mask=jnp.ones((B, 128), bool),
                            implementation='splash')


@pytest.mark.slow
@pytest.mark.cpu_only  # What a host without cuDNN chooses.
def test_each_platform_chooses_its_kernel():
  def chosen(T, S, dtype=jnp.bfloat16, **opts):
    q, k, v, _ = _inputs(2, T, S, dtype)
    call = core._Call(q, k, v, opts.pop('mask', None),
                      opts.get('is_causal', False), H**-0.5,
                      opts.get('local_window'), opts.get('logits_soft_cap'))
    return {p: core.choose(p, call) for p in core.PLATFORMS}
  # Training and prefill shapes.
  assert chosen(512, 512, is_causal=True) == {
      'cpu': 'blockwise', 'tpu': 'splash', 'cuda': 'xla'}  # No cuDNN here.
  assert chosen(256, 256, local_window=64, is_causal=True)['tpu'] == 'splash'
  assert chosen(256, 256, mask=jnp.ones((B, 256), bool))['tpu'] == 'xla'
  # Decoding: the grouped einsum reads the cache in place on accelerators.
  assert chosen(1, 1024, is_causal=True) == {
      'cpu': 'short_query', 'tpu': 'xla', 'cuda': 'xla'}


@pytest.mark.cpu_only  # What a host without cuDNN chooses.
def test_cudnn_refuses_what_it_cannot_take_in_one_message():
  q, k, v, _ = _inputs(2, 128, 128, jnp.bfloat16)
  for args, message in [
      (dict(q=q.astype(jnp.float32)), 'bfloat16 or float16'),
      (dict(local_window=16), 'a local_window needs is_causal'),
      (dict(is_causal=True, k=k[:, :64], v=v[:, :64]), 'T == S'),
      (dict(is_causal=True), 'cuDNN is not present'),
  ]:
    call = {'q': q, 'k': k, 'v': v, **args}
    with pytest.raises(ValueError, match="implementation='cudnn' cannot take "
                       f'this call: .*{message}'):
      dot_product_attention(call.pop('q'), call.pop('k'), call.pop('v'),
                            implementation='cudnn', **call)


@pytest.mark.parametrize('K', [8, 2, 1])
def test_attention_and_gradient_lower_for_tpu_with_the_kernel_and_for_cuda(K):
  q, k, v, _ = _inputs(K, 256, 512, jnp.bfloat16)  # T != S: see below.
  fwd_bwd = lambda q, k, v: jax.value_and_grad(
      lambda q, k, v: dot_product_attention(q, k, v, is_causal=True).astype(
          jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
  tpu = hlo.lowered(fwd_bwd, q, k, v, platform='tpu')
  assert tpu.count(KERNEL) >= 3  # Forward, dQ and dK/dV kernels.
  # No N-head copy of K or V, [B, S, N, H] or heads-major: GQA stays native.
  copies = [f'tensor<{B}x512x{N}x{H}x', f'tensor<{B}x{N}x512x{H}x']
  assert K == N or not any(c in tpu for c in copies)
  # CUDA without cuDNN at trace time: the grouped einsum, forward and
  # backward, with no N-head copy of K or V either.
  cuda = hlo.lowered(fwd_bwd, q, k, v, platform='cuda')
  assert hlo.grouped_matmuls(cuda, K, N // K) >= 2
  assert K == N or not any(c in cuda for c in copies)


@pytest.mark.slow
def test_attention_module_lowers_for_tpu_with_the_kernel():
  layer = Attention(num_heads=N, num_kv_heads=2, head_dim=H,
                    dtype=jnp.bfloat16, local_window=128)
  x = jnp.zeros((2, 256, 64), jnp.bfloat16)
  params = layer.init(jax.random.key(0), x)['params']
  apply = lambda p, x: layer.apply({'params': p}, x)
  assert KERNEL in hlo.lowered(apply, params, x, platform='tpu')
  cuda = hlo.lowered(apply, params, x, platform='cuda')
  assert KERNEL not in cuda
  # Traced where cuDNN is (a GPU machine), CUDA gets its fused attention;
  # elsewhere the grouped einsum.
  assert (hlo.cudnn_attention(cuda) if core.cudnn_available() else
          hlo.grouped_matmuls(cuda, 2, N // 2) >= 1)


# Gemma 2's conventions on gqa_base: local/global layers, soft caps, a query
# scale and post-norms, all of which the splash kernel must take.
GEMMA2_LIKE = dict(attention_pattern='LG', local_window=512, post_norms=True,
                   logits_soft_cap=50.0, final_logits_soft_cap=30.0,
                   query_pre_attn_scalar=48.0)


@pytest.mark.slow
@pytest.mark.parametrize('base, model_options', [
    (mha_base, {}), (gqa_base, {}), (mqa_base, {}), (gqa_base, GEMMA2_LIKE)],
    ids=['mha_base', 'gqa_base', 'mqa_base', 'gqa_base_gemma2_like'])
def test_base_train_steps_lower_for_tpu_with_the_kernel_and_for_cuda(
    base, model_options):
  config = base.get_config()
  config.model.update(model_options)
  config_lib.validate(config, batch_shards=1)
  mc = config_lib.model_config(config)
  assert mc.dtype == jnp.bfloat16
  model = Transformer(mc)
  tx, _ = loop.make_optimizer(config.train)
  state = jax.eval_shape(lambda: loop.init_state(model, tx, 0))
  tokens = jax.ShapeDtypeStruct((8, config.data.seq_len + 1), jnp.int32)
  step = lambda s, b: loop.train_step(s, b, model=model, tx=tx,
                                      accum_steps=1)
  assert KERNEL in hlo.lowered(step, state, tokens, platform='tpu')
  cuda = hlo.lowered(step, state, tokens, platform='cuda')
  N, K = mc.num_heads, mc.num_kv_heads
  assert KERNEL not in cuda
  assert (hlo.cudnn_attention(cuda) if core.cudnn_available() and
          not model_options.get('logits_soft_cap') else
          hlo.grouped_matmuls(cuda, K, N // K) >= 2)


@pytest.mark.slow
@pytest.mark.parametrize('options', [
    {}, dict(local_window=256), dict(kv_cache_dtype='int8'),
    dict(local_window=256, kv_cache_dtype='int8')],
    ids=['global', 'ring', 'int8', 'ring_int8'])
def test_decode_step_lowered_for_tpu_copies_no_cache_sized_buffer(options):
  """Nothing of the cache's size is copied, transposed, broadcast or
  converted: an int8 cache goes into the matmuls as int8."""
  batch, max_len, D, K = 4, 1024, 256, 2
  layer = Attention(num_heads=N, num_kv_heads=K, head_dim=H, decode=True,
                    dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, **options)
  variables = layer.init(jax.random.key(0),
                         jnp.zeros((batch, max_len, D), jnp.bfloat16))
  step = lambda cache, x: layer.apply(
      {'params': variables['params'], 'cache': cache}, x, mutable=['cache'])
  text = hlo.lowered(step, variables['cache'], jnp.zeros((batch, 1, D),
                                                      jnp.bfloat16),
                  platform='tpu')
  cache_size = variables['cache']['cached_value'].size
  assert cache_size == batch * K * H * options.get('local_window', max_len)
  assert not hlo.big_shapes(text, cache_size)
  # The control: copying K/V per query head, the seeds' method, is caught.
  cache = jnp.zeros((batch, max_len, K, H), jnp.bfloat16)
  repeat = lambda q, k, v: reference.attention_repeated(
      q, jnp.repeat(k, N // K, 2), jnp.repeat(v, N // K, 2),
      jnp.ones((batch, N, 1, max_len), bool))
  control = hlo.lowered(repeat, jnp.zeros((batch, 1, N, H), jnp.bfloat16),
                     cache, cache, platform='tpu')
  assert hlo.big_shapes(control, cache_size)
  # And a dequantized copy of an int8 cache would be.
  dequantize = lambda c: c.astype(jnp.bfloat16) * 2
  assert hlo.big_shapes(hlo.lowered(dequantize, jnp.zeros((batch, max_len, K, H),
                                                    jnp.int8),
                              platform='tpu'), cache_size)


@pytest.mark.slow
def test_model_decode_step_with_patterns_sharing_and_int8_lowers_for_tpu_in_place():
  """The whole model's decode step (local and global layers, K/V shared by
  pairs, int8 caches) copies no buffer the size of its smallest cache."""
  config = config_lib.load('tiny')
  config.model.update(num_layers=4, d_model=64, num_heads=N, num_kv_heads=2,
                      head_dim=H, max_len=1024, local_window=256,
                      attention_pattern='LLGG', kv_share=2,
                      kv_cache_dtype='int8', dtype='bfloat16',
                      param_dtype='bfloat16')
  mc = config_lib.model_config(config)
  model, params = unroll_layers(
      Transformer(mc, decode=True),
      nn.unbox(loop.init_params(Transformer(mc), 0)))
  batch = 4
  cache = inference.empty_cache(model, batch)
  step = lambda params, cache, token: model.apply(
      {'params': params, 'cache': cache}, token, mutable=['cache'])
  text = hlo.lowered(step, params, cache, jnp.zeros((batch, 1), jnp.int32),
                  platform='tpu')
  assert not hlo.big_shapes(text, batch * 2 * H * 256)


@pytest.mark.slow
@pytest.mark.parametrize('base', [mha_base, gqa_base, mqa_base],
                         ids=lambda m: m.__name__.split('.')[-1])
@pytest.mark.slowest
def test_base_configs_train_in_bfloat16_close_to_float32(base):
  """Three steps of the real *_base models (72-85M parameters) on CPU.

  bf16 must be finite and learn in all three; its closeness to f32 is checked
  on gqa_base. mha_base and mqa_base differ from it only in K, so they run
  two of their layers: the same widths and heads, a sixth of the time.
  """
  config = base.get_config()
  config.train.update(warmup_steps=1, learning_rate=1e-3)
  if base is not gqa_base:
    config.model.num_layers = 2
  batch = jax.random.randint(jax.random.key(0), (2, 65), 0, 256)
  # Parameters are float32 whatever the compute dtype: one start for both.
  model = Transformer(config_lib.model_config(config))
  tx, _ = loop.make_optimizer(config.train)
  start = jax.jit(lambda: loop.init_state(model, tx, seed=0),
                  compiler_options=OPTIMIZED)()
  losses = {}
  for dtype in ('bfloat16', 'float32') if base is gqa_base else ('bfloat16',):
    config.model.dtype = dtype
    model = Transformer(config_lib.model_config(config))
    step = jax.jit(lambda s, b, model=model: loop.train_step(
        s, b, model=model, tx=tx, accum_steps=1), compiler_options=OPTIMIZED)
    state, losses[dtype] = start, []
    for _ in range(3):  # The first update has warmup's learning rate 0.
      state, metrics = step(state, batch)
      losses[dtype].append(float(metrics['loss']))
  assert np.all(np.isfinite(losses['bfloat16'])), losses
  if 'float32' in losses:
    np.testing.assert_allclose(losses['bfloat16'], losses['float32'],
                               rtol=2e-2)
  assert losses['bfloat16'][2] < losses['bfloat16'][0]  # It learns.


@pytest.mark.slowest
@pytest.mark.slow
@pytest.mark.cpu_only
def test_splash_runs_per_shard_under_a_mesh_that_splits_heads():
  """8 simulated devices: tensor divides K, and K < tensor (replicated KV)."""
  env = host_devices.env(8)
  result = subprocess.run(
      [sys.executable, '-m', 'tests.splash_mesh_runs'], env=env,
      cwd=pathlib.Path(__file__).parent.parent, capture_output=True,
      text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  errors = json.loads(result.stdout.strip().splitlines()[-1])
  assert len(errors) == 4
  for name, (forward, grads) in errors.items():
    assert forward < 2e-5 and max(grads) < 2e-4, (name, forward, grads)


@pytest.mark.slowest
@pytest.mark.slow
def test_the_prepared_device_command_runs_end_to_end(tmp_path):
  """scripts.accelerator_check --quick: every part, at tiny sizes, on CPU."""
  result = subprocess.run(
      [sys.executable, '-m', 'scripts.accelerator_check', '--quick',
       f'--out={tmp_path}'], cwd=pathlib.Path(__file__).parent.parent,
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  report = (tmp_path / 'accelerator.md').read_text()
  assert re.search(r'Tests on the device: 1 passed', report), report
  assert '| 256 | 1 | fwd+bwd |' in report
  assert 'Training tiny for 4 steps' in report and 'MFU' in report
  results = json.loads((tmp_path / 'accelerator.json').read_text())
  assert [r['K'] for r in results['decode']['rows']] == [4, 1]
  assert all(r['tokens_per_sec'] > 0 for r in results['decode']['rows'])
