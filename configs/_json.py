"""A config from JSON (a workdir's config.json): `--config=FILE.json` or
`--config=WORKDIR` (train.config_lib.resolve points here). Fields the file
lacks keep their defaults (configs/default.py)."""

from train import config_lib


def get_config(path: str):
  return config_lib.from_json(path)
