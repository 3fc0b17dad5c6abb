"""What the comparison trains: each variant's config (K/V heads, the MLP
widened to MHA's parameters where asked), the negative control's (no
context), the A/A control's first step (the reference with its K/V
projections redrawn), and where each run lives."""

from __future__ import annotations

import pathlib

import jax
from flax import linen as nn

from lm import checkpoint, config_lib, flops
from lm.model import Transformer
from train import convert, loop

DECODE_BATCH, DECODE_CONTEXT = 16, 256  # Where decoding is timed.
AA_REDRAW = 1_000  # The A/A run's K/V initialisation seed: seed + this.


def variant_config(base, K, seed, steps, equal_params):
  config = config_lib.load(base)
  m = config.model
  if equal_params:
    m.mlp_dim = flops.equal_params_mlp_dim(m.mlp_dim, m.num_heads, K,
                                           m.head_dim)
  m.num_kv_heads = K
  config.seed = seed
  if steps:
    config.train.update(steps=steps, eval_every=max(steps // 3, 1),
                        checkpoint_every=steps,
                        warmup_steps=min(config.train.warmup_steps, steps // 4))
  return config


def control_config(base, K, seed, steps):
  """The negative control: variant K (not widened) with every layer's
  attention a window of 1 key, its own token: no context."""
  config = variant_config(base, K, seed, steps, equal_params=False)
  config.model.update(attention_pattern='L', local_window=1)
  return config


def aa_start(workdir: pathlib.Path, config, seed: int):
  """The A/A run's step 0 in WORKDIR (once): the parameters `config` starts
  from with `seed`, its K/V projections (`convert.is_kv_kernel`) drawn with
  seed + AA_REDRAW instead; `train.main` then trains it with `seed`'s data
  order and a fresh optimizer."""
  if (workdir / 'config.json').exists():
    return
  model = Transformer(config_lib.model_config(config))
  base, other = (nn.unbox(loop.init_params(model, s))
                 for s in (seed, seed + AA_REDRAW))
  params = jax.tree_util.tree_map_with_path(
      lambda path, a, b: b if convert.is_kv_kernel(path) else a, base, other)
  workdir.mkdir(parents=True, exist_ok=True)
  checkpoint.save_params(workdir, params)
  (workdir / 'config.json').write_text(config.to_json(indent=2))


def reference_K(kv_heads, num_heads: int) -> int:
  """What the variants are compared against: MHA (K = num_heads) when it
  runs, else the variant with the most K/V heads."""
  return num_heads if num_heads in kv_heads else max(kv_heads)


def run_name(K) -> str:
  """A run's folder name in OUT, before _s{seed}: K{k}, control or aa."""
  return K if K in ('control', 'aa') else f'K{K}'


def plan(args) -> dict:
  """{(K, seed): config} of every run the flags ask for: each variant and
  seed, then (with 2 seeds or more: one seed resolves nothing, the controls
  included) the negative control's runs (('control', seed), unless
  --no_control) and the A/A control's (('aa', seed), the reference's
  config, unless --no_aa)."""
  steps = 120 if args.quick and not args.steps else args.steps
  configs = {(K, seed): variant_config(args.config, K, seed, steps,
                                       args.equal_params)
             for K in args.kv_heads for seed in range(args.seeds)}
  num_heads = config_lib.load(args.config).model.num_heads
  control_K = reference_K(args.kv_heads, num_heads)
  if args.seeds < 2:
    return configs
  if not args.no_control:
    configs.update({('control', seed): control_config(args.config, control_K,
                                                      seed, steps)
                    for seed in range(args.seeds)})
  if not args.no_aa:
    configs.update({('aa', seed): configs[control_K, seed]
                    for seed in range(args.seeds)
                    if (control_K, seed) in configs})
  return configs
