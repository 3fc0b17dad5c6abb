"""Specification: a workdir whose config.json no longer matches its
checkpoint (edited after training) is refused by every loader in one line,
never loaded into another model."""

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import pytest

from configs import tiny
from infra.errors import UserError
from lm import checkpoint, config_lib, inference, model

REPO = pathlib.Path(__file__).parent.parent


def _edited(trained, tmp_path, **model_fields):
  """A copy of the `trained` workdir with config.json's model edited."""
  workdir = tmp_path / 'edited'
  shutil.copytree(trained, workdir)
  path = workdir / 'config.json'
  config = json.loads(path.read_text())
  config['model'].update(model_fields)
  path.write_text(json.dumps(config))
  return workdir


EDITS = [
    # A third layer: jax clamps its index into the 2 stacked layers, so it
    # would silently be a copy of layer 1.
    (dict(num_layers=3), "params['layers']['attention']['key'] is "
                         "[2, 32, 2, 8] in the checkpoint, [3, 32, 2, 8] by "
                         "config.json; "),
    # One K/V head where two were trained: a shape error at the first call.
    (dict(num_kv_heads=1), "params['layers']['attention']['key'] is "
                           "[2, 32, 2, 8] in the checkpoint, [2, 32, 1, 8] by "
                           "config.json; "),
]


@pytest.mark.parametrize('edit, shapes', EDITS)
def test_the_load_refuses_an_edited_config_naming_the_array(
    trained, tmp_path, edit, shapes):
  workdir = _edited(trained, tmp_path, **edit)
  for load in (checkpoint.load_workdir, inference.load_language_model):
    with pytest.raises(UserError) as raised:
      load(str(workdir))
    message = str(raised.value)
    assert '\n' not in message
    assert message.startswith(
        f'{workdir / "config.json"} does not match its checkpoint at step ')
    assert message.endswith('restore the config.json the run wrote, or '
                            'retrain')
    assert f': {shapes}' in message, message


@pytest.mark.slow
@pytest.mark.parametrize('edit, shapes', EDITS)
def test_sample_cli_refuses_an_edited_config_in_one_line(
    trained, tmp_path, edit, shapes):
  workdir = _edited(trained, tmp_path, **edit)
  result = subprocess.run(
      [sys.executable, '-m', 'train.sample', f'--workdir={workdir}',
       '--prompt=def ', '--max_new_tokens=4'],
      cwd=REPO, capture_output=True, timeout=120)
  assert result.returncode == 1, result.stderr.decode()
  lines = result.stderr.decode().strip().splitlines()
  assert len(lines) == 1, lines
  assert lines[0].startswith(f'error: {workdir / "config.json"} does not '
                             'match its checkpoint'), lines[0]
  assert result.stdout == b''


def test_the_unedited_workdir_still_loads(trained):
  mc, params, _ = checkpoint.load_workdir(str(trained))
  assert checkpoint.first_mismatch(params, model.parameter_shapes(mc)) is None


def test_layer_subtrees_never_reads_a_layer_the_params_lack():
  """jax clamps x[2] on an axis of 2 to x[1]; the stacked layers' reader
  must refuse instead of handing back layer 1 as layer 2."""
  config = tiny.get_config()
  two = config_lib.model_config(config)
  assert two.scan_layers and two.num_layers == 2
  params = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype),
                        model.parameter_shapes(two))
  assert len(model.layer_subtrees(two, params)) == 2
  config.model.num_layers = 3
  three = config_lib.model_config(config)
  with pytest.raises(ValueError, match='layer 2 of num_layers=3 is not in '
                                       'the params'):
    model.layer_subtrees(three, params)
