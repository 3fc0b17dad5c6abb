"""Named configs, and the checks that turn a bad config into one clear line."""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import pathlib
import sys

import jax.numpy as jnp
from ml_collections import config_dict

from attention import layer
from attention import layout as layout_lib
from attention.layout import Layout
from attention.rope import RopeScaling
from infra.errors import UserError
from infra.storage import refuse_url
from lm.model import ACTIVATIONS, ModelConfig

CONFIG_DIR = pathlib.Path(__file__).parent.parent / 'configs'
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16,
          'float16': jnp.float16}


def known_configs() -> list[str]:
  return sorted(p.stem for p in CONFIG_DIR.glob('*.py')
                if not p.stem.startswith('_') and p.stem != 'default')


def _is_folder(name: str) -> bool:
  """Whether --config=NAME means a folder (a workdir): a config's name means
  the config, even where a folder of that name is in the current directory
  (`--config=tiny --workdir=tiny`, rerun, resumes with configs/tiny.py);
  ./NAME is the folder."""
  if name in known_configs():
    if pathlib.Path(name).is_dir():
      print(f'note: --config={name} is the config configs/{name}.py, not the '
            f'folder {name}/ here (for that, --config=./{name})',
            file=sys.stderr)
    return False
  return pathlib.Path(name).is_dir()


def resolve(argv: list[str]) -> list[str]:
  """Rewrites `--config=NAME` to the path of configs/NAME.py; paths pass through.

  A .json file (a workdir's config.json) or a workdir holding one is read by
  configs/_json.py: the defaults, updated with what the file sets.
  """
  out = []
  for arg in argv:
    if arg.startswith('--config='):
      value = arg.split('=', 1)[1]
      refuse_url(value, '--config')
      name, _, rest = value.partition(':')
      path = pathlib.Path(name)
      if _is_folder(name) or name.endswith('.json'):
        if path.is_dir():
          path = path / 'config.json'
        if not path.is_file():
          raise UserError(f'{path} does not exist; --config takes a config '
                          'name, a .py or .json file, or a workdir')
        from_json(path)  # Refused here, in one line, if it is not JSON.
        value = f'{CONFIG_DIR / "_json.py"}:{path.absolute()}'
      elif not name.endswith('.py') and '/' not in name:
        if name not in known_configs():
          raise UserError(f'unknown config {name!r}; known: '
                          f'{", ".join(known_configs())} (or a path to a .py '
                          'or .json file, or a workdir)')
        value = str(CONFIG_DIR / f'{name}.py') + (f':{rest}' if rest else '')
      elif not pathlib.Path(name).is_file():
        raise UserError(f'config file {name!r} does not exist')
      else:
        _check_config_file(pathlib.Path(name))
      arg = f'--config={value}'
    out.append(arg)
  return out


def _check_config_file(path: pathlib.Path):
  """A config .py must parse and define get_config; say where if not."""
  try:
    tree = ast.parse(path.read_bytes(), str(path))
  except SyntaxError as e:
    raise UserError(f'{path}, line {e.lineno}: {e.msg}; fix the config file'
                    ) from None
  except (OSError, ValueError) as e:
    raise UserError(f'config file {str(path)!r} cannot be read ({e})'
                    ) from None
  defined = set()
  for node in tree.body:  # def get_config, an import of one, or a name.
    if isinstance(node, ast.FunctionDef):
      defined.add(node.name)
    elif isinstance(node, ast.ImportFrom):
      defined |= {alias.asname or alias.name for alias in node.names}
    elif isinstance(node, ast.Assign):
      defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
  if 'get_config' not in defined:
    raise UserError(f'{path} defines no get_config(); a config file returns '
                    'its ml_collections.ConfigDict from get_config() (see '
                    'configs/tiny.py)')


def load(name: str) -> config_dict.ConfigDict:
  """The config called NAME in configs/, or the one in the .py file, the
  .json file or the workdir NAME."""
  if name not in known_configs() and pathlib.Path(name).is_dir() or (
      name.endswith('.json')):
    resolve([f'--config={name}'])  # The same checks as on the command line.
    path = pathlib.Path(name)
    return from_json(path / 'config.json' if path.is_dir() else path)
  path = pathlib.Path(resolve([f'--config={name}'])[0].split('=', 1)[1])
  spec = importlib.util.spec_from_file_location(f'config_{path.stem}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def defaults() -> config_dict.ConfigDict:
  """configs/default.py: every field, with its type."""
  from configs import default  # pylint: disable=import-outside-toplevel
  return default.get_config()


def from_json(path: pathlib.Path) -> config_dict.ConfigDict:
  """The defaults, updated with what the JSON file (a workdir's config.json)
  sets; so a config written before a field existed gets its default."""
  from configs import _json  # pylint: disable=import-outside-toplevel
  try:
    return _json.read(path)
  except json.JSONDecodeError as e:
    raise UserError(f'{path} is not valid JSON ({e}); restore it from the '
                    'config the run was started with') from None


def model_config(config: config_dict.ConfigDict) -> ModelConfig:
  fields = config.model.to_dict()
  fields['dtype'] = DTYPES[fields['dtype']]
  fields['param_dtype'] = DTYPES[fields['param_dtype']]
  scaling = fields['rope_scaling']
  fields['rope_scaling'] = RopeScaling(**scaling) if scaling['kind'] else None
  fields['layout'] = layout_of(fields)
  return ModelConfig(**fields)


def layout_of(model: dict) -> Layout:
  """The layout model['attention'] names, built from its settings
  model[name] (a layout without settings has none); pops 'attention' and
  every layout's settings from `model`. Lists (JSON's) become tuples, so
  that the layout is hashable as a model config must be."""
  name = model.pop('attention')
  settings = {n: model.pop(n) for n in layout_lib.names() if n in model}
  own = settings.get(name, {})
  return layout_lib.get(name)(**{
      k: tuple(v) if isinstance(v, list) else v for k, v in own.items()})


def _check_layout(m):
  """model.attention names a layout, and no other layout's settings are
  set (they would be silently ignored)."""
  try:
    layout_lib.get(m.attention)
  except ValueError as e:
    raise UserError(f'model.{e}') from None
  default_model = defaults().model
  for name in layout_lib.names():
    if name == m.attention or name not in m:
      continue
    changed = [f'model.{name}.{k}={v!r}' for k, v in m[name].items()
               if v != default_model[name][k]]
    if changed:
      raise UserError(
          f'{", ".join(changed)} set, but model.attention={m.attention!r}: '
          f'another layout\'s settings; set --config.model.attention={name}, '
          f'or leave model.{name} at its defaults')


def _is(low=None, high=None, *, low_open=False, high_open=False,
        optional=False, integer=False):
  """A range check: (predicate, what the value must be)."""
  def check(x):
    if x is None:
      return optional
    if isinstance(x, bool) or not isinstance(x, (int, float)):
      return False
    if integer and x != int(x) or not math.isfinite(x):
      return False
    if low is not None and (x <= low if low_open else x < low):
      return False
    return high is None or (x < high if high_open else x <= high)
  bounds = [f'{">" if low_open else ">="} {low}' if low is not None else '',
            f'{"<" if high_open else "<="} {high}' if high is not None else '']
  what = ' and '.join(b for b in bounds if b) or 'finite'
  what = f'{"an integer" if integer else "a number"} {what}'
  return check, what + (' (or None)' if optional else '')


_COUNT = _is(1, integer=True)
# Every numeric field's range, in one place: (section, field) -> check.
RANGES = {
    **{('model', f): _COUNT for f in (
        'vocab_size', 'num_layers', 'd_model', 'num_heads', 'num_kv_heads',
        'head_dim', 'mlp_dim', 'max_len', 'scan_unroll', 'kv_share')},
    ('model', 'rope_base'): _is(1, low_open=True),
    ('model', 'norm_eps'): _is(0, low_open=True),
    ('model', 'norm_scale_offset'): _is(),
    ('model', 'local_window'): _is(1, integer=True, optional=True),
    ('model', 'logits_soft_cap'): _is(0, low_open=True, optional=True),
    ('model', 'final_logits_soft_cap'): _is(0, low_open=True, optional=True),
    ('model', 'query_pre_attn_scalar'): _is(0, low_open=True, optional=True),
    ('model', 'local_rope_base'): _is(1, low_open=True, optional=True),
    ('data', 'seq_len'): _COUNT,
    ('data', 'val_fraction'): _is(0, 1, low_open=True, high_open=True),
    ('data', 'recall_pairs'): _is(0, integer=True),
    ('data', 'recall_gap'): _is(0, integer=True),
    **{('train', f): _COUNT for f in (
        'steps', 'batch_size', 'grad_accum_steps', 'log_every', 'eval_every',
        'eval_batches', 'checkpoint_every', 'keep_checkpoints')},
    ('train', 'learning_rate'): _is(0, low_open=True),
    ('train', 'warmup_steps'): _is(0, integer=True),
    ('train', 'min_learning_rate_ratio'): _is(0, 1),
    ('train', 'weight_decay'): _is(0),
    ('train', 'b1'): _is(0, 1, high_open=True),
    ('train', 'b2'): _is(0, 1, high_open=True),
    ('train', 'grad_clip'): _is(0, low_open=True),
}


# The fields a resumed run may set otherwise than the run that wrote its
# checkpoints: how it trains on from them, never what they compute. A closed
# set: any other field (one added later included, until it is named here)
# is refused on resume by `check_resume`, since pattern, window, kv_share,
# soft caps, RoPE, norms, tying or a dimension change the function the saved
# parameters compute (and mostly not their shapes, so nothing else notices).
RESUME_MAY_CHANGE = {
    **{f'train.{f}': 'the optimisation from here on' for f in (
        'steps', 'batch_size', 'grad_accum_steps', 'learning_rate',
        'warmup_steps', 'min_learning_rate_ratio', 'weight_decay', 'b1', 'b2',
        'grad_clip')},
    **{f'train.{f}': 'logging, evaluation or saving' for f in (
        'log_every', 'eval_every', 'eval_batches', 'checkpoint_every',
        'keep_checkpoints')},
    **{f'data.{f}': 'what it trains on next (the workdir checks its '
                    'tokenizer)' for f in (
        'task', 'path', 'recall_pairs', 'seq_len', 'val_fraction',
        'cache_dir', 'tokenizer')},
    'seed': 'the data order from here on (the initialisation is restored)',
    **{f'mesh.{f}': 'the devices (checkpoints restore onto any mesh)'
       for f in ('data', 'fsdp', 'tensor')},
    'model.dtype': 'the compute precision, not the saved parameters',
    'model.kv_cache_dtype': 'decoding only',
    'model.remat': 'memory against time, same values',
    'model.scan_unroll': 'compilation, same values',
}


def field_paths() -> set[str]:
  """Every field of the defaults as its dotted path, the sections too:
  {'seed', 'model', 'model.rope_scaling', 'model.rope_scaling.kind', ...}."""
  paths = set()
  for leaf in _leaves(defaults().to_dict()):
    parts = leaf.split('.')
    paths |= {'.'.join(parts[:i]) for i in range(1, len(parts) + 1)}
  return paths


def _leaves(tree: dict, prefix: str = '') -> dict:
  """{'model.rope_scaling.kind': value, ...} of a nested dict."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_leaves(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def check_resume(saved: config_dict.ConfigDict,
                 config: config_dict.ConfigDict, workdir):
  """Raises UserError naming the fields, outside RESUME_MAY_CHANGE, in which
  `config` differs from `saved`, the config of WORKDIR's checkpoints."""
  old, new = _leaves(saved.to_dict()), _leaves(config.to_dict())
  missing = object()
  changed = [f'{k} {old.get(k, missing)!r} -> {new.get(k, missing)!r}'
             .replace(repr(missing), 'absent')
             for k in sorted(old.keys() | new.keys())
             if k not in RESUME_MAY_CHANGE
             and old.get(k, missing) != new.get(k, missing)]
  if changed:
    raise UserError(
        f'{workdir} holds another model: its checkpoints have '
        f'{"; ".join(changed)}, which cannot change on resume; use a new '
        '--workdir (or convert into one: python -m train.convert), or the '
        f'config that wrote them ({workdir}/config.json); nothing was changed')


def _check_layer_kinds(m):
  """attention_pattern, local_window, kv_share and kv_cache_dtype agree."""
  pattern = m.attention_pattern
  if not isinstance(pattern, str) or not pattern or set(pattern) - set('GL'):
    raise UserError(f'model.attention_pattern={pattern!r} must be a string '
                    "of G (global) and L (local) layers, e.g. 'G', 'LG', "
                    "'LLLLLG'")
  if ('L' in pattern) != (m.local_window is not None):
    raise UserError(
        f'model.attention_pattern={pattern!r} with model.local_window='
        f'{m.local_window}: local (L) layers need a window and a window '
        "needs L layers; set both (e.g. attention_pattern='L' for every "
        "layer local, 'LG' to alternate) or neither")
  if m.local_rope_base is not None and 'L' not in pattern:
    raise UserError(f'model.local_rope_base={m.local_rope_base} applies to '
                    f'local (L) layers, but attention_pattern={pattern!r} has '
                    'none; unset it, or add L layers')
  L, share = m.num_layers, m.kv_share
  if L % share:
    raise UserError(f'model.kv_share={share} does not divide model.num_layers'
                    f'={L}; layers share K/V in groups of kv_share')
  expanded = (pattern * L)[:L]
  for first in range(0, L, share):
    if len(set(expanded[first:first + share])) > 1:
      raise UserError(
          f'model.kv_share={share} makes layers {first}-{first + share - 1} '
          f'share K/V, but attention_pattern={pattern!r} makes them '
          f'{expanded[first:first + share]}; layers sharing a cache must be '
          f"all local or all global (e.g. attention_pattern='{'L' * share}"
          f"{'G' * share}')")
  group = math.lcm(len(pattern), share)
  if m.scan_layers and L % group:
    raise UserError(
        f'model.num_layers={L} is not a multiple of {group}, the period of '
        f'attention_pattern={pattern!r} and kv_share={share}, which '
        'scan_layers steps over; change one, or set model.scan_layers=False')
  kinds = (None, *layer.KV_CACHE_DTYPES)
  if m.kv_cache_dtype not in kinds:
    raise UserError(f'model.kv_cache_dtype={m.kv_cache_dtype!r}; use one of '
                    f'{", ".join(map(repr, kinds))} (None: model.dtype)')


def validate(config: config_dict.ConfigDict, batch_shards: int,
             num_hosts: int = 1):
  """Raises UserError naming the setting to change."""
  m, d, t = config.model, config.data, config.train
  for field in ('dtype', 'param_dtype'):
    if m[field] not in DTYPES:
      raise UserError(f'model.{field}={m[field]!r}; use one of {sorted(DTYPES)}')
  if m.mlp_activation not in ACTIVATIONS:
    raise UserError(f'model.mlp_activation={m.mlp_activation!r}; use one of '
                    f'{sorted(ACTIVATIONS)}')
  scaling = m.rope_scaling
  if scaling.kind not in ('', *RopeScaling.KINDS):
    raise UserError(f'model.rope_scaling.kind={scaling.kind!r}; use one of '
                    f"'' (none), {', '.join(map(repr, RopeScaling.KINDS))}")
  if scaling.kind and not (
      scaling.factor >= 1 and 0 < scaling.low_freq_factor
      < scaling.high_freq_factor and scaling.original_max_len >= 1):
    raise UserError(f'model.rope_scaling={scaling.to_dict()} needs factor >= '
                    '1, 0 < low_freq_factor < high_freq_factor and '
                    'original_max_len >= 1')
  if scaling.kind == 'yarn' and not (
      scaling.beta_fast > scaling.beta_slow > 0 and scaling.mscale >= 0
      and scaling.mscale_all_dim >= 0):
    raise UserError(f'model.rope_scaling={scaling.to_dict()}: yarn needs '
                    'beta_fast > beta_slow > 0 and mscale, mscale_all_dim '
                    '>= 0 (0: absent)')
  if not isinstance(config.seed, int) or config.seed < 0:
    raise UserError(f'seed={config.seed!r} must be an integer >= 0')
  for (section, name), (check, what) in RANGES.items():
    value = config[section].get(name)
    if not check(value):
      raise UserError(f'{section}.{name}={value!r} must be {what}')
  if m.num_heads % m.num_kv_heads:
    divisors = [k for k in range(1, m.num_heads + 1) if m.num_heads % k == 0]
    raise UserError(
        f'model.num_heads={m.num_heads} is not divisible by model.num_kv_heads'
        f'={m.num_kv_heads}; use num_kv_heads in {divisors}')
  _check_layer_kinds(m)
  _check_layout(m)
  try:  # The attention's own checks, its layout's among them.
    model_config(config).attention(0)
  except ValueError as e:
    raise UserError(f'model.{e}') from None
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
  if t.warmup_steps >= t.steps:
    raise UserError(f'train.warmup_steps={t.warmup_steps} must be below '
                    f'train.steps={t.steps}')
