"""gqa_small with 16 query heads of 16 (N = H): the KV frontier's heads panel
(scripts/kv_frontier.py).

Where N = H, tensor product attention of rank R caches 2R(N + H) = 4RH
numbers per token and layer, exactly GQA-2R's 2·2R·H: TPA and GQA compare at
equal query heads and equal bytes (at gqa_small's 8 heads of 32, TPA-R's 80R
numbers match no GQA's 64K). N·H = 256 as gqa_small's: queries and output of
the same width.
"""

from configs import gqa_small


def get_config():
  config = gqa_small.get_config()
  config.model.update(num_heads=16, head_dim=16)
  return config
