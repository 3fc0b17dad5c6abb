"""Every named layout trained on a tensor=2 mesh of 2 simulated devices;
prints {name: {losses, eval_loss}} as JSON.

Run by tests/test_layouts.py as
  XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      python -m tests.layout_mesh_runs DIR NAME...
"""

import json
import sys

import jax

from tests import test_layouts
from train import loop


def main(out: str, names: list[str]):
  assert jax.device_count() == 2, jax.devices()
  results = {}
  for name in names:
    config = test_layouts.mesh_config(name, dict(tensor=2))
    loop.train_and_evaluate(config, f'{out}/{name}')
    results[name] = test_layouts._summary(f'{out}/{name}')  # pylint: disable=protected-access
  print(json.dumps(results))


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2:])
