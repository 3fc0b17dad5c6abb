"""The recall probe: multi-query associative recall (see lm/data.py).

Two layers of 8 query heads of 16: with one K/V head (MQA) a layer stores each
position's key in 16 numbers, with eight (MHA) in 128. Each row lists 8
key-value pairs (keys from 32 ids, values from 32 more), then asks for every
key again; only the answers are scored. Chance is 1/32 per answer; picking
among the row's 8 values gives 1/8, and crossing out answered values (the
last query then has one left) about 0.34 on average. Only retrieving by
content reaches 1: `scripts/compare.py` reports the first query's accuracy,
where crossing out cannot help.

Positions are a learned table (`model.learned_positions`, as in Zoology's
models) and there is no RoPE: retrieval needs an induction circuit, whose
first half is a previous-token head, and with RoPE alone that head did not
form within thousands of steps (docs/results/recall/experiments.md). With
these settings MHA answers every query after about 800 steps (2 minutes
here); `scripts/recall_sweep.py` compares the K/V head counts.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.update(num_layers=2, d_model=128, num_heads=8, num_kv_heads=8,
                      head_dim=16, mlp_dim=256, max_len=32, vocab_size=64,
                      use_rope=False, learned_positions=True,
                      embed_scale=False)
  config.data.update(task='recall', seq_len=32, recall_pairs=8)
  config.train.update(steps=1500, batch_size=64, learning_rate=1e-3,
                      weight_decay=0.0, warmup_steps=50, log_every=50,
                      eval_every=250, eval_batches=4, checkpoint_every=1500)
  return config
