"""Tiny: for tests, trains in seconds."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_dim=64, max_len=32)
  config.data.seq_len = 32
  config.train.update(steps=20, batch_size=8, learning_rate=1e-2,
                      warmup_steps=2, log_every=5, eval_every=10,
                      eval_batches=2, checkpoint_every=10)
  return config
