"""The GQA paper's uptraining claims (Ainslie et al. 2023), tested as the
paper states them, with controls, and replicated over sources.

  python -m scripts.uptrain_study --out=DIR [--source_seeds=3]
      [--source_steps=400,1600,3200 | --quick] [--seeds=2]
      [--kv_heads=K,...] [--config=uptrain_source]
  python -m scripts.uptrain_study --single_source --out=DIR [--quick]
      [--steps=S] [--seeds=n] [--kv_heads=K,...]
      [--recall_config=uptrain_recall] [--recall_steps=S_r]
      [--tasks=T1,T2 [--include_path=DIR] [--task_limit=N]]
  python -m scripts.uptrain_study --out=DIR --report_only

The default design: the source is the unit of replication (issue #49).
For each length S in --source_steps and each source seed 0 .. n-1, an MHA
source (the config's K set to its N) is trained S steps by the config's
recipe scaled to S (OUT/sources/S{S}_s{seed}/source), converted to the
identity control (K = N), mean-pooled, first-head and random (fresh K/V
heads, one draw per uptraining seed) to each --kv_heads (default N/2 and
1), and MHA -> MLA with a latent below GQA's width (`mla_below_plan`: half
of GQA-max(K)'s cache, so R < d_model), GTA at (or nearest) that MLA's
cache bytes (`gta_plan`: K/V heads mean-pooled, then tied), GLA with
GLA_GROUPS latent groups at its latent width (`gla_plan`, issue #51) and
TPA nearest that MLA's bytes (`tpa_plan`: K/V heads mean-pooled to K, then
rank-K factors whose head factors start one-hot, exact; issue #63), each
uptrained once per uptraining seed (--seeds, default 2) at RATE_RATIO x
the source's peak rate (warmup over alpha = 0.0125 of S, then constant)
with a fresh Adam and read at alpha = 0.05 of S and at FIXED_STEPS
steps. Beside each source, each
--kv_heads K is trained from scratch for S steps by the source's recipe
and seed (.../scratch/K{K}_s{seed}, evaluated every S/40 steps: claim 3,
the cost). The statistics (`studies.uptrain.replicated_summary`) average within
a source and give intervals over sources, and the alpha = 0.05 gaps'
trends over S paired by source seed; GTA and TPA are compared with the
mean-pooled GQA arm of nearest bytes, GLA with the MLA, paired within the
source. The
default run (3 sources x 400, 1,600, 3,200 steps: 225 runs, 207 before
the TPA arm) is about 20 CPU-minutes on the 2-core machine
(docs/results/uptrain/: all 225 trained in one pass at 50193ec on the
AMD EPYC Zen 5 VM, 26 min 45 s of wall time and 20.0 CPU-minutes beside
other jobs, load 5-7); --quick: sources of 200 and 400 steps
(QUICK_SOURCE_STEPS), the same arms.

--single_source, the former design (one source, seed 0; the seeds replicate
only the uptraining data order):
1. An MHA source (the config's K set to its N) trained S steps, seed 0.
2. A learning-rate pilot (seed 0, recorded): mean-pooled MQA and the identity
   control uptrained for alpha = 0.05 at the source's peak rate x 1, 1/3,
   1/10. The rate chosen is fixed in advance: the lowest mean-pooled loss
   among the rates whose control drifts at most NEAR from the source (else
   the least drifting one).
3. Conversions: identity (K = N, no conversion: the control) and mean, first,
   random to each --kv_heads (default N/2 and 1; --quick: 1), each with a
   fresh Adam; identity and mean also with the source's Adam moments carried
   over and pooled like the weights (`train.convert --optimizer=pooled`).
4. Per (conversion, seed) ONE uptraining run of alpha = 0.2 of S steps at the
   chosen rate (warmup to it over the first alpha point, then constant, so
   that each checkpoint is the same recipe stopped earlier), evaluated at
   alpha = 0.0125, 0.025, 0.05, 0.1, 0.2; alpha = 0 evaluates the conversion.
4b. MHA -> MLA at equal cache bytes (`mla_plan`, issue #40): for each K,
   `train.convert --to_mla` of the same source with qk_rope_head_dim
   Y = 2·N (one RoPE pair per head) and kv_lora_rank R = 2·K·H - Y, so
   that kv_bytes_per_token equals GQA-K's; uptrained as in 4 (the chosen
   rate, fresh Adam, one run per seed), compared with mean-pooled K paired
   by seed at each alpha; its losses also map onto GQA-K's scratch curve
   (5: the layout of equal bytes; no MLA is trained from scratch).
5. From-scratch compute curves: MHA and each K trained (1 + 0.2) S steps per
   seed by the source's recipe, evaluated every S/40 steps; each seed's
   uptrained loss maps to the steps the same seed's scratch curve needs to
   reach it (paired by seed; `studies.uptrain.common.equivalent_steps`).
6. The recall arm: an MHA recall-probe source (accuracy 1.000 by
   construction), converted as in 3 (fresh Adam) and uptrained up to 0.2 x S_r
   steps at its peak rate; steps to regain accuracy >= 0.95 against K trained
   from scratch (up to S_r steps) per seed; each run ends when it gets there.
   MLA at each K's bytes too (uptrain_recall has no RoPE: R = 2·K·H).
7. DIR/report.md (`studies.uptrain.single_tables`), DIR/results.json (per-seed
   values, the provenance) and plots.
8. --tasks: lm-evaluation-harness scores (`score_lm`, as evaluation.evaluate
   scores a workdir) of the source, the fresh-Adam conversions at alpha =
   0.05 and 0.2 and the from-scratch end points, per seed, paired against
   the identity control and MHA from scratch (docs/evaluation.md).

Every run is `train.main`'s loop (`studies.study.train`); a rerun with the
same --out reuses finished runs and resumes an interrupted one (one made
before the MLA arm: only the MLA runs train; a default-design one made
before the random and from-scratch arms, the GTA and GLA arms or the TPA
arm: only those train, and
results.json's provenance names the earlier passes and each run's commit). --single_source: 4 seeds,
38.5 CPU-minutes with the MLA arm (the most its wall time is on an idle
2-core machine; docs/results/uptrain/single_source/report.md); with
--quick: S/4, K = 1 only, 3 seeds, 5 min 30 s on the idle machine (9.1
CPU-minutes, at d3fc18f).
"""


from __future__ import annotations

import pathlib

from infra.cli import (check_output_dir, exit_on_user_error, int_list,
                       positive_int)
from infra.errors import UserError
from studies import study, task_scores
from studies.uptrain import replicated, results, single_source


def main():
  parser = study.parser(
      __doc__, config='uptrain_source', report_only='results.json in --out',
      helps=dict(
          config="the LM source's config (K is set to its N)",
          steps="LM source steps (default: the config's; --quick: a "
                'quarter)',
          kv_heads='targets (default: N/2 and 1; --quick: 1)',
          seeds='uptraining seeds per arm (default 2 per source; '
                '--single_source: 4, --quick: 3)',
          quick='sources of 200 and 400 steps (--single_source: S/4, '
                'K = 1 only, 3 seeds)'))
  parser.add_argument('--recall_config', default='uptrain_recall',
                      help="the recall arm's source config (K set to its N)")
  parser.add_argument('--recall_steps', type=positive_int, default=None,
                      help="its steps (default: the config's)")
  parser.add_argument('--single_source', action='store_true',
                      help='the former design: one source (seed 0) of '
                      '--steps, a pilot, every conversion, scratch curves '
                      'and the recall arm')
  parser.add_argument('--source_seeds', type=positive_int, default=3,
                      help='sources per length, seeds 0.. (not with '
                      '--single_source)')
  parser.add_argument('--source_steps', type=int_list,
                      default=[400, 1600, 3200],
                      help='the sources\' lengths (not with --single_source)')
  task_scores.add_flags(parser)
  args = parser.parse_args()
  check_output_dir(args.out)
  if args.report_only and args.tasks:
    raise UserError('--tasks scores runs as the study trains them, not with '
                    '--report_only; rerun without it (finished runs are '
                    'reused)')
  if args.report_only:
    results.rebuild(pathlib.Path(args.out), single_source.COMMAND)
  elif args.single_source:
    single_source.run(args)
  else:
    replicated.run(args)


if __name__ == '__main__':
  exit_on_user_error(main)
