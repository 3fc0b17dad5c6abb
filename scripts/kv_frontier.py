"""The KV-memory frontier on a task where the cache matters: GQA beside local
layers, cross-layer sharing and int8 caches, compared at equal bytes.

  python -m scripts.kv_frontier --out=DIR [--quick] [--seeds=N]
      [--panels=recall,lm,heads] [--steps=N] [--lm_steps=N]
      [--variants=A,B,..] [--report_only]

Three panels, each a grid of layouts (Variant: K/V heads K, layer pattern,
kv_share, and MLA's, GTA's and TPA's settings) trained with train.main's loop
(`studies.study.train`), one run per seed, into DIR/<panel>/runs/:

- recall (configs/kv_recall.py): the recall probe with a gap of filler
  tokens between the pairs and the queries, wider than a stack of local
  layers reaches (4 layers of the panel's window of 2 keys each: 4
  (window - 1) positions). Layouts: all-global 'G', 'LLGG', and all-local
  'L', the negative control: no pair is within its reach, so it must fail
  where the global layouts succeed, or the setup cannot see attention at
  all. MQA, GQA-2 with CLA2 and MLA with a latent of MQA's width hold the
  same bytes per token; tensor product attention (TPA) of rank 1 holds
  1.25x theirs. MQA's runs are also converted into MLA at half its bytes
  (`train.convert --to_mla`), read as converted and after 100 steps of the
  conversion's uptraining recipe.
- lm (configs/gqa_small.py): held-out loss on text: MQA, GQA-2 with CLA2
  and MLA (a latent of 48 and a RoPE key of 16), all at MQA's bytes; GQA-2;
  tensor product attention (TPA, T6's factored queries) of rank 1 and 2,
  at the bytes nearest MQA's and MLA's, and GQA-2's; MHA, against T6 with
  its heads and with 17 (MHA's parameters: the paper's framing).
- heads (configs/gqa_small_h16.py: gqa_small with 16 heads of 16): TPA
  against GQA at equal query heads and exactly equal bytes (N = H: TPA-R
  caches GQA-2R's), TPA-KV-only (per-head queries) beside T6's.

Every trained model is then read through its decode cache twice, float and
int8 (`model.ThroughCache`: the logits decoding gives, each held-out row of
the loop's evaluator prefilled into an empty cache): the NLL of the scored
targets, their accuracy (recall: the answers, and the first query's alone,
which crossing out cannot help) and the KL from the float cache's
predictions to the int8 cache's. Its cost: the cache's bytes per token of
context at max_len (`model.kv_bytes_per_token`).

Comparisons are paired by seed (studies/stats.py): the negative control
against all-global; the equal-bytes pairs (GQA-2 with CLA2 against MQA, in
each pattern, and MLA against both); the main effects of the pattern, of
kv_share and of K over the GQA grid, Holm-corrected as one family; each
conversion against its source; the families of pairs the design fixes
(`design.Family`: TPA at other layouts' bytes, and TPA against GQA at
equal heads and bytes), each Holm-corrected; int8 against float for every
model. A point is on the frontier when its NLL is resolved lower (paired
interval) than that of every point with fewer bytes: no point is there by
noise. The negative control is a control, not a design: it is left out of
the frontier.

Writes DIR/frontier.json (per-seed values, the comparisons, provenance),
DIR/report.md and DIR/frontier.png. A rerun reuses finished runs;
--report_only rebuilds the report from DIR/frontier.json alone (report.md is
a function of it: the reading included, every verdict `stats.decision`'s words; the
provenance's `note`, where a run's history is recorded, rendered as saved),
recording the rebuild beside the command that measured. The default: the
recall panel's 10 layouts at 1,000 steps and the conversion; the LM panel's
10 and the heads panel's 5 at 40 steps; 3 seeds each (about 140
CPU-minutes here by the per-run costs of docs/results/kv_frontier/report.md,
a run that predates the layouts of GTA and GLA, published apart in
docs/results/kv_frontier/zadouri/, and TPA's, in
docs/results/kv_frontier/tpa/). --variants=NAME,... trains a subset.
--quick: the recall
panel only, its 6 layouts at 100 steps, 3 seeds, no conversion (6.7
CPU-minutes here, docs/results/kv_frontier/quick/): a check that everything runs and reports, too short for
retrieval to be learnt.
"""


from __future__ import annotations

import pathlib

from infra.cli import check_output_dir, exit_on_user_error, positive_int
from studies import study
from studies.kv_frontier import design, measure, tables


def main():
  parser = study.parser(
      __doc__, config='kv_recall', report_only='frontier.json in --out',
      helps=dict(config="the recall panel's config",
                 kv_heads='train only the variants with these K (MLA: '
                 'num_heads)',
                 steps="the recall panel's steps (default: the config's)"))
  parser.add_argument('--panels', default=None,
                      help="comma-separated of 'recall', 'lm', 'heads' "
                      '(default all; --quick: recall)')
  parser.add_argument('--lm_steps', type=positive_int, default=None,
                      help="the LM panels' steps (lm and heads; default 40)")
  parser.add_argument('--variants', default=None,
                      help='comma-separated variant names (e.g. '
                      'K1_G_share1,GTA2_G_share1): train only these of the '
                      "panels' grids (default all)")
  args = parser.parse_args()
  check_output_dir(args.out)
  out = pathlib.Path(args.out)
  if args.report_only:
    tables.rebuild(out, measure.COMMAND)
    print(f'wrote {out}/report.md and frontier.png (from frontier.json)')
    return
  result = measure.run(design.plan(args), out)
  print(f'wrote {out}/report.md, frontier.json and frontier.png '
        f'({result["minutes"]:.1f} min)')


if __name__ == '__main__':
  exit_on_user_error(main)
