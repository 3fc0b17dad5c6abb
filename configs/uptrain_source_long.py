"""The recipe study's long-context panel (issue #60; scripts/uptrain_recipe.py):
the uptraining source at a context where the KV cache matters, rows of 512
tokens and d_model 128 (4 heads of 32), 2 layers as uptrain_source.py, 8
rows a step (4,096 tokens, 4x uptrain_source's). The study sets its steps."""

from configs import uptrain_source


def get_config():
  config = uptrain_source.get_config()
  config.model.update(d_model=128, num_heads=4, num_kv_heads=4, head_dim=32,
                      mlp_dim=512, max_len=512)
  config.data.seq_len = 512
  config.train.update(batch_size=8)
  return config
