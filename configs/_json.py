"""A config from JSON (a workdir's config.json): `--config=FILE.json` or
`--config=WORKDIR` (lm.config_lib.resolve points here). Fields the file
lacks keep their defaults (configs/default.py), so a config written before a
field existed still loads."""

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
  model = saved.get('model', {})
  if model.get('local_window') and 'attention_pattern' not in model:
    model['attention_pattern'] = 'L'  # Written when a window meant all.
  with config.unlocked():
    update(config, saved)
  return config


def get_config(path: str):
  return read(path)
