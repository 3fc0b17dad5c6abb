"""Data, FSDP and tensor parallelism train to the losses of one device.

The meshes run in a subprocess with 8 simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8, fixed when JAX starts);
the single-device runs they are compared with run here.
"""

import fcntl
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny
from tests import host_devices
from lm import checkpoint, sharding
from train import loop
from infra.errors import UserError

MESHES = {
    'data8': (dict(data=8), {}),
    'data2_fsdp2_tensor2': (dict(data=2, fsdp=2, tensor=2), {}),
    'fsdp2_tensor4_mqa': (dict(data=1, fsdp=2, tensor=4), dict(num_kv_heads=1)),
    # Local/global pairs sharing K/V: the scan over groups, sharded.
    'data2_fsdp2_tensor2_LLGG_cla2': (
        dict(data=2, fsdp=2, tensor=2),
        dict(num_layers=4, attention_pattern='LLGG', local_window=8,
             kv_share=2)),
}


def config(mesh, **model):
  c = tiny.get_config()
  c.train.update(steps=12, log_every=3, eval_every=6, checkpoint_every=100)
  c.mesh.update({**dict(data=1, fsdp=1, tensor=1), **mesh})
  c.model.update(model)
  return c


def summary(workdir):
  from train.metrics import read_metrics  # pylint: disable=import-outside-toplevel
  params = checkpoint.restore_latest(workdir)[1]['params']
  return {'losses': [m['loss'] for m in read_metrics(workdir)],
          'eval_loss': read_metrics(workdir)[-1]['eval_loss'],
          'param_sum': float(sum(np.abs(np.asarray(x, np.float64)).sum()
                                 for x in jax.tree.leaves(params)))}


@pytest.fixture(scope='session')
def mesh_results(tmp_path_factory):
  """Built once per test run: with several xdist workers, the first to take
  the lock runs the meshes, the others read its results."""
  shared = tmp_path_factory.getbasetemp().parent  # Common to the workers.
  results = shared / 'mesh_results.json'
  with open(shared / 'mesh_results.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not results.exists():
      env = host_devices.env(8)
      result = subprocess.run(
          [sys.executable, '-m', 'tests.mesh_runs', str(shared / 'meshes')],
          cwd=pathlib.Path(__file__).parent.parent, env=env,
          capture_output=True, text=True, timeout=600)
      assert result.returncode == 0, result.stderr[-3000:]
      results.write_text(result.stdout.strip().splitlines()[-1])
  return json.loads(results.read_text())


@pytest.fixture(scope='session')
def one_device(tmp_path_factory):
  """model overrides -> summary of the same run on one device, trained once."""
  runs = {}

  def run(**model):
    key = tuple(sorted(model.items()))
    if key not in runs:
      workdir = str(tmp_path_factory.mktemp('one_device'))
      loop.train_and_evaluate(config(dict(data=1), **model), workdir)
      runs[key] = summary(workdir)
    return runs[key]
  return run


@pytest.mark.slow
@pytest.mark.cpu_only  # Simulated host devices.
# On one xdist worker: the other would wait on mesh_results' lock, and
# train one_device's runs a second time.
@pytest.mark.slowest
@pytest.mark.xdist_group('mesh')
@pytest.mark.parametrize('name', list(MESHES) + ['moved'])
def test_meshes_train_to_the_losses_of_one_device(mesh_results, one_device,
                                                  name):
  one = one_device(**MESHES.get(name, ({}, {}))[1])
  got = mesh_results[name]
  np.testing.assert_allclose(got['losses'], one['losses'], rtol=2e-4)
  np.testing.assert_allclose(got['eval_loss'], one['eval_loss'], rtol=2e-4)
  np.testing.assert_allclose(got['param_sum'], one['param_sum'], rtol=1e-4)


def test_kv_heads_are_replicated_only_when_tensor_does_not_divide_them():
  model = loop.config_lib.model_config(tiny.get_config())
  mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1))
  assert dict(sharding.rules(model, mesh))['kv_heads'] == 'tensor'
  mesh_4 = jax.sharding.AbstractMesh((1, 1, 4), sharding.AXES)
  import dataclasses  # pylint: disable=import-outside-toplevel
  assert dict(sharding.rules(dataclasses.replace(model, num_kv_heads=1),
                             mesh_4))['kv_heads'] is None
  assert dict(sharding.rules(dataclasses.replace(model, num_kv_heads=4),
                             mesh_4))['kv_heads'] == 'tensor'


@pytest.mark.parametrize('mesh, message', [
    (dict(data=2, fsdp=1, tensor=1), 'has 2 devices but 1 are present'),
    (dict(data=-1, fsdp=-1, tensor=1), 'at most one axis'),
])
def test_impossible_meshes_are_one_line_errors(mesh, message):
  with pytest.raises(UserError, match=message):
    sharding.make_mesh(mesh)


def test_heads_that_tensor_cannot_split_name_the_setting():
  model = loop.config_lib.model_config(tiny.get_config())  # 4 heads.
  mesh = jax.sharding.AbstractMesh((1, 1, 8), sharding.AXES)
  with pytest.raises(UserError, match='model.num_heads=4 does not split over '
                     'mesh.tensor=8'):
    sharding.rules(model, mesh)
