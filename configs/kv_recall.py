"""The recall probe where the cache matters: scripts/kv_frontier.py's panel.

configs/recall.py's probe and model (learned positions, no RoPE; 8 query
heads of 16), four layers of width 64, and a gap of 16 filler tokens
between the 8 key-value pairs and the queries (`data.recall_gap`): every
key is more than 16 positions before its query, beyond what four local
layers of 4 keys reach (4 x 3 positions). So a layer pattern of all-local
layers cannot retrieve a single answer, while 'G' and 'LLGG' (two local
layers, enough for the previous-token half of the induction circuit, then
two global ones) can: the frontier's negative control.
"""

from configs import recall


def get_config():
  config = recall.get_config()
  config.model.update(num_layers=4, d_model=64, mlp_dim=128, max_len=48)
  config.data.update(seq_len=48, recall_pairs=8, recall_gap=16)
  # A constant learning rate after warmup, as scripts/recall_sweep.py; 3e-3
  # because at 64 rows it fell faster than 1e-3 (held-out answer loss 2.01
  # against 2.50 at step 300, MQA, one seed each). Rows of 32: half the
  # compute of a step. Eight held-out batches: 2,048 scored answers.
  config.train.update(steps=600, batch_size=32, learning_rate=3e-3,
                      min_learning_rate_ratio=1.0, eval_every=600,
                      eval_batches=8, checkpoint_every=600)
  return config
