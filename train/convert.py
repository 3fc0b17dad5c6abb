"""Checkpoints in and out, and to fewer K/V heads (Ainslie et al. 2023).

  python -m train.convert --source=WORKDIR --workdir=NEWDIR --num_kv_heads=K \
      [--method=mean|first|random] [--optimizer=fresh|pooled]
                                            # our checkpoint -> fewer KV heads
  python -m train.convert --from_hf=HF_DIR --workdir=NEWDIR \
      [--num_kv_heads=K --method=mean] [--param_dtype=float32]   # import
  python -m train.convert --source=WORKDIR --to_hf=HF_DIR          # export
  python -m train.convert --source=WORKDIR --to_gguf=OUT.gguf \
      [--dtype=f32|f16|bf16]                   # for llama.cpp (train.to_gguf)
  python -m train.convert --source=WORKDIR --workdir=NEWDIR --to_mla \
      --kv_lora_rank=A --qk_rope_head_dim=Y [--latent_groups=G]
                                            # into latent attention (GLA)
  python -m train.convert --source=WORKDIR --workdir=NEWDIR --to_gta \
      [--num_kv_heads=K --method=mean] --qk_rope_head_dim=Y   # tied K/V

`mean` averages the key and value projection heads of each group (the
paper's method), `first` keeps the first of them, `random` re-initialises the
projections. KV head j of the result serves query heads [j·N/K, (j+1)·N/K),
which in the source were served by its KV heads [j·r, (j+1)·r),
r = K_source / K (the `jnp.repeat` head order of
`attention.dot_product_attention`). K = -1 (the default) keeps every head.

NEWDIR gets config.json and a step-0 checkpoint of the parameters (the
optimizer starts fresh), or with --optimizer=pooled of the parameters and the
source's Adam moments, their K/V heads pooled as the weights are (its
schedule restarts); an imported one also gets the tokenizer
(tokenizer.json) and the source's other small files (hf/), which export
copies back out. Uptrain with the workdir's own config, e.g.

  python -m train.main --config=NEWDIR --workdir=NEWDIR \
      --config.train.steps=36 --config.train.learning_rate=1e-4

--to_mla factorises each layer's K/V projections into multi-head latent
attention (`train.to_mla`: partial RoPE on the best qk_rope_head_dim / (2K)
frequency pairs per KV head, a joint SVD of the rest of [W_K | W_V], the energy kept per
layer and the held-out loss before any uptraining in NEWDIR/convert.json and
on stdout; MLA caches A numbers per token and layer instead of 2·K·H).
--latent_groups=G (a divisor of the source's K) converts into grouped latent
attention: each of G latents factorised from its own K/G KV heads.

--to_gta pools the K/V heads to K as above, then ties them into grouped-tied
attention (`train.to_gta`: each KV head's value becomes its tied state, the
keys' best qk_rope_head_dim / 2 RoPE pairs, averaged over the heads, the
shared RoPE key; K·H + Y numbers per token and layer instead of 2·K·H). It
is lossy: convert.json and stdout give the held-out loss before uptraining.
No Hugging Face architecture computes GTA, so --to_hf refuses such a model.

Hugging Face import supports Llama 2/3/3.1+, Mistral, Qwen2, Qwen3, Gemma
and DeepSeek-V2/V3 with dense MLPs (`train.hf`, `train.hf_deepseek`); it
streams the safetensors tensor by tensor, so the peak memory
is about one copy of the parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil
import sys
import zlib
from typing import Literal

from etils import epath
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from train import checkpoint, config_lib, hf, loop, safetensors_io, storage
from train import hf_deepseek, to_gguf, to_gta, to_mla
from train import model as model_lib
from train import tokenizer as tokenizer_lib
from train import workdir as workdir_lib
from train.errors import UserError
from train.cli import run_app
from train.model import Transformer


# How the r source heads of a group become one: [..., K, r, H] -> [..., K, H].
Method = Literal['mean', 'first', 'random']
# How a converted checkpoint's optimizer starts: fresh, or the source's Adam
# moments carried over, pooled like the weights (`pool_moments`).
Optimizer = Literal['fresh', 'pooled']
POOLERS = {
    'mean': lambda grouped: grouped.mean(-2),  # Ainslie et al. 2023.
    'first': lambda grouped: grouped[..., 0, :],
}
METHODS = (*POOLERS, 'random')  # 'random': freshly initialised projections.


def pool_heads(kernel_DKH, num_kv_heads: int, method: Method):
  """[..., K_source, H] -> [..., K, H]: contiguous groups of r heads become one."""
  if method not in POOLERS:
    raise ValueError(f'method={method!r}; pooling is one of {list(POOLERS)}')
  *lead, k_source, H = kernel_DKH.shape
  grouped = kernel_DKH.reshape(*lead, num_kv_heads, k_source // num_kv_heads, H)
  return POOLERS[method](grouped)


def is_kv_kernel(path) -> bool:
  """Whether a parameter path ends in an attention's key or value kernel (or
  bias)."""
  names = [getattr(k, 'key', None) for k in path]
  return len(names) >= 2 and names[-2] == 'attention' and names[-1] in (
      hf.KV_NAMES)


def convert_params(params, model_config, num_kv_heads: int, method: Method,
                   seed: int = 0):
  """Params of `model_config` with K/V projections for `num_kv_heads` heads."""
  new_config = dataclasses.replace(model_config, num_kv_heads=num_kv_heads)
  if model_config.tie_kv:
    raise UserError('--num_kv_heads pools key and value heads, which a GTA '
                    'model (model.tie_kv=True) has tied; convert its MHA/GQA '
                    'source with --to_gta --num_kv_heads=K instead')
  if model_config.kv_lora_rank:
    raise UserError('--num_kv_heads pools K/V heads, which an MLA model '
                    f'(model.kv_lora_rank={model_config.kv_lora_rank}) has '
                    'not; convert its source, or train a smaller latent')
  if model_config.fused_qkv:
    raise UserError('convert works on separate query/key/value kernels; '
                    'train with model.fused_qkv=False')
  # Only 'random' needs a fresh model; the shapes stand in otherwise.
  fresh = (nn.unbox(loop.init_params(Transformer(new_config), seed))
           if method == 'random' else model_lib.parameter_shapes(new_config))

  def convert(path, leaf, fresh_leaf):
    if is_kv_kernel(path):
      if method == 'random':
        return fresh_leaf
      return pool_heads(jnp.asarray(leaf), num_kv_heads, method)
    return jnp.asarray(leaf)

  return jax.tree_util.tree_map_with_path(convert, params, fresh), new_config


# Continued training of a pretrained model, written into every imported or
# converted workdir's config (README, "The uptraining recipe"): a short
# warmup to a peak far below a from-scratch one, then cosine decay to 10% of
# it, float32 master weights. A pretrained Hugging Face model gets 3e-5
# (a tenth of the ~3e-4 peak at which 1-8B models are pre-trained, the range
# continued pre-training uses: Llama 2's fine-tuning 2e-5, Ibrahim et al.
# 2024's lower re-warmed rates for less forgetting); our own source resumes
# at the rate its schedule ended with (`source_rate`).
HF_UPTRAINING_LEARNING_RATE = 3e-5


def apply_recipe(config, learning_rate: float) -> dict:
  """Sets the recipe in `config`; returns its fields (dotted names)."""
  recipe = {'train.learning_rate': learning_rate,
            'train.warmup_steps': min(max(1, config.train.steps // 50),
                                      config.train.steps - 1),
            'train.min_learning_rate_ratio': 0.1,
            'model.param_dtype': 'float32'}
  config.update_from_flattened_dict(recipe)
  return recipe


def source_rate(source: epath.Path, config) -> float:
  """The recipe's peak for a checkpoint of ours: the rate its schedule ended
  at, or, for one that was itself converted or imported, its own recipe's."""
  rate = workdir_lib.recipe_learning_rate(source)
  if rate is not None:
    return rate
  return config.train.learning_rate * config.train.min_learning_rate_ratio


def _target_heads(k_source: int, num_kv_heads: int) -> int:
  k = k_source if num_kv_heads == -1 else num_kv_heads
  if k < 1 or k_source % k:
    raise UserError(f'--num_kv_heads={num_kv_heads}: the source has '
                    f'{k_source} KV heads; pick a divisor of {k_source} or -1')
  return k


def convert_workdir(source: str, workdir: str, num_kv_heads: int,
                    method: Method, seed: int = 0,
                    optimizer: Optimizer = 'fresh') -> tuple[int, int]:
  """Writes WORKDIR: SOURCE's config and a step-0 checkpoint with K KV heads
  (optimizer 'pooled': and the source's Adam state, `pool_moments`).

  Returns (K of the source, K written); num_kv_heads -1 keeps the source's.
  """
  _check_method(method)
  if optimizer not in ('fresh', 'pooled'):
    raise UserError(f'--optimizer={optimizer!r}; use fresh or pooled')
  with _new_workdir(workdir) as path:
    model_config, params, config = checkpoint.load_workdir(source, '--source')
    k_source = model_config.num_kv_heads
    k = _target_heads(k_source, num_kv_heads)
    new_params, _ = convert_params(params, model_config, k, method, seed)
    config.model.num_kv_heads = k
    source = storage.path(source, '--source')
    recipe = apply_recipe(config, source_rate(source, config))
    opt_state = None if optimizer == 'fresh' else pool_moments(
        source, new_params, config, k, method)
    for name in ('tokenizer.json', 'hf'):  # The tokenizer travels along.
      storage.copy(source / name, path / name)
    _write_step0(path, new_params, config, {
        'source': str(source), 'num_kv_heads': k,
        'source_num_kv_heads': k_source, 'method': method,
        'optimizer': optimizer, 'recipe': recipe}, opt_state)
  return k_source, k


def pool_moments(source: epath.Path, new_params, config, num_kv_heads: int,
                 method: Method):
  """The optimizer state of `new_params` (`config`'s AdamW) carrying
  SOURCE's latest Adam state: its step count, and its first and second
  moments with the K/V heads pooled as `method` pools the weights ('random':
  zeros for the new heads). The learning-rate schedule's count starts at 0,
  so the uptraining recipe's warmup runs; Adam's own count carries on, so
  its bias correction stays that of moments already averaged."""
  _, saved = checkpoint.restore_latest(source)
  if 'opt_state' not in saved:
    raise UserError(f'--source={source} has no optimizer state (a converted '
                    'or imported checkpoint); use --optimizer=fresh')

  def pool(path, leaf, new_leaf):
    if not is_kv_kernel(path):
      return jnp.asarray(leaf)
    if method == 'random':
      return jnp.zeros_like(new_leaf)
    return pool_heads(jnp.asarray(leaf), num_kv_heads, method)

  def carried(path, fresh):
    if not isinstance(fresh, optax.ScaleByAdamState):
      return fresh  # Clipping, decay mask, the schedule's count: fresh.
    adam = saved['opt_state']
    for key in path:  # The same place in the saved (list and dict) tree.
      adam = adam[getattr(key, 'idx', getattr(key, 'key', None))]
    moments = [jax.tree_util.tree_map_with_path(pool, adam[name], new_params)
               for name in ('mu', 'nu')]
    return optax.ScaleByAdamState(jnp.asarray(adam['count']), *moments)

  fresh = loop.make_optimizer(config.train)[0].init(new_params)
  return jax.tree_util.tree_map_with_path(
      carried, fresh, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))


def convert_to_mla(source: str, workdir: str, kv_lora_rank: int,
                   qk_rope_head_dim: int = 0, latent_groups: int = 1) -> dict:
  """Writes WORKDIR: SOURCE's model as multi-head latent attention
  (`train.to_mla`; grouped, GLA, with latent_groups > 1), with the
  uptraining recipe; returns convert.json's record (energy kept per layer,
  held-out loss of the source and of the converted model before
  uptraining)."""
  with _new_workdir(workdir) as path:
    model_config, params, config = checkpoint.load_workdir(source, '--source')
    to_mla.check_source(model_config, kv_lora_rank, qk_rope_head_dim,
                        latent_groups)
    source = storage.path(source, '--source')
    scores, calibration = None, None
    if model_config.use_rope:
      tokens, calibration = _calibration_tokens(config, source)
      scores = to_mla.calibration_scores(model_config, params, tokens)
    new_params, new_mc, energies = to_mla.convert_params(
        params, model_config, kv_lora_rank, qk_rope_head_dim, scores,
        latent_groups)
    config.model.update(to_mla.target_config(
        model_config, kv_lora_rank, qk_rope_head_dim,
        None if scores is None else to_mla.select_pairs(
            scores, qk_rope_head_dim), latent_groups)[1])
    recipe = apply_recipe(config, source_rate(source, config))
    for name in ('tokenizer.json', 'hf'):
      storage.copy(source / name, path / name)
    info = {'source': str(source), 'to_mla': True,
            'kv_lora_rank': kv_lora_rank,
            'qk_rope_head_dim': qk_rope_head_dim,
            'latent_groups': latent_groups,
            'source_num_kv_heads': model_config.num_kv_heads,
            'energy_kept': energies, 'rope_pairs': new_mc.rope_pairs,
            'calibration': calibration,
            'kv_bytes_per_token': model_lib.kv_bytes_per_token(
                config_lib.model_config(config)),
            'source_kv_bytes_per_token': model_lib.kv_bytes_per_token(
                model_config), 'recipe': recipe}
    _write_step0(path, new_params, config, info)
    _record_losses(info, source, path)
  return info


def convert_to_gta(source: str, workdir: str, num_kv_heads: int,
                   qk_rope_head_dim: int, method: Method = 'mean',
                   seed: int = 0) -> dict:
  """Writes WORKDIR: SOURCE's model with its K/V heads pooled to
  num_kv_heads (-1: the source's) by `method`, then tied (grouped-tied
  attention, `train.to_gta`), with the uptraining recipe; returns
  convert.json's record (the RoPE pairs kept, the cache bytes, the held-out
  loss of the source and of the converted model before uptraining)."""
  _check_method(method)
  with _new_workdir(workdir) as path:
    model_config, params, config = checkpoint.load_workdir(source, '--source')
    to_gta.check_source(model_config, qk_rope_head_dim)
    k_source = model_config.num_kv_heads
    k = _target_heads(k_source, num_kv_heads)
    pooled, pooled_mc = convert_params(params, model_config, k, method, seed)
    pooled = jax.tree.map(np.asarray, pooled)
    source = storage.path(source, '--source')
    scores, calibration = None, None
    if pooled_mc.use_rope:
      tokens, calibration = _calibration_tokens(config, source)
      scores = to_mla.calibration_scores(pooled_mc, pooled, tokens)
    new_params, new_mc = to_gta.convert_params(pooled, pooled_mc,
                                               qk_rope_head_dim, scores)
    config.model.update(to_gta.target_config(
        pooled_mc, qk_rope_head_dim, None if scores is None else
        to_gta.select_pairs(scores, qk_rope_head_dim))[1])
    recipe = apply_recipe(config, source_rate(source, config))
    for name in ('tokenizer.json', 'hf'):
      storage.copy(source / name, path / name)
    info = {'source': str(source), 'to_gta': True, 'num_kv_heads': k,
            'source_num_kv_heads': k_source, 'method': method,
            'qk_rope_head_dim': qk_rope_head_dim,
            'rope_pairs': new_mc.rope_pairs, 'calibration': calibration,
            'kv_bytes_per_token': model_lib.kv_bytes_per_token(
                config_lib.model_config(config)),
            'source_kv_bytes_per_token': model_lib.kv_bytes_per_token(
                model_config), 'recipe': recipe}
    _write_step0(path, new_params, config, info)
    _record_losses(info, source, path)
  return info


def _calibration_tokens(config, source: epath.Path):
  """(tokens [8, seq_len], in words) to score RoPE pairs on: training
  windows of SOURCE's data."""
  dataset = loop.training_data(config, str(source))
  tokens = dataset.batch('train', seed=0, step=0, batch_size=8,
                         seq_len=config.data.seq_len)[:, :-1]
  return tokens, f'{tokens.shape[0]} x {tokens.shape[1]} training tokens'


def _record_losses(info: dict, source: epath.Path, path: epath.Path):
  """Adds the held-out losses of SOURCE and of the converted workdir
  (before uptraining) to `info` and rewrites its convert.json."""
  info['source_eval_loss'] = loop.evaluate_workdir(str(source))['eval_loss']
  info['eval_loss_before_uptraining'] = loop.evaluate_workdir(
      str(path))['eval_loss']
  (path / workdir_lib.CONVERT_INFO).write_text(json.dumps(info))


def _kv_converter(k: int, method: Method, seed: int):
  """(a source K/V weight [D, K_source, H] or bias [K_source, H], its HF
  name) -> the same with k heads, by `method`."""
  init = nn.initializers.lecun_normal()
  key = jax.random.key(seed)

  def convert_kv(value, name):
    if method == 'random':  # Kernels fresh, biases zero.
      shape = (*value.shape[:-2], k, value.shape[-1])
      if value.ndim == 2:
        return np.zeros(shape, value.dtype)
      rng = jax.random.fold_in(key, zlib.crc32(name.encode()))
      return np.asarray(init(rng, shape, jnp.float32))
    return pool_heads(value.astype(np.float32), k, method)
  return convert_kv


def import_hf(source: str, workdir: str, num_kv_heads: int = -1,
              method: Method = 'mean', seed: int = 0,
              param_dtype: str = '') -> tuple[str, int, int]:
  """Writes WORKDIR from a Hugging Face checkpoint folder; returns
  (model_type, K of the source, K written).

  Everything is checked (config, tensor names and shapes) before anything
  is written; a failure after that removes what was written.
  """
  _check_method(method)
  storage.refuse_url(source, '--from_hf')
  directory = pathlib.Path(source).absolute()
  hf_config = hf.read_config(directory)
  fields = hf.model_fields(hf_config)
  if param_dtype:
    if param_dtype not in config_lib.DTYPES:
      raise UserError(f'--param_dtype={param_dtype!r}; use one of '
                      f'{sorted(config_lib.DTYPES)}')
    fields['param_dtype'] = param_dtype
  k_source = fields['num_kv_heads']
  k = fields['num_kv_heads'] = _target_heads(k_source, num_kv_heads)
  config = config_lib.defaults()
  config.model.update({f: v for f, v in fields.items()
                       if f != 'rope_scaling'})
  config.model.rope_scaling.update(fields['rope_scaling'])
  config.data.seq_len = min(config.data.seq_len, config.model.max_len)
  recipe = apply_recipe(config, HF_UPTRAINING_LEARNING_RATE)
  if param_dtype:  # Asked for: it overrides the recipe's float32.
    config.model.param_dtype = param_dtype
  config_lib.validate(config, batch_shards=1)
  _check_tokenizer(directory / tokenizer_lib.FILE, fields['vocab_size'])
  files = safetensors_io.open_checkpoint(directory)
  mc = config_lib.model_config(config)
  shapes = model_lib.parameter_shapes(mc)

  convert_kv = _kv_converter(k, method, seed) if (
      k != k_source or method == 'random') else None
  with _new_workdir(workdir) as path:
    params = hf.read_weights(
        files, shapes, mc, convert_kv,
        interleaved=hf_deepseek.interleaved(hf_config) if mc.kv_lora_rank
        else True)
    (path / 'hf').mkdir(exist_ok=True)
    (path / 'hf' / 'config.json').write_text(json.dumps(hf_config, indent=2))
    for name in hf.TOKENIZER_FILES:
      storage.copy(epath.Path(directory / name), path / 'hf' / name)
    storage.copy(epath.Path(directory / tokenizer_lib.FILE),
                 path / tokenizer_lib.FILE)
    _write_step0(path, params, config, {
        'from_hf': str(directory),
        'model_type': hf_config['model_type'], 'num_kv_heads': k,
        'source_num_kv_heads': k_source, 'method': method,
        'recipe': recipe})
  return hf_config['model_type'], k_source, k


def _check_tokenizer(path: pathlib.Path, vocab_size: int):
  """A tokenizer.json that travels with an import must load, and its ids fit
  the embedding."""
  if not path.exists():
    return
  loaded = tokenizer_lib.load(path)  # UserError if it is not one.
  if loaded.vocab_size > vocab_size:
    raise UserError(f'{path} has {loaded.vocab_size} tokens, more than the '
                    f'model\'s vocab_size={vocab_size}; give the tokenizer '
                    'of this model; nothing was written')


def export_hf(source: str, target: str) -> str:
  """Writes SOURCE's latest parameters as a Hugging Face folder TARGET;
  returns its model_type."""
  storage.refuse_url(target, '--to_hf')
  out = pathlib.Path(target)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise UserError(f'--to_hf={target} exists and is not an empty folder; '
                    'give a new one')
  mc, params, _ = checkpoint.load_workdir(source, '--source')
  source = storage.path(source, '--source')
  remembered = {}
  if (source / 'hf' / 'config.json').exists():
    remembered = json.loads((source / 'hf' / 'config.json').read_text())
  family = hf.family_of(mc, remembered.get('model_type'))
  if remembered.get('model_type') not in (None, family):
    remembered = {}  # Another architecture now: keep only its token ids.
  params = hf.unfused(params, mc)
  shapes, tensors = hf.hf_tensors(params, mc)
  out.mkdir(parents=True, exist_ok=True)
  try:
    safetensors_io.write(out, tensors, shapes)
    config = hf.hf_config(mc, family, remembered)
    (out / 'config.json').write_text(json.dumps(config, indent=2))
    for name in hf.TOKENIZER_FILES:
      storage.copy(source / 'hf' / name, epath.Path(out / name))
    storage.copy(source / 'tokenizer.json', epath.Path(out / 'tokenizer.json'))
  except BaseException:
    shutil.rmtree(out)
    raise
  return family


def _check_method(method: str):
  if method not in METHODS:
    raise UserError(f'--method={method!r}; use one of {", ".join(METHODS)}')


@contextlib.contextmanager
def _new_workdir(workdir: str):
  """A new workdir, locked; on any failure, what was written is removed."""
  existed = storage.path(workdir).exists()
  path = workdir_lib.check_writable(workdir)
  if (path / 'checkpoints').exists():
    raise UserError(f'{workdir} already holds checkpoints; pick a new '
                    '--workdir')
  before = set(path.iterdir()) if existed else set()  # A bucket has no
  # empty folders.
  try:
    with workdir_lib.lock(path):
      yield path
  except BaseException:
    for item in set(path.iterdir()) - before if existed else [path]:
      storage.remove(item)
    raise


def _write_step0(path: epath.Path, params, config, info: dict,
                 opt_state=None):
  """The step-0 checkpoint (parameters only: `train.main` starts the
  optimizer fresh; or with `opt_state`, a whole training state it resumes),
  then config.json, which marks the workdir complete."""
  if opt_state is None:
    checkpoint.save_params(path, params)
  else:
    saver = checkpoint.Checkpointer(path, every=1, keep=1)
    try:
      saver.save(0, loop.TrainState(jnp.array(0, jnp.int32), params,
                                    opt_state), force=True)
      saver.wait()
    finally:
      saver.close()
  (path / workdir_lib.CONVERT_INFO).write_text(json.dumps(info))
  (path / 'config.json').write_text(config.to_json(indent=2))


def main(argv):
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  del argv
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  if bool(f.source) == bool(f.from_hf):
    raise UserError('give one of --source (a workdir) or --from_hf (a '
                    'Hugging Face folder)')
  if sum(map(bool, (f.workdir, f.to_hf, f.to_gguf))) != 1 or (
      f.from_hf and (f.to_hf or f.to_gguf)):
    raise UserError('give --workdir (to write a workdir) or, with --source, '
                    '--to_hf (to write a Hugging Face folder) or --to_gguf (a '
                    'GGUF file for llama.cpp)')
  ignored = [f'--{name}' for name in (
      'num_kv_heads', 'method', 'seed', 'optimizer', 'param_dtype',
      'kv_lora_rank', 'qk_rope_head_dim', 'latent_groups')
             if f.to_gguf and f[name].present]
  if ignored:
    raise UserError(f'--to_gguf writes the workdir as it is and takes no '
                    f'{", ".join(ignored)}; convert it first (--workdir), '
                    'then export that')
  if f['dtype'].present and not f.to_gguf:
    raise UserError('--dtype is the weights\' dtype in a GGUF file; give it '
                    'with --to_gguf, or leave it out')
  if f.to_mla and f.to_gta:
    raise UserError('give one of --to_mla and --to_gta')
  for name in ('to_mla', 'to_gta'):
    if f[name].value and not (f.source and f.workdir):
      raise UserError(f'--{name} converts --source=WORKDIR into a new '
                      '--workdir')
  ignored = [f'--{name}' for name in ('kv_lora_rank', 'optimizer',
                                      'param_dtype')
             if f.to_gta and f[name].present]
  if ignored:
    raise UserError(f'--to_gta takes no {", ".join(ignored)} (an MLA '
                    'conversion\'s, a GQA conversion\'s or an import\'s); '
                    'leave them out')
  if f['latent_groups'].present and not f.to_mla:
    raise UserError('--latent_groups splits the latent of --to_mla; give it '
                    'with --to_mla (and --kv_lora_rank), or leave it out')
  ignored = [f'--{name}' for name in ('num_kv_heads', 'method', 'seed',
                                      'optimizer', 'param_dtype')
             if f.to_mla and f[name].present]
  if ignored:  # Those of a GQA conversion or an import: not used here.
    raise UserError(f'--to_mla takes no {", ".join(ignored)} (a GQA '
                    'conversion\'s or an import\'s); leave them out')
  if f.to_mla and f.kv_lora_rank is None:
    raise UserError('--to_mla needs --kv_lora_rank=A, the latent\'s width '
                    '(at most min(d_model, 2·K·H - --qk_rope_head_dim) for K '
                    'KV heads of H dims: the full rank, every K/V direction '
                    'kept)')
  if f.to_gguf:
    info = to_gguf.export(f.source, f.to_gguf, f.dtype)
    print(f'wrote {f.to_gguf}: {info["arch"]} ({info["dtype"]}, '
          f'{info["bytes"] / 2**20:,.1f} MiB) for llama.cpp')
    return
  if f.to_hf:
    family = export_hf(f.source, f.to_hf)
    print(f'wrote {f.to_hf}: a {family} checkpoint (Hugging Face format)')
    return
  if f.from_hf:
    family, k_source, k = import_hf(f.from_hf, f.workdir, f.num_kv_heads,
                                    f.method, f.seed, f.param_dtype)
    print(f'wrote {f.workdir}: {family}, {_heads(k_source, k, f.method)}')
    if not (pathlib.Path(f.from_hf) / tokenizer_lib.FILE).exists():
      print(f'warning: {f.from_hf} has no {tokenizer_lib.FILE}, so '
            f'{f.workdir} can train only on token ids (.bin files); to train '
            f'on text, copy the model\'s {tokenizer_lib.FILE} into both',
            file=sys.stderr)
    return
  if f.to_gta:
    info = convert_to_gta(f.source, f.workdir, f.num_kv_heads,
                          f.qk_rope_head_dim, f.method, f.seed)
    print(f'wrote {f.workdir}: GTA, '
          f"{_heads(info['source_num_kv_heads'], info['num_kv_heads'], f.method)}"
          f', tied with a RoPE key of {f.qk_rope_head_dim}, '
          f"{info['source_kv_bytes_per_token']:g} -> "
          f"{info['kv_bytes_per_token']:g} KV bytes/token; held-out loss "
          f'{info["source_eval_loss"]:.4f} -> '
          f'{info["eval_loss_before_uptraining"]:.4f} before uptraining')
    return
  if f.to_mla:
    info = convert_to_mla(f.source, f.workdir, f.kv_lora_rank,
                          f.qk_rope_head_dim, f.latent_groups)
    energy = [round(e, 4) for e in info['energy_kept'] if e is not None]
    kind = (f'GLA, latent_groups={f.latent_groups}' if f.latent_groups > 1
            else 'MLA')
    print(f'wrote {f.workdir}: {kind}, kv_lora_rank={f.kv_lora_rank}, '
          f"{info['source_kv_bytes_per_token']:g} -> "
          f"{info['kv_bytes_per_token']:g} KV bytes/token; energy kept per "
          f'layer {energy}; held-out loss {info["source_eval_loss"]:.4f} -> '
          f'{info["eval_loss_before_uptraining"]:.4f} before uptraining')
    return
  k_source, k = convert_workdir(f.source, f.workdir, f.num_kv_heads, f.method,
                                f.seed, f.optimizer)
  print(f'wrote {f.workdir}: {_heads(k_source, k, f.method)}')


def _heads(k_source: int, k: int, method: str) -> str:
  if k == k_source and method != 'random':
    return f'{k} KV heads, copied unchanged'
  return f'{k_source} -> {k} KV heads by {method}'


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('source', None, 'a train.main workdir to read')
  flags.DEFINE_string('from_hf', None, 'a Hugging Face checkpoint folder')
  flags.DEFINE_string('workdir', None, 'new workdir to write')
  flags.DEFINE_string('to_hf', None, 'new Hugging Face folder to write')
  flags.DEFINE_string('to_gguf', None, 'new GGUF file to write (llama.cpp; '
                      'train.to_gguf)')
  flags.DEFINE_enum('dtype', None, list(to_gguf.DTYPES), '--to_gguf: the '
                    "weights' dtype; default the checkpoint's param_dtype")
  flags.DEFINE_integer('num_kv_heads', -1, 'K; -1 keeps all')
  flags.DEFINE_enum('method', 'mean', METHODS, 'how grouped heads become one')
  flags.DEFINE_integer('seed', 0, 'seed of --method=random')
  flags.DEFINE_enum('optimizer', 'fresh', ['fresh', 'pooled'],
                    "a converted workdir's optimizer: fresh, or the source's "
                    'Adam moments pooled like the weights')


  flags.DEFINE_bool('to_mla', False, 'convert --source into multi-head '
                    'latent attention (train.to_mla)')
  flags.DEFINE_integer('kv_lora_rank', None, '--to_mla: the latent\'s width')
  flags.DEFINE_bool('to_gta', False, 'convert --source into grouped-tied '
                    'attention (train.to_gta), its K/V heads pooled to '
                    '--num_kv_heads first')
  flags.DEFINE_integer('qk_rope_head_dim', 0, '--to_mla: RoPE dims kept, 2·r·K (r pairs per KV head); --to_gta: the shared RoPE key\'s width, even, below head_dim; 0 without RoPE')
  flags.DEFINE_integer('latent_groups', 1, '--to_mla: latents of '
                       '--kv_lora_rank / G features, each from K/G source KV '
                       'heads (grouped latent attention); 1: MLA')
  flags.DEFINE_string('param_dtype', '', "imported parameters' dtype; '': "
                      "float32 master weights (the uptraining recipe)")
  run_app(main)


if __name__ == '__main__':
  run()
