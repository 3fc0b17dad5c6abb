"""Compile time of the training step against depth: nn.scan keeps it flat.

  python -m scripts.compile_time [--layers=2,12]
"""

import dataclasses
import time

import jax
import jax.numpy as jnp

from lm import config_lib
from train import loop
from infra.cli import ArgumentParser, exit_on_user_error, int_list
from lm.model import Transformer


def compile_seconds(model_config, batch=16, seq_len=256) -> float:
  model = Transformer(model_config)
  config = config_lib.load('gqa_small')
  tx, _ = loop.make_optimizer(config.train)
  state = jax.eval_shape(lambda: loop.init_state(model, tx, 0))
  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
  step = jax.jit(lambda s, b: loop.train_step(s, b, model=model, tx=tx,
                                              accum_steps=1))
  start = time.perf_counter()
  step.lower(state, tokens).compile()
  return time.perf_counter() - start


def main():
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--layers', type=int_list, default=[2, 12])
  args = parser.parse_args()
  base = config_lib.model_config(config_lib.load('gqa_small'))
  print(f'{"layers":>6} {"scanned s":>10} {"unrolled s":>11}')
  for n in args.layers:
    scanned = compile_seconds(dataclasses.replace(base, num_layers=n))
    unrolled = compile_seconds(dataclasses.replace(base, num_layers=n,
                                                   scan_layers=False))
    print(f'{n:>6} {scanned:>10.1f} {unrolled:>11.1f}', flush=True)


if __name__ == '__main__':
  exit_on_user_error(main)
