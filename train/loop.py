"""Training, as plain functions: build state, train step, eval step, the loop."""

from __future__ import annotations

import json
import math
import pathlib
import time
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from attention import Attention
from train import config_lib, data as data_lib, flops, sharding
from train.checkpoint import Checkpointer
from train.errors import UserError
from train.model import Transformer
from train.report import Reporter


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def make_optimizer(tc) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with warmup + cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, tc.learning_rate, tc.warmup_steps, tc.steps,
      end_value=tc.learning_rate * tc.min_learning_rate_ratio)
  # Weight decay on matrices only, not on norm scales.
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  tx = optax.chain(
      optax.clip_by_global_norm(tc.grad_clip),
      optax.adamw(schedule, tc.b1, tc.b2, weight_decay=tc.weight_decay,
                  mask=decay_mask))
  return tx, schedule


def init_params(model: Transformer, seed: int):
  """Parameters with their logical-axis boxes (see `train.sharding`)."""
  tokens = jnp.zeros((1, model.config.max_len), jnp.int32)
  return model.init(jax.random.key(seed), tokens)['params']


def init_state(model: Transformer, tx, seed: int) -> TrainState:
  params = nn.unbox(init_params(model, seed))
  return TrainState(jnp.array(0, jnp.int32), params, tx.init(params))


def loss_fn(params, model: Transformer, tokens_BT1: jax.Array,
            weights_T: jax.Array | None = None, with_accuracy: bool = False):
  """Mean next-token cross-entropy in nats, float32.

  weights_T: which targets count (the recall task scores only its answers);
  None counts all. with_accuracy: also return the argmax accuracy on them.
  """
  logits_BTV = model.apply({'params': params}, tokens_BT1[:, :-1])
  targets_BT = tokens_BT1[:, 1:]
  if weights_T is None:
    weights_T = jnp.ones(targets_BT.shape[1], jnp.float32)
  weights_BT = jnp.broadcast_to(weights_T, targets_BT.shape)
  mean = lambda x_BT: (x_BT * weights_BT).sum() / weights_BT.sum()
  loss = mean(optax.softmax_cross_entropy_with_integer_labels(
      logits_BTV, targets_BT))
  if not with_accuracy:
    return loss
  return loss, mean(logits_BTV.argmax(-1) == targets_BT)


def train_step(state: TrainState, tokens_BT1, *, model, tx, accum_steps: int,
               weights_T=None):
  """One optimizer update, averaging gradients over `accum_steps` microbatches."""
  grad_fn = jax.value_and_grad(loss_fn)
  if accum_steps == 1:
    loss, grads = grad_fn(state.params, model, tokens_BT1, weights_T)
  else:
    micro_ABT1 = tokens_BT1.reshape(accum_steps, -1, tokens_BT1.shape[-1])

    def accumulate(carry, micro_BT1):
      loss, grads = grad_fn(state.params, model, micro_BT1, weights_T)
      return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
    (loss, grads), _ = jax.lax.scan(accumulate, zeros, micro_ABT1)
    loss, grads = jax.tree.map(lambda x: x / accum_steps, (loss, grads))
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {'loss': loss, 'grad_norm': optax.tree.norm(grads)}
  return TrainState(state.step + 1, params, opt_state), metrics


def eval_step(params, tokens_BT1, *, model, weights_T=None):
  """(held-out loss, next-token accuracy) on the scored targets."""
  return loss_fn(params, model, tokens_BT1, weights_T, with_accuracy=True)


def train_and_evaluate(config, workdir: str, *,
                       should_stop: Callable[[], bool] = lambda: False
                       ) -> dict:
  """Trains per `config`, resuming from WORKDIR's checkpoints; returns the last record.

  Stops early, saving a checkpoint, when `should_stop()` turns true (the
  signal handlers in `train.main` use it); then the returned record has
  'stopped_at'.
  """
  num_devices = jax.device_count()
  mesh = sharding.make_mesh(config.mesh)
  config_lib.validate(config, mesh.shape['data'] * mesh.shape['fsdp'],
                      jax.process_count())
  mc = config_lib.model_config(config)
  rules = sharding.rules(mc, mesh)
  tc, dc = config.train, config.data
  dataset = data_lib.load(dc.path, val_fraction=dc.val_fraction,
                          seq_len=dc.seq_len, cache_dir=dc.cache_dir or None,
                          task=dc.task, recall_pairs=dc.recall_pairs,
                          vocab_size=config.model.vocab_size)
  if dataset.vocab_size > mc.vocab_size:
    raise UserError(f'{dataset.description} has token ids up to '
                    f'{dataset.vocab_size - 1}; set model.vocab_size >= '
                    f'{dataset.vocab_size}')

  workdir_path = pathlib.Path(workdir)
  workdir_path.mkdir(parents=True, exist_ok=True)
  model = Transformer(mc)
  tx, schedule = make_optimizer(tc)
  batch_sharding = sharding.batch_sharding(mesh)
  replicated = jax.NamedSharding(mesh, jax.P())
  abstract = jax.eval_shape(lambda: init_state(model, tx, config.seed))
  state_sharding = sharding.state_shardings(
      jax.eval_shape(lambda: init_params(model, config.seed)), tx, abstract,
      mesh, rules)

  checkpointer = Checkpointer(workdir, every=tc.checkpoint_every,
                              keep=tc.keep_checkpoints)
  resume_step = checkpointer.latest_step()
  if resume_step is not None:  # Onto this run's mesh, whatever wrote it.
    state = checkpointer.restore(jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract, state_sharding))
  else:
    state = jax.jit(lambda: init_state(model, tx, config.seed),
                    out_shardings=state_sharding)()
  is_chief = jax.process_index() == 0  # Writes the files beside checkpoints.
  if is_chief:
    (workdir_path / 'config.json').write_text(config.to_json(indent=2))

  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(state.params))
  kv_bytes = mc.num_layers * Attention(
      mc.num_heads, mc.num_kv_heads, mc.head_dim).kv_cache_bytes(
          1, 1, mc.dtype)
  flops_per_token = flops.training_flops_per_token(
      **config.model, seq_len=dc.seq_len)
  peak, peak_source = flops.peak_flops()
  tokens_per_step = tc.batch_size * dc.seq_len

  reporter = Reporter(workdir, tc.steps, enabled=is_chief,
                      resume_step=resume_step or 0)
  say = reporter.message
  say(f'config:\n{config}')
  say(f'data: {dataset.summary()}')
  say(f'model: {n_params:,} parameters; KV cache {kv_bytes:,} bytes/token '
      f'({mc.num_layers} layers x 2 x {mc.num_kv_heads} KV heads x '
      f'{mc.head_dim} x {np.dtype(mc.dtype).itemsize} B); '
      f'{flops_per_token / 1e6:,.1f} MFLOPs/token to train')
  say(f'devices: {num_devices} x {jax.devices()[0].device_kind} on '
      f'{jax.process_count()} host(s), mesh {dict(mesh.shape)}; peak '
      f'{peak / 1e12:,.2f} TFLOP/s each ({peak_source})')
  if resume_step is not None:
    say(f'resuming from step {resume_step} ({checkpointer.directory})')
  if int(state.step) >= tc.steps:
    say(f'{workdir} is already trained to step {int(state.step)} '
        f'(train.steps={tc.steps}); nothing to do. Raise '
        '--config.train.steps to train on, or use a new --workdir')
    checkpointer.close()
    reporter.close()
    final = workdir_path / 'final.json'  # Absent if a crash followed the save.
    return json.loads(final.read_text()) if final.exists() else {}

  def global_batch(split, **kwargs):
    # Each host makes only its rows; together they form the global batch.
    local = dataset.batch(split, batch_size=tc.batch_size,
                          seq_len=dc.seq_len, shard=jax.process_index(),
                          num_shards=jax.process_count(), **kwargs)
    return jax.make_array_from_process_local_data(
        batch_sharding, local, (tc.batch_size, dc.seq_len + 1))

  def get_batch(step):
    return global_batch('train', seed=config.seed, step=step)

  weights_T = dataset.loss_weights
  step_fn = jax.jit(
      lambda s, b: train_step(s, b, model=model, tx=tx,
                              accum_steps=tc.grad_accum_steps,
                              weights_T=weights_T),
      in_shardings=(state_sharding, batch_sharding),
      out_shardings=(state_sharding, replicated), donate_argnums=0)
  eval_fn = jax.jit(lambda p, b: eval_step(p, b, model=model,
                                           weights_T=weights_T),
                    in_shardings=(state_sharding.params, batch_sharding),
                    out_shardings=replicated)
  start = int(state.step)
  t0 = time.perf_counter()
  step_fn = step_fn.lower(state, get_batch(start)).compile()
  say(f'compiled the train step in {time.perf_counter() - t0:.1f}s')
  eval_batches = [global_batch('val', seed=0, step=i, stream=1)
                  for i in range(tc.eval_batches)]

  def evaluate(params):
    loss, accuracy = np.mean(jax.device_get(
        [eval_fn(params, b) for b in eval_batches]), axis=0).tolist()
    out = {'eval_loss': loss, 'eval_accuracy': accuracy}
    if dataset.bytes_per_token:
      out['eval_bpb'] = loss / math.log(2) / dataset.bytes_per_token
    return out

  def check_finite(step, metrics):
    if not all(np.isfinite(float(v)) for v in metrics.values()):
      last = checkpointer.latest_step()
      raise UserError(
          f'non-finite loss or gradient at step {step} ({metrics}); stopped; '
          f'the last good checkpoint is step {last}; lower '
          'train.learning_rate or check the data')

  train_seconds = 0.0  # Wall time in train steps, excluding eval and saving.
  pending = None  # (step, device metrics): fetched one step behind.
  window = []  # Host metrics since the last log line.
  t_last = time.perf_counter()
  record = {}
  stopped_at = None
  for step in range(start, tc.steps):
    batch = get_batch(step)
    state, metrics = step_fn(state, batch)
    if pending is not None:
      # Waits for the previous step only, while this one runs on the device.
      done_step, host = pending[0], jax.device_get(pending[1])
      check_finite(done_step, host)
      now = time.perf_counter()
      window.append({**host, 'step_time': now - t_last})
      t_last = now
    pending = (step + 1, metrics)
    n = step + 1
    last = n == tc.steps
    stop = should_stop()
    if not (last or stop or n % tc.log_every == 0 or n % tc.eval_every == 0
            or n % tc.checkpoint_every == 0):
      continue
    host = jax.device_get(pending[1])  # Logging/eval/saving steps sync here.
    check_finite(n, host)
    now = time.perf_counter()
    window.append({**host, 'step_time': now - t_last})
    t_last = now
    pending = None
    step_time = float(np.mean([w['step_time'] for w in window]))
    train_seconds += sum(w['step_time'] for w in window)
    record = {
        'loss': float(host['loss']),  # This step's, so a resume logs the same.
        'grad_norm': float(host['grad_norm']),
        'learning_rate': float(schedule(step)),
        'step_time': step_time,
        'tokens_per_sec': tokens_per_step / step_time,
        'tokens_per_sec_per_device': tokens_per_step / step_time / num_devices,
        'mfu': tokens_per_step / step_time * flops_per_token
               / (peak * num_devices),
        'train_seconds': train_seconds,  # Since this process started.
    }
    window = []
    if last or n % tc.eval_every == 0:
      record.update(evaluate(state.params))
    checkpointer.save(n, state, force=last or stop)
    reporter.log(n, record)
    t_last = time.perf_counter()  # Evaluation and saving are not step time.
    if stop and not last:
      stopped_at = n
      break
  checkpointer.close()
  if stopped_at is not None:
    say(f'stopped at step {stopped_at}; checkpoint saved; rerun the same '
        'command to resume')
    record['stopped_at'] = stopped_at
  elif record:
    summary = f'done: step {tc.steps}, held-out loss {record["eval_loss"]:.4f}'
    if 'eval_bpb' in record:
      summary += f' nats/token = {record["eval_bpb"]:.3f} bits/byte'
    say(f'{summary}, next-token accuracy {record["eval_accuracy"]:.3f}')
  reporter.close()
  if is_chief:
    (workdir_path / 'final.json').write_text(json.dumps(record))
  return record
