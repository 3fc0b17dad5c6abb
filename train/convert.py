"""Converts a trained checkpoint to fewer K/V heads (Ainslie et al. 2023).

  python -m train.convert --source=WORKDIR --workdir=NEWDIR --num_kv_heads=K \
      --method=mean|first|random

`mean` averages the key and value projection heads of each group (the
paper's method), `first` keeps the first of them, `random` re-initialises the
projections. KV head j of the result serves query heads [j·N/K, (j+1)·N/K),
which in the source were served by its KV heads [j·r, (j+1)·r),
r = K_source / K (the `jnp.repeat` head order of
`attention.dot_product_attention`). K = -1 keeps every head: an exact copy.
NEWDIR gets the config and a step-0 checkpoint with a fresh optimizer state;
uptrain it with train.main and the same config, the new num_kv_heads and the
steps to spend, e.g.

  python -m train.main --config=gqa_small --config.model.num_kv_heads=1 \
      --config.train.steps=36 --workdir=NEWDIR
"""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp

from train import checkpoint, loop
from train import workdir as workdir_lib
from train.errors import UserError, run_app
from train.model import Transformer


# How the r source heads of a group become one: [..., K, r, H] -> [..., K, H].
POOLERS = {
    'mean': lambda grouped: grouped.mean(-2),  # Ainslie et al. 2023.
    'first': lambda grouped: grouped[..., 0, :],
}
METHODS = (*POOLERS, 'random')  # 'random': freshly initialised projections.


def pool_heads(kernel_DKH: jax.Array, num_kv_heads: int, method: str):
  """[..., K_source, H] -> [..., K, H]: contiguous groups of r heads become one."""
  if method not in POOLERS:
    raise ValueError(f'method={method!r}; pooling is one of {list(POOLERS)}')
  *lead, k_source, H = kernel_DKH.shape
  grouped = kernel_DKH.reshape(*lead, num_kv_heads, k_source // num_kv_heads, H)
  return POOLERS[method](grouped)


def is_kv_kernel(path) -> bool:
  """Whether a parameter path ends in an attention's key or value kernel."""
  names = [getattr(k, 'key', None) for k in path]
  return len(names) >= 2 and names[-2] == 'attention' and names[-1] in (
      'key', 'value')


def convert_params(params, model_config, num_kv_heads: int, method: str,
                   seed: int = 0):
  """Params of `model_config` with K/V projections for `num_kv_heads` heads."""
  new_config = dataclasses.replace(model_config, num_kv_heads=num_kv_heads)
  if model_config.fused_qkv:
    raise UserError('convert works on separate query/key/value kernels; '
                    'train with model.fused_qkv=False')
  fresh = nn.unbox(loop.init_params(Transformer(new_config), seed))

  def convert(path, leaf, fresh_leaf):
    if is_kv_kernel(path):
      if method == 'random':
        return fresh_leaf
      return pool_heads(jnp.asarray(leaf), num_kv_heads, method)
    return jnp.asarray(leaf)

  return jax.tree_util.tree_map_with_path(convert, params, fresh), new_config


def convert_workdir(source: str, workdir: str, num_kv_heads: int,
                    method: str, seed: int = 0) -> tuple[int, int]:
  """Writes WORKDIR: SOURCE's config and a step-0 checkpoint with K KV heads.

  Returns (K of the source, K written); num_kv_heads -1 keeps the source's.
  """
  if method not in METHODS:
    raise UserError(f'--method={method!r}; use one of {", ".join(METHODS)}')
  # The target is checked before the (possibly long) work on the source.
  path = workdir_lib.check_writable(workdir)
  if (path / 'checkpoints').exists():
    raise UserError(f'{workdir} already holds checkpoints; pick a new '
                    '--workdir')
  with workdir_lib.lock(path):
    model_config, params, config = checkpoint.load_workdir(source, '--source')
    k_source = model_config.num_kv_heads
    k = k_source if num_kv_heads == -1 else num_kv_heads
    if k is None or k < 1 or k_source % k:
      raise UserError(f'--num_kv_heads={num_kv_heads}: the source has '
                      f'{k_source} KV heads; pick a divisor of {k_source} or '
                      '-1')
    new_params, _ = convert_params(params, model_config, k, method, seed)
    config.model.num_kv_heads = k
    tx, _ = loop.make_optimizer(config.train)
    state = loop.TrainState(jnp.array(0, jnp.int32), new_params,
                            tx.init(new_params))
    checkpointer = checkpoint.Checkpointer(workdir, every=1, keep=1)
    checkpointer.save(0, state, force=True)
    checkpointer.close()
    (path / 'config.json').write_text(config.to_json(indent=2))
    (path / 'convert.json').write_text(json.dumps({
        'source': str(source), 'num_kv_heads': k,
        'source_num_kv_heads': k_source, 'method': method}))
  return k_source, k


def main(argv):
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  del argv
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  k_source, k = convert_workdir(f.source, f.workdir, f.num_kv_heads, f.method,
                                f.seed)
  print(f'wrote {f.workdir}: {k_source} -> {k} KV heads by {f.method}')


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('source', None, 'trained workdir')
  flags.DEFINE_string('workdir', None, 'new workdir to write')
  flags.DEFINE_integer('num_kv_heads', None, 'K; -1 keeps all')
  flags.DEFINE_enum('method', 'mean', METHODS, 'how grouped heads become one')
  flags.DEFINE_integer('seed', 0, 'seed of --method=random')
  run_app(main, required=['source', 'workdir', 'num_kv_heads'])


if __name__ == '__main__':
  run()
