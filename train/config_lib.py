"""Named configs, and the checks that turn a bad config into one clear line."""

from __future__ import annotations

import math
import pathlib

import jax.numpy as jnp
from ml_collections import config_dict

from train.errors import UserError
from train.model import ModelConfig

CONFIG_DIR = pathlib.Path(__file__).parent.parent / 'configs'
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16,
          'float16': jnp.float16}


def known_configs() -> list[str]:
  return sorted(p.stem for p in CONFIG_DIR.glob('*.py')
                if not p.stem.startswith('_') and p.stem != 'default')


def resolve(argv: list[str]) -> list[str]:
  """Rewrites `--config=NAME` to the path of configs/NAME.py; paths pass through."""
  out = []
  for arg in argv:
    if arg.startswith('--config='):
      value = arg.split('=', 1)[1]
      name, _, rest = value.partition(':')
      if not name.endswith('.py') and '/' not in name:
        if name not in known_configs():
          raise UserError(f'unknown config {name!r}; known: '
                          f'{", ".join(known_configs())} (or a path to a .py)')
        value = str(CONFIG_DIR / f'{name}.py') + (f':{rest}' if rest else '')
      elif not pathlib.Path(name).is_file():
        raise UserError(f'config file {name!r} does not exist')
      arg = f'--config={value}'
    out.append(arg)
  return out


def model_config(config: config_dict.ConfigDict) -> ModelConfig:
  fields = config.model.to_dict()
  fields['dtype'] = DTYPES[fields['dtype']]
  return ModelConfig(**fields)


def validate(config: config_dict.ConfigDict, batch_shards: int,
             num_hosts: int = 1):
  """Raises UserError naming the setting to change."""
  m, d, t = config.model, config.data, config.train
  if m.dtype not in DTYPES:
    raise UserError(f'model.dtype={m.dtype!r}; use one of {sorted(DTYPES)}')
  for section, names in (('model', ('num_layers', 'd_model', 'num_heads',
                                    'num_kv_heads', 'head_dim', 'mlp_dim',
                                    'max_len', 'vocab_size')),
                         ('data', ('seq_len',)),
                         ('train', ('steps', 'batch_size', 'grad_accum_steps',
                                    'log_every', 'eval_every', 'eval_batches',
                                    'checkpoint_every', 'keep_checkpoints'))):
    for name in names:
      if config[section][name] < 1:
        raise UserError(f'{section}.{name}={config[section][name]} must be '
                        'positive')
  if m.num_heads % m.num_kv_heads:
    divisors = [k for k in range(1, m.num_heads + 1) if m.num_heads % k == 0]
    raise UserError(
        f'model.num_heads={m.num_heads} is not divisible by model.num_kv_heads'
        f'={m.num_kv_heads}; use num_kv_heads in {divisors}')
  if m.head_dim % 2:
    raise UserError(f'model.head_dim={m.head_dim} must be even for RoPE')
  if d.seq_len > m.max_len:
    raise UserError(
        f'data.seq_len={d.seq_len} is longer than model.max_len={m.max_len}; '
        'shorten the sequence or raise model.max_len')
  per_step = math.lcm(batch_shards * t.grad_accum_steps, num_hosts)
  if t.batch_size % per_step:
    raise UserError(
        f'train.batch_size={t.batch_size} does not split over {batch_shards} '
        f'data x fsdp device(s), {num_hosts} host(s) and '
        f'{t.grad_accum_steps} accumulation step(s); use a multiple of '
        f'{per_step}')
  if t.learning_rate <= 0 or not 0 <= t.min_learning_rate_ratio <= 1:
    raise UserError('train.learning_rate must be > 0 and '
                    'train.min_learning_rate_ratio in [0, 1]')
  if t.warmup_steps >= t.steps:
    raise UserError(f'train.warmup_steps={t.warmup_steps} must be below '
                    f'train.steps={t.steps}')
