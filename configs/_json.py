"""A config from JSON (a workdir's config.json): `--config=FILE.json` or
`--config=WORKDIR` (lm.config_lib.resolve points here). Fields the file
lacks keep their defaults (configs/default.py), so a config written before a
field existed still loads; one written before attention layouts had names
(`upgrade_model`) is read as the layout it described."""

import json
from etils import epath

from ml_collections import config_dict

from configs import default


def read(path) -> config_dict.ConfigDict:
  """The defaults, updated with what the JSON file sets (json.JSONDecodeError
  if it is not JSON)."""
  saved = json.loads(epath.Path(path).read_text())
  config = default.get_config()

  def update(target, values):
    for key, value in values.items():
      if isinstance(value, dict) and isinstance(target.get(key),
                                                config_dict.ConfigDict):
        update(target[key], value)
      else:
        target[key] = value
  model = upgrade_model(saved.get('model', {}))
  if model.get('local_window') and 'attention_pattern' not in model:
    model['attention_pattern'] = 'L'  # Written when a window meant all.
  saved['model'] = model
  with config.unlocked():
    update(config, saved)
  return config


# The layout settings that configs written before `model.attention` held
# flat in `model` (until 2026-12): multi-head latent attention's when
# kv_lora_rank was set, grouped-tied attention's (tie_kv) the RoPE key's.
_LEGACY_MLA = ('kv_lora_rank', 'q_lora_rank', 'qk_rope_head_dim',
               'qk_nope_head_dim', 'v_head_dim', 'latent_groups',
               'latent_norm', 'rope_pairs')
_LEGACY_GTA = ('qk_rope_head_dim', 'rope_pairs')


def upgrade_model(model: dict) -> dict:
  """A config's model section as written today: one that holds the flat
  layout fields of before (kv_lora_rank, tie_kv, ...) names its layout in
  'attention' and moves its settings to model['mla'] or model['gta'];
  anything else is returned as it is."""
  legacy = set(_LEGACY_MLA) | {'tie_kv'}
  if not legacy & model.keys():
    return model
  model = dict(model)
  flat = {k: model.pop(k) for k in sorted(legacy & model.keys())}
  if flat.get('kv_lora_rank'):
    model['attention'] = 'mla'
    model['mla'] = {k: flat[k] for k in _LEGACY_MLA if k in flat}
  elif flat.get('tie_kv'):
    model['attention'] = 'gta'
    model['gta'] = {k: flat[k] for k in _LEGACY_GTA if k in flat}
  else:
    model.setdefault('attention', 'gqa')
  return model


def get_config(path: str):
  return read(path)
