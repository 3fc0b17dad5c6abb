"""Each conversion end to end: a workdir or a Hugging Face folder in, a new
workdir or folder out. `python -m train.convert` (train/convert/__main__.py)
is their command line and says what each does."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil
import zlib
from typing import Literal

from etils import epath
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from infra import storage
from lm import checkpoint, config_lib, evaluator
from train import loop
from train.convert import hf, safetensors_io
from train.convert import hf_deepseek, to_gta, to_mla, to_tpa
from lm import model as model_lib
from lm import tokenizer as tokenizer_lib
from infra import workdir as workdir_lib
from infra.errors import UserError
from lm.model import Transformer


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
  if model_config.layout.name != 'gqa':
    raise UserError(
        f'--num_kv_heads pools the K/V heads of grouped-query attention, '
        f'which a model.attention={model_config.layout.name!r} model '
        f'({model_config.layout_description()}) has not; convert its MHA/GQA '
        'source instead (--to_gta --num_kv_heads=K pools, then ties)')
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
  (`train.convert.to_mla`; grouped, GLA, with latent_groups > 1), with the
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
    info = {'source': str(source), 'to_mla': True,
            'kv_lora_rank': kv_lora_rank,
            'qk_rope_head_dim': qk_rope_head_dim,
            'latent_groups': latent_groups,
            'source_num_kv_heads': model_config.num_kv_heads,
            'energy_kept': energies, 'rope_pairs': new_mc.layout.rope_pairs,
            'calibration': calibration,
            'recipe': recipe}
    return _write_converted(path, source, model_config, new_params, config,
                            info)


def convert_to_gta(source: str, workdir: str, num_kv_heads: int,
                   qk_rope_head_dim: int, method: Method = 'mean',
                   seed: int = 0) -> dict:
  """Writes WORKDIR: SOURCE's model with its K/V heads pooled to
  num_kv_heads (-1: the source's) by `method`, then tied (grouped-tied
  attention, `train.convert.to_gta`), with the uptraining recipe; returns
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
    info = {'source': str(source), 'to_gta': True, 'num_kv_heads': k,
            'source_num_kv_heads': k_source, 'method': method,
            'qk_rope_head_dim': qk_rope_head_dim,
            'rope_pairs': new_mc.layout.rope_pairs, 'calibration': calibration,
            'recipe': recipe}
    return _write_converted(path, source, model_config, new_params, config,
                            info)


def convert_to_tpa(source: str, workdir: str, num_kv_heads: int = -1,
                   method: Method = 'mean', seed: int = 0) -> dict:
  """Writes WORKDIR: SOURCE's model with its K/V heads pooled to
  num_kv_heads (-1: the source's) by `method`, then as tensor product
  attention of rank K with constant one-hot head factors
  (`train.convert.to_tpa`: the pooled model's logits exactly), with the
  uptraining recipe; returns convert.json's record (the ranks, the cache
  bytes, the held-out loss of the source and of the converted model before
  uptraining)."""
  _check_method(method)
  with _new_workdir(workdir) as path:
    model_config, params, config = checkpoint.load_workdir(source, '--source')
    to_tpa.check_source(model_config)
    k_source = model_config.num_kv_heads
    k = _target_heads(k_source, num_kv_heads)
    pooled, pooled_mc = convert_params(params, model_config, k, method, seed)
    new_params, _ = to_tpa.convert_params(jax.tree.map(np.asarray, pooled),
                                          pooled_mc)
    config.model.update(to_tpa.target_config(pooled_mc)[1])
    recipe = apply_recipe(config, source_rate(source, config))
    source = storage.path(source, '--source')
    info = {'source': str(source), 'to_tpa': True, 'k_rank': k, 'v_rank': k,
            'source_num_kv_heads': k_source, 'method': method,
            'recipe': recipe}
    return _write_converted(path, source, model_config, new_params, config,
                            info)


def _calibration_tokens(config, source: epath.Path):
  """(tokens [8, seq_len], in words) to score RoPE pairs on: training
  windows of SOURCE's data."""
  dataset = loop.training_data(config, str(source))
  tokens = dataset.batch('train', seed=0, step=0, batch_size=8,
                         seq_len=config.data.seq_len)[:, :-1]
  return tokens, f'{tokens.shape[0]} x {tokens.shape[1]} training tokens'


def _write_converted(path: epath.Path, source: epath.Path, source_mc,
                     params, config, info: dict) -> dict:
  """A layout conversion's end (to_mla, to_gta, to_tpa): the source's
  tokenizer files copied, both models' KV bytes per token put in `info`
  before its recipe, step 0 written and both held-out losses recorded;
  returns info, convert.json's record."""
  for name in ('tokenizer.json', 'hf'):
    storage.copy(source / name, path / name)
  recipe = info.pop('recipe')
  info.update(
      kv_bytes_per_token=model_lib.kv_bytes_per_token(
          config_lib.model_config(config)),
      source_kv_bytes_per_token=model_lib.kv_bytes_per_token(source_mc),
      recipe=recipe)
  _write_step0(path, params, config, info)
  _record_losses(info, source, path)
  return info


def _record_losses(info: dict, source: epath.Path, path: epath.Path):
  """Adds the held-out losses of SOURCE and of the converted workdir
  (before uptraining) to `info` and rewrites its convert.json."""
  info['source_eval_loss'] = evaluator.evaluate_workdir(
      str(source))['eval_loss']
  info['eval_loss_before_uptraining'] = evaluator.evaluate_workdir(
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
        interleaved=hf_deepseek.interleaved(hf_config)
        if mc.layout.name == 'mla' else True)
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
  _, _, mc = checkpoint.load_workdir_config(source, '--source')
  folder = storage.path(source, '--source')
  remembered = {}
  if (folder / 'hf' / 'config.json').exists():
    remembered = json.loads((folder / 'hf' / 'config.json').read_text())
  # What no architecture computes is refused before any array is read.
  family = hf.family_of(mc, remembered.get('model_type'))
  if remembered.get('model_type') not in (None, family):
    remembered = {}  # Another architecture now: keep only its token ids.
  mc, params, _ = checkpoint.load_workdir(source, '--source')
  source = folder
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
