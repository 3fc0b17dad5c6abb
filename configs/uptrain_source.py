"""The uptraining study's MHA source (scripts/uptrain_study.py): small enough
that the study's ~200 runs fit in an hour on 2 CPU cores (0.17 s a step
there). Its 800 steps do not train it until flat: its held-out loss still
fell 2.5% over the last fifth (docs/results.md, Uptraining)."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(num_layers=4, d_model=64, num_heads=4, num_kv_heads=4,
                      head_dim=16, mlp_dim=256, max_len=128)
  config.data.seq_len = 128
  config.train.update(steps=800, batch_size=16, warmup_steps=40)
  return config
