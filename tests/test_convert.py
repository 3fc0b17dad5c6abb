"""Specification of MHA -> GQA/MQA checkpoint conversion (`train.convert`)."""

import pathlib
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from lm import checkpoint, config_lib, data, evaluator
from train import convert, loop
from lm.model import Transformer
from infra.errors import UserError
from train.metrics import read_metrics

REPO = pathlib.Path(__file__).parent.parent


def test_pooling_takes_contiguous_groups_in_query_head_order():
  kernel = jnp.arange(1.0, 5.0).reshape(1, 4, 1)  # [D=1, K=4, H=1].
  np.testing.assert_array_equal(convert.pool_heads(kernel, 2, 'mean'),
                                [[[1.5], [3.5]]])
  np.testing.assert_array_equal(convert.pool_heads(kernel, 2, 'first'),
                                [[[1.0], [3.0]]])
  np.testing.assert_array_equal(convert.pool_heads(kernel, 1, 'mean'),
                                [[[2.5]]])


def _mha():
  config = tiny.get_config()
  config.model.num_kv_heads = 4
  mc = config_lib.model_config(config)
  return mc, nn.unbox(loop.init_params(Transformer(mc), seed=0))


def test_mean_pooling_is_lossless_when_grouped_heads_agree():
  mc, params = _mha()
  # Make K/V heads equal within each pair; pooling them to 2 loses nothing.
  def pair_up(path, x):
    name = jax.tree_util.keystr(path)
    if "['key']" in name or "['value']" in name:
      return jnp.repeat(x[..., ::2, :], 2, axis=-2)
    return x
  params = jax.tree_util.tree_map_with_path(pair_up, params)
  gqa_params, gqa_config = convert.convert_params(params, mc, 2, 'mean')
  assert gqa_config.num_kv_heads == 2
  chex.assert_shape(gqa_params['layers']['attention']['key'],
                    (mc.num_layers, mc.d_model, 2, mc.head_dim))
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
  chex.assert_trees_all_close(
      jax.jit(Transformer(gqa_config).apply)({'params': gqa_params}, tokens),
      jax.jit(Transformer(mc).apply)({'params': params}, tokens), atol=1e-5)


@pytest.mark.parametrize('method', ['mean', 'first', 'random'])
def test_methods_give_the_new_shapes_and_touch_only_key_and_value(method):
  mc, params = _mha()
  new, _ = convert.convert_params(params, mc, 1, method)
  for name in ('key', 'value'):
    chex.assert_shape(new['layers']['attention'][name],
                      (mc.num_layers, mc.d_model, 1, mc.head_dim))
  for name in ('query', 'out'):
    np.testing.assert_array_equal(new['layers']['attention'][name],
                                  params['layers']['attention'][name])
  np.testing.assert_array_equal(new['embed']['embedding'],
                                params['embed']['embedding'])


def _convert(*args):
  return subprocess.run([sys.executable, '-m', 'train.convert', *args],
                        cwd=REPO, capture_output=True, text=True, timeout=120)


def test_keeping_all_heads_is_an_exact_copy(trained, tmp_path):
  result = _convert(f'--source={trained}', f'--workdir={tmp_path}/copy',
                    '--num_kv_heads=-1')
  assert result.returncode == 0, result.stderr
  _, original, _ = checkpoint.load_workdir(str(trained))
  step, copied = checkpoint.restore_latest(str(tmp_path / 'copy'))
  assert step == 0  # A fresh start for uptraining, from the same weights.
  chex.assert_trees_all_equal(copied['params'], original)


@pytest.mark.slow
@pytest.mark.slowest  # 20-28 s on 2 cores.
def test_converted_workdir_uptrains_from_the_converted_weights(
    trained, tmp_path, capsys):
  result = _convert(f'--source={trained}', f'--workdir={tmp_path}/mqa',
                    '--num_kv_heads=1', '--method=mean')
  assert result.returncode == 0, result.stderr
  config = tiny.get_config()
  config.model.num_kv_heads = 1
  config.train.update(steps=5, log_every=1)
  mc, converted, _ = checkpoint.load_workdir(str(tmp_path / 'mqa'))
  # The first logged loss is step 0's: the converted weights on batch 0.
  batch = data.batch(data.load('', val_fraction=0.05, seq_len=32).train,
                     seed=config.seed, step=0, batch_size=8, seq_len=32)
  loss = lambda params: float(evaluator.loss_fn(params, Transformer(mc), batch))
  fresh = nn.unbox(loop.init_params(Transformer(mc), config.seed))
  record = loop.train_and_evaluate(config, str(tmp_path / 'mqa'))
  assert 'resuming from step 0' in capsys.readouterr().out
  first = read_metrics(tmp_path / 'mqa')[0]
  assert first['step'] == 1
  assert first['loss'] == pytest.approx(loss(converted), rel=1e-5)
  assert abs(loss(fresh) - loss(converted)) > 0.1  # Not a fresh start.
  assert np.isfinite(record['eval_loss'])
  assert checkpoint.restore_latest(str(tmp_path / 'mqa'))[0] == 5


def test_impossible_head_counts_are_one_line_errors(trained, tmp_path):
  result = _convert(f'--source={trained}', f'--workdir={tmp_path}/x',
                    '--num_kv_heads=3')
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      'error: --num_kv_heads=3: the source has 2 KV heads; pick a divisor of '
      '2 or -1']


def test_a_converted_workdir_uptrains_at_the_rate_its_source_ended_at(
    trained, tmp_path):
  """The uptraining recipe, not the from-scratch 1e-2 of configs/tiny.py:
  tiny's cosine ends at 1e-2 x 0.1; a conversion of a conversion keeps it."""
  convert.convert_workdir(str(trained), str(tmp_path / 'gqa'), 1, 'mean')
  convert.convert_workdir(str(tmp_path / 'gqa'), str(tmp_path / 'again'), 1,
                          'mean')
  for name in ('gqa', 'again'):
    config = config_lib.from_json(tmp_path / name / 'config.json')
    assert config.train.learning_rate == pytest.approx(1e-3)
    assert (config.train.warmup_steps, config.train.min_learning_rate_ratio,
            config.model.param_dtype) == (1, 0.1, 'float32')


@pytest.mark.parametrize('method', [
    'mean', pytest.param('random', marks=pytest.mark.slow)])  # Inits a model.
def test_pooled_optimizer_carries_adam_moments_pooled_like_the_weights(
    trained, tmp_path, method):
  """--optimizer=pooled: the source's Adam moments, K/V heads pooled as the
  weights are (random: zeros for fresh heads), Adam's count carried and the
  schedule's restarted."""
  convert.convert_workdir(str(trained), str(tmp_path / 'mqa'), 1, method,
                          optimizer='pooled')
  _, source = checkpoint.restore_latest(str(trained))
  step, written = checkpoint.restore_latest(str(tmp_path / 'mqa'))
  assert step == 0
  adam, theirs = written['opt_state'][1][0], source['opt_state'][1][0]
  assert int(adam['count']) == int(theirs['count']) == 20
  assert int(written['opt_state'][1][2]['count']) == 0  # The schedule's.
  for name in ('mu', 'nu'):
    kv = adam[name]['layers']['attention']['key']  # [L, D, K, H]
    source_kv = theirs[name]['layers']['attention']['key']
    expected = (source_kv.mean(-2, keepdims=True) if method == 'mean'
                else np.zeros_like(kv))
    np.testing.assert_allclose(kv, expected, rtol=1e-6)
    chex.assert_trees_all_equal(adam[name]['layers']['mlp'],
                                theirs[name]['layers']['mlp'])


@pytest.mark.slow
def test_the_loop_resumes_a_pooled_optimizer_rather_than_a_fresh_one(
    trained, tmp_path):
  convert.convert_workdir(str(trained), str(tmp_path / 'mqa'), 1, 'mean',
                          optimizer='pooled')
  config = config_lib.from_json(tmp_path / 'mqa' / 'config.json')
  config.train.update(steps=2, log_every=1)
  loop.train_and_evaluate(config, str(tmp_path / 'mqa'))
  _, after = checkpoint.restore_latest(str(tmp_path / 'mqa'))
  assert int(after['opt_state'][1][0]['count']) == 22  # Carried on: 20 + 2.
  assert int(after['opt_state'][1][2]['count']) == 2


def test_pooled_optimizer_needs_a_source_that_has_one(trained, tmp_path):
  convert.convert_workdir(str(trained), str(tmp_path / 'gqa'), 1, 'mean')
  with pytest.raises(UserError, match='has no optimizer state'):
    convert.convert_workdir(str(tmp_path / 'gqa'), str(tmp_path / 'again'),
                            1, 'mean', optimizer='pooled')
  assert not (tmp_path / 'again' / 'config.json').exists()


# Command lines refused before anything is read: each case names what its one
# line must say.
_REFUSED = {
    'kv_lora_rank alone': (
        ['--source=S', '--workdir=W', '--kv_lora_rank=8'],
        '--kv_lora_rank is read only by --to_mla, not by a K/V-head '
        'conversion (--source with --workdir); give it with --to_mla'),
    'qk_rope_head_dim with K': (
        ['--source=S', '--workdir=W', '--qk_rope_head_dim=4',
         '--num_kv_heads=1'],
        '--qk_rope_head_dim is read only by --to_mla or --to_gta'),
    'tpa ranks without --to_tpa': (
        ['--source=S', '--to_hf=H', '--num_kv_heads=1'],
        '--num_kv_heads is read only by --from_hf or --to_gta or --to_tpa or '
        'a K/V-head conversion (--source with --workdir), not by --to_hf'),
    'param_dtype of an import': (
        ['--source=S', '--workdir=W', '--param_dtype=bfloat16'],
        '--param_dtype is read only by --from_hf, not by a K/V-head'),
    'optimizer on import': (
        ['--from_hf=H', '--workdir=W', '--optimizer=pooled'],
        '--optimizer is read only by a K/V-head conversion (--source with '
        '--workdir), not by --from_hf'),
    'mla rank on import': (
        ['--from_hf=H', '--workdir=W', '--kv_lora_rank=8'],
        '--kv_lora_rank is read only by --to_mla, not by --from_hf'),
    'seed with --to_mla': (
        ['--source=S', '--workdir=W', '--to_mla', '--kv_lora_rank=8',
         '--seed=1'], '--to_mla takes no --seed'),
    'two outputs': (
        ['--source=S', '--to_hf=H', '--to_gguf=G.gguf'],
        'give only one of --workdir, --to_hf, --to_gguf (not --to_hf and '
        '--to_gguf)'),
    'an output and a workdir': (
        ['--source=S', '--workdir=W', '--to_gguf=G.gguf'],
        'give only one of --workdir, --to_hf, --to_gguf'),
    'an import exported': (
        ['--from_hf=H', '--to_hf=X'],
        '--from_hf imports into a --workdir, not --to_hf'),
}


@pytest.mark.slow
def test_a_flag_the_command_does_not_read_is_one_line_not_ignored(tmp_path):
  """Every conversion-specific flag given without the command that reads it
  (and two outputs at once) is refused before any work, not ignored."""
  running = {case: subprocess.Popen(  # Together: each mostly imports jax.
      [sys.executable, '-m', 'train.convert', *args], cwd=tmp_path,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case, (args, _) in _REFUSED.items()}
  for case, process in running.items():
    _, stderr = process.communicate(timeout=300)
    says = _REFUSED[case][1]
    assert process.returncode == 1, (case, stderr)
    assert stderr.count('\n') == 1 and says in stderr, (case, stderr)
  assert not any(tmp_path.iterdir())
