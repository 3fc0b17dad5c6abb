"""Trains MHA, GQA and MQA on the same data and budget, and writes a report.

  python -m scripts.compare --out=out/compare [--quick] [--kv_heads=8,2,1]
      [--seeds=1] [--equal_params] [--steps=N] [--config=gqa_small]
      [--no_control] [--no_aa]
      [--tasks=T1,T2 [--include_path=DIR] [--task_limit=N]]

Each variant (and seed) trains with train.main's loop into OUT/K{k}_s{seed}
(studies/study.py: a finished run is reused only if it was trained with these
settings); then decoding is timed per variant as bench_decode times it
(batch 16, context 256, studies/timing.py: the cache donated, updated in
place). OUT/report.md gets the table (num_kv_heads, parameters, KV bytes per
token, held-out loss and bits per byte, training and decode tokens/s, mean ±
sd over seeds), each variant's held-out loss by seed and its paired
difference from MHA with the smallest difference the seeds can detect
(studies/stats.py), what that lets it say about the papers, and the plots
beside it: loss against step, training throughput, decode throughput with
its roofline (the lower of the bandwidth and FLOP bounds). OUT/results.json
holds every per-seed value (each run's training curve too), the settings,
the decode timings, the comparisons and the command, commit, machine and
--out: everything the report states, so that --report_only rebuilds it
from results.json alone. --equal_params widens the MLP of variants with fewer K/V heads to
MHA's parameter count (as Shazeer 2019 did).
The negative control (with 2 seeds or more; left out by --no_control):
the reference layout (MHA when it runs) trained with the same seeds but
every layer attending to its own token only (a local window of 1 key), into
OUT/control_s{seed}. It cannot use the context, so its held-out loss must
be resolved worse than the reference's: that shows the seeds and the
evaluation can see what attention does at all. If it is not resolved, the
report says that an unresolved difference between the variants says
nothing about K; if it is resolved better, that the reference does not use
its context and nothing is interpretable.
The A/A control (with 2 seeds or more; left out by --no_aa): the reference layout
again, the same seed (data order and every other weight), but its K/V
projections initialised from another seed (`aa_start`), into OUT/aa_s{seed}.
A variant with other K differs from the reference in its K/V
initialisation too, so the A/A difference's sd measures how much of the
variants' paired sd that redraw alone makes.
The verdicts read per-byte losses (this data is bytes) in their own unit:
Shazeer's MQA cost is per subword token at equal parameters, so it is
named, never compared.
--quick: 120 steps per variant (README, Results, has its run times).
--config=recall runs the recall probe instead (see configs/recall.py); the
table then adds each variant's first-query accuracy (pure retrieval).
--report_only rebuilds report.md (and the plots) from OUT/results.json
alone, neither reading the runs nor timing anything: the statistics and
readings as this commit makes them, the values as saved; results.json then
records the rebuild beside the command that made it (`rebuilt`). To time
decoding again, rerun without it (finished runs are reused).
--tasks=T1,T2 [--include_path=DIR] [--task_limit=N] also scores each run's
final checkpoint on lm-evaluation-harness tasks as evaluation.evaluate does
(studies/task_scores.py, into OUT/tasks/K{k}_s{seed}, reused on rerun) and
reports them by seed and paired against MHA (docs/evaluation.md).
"""

from __future__ import annotations

import pathlib

from infra.cli import check_output_dir, exit_on_user_error
from infra.errors import UserError
from studies import study, task_scores
from studies.compare import runs, text


def main():
  parser = study.parser(__doc__, config='gqa_small', kv_heads=[8, 2, 1],
                        seeds=1, report_only='OUT/results.json alone',
                        helps=dict(steps="default: the config's",
                                   quick='120 steps each'))
  parser.add_argument('--equal_params', action='store_true')
  parser.add_argument('--no_control', action='store_true',
                      help='leave out the negative control (no context)')
  parser.add_argument('--no_aa', action='store_true',
                      help='leave out the A/A control (K/V init redrawn)')
  task_scores.add_flags(parser)
  args = parser.parse_args()
  check_output_dir(args.out)
  out = pathlib.Path(args.out)
  if args.report_only:
    if args.tasks:
      raise UserError('--tasks scores runs as compare trains them, not with '
                      '--report_only; rerun without it (finished runs are '
                      'reused)')
    text.rebuild(out, runs.COMMAND)
    print(f'wrote {out}/report.md (from {out}/results.json)')
    return
  runs.run(args)
  print(f'wrote {out}/report.md')


if __name__ == '__main__':
  exit_on_user_error(main)
