"""Trains `tiny` on several meshes of simulated devices; prints JSON results.

Run by tests/test_mesh.py as
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.mesh_runs DIR
"""

import json
import sys

import jax

from tests import test_mesh
from lm import checkpoint
from train import loop


def main(workdir):
  assert jax.device_count() == 8, jax.devices()
  results = {}
  for name, (mesh, overrides) in test_mesh.MESHES.items():
    config = test_mesh.config(mesh, **overrides)
    loop.train_and_evaluate(config, f'{workdir}/{name}')
    results[name] = test_mesh.summary(f'{workdir}/{name}')
  # Written on one mesh, stopped at step 6, resumed on another.
  config = test_mesh.config(dict(data=8))
  calls = []
  loop.train_and_evaluate(config, f'{workdir}/moved',
                          should_stop=lambda: calls.append(1) or len(calls) == 6)
  assert checkpoint.restore_latest(f'{workdir}/moved')[0] == 6
  loop.train_and_evaluate(test_mesh.config(dict(fsdp=2, tensor=4)),
                          f'{workdir}/moved')
  results['moved'] = test_mesh.summary(f'{workdir}/moved')
  print(json.dumps(results))


if __name__ == '__main__':
  main(sys.argv[1])
