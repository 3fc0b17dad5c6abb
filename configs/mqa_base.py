"""MQA base: gqa_base with num_kv_heads=1 (one GPU/TPU, bfloat16 compute)."""

from configs import gqa_base


def get_config():
  config = gqa_base.get_config()
  config.model.num_kv_heads = 1
  return config
