"""The uptraining study's MHA source (scripts/uptrain_study.py): 2 layers,
d_model 64, 4 heads of 16, rows of 64 tokens, 1600 steps, so that alpha =
0.05 of its steps is 80 uptraining steps and the study's runs (from-scratch
curves included) fit in an hour on 2 CPU cores (about 0.03 s a step there).
It is not trained to convergence: the study's identity control measures
what the source still learns while being uptrained."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(num_layers=2, d_model=64, num_heads=4, num_kv_heads=4,
                      head_dim=16, mlp_dim=256, max_len=64)
  config.data.seq_len = 64
  config.train.update(steps=1600, batch_size=16, warmup_steps=80)
  return config
