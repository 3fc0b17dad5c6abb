"""Where do fewer K/V heads start to cost retrieval? A sweep on the recall probe.

  python -m scripts.recall_sweep --out=out/recall [--quick] [--seeds=3]
      [--kv_heads=8,4,2,1] [--head_dims=16,8] [--steps=1200] [--d_model=64]

Trains the recall probe (configs/recall.py: multi-query associative recall,
two layers of 8 query heads; narrowed to d_model 64 and MLP 128 so that the
sweep fits 45 minutes here) for every num_kv_heads K against a difficulty
axis, the head dimension H at fixed width (each K/V head stores a position's
key in H numbers), with several seeds per cell. Every run is train.main's
loop (studies/study.py, in OUT/runs/K{K}_H{H}_s{seed}: a rerun reuses a
finished run only if it was trained with the same settings, and resumes an
interrupted one) at a constant learning rate after warmup; every
--eval_every steps its accuracy by query is measured on 512 held-out rows
(kept in the run's history.json), and the run ends once every query is
answered at >= 0.99.

OUT/report.md gets, per cell, the first-query accuracy (pure retrieval:
crossing out answered values cannot help it) as mean ± sd over seeds, the
seeds that reached 0.95 on it (k of n: a seed learns retrieval or not, all
or nothing, so the seeds are counted) and their median step, and the KV
cache bytes per token; then, at each head size, each K against the most K/V
heads, paired by seed on whether the seed learnt (1) or not (0), with
`stats.decision`'s words (resolved, or not claimed with its reason): the
only verdicts the report makes. A heat map and accuracy curves beside it
(recall.png); everything as JSON (sweep.json).
--quick: H = 16 only, 500 steps at most (under 10 minutes here).
--report_only rewrites the report from OUT/sweep.json alone (report.md is a
function of it), recording the rebuild in it beside the run.
"""


from __future__ import annotations

import pathlib

from infra.cli import (check_output_dir, exit_on_user_error, int_list,
                       positive_int)
from studies import recall_sweep, study


def main():
  parser = study.parser(
      __doc__, config='recall', seeds=3, report_only='OUT/sweep.json',
      helps=dict(kv_heads="default: N, N/2, N/4 and 1 of the config's N",
                 steps='most steps per run; default 1200 (--quick: 500)'))
  parser.add_argument('--head_dims', type=int_list, default=None,
                      help='default: 16,8 (--quick: 16)')
  parser.add_argument('--d_model', type=int, default=64,
                      help="model width (MLP twice it); 0: the config's")
  parser.add_argument('--eval_every', type=positive_int, default=100)
  args = parser.parse_args()
  check_output_dir(args.out)
  out = pathlib.Path(args.out)
  if args.report_only:
    recall_sweep.rebuild(out)
    print(f'wrote {out}/report.md')
    return
  meta = recall_sweep.run(args)
  print(f'wrote {out}/report.md ({meta["minutes"]:.1f} minutes)')


if __name__ == '__main__':
  exit_on_user_error(main)
