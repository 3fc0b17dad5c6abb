"""Orbax checkpoints of the train state in WORKDIR/checkpoints, and resume."""

from __future__ import annotations

import json
import pathlib

from flax import serialization
import jax
import numpy as np
import orbax.checkpoint as ocp

from train.errors import UserError


class Checkpointer:
  """Saves every `every` steps (and on demand), keeps the last `keep`."""

  def __init__(self, workdir: str, *, every: int, keep: int):
    self.directory = pathlib.Path(workdir).absolute() / 'checkpoints'
    self.every = every
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_handlers=ocp.StandardCheckpointHandler())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def restore(self, abstract_state):
    """Restores the latest checkpoint onto `abstract_state`'s shapes/shardings."""
    step = self._manager.latest_step()
    self._check_shapes(step, abstract_state)
    return self._manager.restore(
        step, args=ocp.args.StandardRestore(abstract_state))

  def save(self, step: int, state, *, force: bool = False) -> bool:
    if not force and step % self.every:
      return False
    if step in self._manager.all_steps():
      return False
    return self._manager.save(step, args=ocp.args.StandardSave(state),
                              force=True)

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()

  def _check_shapes(self, step, abstract_state):
    """Names the first parameter whose shape differs from this run's model."""
    saved = self._manager.item_metadata(step)['params']
    saved_flat = dict(_flatten(saved))
    ours = serialization.to_state_dict(abstract_state)['params']
    for path, leaf in _flatten(ours):
      ours = tuple(np.shape(leaf))
      theirs = tuple(getattr(saved_flat.get(path), 'shape', ()) or ())
      if path not in saved_flat or ours != theirs:
        raise UserError(
            f'{self.directory} (step {step}) holds another model: params{path} is '
            f'{theirs if path in saved_flat else "absent"} there and {ours} '
            'here; use a new --workdir, or the config that wrote it')


def _flatten(tree):
  flat, _ = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, 'shape') and not isinstance(x, dict))
  return [(jax.tree_util.keystr(p), leaf) for p, leaf in flat]


def restore_latest(workdir: str) -> tuple[int, dict]:
  """(step, saved state as a dict of arrays) of WORKDIR's latest checkpoint."""
  directory = pathlib.Path(workdir).absolute() / 'checkpoints'
  manager = ocp.CheckpointManager(
      directory, item_handlers=ocp.StandardCheckpointHandler())
  step = manager.latest_step()
  if step is None:
    raise UserError(f'no checkpoint in {directory}; train first with '
                    f'python -m train.main --workdir={workdir}')
  return step, manager.restore(step, args=ocp.args.StandardRestore())


def load_workdir(workdir: str):
  """(ModelConfig, params, ConfigDict) of a train.main WORKDIR's latest step."""
  from ml_collections import config_dict  # pylint: disable=import-outside-toplevel
  from train import config_lib  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(workdir) / 'config.json'
  if not path.exists():
    raise UserError(f'{path} not found; --workdir must be a train.main workdir')
  config = config_dict.ConfigDict(json.loads(path.read_text()))
  _, state = restore_latest(workdir)
  return config_lib.model_config(config), state['params'], config
