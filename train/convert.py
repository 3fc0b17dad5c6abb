"""Converts a trained checkpoint to fewer K/V heads (Ainslie et al. 2023).

  python -m train.convert --source=WORKDIR --workdir=NEWDIR --num_kv_heads=K \
      --method=mean|first|random

KV head j of the result serves query heads [j·N/K, (j+1)·N/K), which in the
source were served by its KV heads [j·r, (j+1)·r), r = K_source / K. `mean`
averages those r key and value projection heads (the paper's method), `first`
keeps the first of them, `random` re-initialises the projections. K = -1
keeps every head: an exact copy. NEWDIR gets the config and a step-0
checkpoint with a fresh optimizer state; uptrain it with train.main and the
same config, the new num_kv_heads and the steps to spend, e.g.

  python -m train.main --config=gqa_small --config.model.num_kv_heads=1 \
      --config.train.steps=36 --workdir=NEWDIR
"""

import json
import pathlib

from absl import app, flags, logging
import jax.numpy as jnp

from train import checkpoint, kv_heads, loop
from train.errors import UserError, exit_on_user_error

_SOURCE = flags.DEFINE_string('source', None, 'trained workdir')
_WORKDIR = flags.DEFINE_string('workdir', None, 'new workdir to write')
_KV_HEADS = flags.DEFINE_integer('num_kv_heads', None, 'K; -1 keeps all')
_METHOD = flags.DEFINE_enum('method', 'mean', ['mean', 'first', 'random'],
                            'how grouped heads become one')
_SEED = flags.DEFINE_integer('seed', 0, 'seed of --method=random')



def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  model_config, params, config = checkpoint.load_workdir(_SOURCE.value)
  k_source = model_config.num_kv_heads
  k = k_source if _KV_HEADS.value == -1 else _KV_HEADS.value
  if k is None or k < 1 or k_source % k:
    raise UserError(f'--num_kv_heads={_KV_HEADS.value}: the source has '
                    f'{k_source} KV heads; pick a divisor of {k_source} or -1')
  workdir = pathlib.Path(_WORKDIR.value)
  if (workdir / 'checkpoints').exists():
    raise UserError(f'{workdir} already holds checkpoints; pick a new '
                    '--workdir')
  new_params, _ = kv_heads.convert_params(params, model_config, k, _METHOD.value,
                                 _SEED.value)
  config.model.num_kv_heads = k
  tx, _ = loop.make_optimizer(config.train)
  state = loop.TrainState(jnp.array(0, jnp.int32), new_params,
                          tx.init(new_params))
  checkpointer = checkpoint.Checkpointer(str(workdir), every=1, keep=1)
  checkpointer.save(0, state, force=True)
  checkpointer.close()
  (workdir / 'config.json').write_text(config.to_json(indent=2))
  (workdir / 'convert.json').write_text(json.dumps({
      'source': str(_SOURCE.value), 'num_kv_heads': k,
      'source_num_kv_heads': k_source, 'method': _METHOD.value}))
  print(f'wrote {workdir}: {k_source} -> {k} KV heads by {_METHOD.value}')


if __name__ == '__main__':
  flags.mark_flags_as_required(['source', 'workdir', 'num_kv_heads'])
  exit_on_user_error(lambda: app.run(main))
