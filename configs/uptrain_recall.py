"""The uptraining study's recall-probe source (scripts/uptrain_study.py):
configs/recall.py made smaller (d_model 64, 4 heads of 16, MLP 128; 4
key-value pairs in rows of 16 tokens; docs/results/recall/experiments.md's
T1), MHA. It answers every held-out query (accuracy 1.000) after about 950
of its 1000 steps, so the conversions start from a source that is converged
by construction, on a task where a K/V head's content is the whole answer."""

from configs import recall


def get_config():
  config = recall.get_config()
  config.model.update(d_model=64, num_heads=4, num_kv_heads=4, head_dim=16,
                      mlp_dim=128, max_len=16)
  config.data.update(seq_len=16, recall_pairs=4)
  config.train.update(steps=1000, eval_every=25, checkpoint_every=1000)
  return config
