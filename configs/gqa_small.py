"""GQA small: the laptop-scale comparison (README, Training, has its run time)."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.num_kv_heads = 2
  return config
