"""GQA small: the laptop-scale comparison (2-core CPU: about 10 minutes)."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.num_kv_heads = 2
  return config
