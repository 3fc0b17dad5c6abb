"""The recall probe where the cache matters: scripts/kv_frontier.py's panel.

configs/recall.py's probe and model (learned positions, no RoPE), four
layers of width 64 with 4 query heads of 16 (MLP 128), and a gap of 4
filler tokens between the 8 key-value pairs and the queries
(`data.recall_gap`): every pair ends at least 5 positions before the first
query, beyond what four local layers of 2 keys reach (4 x 1 positions;
scripts/kv_frontier.py's recall window). So a layer pattern of all-local
layers cannot see a single pair, while 'G' and 'LLGG' (two local layers,
enough for the previous-token half of the induction circuit, then two
global ones) can: the frontier's negative control.

The optimiser is configs/recall.py's (lr 1e-3 after 50 warmup steps,
batch 64, no weight decay), under which its two-layer probe answered every
query after 600-900 steps (docs/results/recall/); here constant after the
warmup, as scripts/recall_sweep.py. docs/results/kv_frontier/pilots.md has
the pilots that chose the gap, the width and the steps.
"""

from configs import recall


def get_config():
  config = recall.get_config()
  config.model.update(num_layers=4, d_model=64, num_heads=4, num_kv_heads=4,
                      mlp_dim=128, max_len=36)
  config.data.update(seq_len=36, recall_pairs=8, recall_gap=4)
  # Four held-out batches of 64 rows: 2,048 scored answers.
  config.train.update(steps=1000, batch_size=64, learning_rate=1e-3,
                      min_learning_rate_ratio=1.0, eval_every=1000,
                      eval_batches=4, checkpoint_every=1000)
  return config
