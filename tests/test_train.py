"""Specification of the training program (`train.main`, `train.loop`)."""

import dataclasses
import json
import math
import pathlib
import signal
import subprocess
import sys
import time

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from attention import layer
from attention.latent import MLA
from attention.tied import GTA
from configs import tiny
from lm import checkpoint, config_lib, data, evaluator, flops
from train import loop
from lm import model as model_lib
from infra.errors import UserError
from lm.model import Transformer, unroll_layers
from train.metrics import read_metrics

REPO = pathlib.Path(__file__).parent.parent


def _config(**overrides):
  config = tiny.get_config()
  for dotted, value in overrides.items():
    section, field = dotted.split('__')
    config[section][field] = value
  return config


def _main(*args, timeout=120):
  return subprocess.run(
      [sys.executable, '-m', 'train.main', *args], cwd=REPO,
      capture_output=True, text=True, timeout=timeout)


def test_tiny_trains_and_its_loss_falls(tmp_path):
  record = loop.train_and_evaluate(_config(train__steps=40), str(tmp_path))
  metrics = read_metrics(tmp_path)
  assert [m['step'] for m in metrics] == list(range(5, 45, 5))
  assert metrics[-1]['loss'] < metrics[0]['loss'] - 1.0
  assert record['eval_loss'] < math.log(256) - 1.0  # Well below uniform.
  for m in metrics:
    assert m['tokens_per_sec'] > 0 and 0 < m['mfu'] < 1
  assert 'eval_loss' in metrics[-1] and 'eval_bpb' in metrics[-1]
  assert list((tmp_path / 'tensorboard').iterdir())


def test_tensorboard_events_hold_the_logged_scalars_without_importing_torch(
    tmp_path):
  """tensorboardX would import PyTorch, when installed, to accept its
  tensors: a second or two of every run's start, for scalars that are
  floats. The writer leaves it out, and torch still imports afterwards."""
  script = (
      'import sys\n'
      'from train.metrics import MetricsWriter\n'
      f'writer = MetricsWriter({str(tmp_path)!r}, 2)\n'
      'shown = {"step_time": 0.5, "tokens_per_sec": 8.0, "mfu": 0.25}\n'
      'writer.log(1, {"loss": 2.5, "note": "text", **shown})\n'
      'writer.log(2, {"loss": 1.5, **shown})\n'
      'writer.close()\n'
      'print("torch" in sys.modules)\n'
      'import torch\n')
  result = subprocess.run([sys.executable, '-c', script], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split()[-1] == 'False'
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  (events_file,) = (tmp_path / 'tensorboard').iterdir()
  data, scalars, at = events_file.read_bytes(), {}, 0
  while at < len(data):  # TFRecords: length, its CRC, the event, its CRC.
    length = int.from_bytes(data[at:at + 8], 'little')
    event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
    scalars.update({(event.step, v.tag): v.simple_value
                    for v in event.summary.value})
    at += 12 + length + 4
  shown = {'step_time': 0.5, 'tokens_per_sec': 8.0, 'mfu': 0.25}
  assert scalars == {(step, tag): value for step, loss in ((1, 2.5), (2, 1.5))
                     for tag, value in {'loss': loss, **shown}.items()}


def _params(workdir):
  return checkpoint.restore_latest(str(workdir))[1]


def test_stopped_and_resumed_run_is_bit_identical_to_a_straight_run(tmp_path):
  config = _config(train__steps=20, train__checkpoint_every=100)
  loop.train_and_evaluate(config, str(tmp_path / 'straight'))

  calls = []
  stop_after_7 = lambda: calls.append(1) or len(calls) == 7
  record = loop.train_and_evaluate(config, str(tmp_path / 'resumed'),
                                   should_stop=stop_after_7)
  assert record['stopped_at'] == 7
  assert checkpoint.restore_latest(str(tmp_path / 'resumed'))[0] == 7
  loop.train_and_evaluate(config, str(tmp_path / 'resumed'))

  chex.assert_trees_all_equal(_params(tmp_path / 'straight'),
                              _params(tmp_path / 'resumed'))
  straight = read_metrics(tmp_path / 'straight')
  resumed = read_metrics(tmp_path / 'resumed')
  key = lambda ms: [(m['step'], m['loss'], m.get('eval_loss')) for m in ms
                    if m['step'] % 5 == 0]
  assert key(resumed) == key(straight)


def test_the_schedule_is_optaxs_warmup_cosine_from_traced_arguments():
  tc = _config(train__steps=100, train__warmup_steps=10,
               train__learning_rate=3e-3).train
  reference = optax.warmup_cosine_decay_schedule(
      0.0, 3e-3, 10, 100, end_value=3e-3 * tc.min_learning_rate_ratio)
  counts = jnp.arange(0, 120)
  rates = jax.jit(jax.vmap(loop.learning_rate, in_axes=(0, None)))(
      counts, loop.schedule_args(tc))
  np.testing.assert_allclose(rates, jax.vmap(reference)(counts), rtol=1e-5,
                             atol=1e-9)


@pytest.mark.slow
def test_runs_differing_in_schedule_share_one_program_and_equal_fresh_ones(
    tmp_path, capsys):
  """A study's runs reuse the compiled step; the result is the same as
  compiling it afresh."""
  config = _config(train__steps=10, train__learning_rate=5e-3)
  loop.train_and_evaluate(_config(train__steps=12), str(tmp_path / 'a'))
  shared = loop.train_and_evaluate(config, str(tmp_path / 'b'))
  assert 'reused the compiled train step' in capsys.readouterr().out
  loop._Programs._cache.clear()  # pylint: disable=protected-access
  fresh = loop.train_and_evaluate(config, str(tmp_path / 'c'))
  assert 'compiled the train step in' in capsys.readouterr().out
  chex.assert_trees_all_equal(_params(tmp_path / 'b'), _params(tmp_path / 'c'))
  assert shared['eval_loss'] == fresh['eval_loss']
  # Its own schedule (at its last step, 9 of 10), not the first run's.
  assert shared['learning_rate'] == pytest.approx(
      float(loop.learning_rate(9, loop.schedule_args(config.train))))


def test_evaluate_workdir_is_the_loops_evaluation_of_the_last_checkpoint(
    tmp_path):
  record = loop.train_and_evaluate(_config(), str(tmp_path))
  before = sorted(p.name for p in tmp_path.rglob('*'))
  evaluated = evaluator.evaluate_workdir(str(tmp_path))
  assert evaluated['eval_loss'] == pytest.approx(record['eval_loss'],
                                                 rel=1e-6)
  assert evaluated.keys() == {'eval_loss', 'eval_accuracy', 'eval_bpb'}
  assert sorted(p.name for p in tmp_path.rglob('*')) == before


def test_on_eval_can_end_a_run_early_as_finished(tmp_path):
  seen = []
  on_eval = lambda step, params, record: seen.append(
      (step, record['eval_loss'])) or step >= 10
  record = loop.train_and_evaluate(_config(train__eval_every=5),
                                   str(tmp_path), on_eval=on_eval)
  assert [step for step, _ in seen] == [5, 10]
  assert record['finished_early'] == 10 and 'stopped_at' not in record
  assert checkpoint.restore_latest(str(tmp_path))[0] == 10
  assert read_metrics(tmp_path)[-1]['step'] == 10


@pytest.mark.slowest
@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_a_rerun_resumes(tmp_path):
  args = ['--config=tiny', f'--workdir={tmp_path}',
          '--config.train.steps=300', '--config.train.log_every=1']
  proc = subprocess.Popen([sys.executable, '-m', 'train.main', *args],
                          cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  metrics = tmp_path / 'metrics.jsonl'
  deadline = time.time() + 90
  while not (metrics.exists() and metrics.read_text()) and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 128 + signal.SIGTERM, out
  stopped = int(out.split('stopped at step ')[1].split(';')[0])
  assert 0 < stopped < 300
  assert checkpoint.restore_latest(str(tmp_path))[0] == stopped

  resumed = _main(*args)
  assert resumed.returncode == 0, resumed.stderr
  assert f'resuming from step {stopped}' in resumed.stdout
  assert read_metrics(tmp_path)[-1]['step'] == 300
  steps = [m['step'] for m in read_metrics(tmp_path)]
  assert steps == sorted(set(steps))  # No step logged twice.


@pytest.mark.parametrize('args, message', [
    (['--config=nope'], "unknown config 'nope'; known: gqa_base"),
    (['--config=tiny', '--config.model.nope=1'],
     "unknown config field 'nope'"),
    (['--config=tiny', '--config.modle.steps=1'],
     "unknown config field 'modle' in --config.modle.steps"),
    # The one bad override named, not the good one beside it, and where the
    # field is.
    (['--config=tiny', '--config.model.num_kv_heads=1',
      '--config.train.seed=3'],
     "error: unknown config field 'seed' in --config.train.seed (did you mean "
     '--config.seed?); the fields are those of the config file'),
    (['--config=tiny', '--config.train.steps=ten'], 'config.train.steps=ten'),
    (['--config=tiny', '--config.model.num_kv_heads=3'],
     'model.num_heads=4 is not divisible by model.num_kv_heads=3'),
])
def test_bad_command_lines_print_one_line_and_exit_1(tmp_path, args, message):
  result = _main(*args, f'--workdir={tmp_path / "w"}')
  assert result.returncode == 1
  assert message in result.stderr
  assert 'Traceback' not in result.stderr + result.stdout
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert not (tmp_path / 'w' / 'checkpoints').exists()


def _write(path, content):
  path.write_bytes(content)
  return str(path)


@pytest.mark.parametrize('overrides, message', [
    (dict(train__batch_size=6, train__grad_accum_steps=4),
     'train.batch_size=6 does not split'),
    (dict(data__seq_len=64), 'data.seq_len=64 is longer than model.max_len=32'),
    (dict(data__path='/nonexistent/corpus.txt'), 'does not exist'),
    (dict(model__dtype='float8'), "model.dtype='float8'"),
    (dict(train__steps=0), 'train.steps=0 must be an integer >= 1'),
    (dict(data__task='mlm'), "data.task='mlm'; use 'lm'"),
    (dict(data__task='recall', data__recall_pairs=9),
     r'data.recall_pairs=9 does not fit.*use 1..8'),
])
def test_bad_configs_raise_one_line_user_errors(tmp_path, overrides, message):
  with pytest.raises(UserError, match=message):
    loop.train_and_evaluate(_config(**overrides), str(tmp_path))


def test_bad_data_files_raise_user_errors(tmp_path):
  empty = _write(tmp_path / 'empty.txt', b'')
  short = _write(tmp_path / 'short.txt', b'x' * 100)
  odd_bin = _write(tmp_path / 'odd.bin', b'abc')
  for path, message in ((empty, 'is empty'), (short, 'fewer than'),
                        (odd_bin, 'uint16')):
    with pytest.raises(UserError, match=message):
      loop.train_and_evaluate(_config(data__path=path), str(tmp_path / 'w'))
  big_vocab = _write(tmp_path / 'v.bin',
                     np.arange(4000, dtype=np.uint16).tobytes())
  with pytest.raises(UserError, match='set model.vocab_size >= 4000'):
    loop.train_and_evaluate(_config(data__path=big_vocab), str(tmp_path / 'w'))


def test_rerunning_a_finished_workdir_changes_nothing(tmp_path):
  config = _config(train__steps=10)
  first = loop.train_and_evaluate(config, str(tmp_path))
  files = {p: p.read_bytes() for p in tmp_path.rglob('*') if p.is_file()
           and 'tensorboard' not in p.parts}
  assert loop.train_and_evaluate(config, str(tmp_path)) == first
  assert {p: p.read_bytes() for p in files} == files
  # As if killed right after saving: final.json is written again from the
  # last checkpoint's evaluation (a study reads it), nothing else changes.
  (tmp_path / 'final.json').unlink()
  again = loop.train_and_evaluate(config, str(tmp_path))
  for key in ('eval_loss', 'eval_accuracy', 'kv_bytes_per_token'):
    assert again[key] == pytest.approx(first[key], rel=1e-6), key
  assert json.loads((tmp_path / 'final.json').read_text()) == again
  assert {p: p.read_bytes() for p in files if p.name != 'final.json'} == {
      p: b for p, b in files.items() if p.name != 'final.json'}


def test_workdir_holding_another_model_is_refused_and_kept(tmp_path):
  loop.train_and_evaluate(_config(train__steps=10), str(tmp_path))
  before = _params(tmp_path)
  with pytest.raises(UserError, match='holds another model.*new --workdir'):
    loop.train_and_evaluate(_config(model__num_kv_heads=1), str(tmp_path))
  chex.assert_trees_all_equal(_params(tmp_path), before)


def test_non_finite_loss_stops_naming_the_step_and_keeps_good_checkpoint(
    tmp_path):
  config = _config(train__learning_rate=1e12, train__checkpoint_every=1,
                   train__grad_clip=1e30, train__steps=20)
  with pytest.raises(UserError, match=r'non-finite .* at step (\d+).*last good '
                     r'checkpoint is step'):
    loop.train_and_evaluate(config, str(tmp_path))
  step, state = checkpoint.restore_latest(str(tmp_path))
  assert step < 20
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state['params']))


def test_text_folder_and_bin_sources(tmp_path):
  (tmp_path / 'docs').mkdir()
  for i in range(3):
    (tmp_path / 'docs' / f'{i}.txt').write_text('hello world ' * 200)
  folder = data.load(str(tmp_path / 'docs'), val_fraction=0.1, seq_len=32)
  assert folder.vocab_size == 256 and folder.bytes_per_token == 1.0
  assert len(folder.train) + len(folder.val) == 3 * 2400 + 2

  tokens = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.uint16)
  (tmp_path / 'nano').mkdir()
  tokens[:4000].tofile(tmp_path / 'nano' / 'train.bin')
  tokens[4000:].tofile(tmp_path / 'nano' / 'val.bin')
  nano = data.load(str(tmp_path / 'nano'), val_fraction=0.1, seq_len=32)
  np.testing.assert_array_equal(nano.val, tokens[4000:])
  assert nano.vocab_size == int(tokens.max()) + 1


def test_batches_are_a_pure_function_of_seed_and_step_and_shard_exactly():
  tokens = np.arange(10_000, dtype=np.uint16)
  kw = dict(batch_size=8, seq_len=16)
  b = data.batch(tokens, seed=3, step=5, **kw)
  np.testing.assert_array_equal(b, data.batch(tokens, seed=3, step=5, **kw))
  assert not np.array_equal(b, data.batch(tokens, seed=3, step=6, **kw))
  shards = [data.batch(tokens, seed=3, step=5, shard=i, num_shards=4, **kw)
            for i in range(4)]
  np.testing.assert_array_equal(np.concatenate(shards), b)
  np.testing.assert_array_equal(b[:, 1:], b[:, :-1] + 1)  # Contiguous windows.


def _model_config(**fields):
  """tiny's ModelConfig with `fields` changed."""
  config = tiny.get_config()
  config.model.update(fields)
  return loop.config_lib.model_config(config)


def test_flops_formula_against_a_hand_count():
  # L=1, D=4, N=2, K=1, H=2, F=8, V=10, T=4 (causal: C = (1+2+3+4)/4 = 2.5):
  # Q 2*4*2*2=32, out 32, K/V 2*2*4*1*2=32, scores+mix 2*2*2*2*2.5=40,
  # MLP 3*2*4*8=192, logits 2*4*10=80.
  model = _model_config(num_layers=1, d_model=4, num_heads=2, num_kv_heads=1,
                        head_dim=2, mlp_dim=8, vocab_size=10)
  assert flops.forward_flops_per_token(model, seq_len=4) == 408
  assert flops.training_flops_per_token(model, seq_len=4) == 3 * 408
  # A window of 2 sees (1+2+2+2)/4 = 1.75 keys on average.
  windowed = dataclasses.replace(model, local_window=2, attention_pattern='L')
  assert flops.forward_flops_per_token(windowed, seq_len=4) == 408 - 12
  # Two layers: global then local; sharing K/V saves the second's 32.
  two = dataclasses.replace(windowed, num_layers=2, attention_pattern='GL')
  per_layer = 408 - 80
  assert flops.forward_flops_per_token(two, seq_len=4) == (
      80 + per_layer + per_layer - 12)
  shared = dataclasses.replace(two, attention_pattern='G', kv_share=2)
  assert flops.forward_flops_per_token(shared, seq_len=4) == (
      80 + 2 * per_layer - 32)
  # Decoding after 3 cached tokens: 4 keys, 2 in the local layer (per key
  # 2·2·N·H = 16).
  assert flops.decode_flops_per_token(two, context=3) == (
      80 + 2 * (per_layer - 40) + 16 * (4 + 2))


def test_decode_is_judged_against_the_lower_of_its_bandwidth_and_flop_bounds():
  """gqa_small's shapes on this CPU (18 GB/s, 128 GFLOP/s): MHA is bound by
  reading its cache, MQA at a short context by arithmetic."""
  bandwidth, peak = 18e9, 1.28e11
  for K in (8, 1):
    config = config_lib.load('gqa_small')
    config.model.num_kv_heads = K
    mc = config_lib.model_config(config)
    for batch, context in ((1, 2048), (256, 256)):
      b = flops.decode_roofline_tokens_per_sec(mc, batch, context, bandwidth,
                                               peak)
      step_bytes = (model_lib.kv_cache_bytes(mc, batch, context)
                    + model_lib.param_bytes(mc))
      assert b['bandwidth'] == pytest.approx(batch * bandwidth / step_bytes)
      assert b['compute'] == pytest.approx(
          peak / flops.decode_flops_per_token(mc, context))
      assert b['roofline'] == min(b['bandwidth'], b['compute'])
      assert b['roofline'] == b['compute' if (K, batch) == (1, 256) else
                                'bandwidth']


@pytest.mark.parametrize('fields, dtype, expected', [
    # N=8, H=32. Per key: scores and mix 2·2·8·32 = 1,024 FLOPs (GQA, GTA).
    (dict(num_kv_heads=8), 'float32', 1024 / (2 * 8 * 32 * 4)),  # MHA: 0.5.
    (dict(num_kv_heads=8), 'bfloat16', 1.0),  # The paper's MHA: 1.
    (dict(num_kv_heads=2), 'float32', 2.0),  # GQA-2: 1,024 / 512 bytes.
    (dict(num_kv_heads=1), 'float32', 4.0),  # MQA: 1,024 / 256 bytes.
    # int8: 2·2·32 numbers and a float32 scale each per KV head and token.
    (dict(num_kv_heads=2, kv_cache_dtype='int8'), 'float32', 1024 / 144),
    # GTA-2, Y=16: one tied state of 32 per KV head and one RoPE key, 80
    # numbers; its FLOPs are GQA's.
    (dict(num_kv_heads=2, layout=GTA()), 'float32', 1024 / 320),
    # MLA, A=48, Y=16, absorbed: 2·8·(48+16) + 2·8·48 = 1,792 per key over
    # 64 numbers.
    (dict(num_kv_heads=8, layout=MLA(kv_lora_rank=48)), 'float32',
     1792 / 256),
    # GLA-2: each head reads its group's 24: 2·8·(24+16) + 2·8·24 = 1,024.
    (dict(num_kv_heads=8, layout=MLA(kv_lora_rank=48, latent_groups=2)),
     'float32', 1024 / 256),
])
def test_decode_intensity_is_attention_flops_per_cache_byte(fields, dtype,
                                                            expected):
  """A decode step's scores and mix per byte of cache read, counted by hand:
  each cached number serves G heads twice (GQA), the tied state both
  products (GTA), a latent number N/G heads twice (MLA, GLA)."""
  options = layer.Options(num_heads=8, head_dim=32, **fields)
  assert flops.attention_decode_intensity(options, dtype) == pytest.approx(
      expected)


def test_attention_flops_count_backward_as_twice_forward():
  forward = flops.attention_flops(2, 8, 4, 16, backward=False)
  assert forward == 2 * 2 * 2 * 4 * 16 * 8 * 9 / 2
  assert flops.attention_flops(2, 8, 4, 16, backward=True) == 3 * forward


@pytest.mark.slow
@pytest.mark.cpu_only
@pytest.mark.parametrize('conventions', [
    {}, dict(post_norms=True, qk_norm=True, query_pre_attn_scalar=24.0,
             logits_soft_cap=50.0, final_logits_soft_cap=30.0)])
def test_flops_formula_agrees_with_xla_cost_analysis(conventions):
  """Gemma 2/3's norms, query scale and soft caps are elementwise: the same
  count of matmul work, within the same margin."""
  # Unrolled: XLA's cost analysis counts a scanned loop body once.
  c = _model_config(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                    head_dim=16, mlp_dim=128, max_len=64, scan_layers=False,
                    **conventions)
  B, T = 2, 64
  tokens = jnp.zeros((B, T), jnp.int32)
  model = Transformer(c)
  params = model.init(jax.random.key(0), tokens)
  cost = jax.jit(model.apply).lower(params, tokens).compile().cost_analysis()
  xla_per_token = cost['flops'] / (B * T)
  ours = flops.forward_flops_per_token(c, seq_len=T)
  # The dense kernel also multiplies the masked upper triangle, which the
  # formula does not count as work: C = T there instead of (T + 1) / 2.
  masked = c.num_layers * 4 * c.num_heads * c.head_dim * (T - (T + 1) / 2)
  # The rest of XLA's count is elementwise work (norms, softmax, GELU, RoPE).
  assert ours + masked == pytest.approx(xla_per_token, rel=0.1)
  assert ours + masked < xla_per_token


ZEN2_VM = """processor	: 0
vendor_id	: AuthenticAMD
cpu MHz		: 1996.250
siblings	: 2
cpu cores	: 2
flags		: fpu sse sse2 avx fma avx2
"""


def test_cpu_peak_is_the_theoretical_one_from_cpuinfo():
  """cores x lanes x FMA units x 2 x clock: a number that does not move with
  the machine's load, stated in the log line."""
  peak, source = flops.cpu_peak_flops(ZEN2_VM, cores=2)
  assert peak == pytest.approx(2 * 8 * 2 * 2 * 1996.25e6)
  assert '2 cores x 8 lanes (avx) x 2 FMA units x 2 x 2.00 GHz' in source
  skylake = ZEN2_VM.replace('avx2', 'avx2 avx512f')
  assert flops.cpu_peak_flops(skylake, cores=2)[0] == pytest.approx(2 * peak)
  assert flops.cpu_peak_flops('processor\t: 0\n') is None  # Then: measured.


@pytest.mark.slow
def test_scan_unroll_changes_neither_parameters_nor_outputs():
  mc = config_lib.model_config(tiny.get_config())  # 2 layers.
  rolled, unrolled = (Transformer(dataclasses.replace(mc, scan_unroll=n))
                      for n in (1, 2))
  init = lambda model: jax.jit(lambda: loop.init_params(model, 0))()
  params = init(rolled)
  chex.assert_trees_all_equal(init(unrolled), params)
  tokens = jnp.arange(16).reshape(2, 8)
  params = {'params': nn.unbox(params)}
  chex.assert_trees_all_close(jax.jit(unrolled.apply)(params, tokens),
                              jax.jit(rolled.apply)(params, tokens), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('layers', [
    dict(num_layers=3),
    dict(num_layers=4, attention_pattern='LLGG', local_window=4, kv_share=2)])
def test_scanned_and_unrolled_layers_give_the_same_outputs(layers):
  """unroll_layers (decoding's) moves layer i's slice of the stacked
  parameters, or of its group's, to layers_i: the same network."""
  config = _model_config(d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                         mlp_dim=64, max_len=16, scan_unroll=1, **layers)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
  scanned = Transformer(config)
  params = nn.unbox(scanned.init(jax.random.key(1), tokens)['params'])
  unrolled, unrolled_params = unroll_layers(scanned, params)
  assert not unrolled.config.scan_layers and 'layers' not in unrolled_params
  assert sorted(k for k in unrolled_params if k.startswith('layers_')) == [
      f'layers_{i}' for i in range(config.num_layers)]
  chex.assert_trees_all_close(
      jax.jit(unrolled.apply)({'params': unrolled_params}, tokens),
      jax.jit(scanned.apply)({'params': params}, tokens), atol=1e-5)


@pytest.mark.slow
def test_remat_gives_the_same_gradients():
  config = _model_config(num_layers=2, d_model=32, num_heads=4,
                         num_kv_heads=1, head_dim=8, mlp_dim=64, max_len=16)
  tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, 256)
  params = nn.unbox(Transformer(config).init(jax.random.key(1), tokens)[
      'params'])
  grads = [jax.jit(jax.grad(evaluator.loss_fn), static_argnums=1)(
               params, Transformer(c), tokens)
           for c in (config, dataclasses.replace(config, remat=True))]
  chex.assert_trees_all_close(grads[0], grads[1], atol=1e-6)


@pytest.mark.slow
def test_gradient_accumulation_matches_one_large_batch():
  config = _config()
  model = Transformer(loop.config_lib.model_config(config))
  tx, _ = loop.make_optimizer(config.train)
  state = loop.init_state(model, tx, seed=0)
  tokens = jax.random.randint(jax.random.key(0), (8, 33), 0, 256)
  step = jax.jit(loop.train_step, static_argnames=('model', 'tx',
                                                   'accum_steps'))
  one, m1 = step(state, tokens, model=model, tx=tx, accum_steps=1)
  four, m4 = step(state, tokens, model=model, tx=tx, accum_steps=4)
  chex.assert_trees_all_close(m1, m4, rtol=1e-5)
  chex.assert_trees_all_close(one.params, four.params, atol=1e-6)


def test_weight_decay_spares_norm_scales_and_biases_even_when_scanned():
  """Under nn.scan a norm scale is [L, D], as many dims as a matrix: the
  decision is by name, for every parameter of a model with biases and QK-norm."""
  from lm import model as model_lib  # pylint: disable=import-outside-toplevel
  config = tiny.get_config()
  config.model.update(qkv_bias=True, qk_norm=True)
  shapes = model_lib.parameter_shapes(config_lib.model_config(config))
  decided = {jax.tree_util.keystr(path): loop.decays(path) for path, _ in
             jax.tree_util.tree_flatten_with_path(shapes)[0]}
  spared = {name for name, decays in decided.items() if not decays}
  assert spared == {name for name in decided if name.endswith((
      "['scale']", "_bias']", "_norm']"))}
  assert len(spared) == 2 + 3 + 2 + 1  # 2 norms, 3 biases, 2 QK (stacked), final.
  assert decided["['layers']['attention']['query']"]
  assert decided["['embed']['embedding']"]
