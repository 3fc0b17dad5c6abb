"""GQA base: for one GPU/TPU, bfloat16 compute.

75.9M parameters (mha_base 85.3M, mqa_base 72.4M).
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(num_layers=12, scan_unroll=1, d_model=768, num_heads=12,
                      num_kv_heads=4, head_dim=64, mlp_dim=2048,
                      max_len=1024, dtype='bfloat16')
  config.data.seq_len = 1024
  config.train.update(steps=20_000, batch_size=64, learning_rate=6e-4,
                      warmup_steps=1000, eval_every=1000,
                      checkpoint_every=1000)
  return config
