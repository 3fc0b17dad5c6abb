"""A G=2 GLA model on 8 simulated devices with tensor=2: trained, its
compiled step's shardings read, and decoded with its parameters sharded as
trained; prints JSON.

Run by tests/test_gla.py as
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python -m tests.gla_mesh_runs DIR

Writes DIR/mesh (the run's workdir) and DIR/decoded.npz (logits and greedy
tokens); prints {losses, specs, control_specs}: the run's losses, and the
compiled train step's PartitionSpec of each attention parameter, for this
mesh and for the control, tensor=4, which does not divide G.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from tests import test_gla, test_mesh
from lm import checkpoint, config_lib, sharding
from train import loop

MESH = dict(data=2, fsdp=2, tensor=2)
CONTROL = dict(data=2, fsdp=1, tensor=4)


def compiled_specs(config) -> dict[str, str]:
  """Attention parameter -> its PartitionSpec in the compiled train step."""
  mc = config_lib.model_config(config)
  mesh = sharding.make_mesh(config.mesh)
  program = loop._Programs(config, mc, mesh, None)  # pylint: disable=protected-access
  batch = jax.ShapeDtypeStruct(
      (config.train.batch_size, config.data.seq_len + 1), jnp.int32)
  compiled, _ = program.step(program.abstract, batch)
  state = compiled.input_shardings[0][0]
  return {name: str(s.spec)
          for name, s in state.params['layers']['attention'].items()}


def main(out):
  assert jax.device_count() == 8, jax.devices()
  config = test_gla.mesh_config(MESH)
  loop.train_and_evaluate(config, f'{out}/mesh')
  specs = compiled_specs(config)
  mc = config_lib.model_config(config)
  mesh = sharding.make_mesh(config.mesh)
  program = loop._Programs(config, mc, mesh, None)  # pylint: disable=protected-access
  params = jax.device_put(checkpoint.restore_latest(f'{out}/mesh')[1]['params'],
                          program.state_sharding.params)
  assert 'tensor' in str(params['layers']['attention']['kv_norm'].sharding.spec)
  logits, tokens = test_gla.decode_outputs(mc, params)
  np.savez(f'{out}/decoded.npz', logits=logits, tokens=tokens)
  print(json.dumps({
      'losses': test_mesh.summary(f'{out}/mesh')['losses'], 'specs': specs,
      'control_specs': compiled_specs(test_gla.mesh_config(CONTROL))}))


if __name__ == '__main__':
  main(sys.argv[1])
