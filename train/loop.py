"""Training, as plain functions: build state, train step, eval step, the loop."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from typing import Any, Callable

from etils import epath
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lm import config_lib, data as data_lib, evaluator, flops, sharding
from infra import signals, storage
from infra import workdir as workdir_lib
from lm.checkpoint import Checkpointer
from infra.errors import UserError
from lm import model as model_lib
from lm.model import Transformer
from train.metrics import MetricsWriter, left_range_at, read_metrics


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def make_optimizer(tc) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with warmup + cosine decay and global-norm clipping."""
  curve = schedule(tc)
  return optimizer(tc, curve), curve


def schedule(tc) -> optax.Schedule:
  """`tc`'s learning rate by optimizer step (the compiled step takes the
  same curve from `schedule_args` as an input)."""
  return lambda count: learning_rate(count, schedule_args(tc))


def optimizer(tc, schedule: optax.Schedule) -> optax.GradientTransformation:
  """AdamW by `schedule`, global-norm clipping; decay on matrices only."""
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: decays(path), params)
  return optax.chain(
      optax.clip_by_global_norm(tc.grad_clip),
      optax.adamw(schedule, tc.b1, tc.b2, weight_decay=tc.weight_decay,
                  mask=decay_mask))


def schedule_args(tc) -> np.ndarray:
  """The schedule as data ([peak, warmup, steps, end ratio]): an input of
  the compiled step, so runs that differ only in it share one program."""
  return np.array([tc.learning_rate, tc.warmup_steps, tc.steps,
                   tc.min_learning_rate_ratio], np.float32)


def learning_rate(count, args):
  """Linear warmup from 0 to the peak, then cosine decay to end x peak at
  `steps` (optax.warmup_cosine_decay_schedule's curve, from traced args)."""
  peak, warmup, steps, end = (args[i] for i in range(4))
  count = jnp.asarray(count, jnp.float32)
  warm = peak * count / jnp.maximum(warmup, 1.0)
  done = jnp.clip((count - warmup) / jnp.maximum(steps - warmup, 1.0), 0, 1)
  cosine = 0.5 * (1 + jnp.cos(jnp.pi * done))
  return jnp.where(count < warmup, warm, peak * ((1 - end) * cosine + end))


def decays(path) -> bool:
  """Weight decay applies to matrices, not to norm scales and biases.

  Decided by name: under `nn.scan` a norm scale is [L, D], as many dims as a
  matrix (a test checks every parameter's decision)."""
  name = path[-1].key
  return not (name == 'scale' or name.endswith(('_bias', '_norm')))


def init_params(model: Transformer, seed: int):
  """Parameters with their logical-axis boxes (see `lm.sharding`)."""
  return _init_params(model, jax.random.key(seed))


# One compiled program, not the model's hundreds of operations dispatched
# one at a time (a 4-layer tiny model: 3.4 s of CPU instead of 8.6 s), for
# the callers outside a jit (train.convert's random K/V, the benchmarks).
@functools.partial(jax.jit, static_argnums=0)
def _init_params(model: Transformer, rng):
  tokens = jnp.zeros((1, 1), jnp.int32)  # Shapes do not depend on length.
  return model.init(rng, tokens)['params']


def init_state(model: Transformer, tx, seed: int) -> TrainState:
  return fresh_state(nn.unbox(init_params(model, seed)), tx)


def fresh_state(params, tx) -> TrainState:
  """Step 0: `params` and a new optimizer state."""
  return TrainState(jnp.array(0, jnp.int32), params, tx.init(params))


def train_step(state: TrainState, tokens_BT1, *, model, tx, accum_steps: int,
               weights_T=None):
  """One optimizer update, averaging gradients over `accum_steps` microbatches."""
  grad_fn = jax.value_and_grad(evaluator.loss_fn)
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


def train_and_evaluate(config, workdir: str, *,
                       should_stop: Callable[[], bool] | None = None,
                       on_eval: Callable[[int, Any, dict], bool] | None = None
                       ) -> dict:
  """Trains per `config`, resuming from WORKDIR's checkpoints; returns the last record.

  Stops early, saving a checkpoint, when `should_stop()` turns true (the
  signal handlers in `train.main` use it); then the returned record has
  'stopped_at'. Without `should_stop`, SIGTERM and SIGINT (Ctrl-C) stop it
  so, at the next step, and then raise `signals.Interrupted` (one line,
  exit status 128 + the signal): a study's Ctrl-C stops the study, never
  lost in a garbage collection (infra/signals.py). `on_eval(step, params,
  record)`, called after each evaluation (a study's own measures), ends the
  run there, as finished, by returning True. Holds WORKDIR/lock throughout
  (`infra.workdir`), and on every way out, an error included, waits for
  pending checkpoint saves.
  """
  if should_stop is None:  # No caller handles signals: this run does.
    with signals.recorded() as received:
      record = train_and_evaluate(config, workdir, on_eval=on_eval,
                                  should_stop=lambda: bool(received))
    if received:
      where = (f'at step {record["stopped_at"]}, its checkpoint saved in '
               f'{workdir}' if 'stopped_at' in record else
               f'as {workdir} finished')
      raise signals.Interrupted(received[0], 'interrupted by '
                                f'{signals.name(received[0])} {where}; rerun '
                                'the same command to go on')
    return record
  mesh = sharding.make_mesh(config.mesh)
  config_lib.validate(config, mesh.shape['data'] * mesh.shape['fsdp'],
                      jax.process_count())
  is_chief = jax.process_index() == 0  # Writes the files beside checkpoints.
  with workdir_lib.new_or_existing(workdir) as path:
    with workdir_lib.lock(path, enabled=is_chief):
      run = setup(config, path, mesh, is_chief)
      try:
        return _train(run, config, should_stop, on_eval)
      finally:
        run.checkpointer.close()
        run.reporter.close()


DIVERGED_DIR = 'diverged_checkpoints'


@dataclasses.dataclass
class Run:
  """What the loop works with, built once by `setup`."""
  workdir: epath.Path
  state: TrainState
  start: int  # First step to run (the restored step, or 0).
  step_fn: Callable  # Compiled (state, batch) -> (state, metrics).
  evaluate: Callable  # params -> {'eval_loss', 'eval_accuracy'[, 'eval_bpb']}
  get_batch: Callable  # step -> global training batch.
  schedule: optax.Schedule
  checkpointer: Checkpointer
  reporter: MetricsWriter
  tokens_per_step: int
  flops_per_token: float
  peak_flops: float  # Of all devices together.
  kv_bytes_per_token: float  # Decode cache at max_len / max_len.
  config_file: '_ConfigFile'  # WORKDIR/config.json.


@dataclasses.dataclass
class _ConfigFile:
  """WORKDIR/config.json, which describes the checkpoints: the config found
  there describes those from before this run, and this run's is written with
  its first save (a run that fails before saving leaves the old one)."""
  path: epath.Path
  text: str  # This run's config.
  found: str | None  # What config.json held when this run started.
  enabled: bool  # Process 0 writes it.
  written: bool = False

  def write(self):
    if self.enabled and not self.written:
      _write_atomically(self.path, self.text)
    self.written = True

  def after_divergence(self, last_good: int | None, start: int,
                       moved_to: epath.Path):
    """The config of the moved checkpoints goes with them (as moved_to); if
    none of this run's checkpoints is left, config.json is again the one
    that wrote those that are (none left: no config.json)."""
    if not self.enabled:
      return
    _write_atomically(moved_to, self.text if self.written else self.found)
    if self.written and (last_good is None or last_good <= start):
      if self.found is None:
        self.path.unlink(missing_ok=True)
      else:
        _write_atomically(self.path, self.found)
      self.written = False


def setup(config, path: epath.Path, mesh, is_chief: bool) -> Run:
  """The data, model, restored or fresh state and compiled steps of a run in
  WORKDIR `path` (also what scripts/bench_train.py times)."""
  _check_resume(config, path)
  mc = config_lib.model_config(config)
  tc = config.train
  dataset = data_lib.for_model(config.data, mc, path, is_chief)
  program = _Programs(config, mc, mesh, dataset.loss_weights)
  warn = (lambda text: print(text, file=sys.stderr, flush=True)) if (
      is_chief) else (lambda _: None)
  checkpointer = Checkpointer(path, every=tc.checkpoint_every,
                              keep=tc.keep_checkpoints)
  state, resume_step = _restore_or_init(config, program, checkpointer, warn)
  reporter = MetricsWriter(path, tc.steps, enabled=is_chief,
                           resume_step=resume_step or 0)
  _introduce(reporter.message, config, mc, dataset, mesh)
  if resume_step is not None:
    reporter.message(f'resuming from step {resume_step} '
                     f'({checkpointer.directory})')

  global_batch = sharding.global_batches(dataset, config, mesh)
  get_batch = lambda step: global_batch('train', seed=config.seed, step=step)
  start, step_fn = int(state.step), None
  if start < tc.steps:
    t0 = time.perf_counter()
    compiled, reused = program.step(state, get_batch(start))
    args = jax.device_put(schedule_args(tc), program.replicated)
    step_fn = lambda s, b: compiled(s, b, args)
    reporter.message('reused the compiled train step' if reused else
                     'compiled the train step in '
                     f'{time.perf_counter() - t0:.1f}s')
  evaluate = evaluator.build(config, dataset, mesh, program.eval_step())

  written = path / 'config.json'
  config_file = _ConfigFile(written, config.to_json(indent=2), (
      written.read_text() if written.exists() else None), is_chief)
  return Run(path, state, start, step_fn, evaluate, get_batch, schedule(tc),
             checkpointer, reporter, tc.batch_size * config.data.seq_len,
             flops.training_flops_per_token(mc, config.data.seq_len),
             flops.peak_flops()[0] * jax.device_count(),
             model_lib.kv_bytes_per_token(mc), config_file)


class _Programs:
  """The compiled programs of a run: init, train step, eval step.

  Kept per process, keyed by what shapes them (model, mesh, batch shape,
  optimizer constants, loss weights) and not by the schedule, which is an
  input: a study's runs of one model share their programs instead of
  tracing and compiling them again (seconds each).
  """
  _cache: dict = {}

  def __init__(self, config, mc, mesh, weights_T):
    tc = config.train
    model = Transformer(mc)
    self.model, self.mesh, self.weights_T = model, mesh, weights_T
    self.tx = make_optimizer(tc)[0]  # The state's structure; not its rates.
    self.replicated = jax.NamedSharding(mesh, jax.P())
    self.batch_sharding = sharding.batch_sharding(mesh)
    self._train = tc
    self._key = (repr(model), mesh, tc.batch_size, config.data.seq_len,
                 tc.grad_accum_steps, tc.b1, tc.b2, tc.weight_decay,
                 tc.grad_clip, None if weights_T is None else
                 np.asarray(weights_T).tobytes())
    (self.abstract, self.state_sharding), _ = self._get('shapes', self._shapes)

  def _get(self, name, build):
    key = (name, *self._key)
    reused = key in self._cache
    if not reused:
      if len(self._cache) > 64:  # A long study of many shapes.
        self._cache.clear()
      self._cache[key] = build()
    return self._cache[key], reused

  def _shapes(self):
    def boxed_and_state():  # One trace of the model for both.
      boxed = init_params(self.model, 0)
      return boxed, fresh_state(nn.unbox(boxed), self.tx)
    boxed, abstract = jax.eval_shape(boxed_and_state)
    state_sharding = sharding.state_shardings(
        boxed, self.tx, abstract, self.mesh,
        sharding.rules(self.model.config, self.mesh))
    return abstract, state_sharding

  def init(self, seed: int) -> TrainState:
    fn, _ = self._get('init', lambda: jax.jit(
        lambda seed: init_state(self.model, self.tx, seed),
        out_shardings=self.state_sharding))
    return fn(seed)

  def fresh_optimizer(self, state: TrainState) -> TrainState:
    fn, _ = self._get('fresh_optimizer', lambda: jax.jit(
        lambda s: s.replace(opt_state=self.tx.init(s.params)),
        out_shardings=self.state_sharding))
    return fn(state)

  def step(self, state, batch):
    """((state, batch, schedule_args) -> (state, metrics), compiled; whether
    it was already)."""
    tc, model, weights_T = self._train, self.model, self.weights_T

    def step(s, b, args):
      tx = optimizer(tc, lambda count: learning_rate(count, args))
      return train_step(s, b, model=model, tx=tx,
                        accum_steps=tc.grad_accum_steps, weights_T=weights_T)

    def build():
      fn = jax.jit(step, in_shardings=(self.state_sharding,
                                       self.batch_sharding, self.replicated),
                   out_shardings=(self.state_sharding, self.replicated),
                   donate_argnums=0)
      # Traced under the mesh: kernels that XLA cannot partition (TPU
      # splash attention) run per shard with shard_map.
      with jax.set_mesh(self.mesh):
        return fn.lower(state, batch, schedule_args(tc)).compile()
    return self._get('step', build)

  def eval_step(self):
    """`evaluator.eval_program` for this run's params, laid out as its
    state."""
    return self._get('eval', lambda: evaluator.eval_program(
        self.model, self.mesh, self.weights_T, self.state_sharding.params))[0]


def _check_resume(config, path: epath.Path):
  """Refuses, before any work, a config that changes what the workdir's
  checkpoints compute (`config_lib.RESUME_MAY_CHANGE`)."""
  written, saved = path / 'config.json', path / 'checkpoints'
  if written.exists() and saved.is_dir() and any(
      p.name.isdigit() for p in saved.iterdir()):
    config_lib.check_resume(config_lib.from_json(written), config, path)


def _restore_or_init(config, program: _Programs, checkpointer, warn):
  """(state, the restored step or None): the workdir's latest checkpoint,
  onto this run's mesh whatever wrote it, or a fresh state."""
  restored = checkpointer.restore(
      jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
          program.abstract, program.state_sharding), warn=warn)
  if restored is None:
    return program.init(config.seed), None
  step, state = restored
  if state.opt_state is None:  # A converted or imported checkpoint.
    _check_recipe(checkpointer.workdir, config.train.learning_rate, warn)
    state = program.fresh_optimizer(state)
  return state, step


def _introduce(say, config, mc, dataset, mesh):
  """The run's first lines: config, data, model size, devices."""
  flops_per_token = flops.training_flops_per_token(mc, config.data.seq_len)
  peak, peak_source = flops.peak_flops()
  say(f'config:\n{config}')
  say(f'data: {dataset.summary()}')
  say(f'model: {model_lib.num_params(mc):,} parameters; decode cache '
      f'{model_lib.kv_bytes_per_token(mc):,.1f} bytes/token at max_len '
      f'{mc.max_len} ({mc.layout_description()}, {_layer_kinds(mc)}, {mc.kv_cache_dtype or np.dtype(mc.dtype).name}); '
      f'{flops_per_token / 1e6:,.1f} MFLOPs/token to train')
  hosts = jax.process_count()
  rows = (f'; each of {hosts} processes builds {config.train.batch_size // hosts}'
          f' of the {config.train.batch_size} rows of a batch'
          if hosts > 1 else '')
  say(f'devices: {jax.device_count()} x {jax.devices()[0].device_kind} on '
      f'{hosts} host(s), mesh {dict(mesh.shape)}; peak '
      f'{peak / 1e12:,.2f} TFLOP/s each ({peak_source}){rows}')


def _layer_kinds(mc) -> str:
  """'4 layers' or '6 layers, pattern LG (window 128), K/V shared by 2'."""
  text = f'{mc.num_layers} layers'
  if mc.attention_pattern != 'G':
    text += (f', pattern {mc.attention_pattern} (window '
             f'{mc.local_window})')
  if mc.kv_share > 1:
    text += f', K/V shared by {mc.kv_share}'
  return text


def training_data(config, workdir: str) -> data_lib.Source:
  """The data a run of `config` in WORKDIR reads, checked against its model
  as `train.main` checks it; writes nothing (a benchmark feeds its peers
  from it)."""
  return data_lib.for_model(config.data, config_lib.model_config(config),
                            storage.path(workdir), is_chief=False)


def _check_recipe(path: epath.Path, learning_rate: float, warn):
  """One line when uptraining a converted or imported checkpoint faster
  than the recipe `train.convert` wrote (a from-scratch rate can undo what
  the model learnt)."""
  limit = workdir_lib.recipe_learning_rate(path)
  if limit is not None and learning_rate > limit:
    warn(f'warning: train.learning_rate={learning_rate:g} is above the '
         f'uptraining recipe\'s {limit:g} for this converted checkpoint '
         f'({path / workdir_lib.CONVERT_INFO}); a from-scratch rate can undo '
         'what it learnt')


class _NonFinite(Exception):
  """A step's loss or gradient norm is NaN or infinite."""

  def __init__(self, step: int, message: str):
    super().__init__(message)
    self.step = step


def _diverged(run: Run, step: int, what: str) -> str:
  """Sets the run up to resume from before a divergence; returns the line
  that says so.

  The last checkpoint is usually already a dead model (loss at ln V): the
  good one is the newest whose parameters' loss, logged one step after it,
  was still in its running range (`metrics.left_range_at`). Newer ones are
  moved to WORKDIR/diverged_checkpoints, so that a rerun resumes from it,
  with the config that wrote them (diverged_checkpoints/config.json);
  config.json is then again that of the checkpoints left.
  """
  run.checkpointer.wait()  # Every save must be complete first.
  run.reporter.sync()
  records = read_metrics(run.workdir) if (
      run.workdir / 'metrics.jsonl').exists() else []
  left = left_range_at(records, step)
  # The loss logged at step n is that of checkpoint n - 1's parameters.
  good = [s for s in run.checkpointer.all_steps() if s <= left - 2]
  last_good = max(good) if good else None
  moved = run.checkpointer.move_after(last_good, DIVERGED_DIR)
  with_config = ''
  if moved and (run.config_file.written or run.config_file.found):
    config = _unused(run.workdir / DIVERGED_DIR / 'config.json')
    run.config_file.after_divergence(last_good, run.start, config)
    with_config = f', with their config as {config.name}'
  line = f'non-finite loss or gradient {what}; stopped'
  if last_good is None and not moved:
    line += ' (no checkpoint yet)'
  if left < step:
    line += f'; the loss left its running range at step {left}'
  rerun = '; rerun'
  if last_good is None and moved:
    line += (f'; no checkpoint from before that (moved {len(moved)} to '
             f'{run.workdir / DIVERGED_DIR}{with_config})')
    rerun = '; rerun (it starts afresh)'
  elif last_good is not None:
    line += f'; the last good checkpoint is step {last_good}'
    if moved:
      line += (f' (the {len(moved)} after it moved to '
               f'{run.workdir / DIVERGED_DIR}{with_config})')
    rerun = '; rerun to resume from it'
  return line + rerun + ' with a lower train.learning_rate, or check the data'


class _Window:
  """Host metrics of the steps since the last log line.

  Device metrics are fetched one step behind, so the host never waits on
  the step it has just dispatched; each fetched step is checked for
  non-finite values and timed from the previous fetch.
  """

  def __init__(self):
    self.rows, self._pending, self._t_last = [], None, time.perf_counter()

  def add(self, step: int, metrics):
    """Records step's device metrics; fetches the step before it."""
    self.fetch()
    self._pending = (step, metrics)

  def fetch(self):
    """Waits for the pending step's metrics, if any."""
    if self._pending is None:
      return
    step, host = self._pending[0], jax.device_get(self._pending[1])
    self._pending = None
    if not all(np.isfinite(float(v)) for v in host.values()):
      raise _NonFinite(step, f'at step {step} ({_rounded(host)})')
    now = time.perf_counter()
    self.rows.append({**host, 'step_time': now - self._t_last})
    self._t_last = now

  def take(self) -> list[dict]:
    """The fetched rows, emptied; the clock restarts (eval and saves are
    not step time)."""
    rows, self.rows = self.rows, []
    self._t_last = time.perf_counter()
    return rows


def _train(run: Run, config, should_stop, on_eval=None) -> dict:
  tc = config.train
  if run.start >= tc.steps:
    return _trained(run, tc)
  state = run.state
  train_seconds = 0.0  # Wall time in train steps, excluding eval and saving.
  window, record, stopped_at = _Window(), {}, None
  for step in range(run.start, tc.steps):
    state, metrics = run.step_fn(state, run.get_batch(step))
    n = step + 1
    try:
      window.add(n, metrics)
      last, stop = n == tc.steps, _stop_agreed(should_stop, n, tc.log_every)
      if not (last or stop or n % tc.log_every == 0 or n % tc.eval_every == 0
              or n % tc.checkpoint_every == 0):
        continue
      window.fetch()  # Logging, evaluation and saving steps sync here.
    except _NonFinite as e:
      raise UserError(_diverged(run, e.step, str(e))) from None
    rows = window.take()
    train_seconds += sum(r['step_time'] for r in rows)
    record = _record(run, step, rows, train_seconds)
    if last or n % tc.eval_every == 0:
      record.update(run.evaluate(state.params))
      if on_eval is not None and on_eval(n, state.params, record) and (
          not last):
        last, record['finished_early'] = True, n
    if last or stop or n % tc.checkpoint_every == 0:
      run.config_file.write()  # With this run's first save.
    # Logged before the save starts: a kill between the two then resumes
    # from an earlier step and logs this one again, never leaves it out.
    saving = last or stop or n % tc.checkpoint_every == 0
    run.reporter.log(n, record, durable=saving)
    run.checkpointer.save(n, state, force=last or stop)
    window.take()
    if stop and not last:
      stopped_at = n
    if last or stop:
      break
  run.checkpointer.wait()
  return _finish(run, tc, record, stopped_at)


def _trained(run: Run, tc) -> dict:
  """A run already at train.steps: its final.json, written first if it
  stopped between its last save and writing it."""
  workdir = run.workdir
  final = workdir / 'final.json'
  finished = final.exists()
  if jax.process_count() > 1:  # Process 0 writes it: its view decides.
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    finished = bool(multihost_utils.broadcast_one_to_all(np.array(finished)))
  if finished:
    run.reporter.message(
        f'{workdir} is already trained to step {run.start} (train.steps='
        f'{tc.steps}); nothing to do. Raise --config.train.steps to train '
        'on, or use a new --workdir')
    return json.loads(final.read_text()) if final.exists() else {}
  # Stopped between its last save and final.json: the record is the last
  # checkpoint's evaluation (the held-out numbers the run logged at that
  # step; every process evaluates, as the collective needs), so a study
  # reading final.json gets the run's numbers, not an empty record.
  run.reporter.message(
      f'{workdir} is trained to step {run.start} but its final.json was '
      'never written (stopped after the last save); evaluating that '
      'checkpoint to write it')
  return _finish(run, tc, run.evaluate(run.state.params), None)


def _stop_agreed(should_stop: Callable[[], bool], n: int,
                 log_every: int) -> bool:
  """Whether to stop after step n. One process acts on should_stop() at
  once. Several must stop at the same step: a signal reaches them at
  different steps, and one saving (a collective) while another steps on
  waits forever. So they compare their flags at the steps all of them log,
  and stop there if any has one."""
  if jax.process_count() == 1:
    return should_stop()
  if n % log_every:
    return False
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return bool(np.any(multihost_utils.process_allgather(
      np.array(should_stop()))))


def _record(run: Run, step: int, rows: list[dict], train_seconds: float
            ) -> dict:
  """The metrics logged at `step`, from the steps since the last log."""
  step_time = float(np.mean([r['step_time'] for r in rows]))
  return {
      'loss': float(rows[-1]['loss']),  # This step's: a resume logs the same.
      'grad_norm': float(rows[-1]['grad_norm']),
      'learning_rate': float(run.schedule(step)),
      'step_time': step_time,
      'tokens_per_sec': run.tokens_per_step / step_time,
      'tokens_per_sec_per_device':
          run.tokens_per_step / step_time / jax.device_count(),
      'mfu': run.tokens_per_step / step_time * run.flops_per_token
             / run.peak_flops,
      'train_seconds': train_seconds,  # Since this process started.
  }


def _finish(run: Run, tc, record: dict, stopped_at: int | None) -> dict:
  """The last line said, and final.json written (process 0)."""
  say = run.reporter.message
  if stopped_at is not None:
    say(f'stopped at step {stopped_at}; checkpoint saved; rerun the same '
        'command to resume')
    record['stopped_at'] = stopped_at
  else:
    summary = (f'done: step {record.get("finished_early", tc.steps)}, '
               f'held-out loss {record["eval_loss"]:.4f}')
    if 'eval_bpb' in record:
      summary += f' nats/token = {record["eval_bpb"]:.3f} bits/byte'
    say(f'{summary}, next-token accuracy {record["eval_accuracy"]:.3f}')
  record['kv_bytes_per_token'] = run.kv_bytes_per_token
  if jax.process_index() == 0:
    _write_atomically(run.workdir / 'final.json', json.dumps(record))
  return record


def _unused(path: epath.Path) -> epath.Path:
  """path, or path-2, -3... if it exists (an earlier divergence's)."""
  n, free = 1, path
  while free.exists():
    n += 1
    free = path.with_name(f'{path.stem}-{n}{path.suffix}')
  return free


def _rounded(metrics: dict) -> dict:
  return {k: float(f'{float(v):.4g}') for k, v in metrics.items()}


def _write_atomically(path: epath.Path, text: str):
  """A reader sees the old text or the new, never part: through a renamed
  temporary file on a disk; an object's upload is atomic itself."""
  if not storage.is_local(path):
    path.write_text(text)
    return
  tmp = path.with_name(f'.{path.name}.tmp')
  tmp.write_text(text)
  tmp.replace(path)
