"""Converts a trained checkpoint to fewer K/V heads (Ainslie et al. 2023).

  python -m train.convert --source=WORKDIR --workdir=NEWDIR --num_kv_heads=K \
      --method=mean|first|random

`mean` averages the key and value projection heads of each group (the
paper's method), `first` keeps the first of them, `random` re-initialises the
projections (train/kv_heads.py says which heads form a group). K = -1
keeps every head: an exact copy. NEWDIR gets the config and a step-0
checkpoint with a fresh optimizer state; uptrain it with train.main and the
same config, the new num_kv_heads and the steps to spend, e.g.

  python -m train.main --config=gqa_small --config.model.num_kv_heads=1 \
      --config.train.steps=36 --workdir=NEWDIR
"""

from absl import flags, logging

from train import kv_heads
from train.errors import run_app

_SOURCE = flags.DEFINE_string('source', None, 'trained workdir')
_WORKDIR = flags.DEFINE_string('workdir', None, 'new workdir to write')
_KV_HEADS = flags.DEFINE_integer('num_kv_heads', None, 'K; -1 keeps all')
_METHOD = flags.DEFINE_enum('method', 'mean', kv_heads.METHODS,
                            'how grouped heads become one')
_SEED = flags.DEFINE_integer('seed', 0, 'seed of --method=random')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  k_source, k = kv_heads.convert_workdir(
      _SOURCE.value, _WORKDIR.value, _KV_HEADS.value, _METHOD.value,
      _SEED.value)
  print(f'wrote {_WORKDIR.value}: {k_source} -> {k} KV heads by '
        f'{_METHOD.value}')


if __name__ == '__main__':
  run_app(main, required=['source', 'workdir', 'num_kv_heads'])
