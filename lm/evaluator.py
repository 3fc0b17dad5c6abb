"""The loss, and the held-out evaluation as `train.main` logs it.

`loss_fn` is the one next-token objective: the training step differentiates
it (train/loop.py) and `eval_step` reports it with the accuracy. `build` is
the evaluator a run calls every train.eval_every steps, over the same
held-out batches for every run of the data; `evaluate_workdir` runs it on a
workdir's latest checkpoint for the commands and studies that read one
(evaluation/, scripts/), without the training loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from infra import storage
from lm import checkpoint, config_lib, sharding
from lm import data as data_lib
from lm import model as model_lib
from lm.model import Transformer


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


def eval_step(params, tokens_BT1, *, model, weights_T=None):
  """(held-out loss, next-token accuracy) on the scored targets."""
  return loss_fn(params, model, tokens_BT1, weights_T, with_accuracy=True)


def eval_program(model, mesh, weights_T, params_sharding=None) -> Callable:
  """`eval_step` jitted for `mesh`: (params, [B, T + 1] batch) -> (loss,
  accuracy), params laid out by `params_sharding` (None: replicated), the
  batch over the data axes."""
  replicated = jax.NamedSharding(mesh, jax.P())
  return jax.jit(
      lambda p, b: eval_step(p, b, model=model, weights_T=weights_T),
      in_shardings=(params_sharding or replicated,
                    sharding.batch_sharding(mesh)),
      out_shardings=replicated)


def build(config, dataset: data_lib.Source, mesh,
          program: Callable) -> Callable:
  """params -> {'eval_loss', 'eval_accuracy'[, 'eval_bpb']}: the mean of
  `program` (an `eval_program`) over the train.eval_batches held-out batches
  (the same for every run of the data)."""
  global_batch = sharding.global_batches(dataset, config, mesh)
  batches = [global_batch('val', seed=0, step=i, stream=1)
             for i in range(config.train.eval_batches)]

  def evaluate(params):
    with jax.set_mesh(mesh):
      loss, accuracy = np.mean(jax.device_get(
          [program(params, b) for b in batches]), axis=0).tolist()
    out = {'eval_loss': loss, 'eval_accuracy': accuracy}
    if dataset.bytes_per_token:
      out['eval_bpb'] = loss / math.log(2) / dataset.bytes_per_token
    return out
  return evaluate


# Per process, keyed by what shapes a program: a study evaluating many
# workdirs of one model compiles its evaluation once, not once each.
_PROGRAMS: dict = {}


def evaluate_workdir(workdir: str, flag: str = '--workdir', *,
                     through_cache: bool = False,
                     kv_cache_dtype: str | None = None,
                     data_path: str | None = None) -> dict:
  """The held-out metrics of WORKDIR's latest checkpoint, as `train.main`
  logs them (eval_loss, eval_accuracy[, eval_bpb]): the same evaluator on the
  same batches. through_cache: the logits that decoding gives instead
  (`model.ThroughCache`), its cache in kv_cache_dtype (None: the model's).
  data_path: another corpus's held-out split (a prepared one, read with the
  workdir's tokenizer) instead of the run's data.path.
  Reads WORKDIR, writes nothing."""
  mc, params, config = checkpoint.load_workdir(workdir, flag)
  if kv_cache_dtype is not None:
    mc = dataclasses.replace(mc, kv_cache_dtype=kv_cache_dtype)
  if data_path is not None:
    config.data.path = data_path
  mesh = sharding.make_mesh(config.mesh)
  config_lib.validate(config, mesh.shape['data'] * mesh.shape['fsdp'],
                      jax.process_count())
  dataset = data_lib.for_model(config.data, mc, storage.path(workdir, flag),
                               is_chief=False)
  model = model_lib.ThroughCache(mc) if through_cache else Transformer(mc)
  weights_T = dataset.loss_weights
  key = (repr(model), mesh, None if weights_T is None else
         np.asarray(weights_T).tobytes())
  if key not in _PROGRAMS:
    if len(_PROGRAMS) > 64:  # A long study of many shapes.
      _PROGRAMS.clear()
    _PROGRAMS[key] = eval_program(model, mesh, weights_T)
  return build(config, dataset, mesh, _PROGRAMS[key])(params)
