"""The uptraining claims under a swept recipe (issue #60): claims 1 and 3
of Ainslie et al. (2023) read per recipe (the endpoints annealed under the
cosine recipes), and a long-context panel (studies/uptrain/recipe.py has
the design).

  python -m scripts.uptrain_recipe --out=DIR
      [--part=all|sweep|carried|panel|probe] [--source_seeds=3] [--quick]
  python -m scripts.uptrain_recipe --out=DIR --report_only

--part trains one part and writes no report (two parts can train side by
side into the same --out; 'carried' trains the sweep first, since it
carries the sweep's best recipe); --part=all (the default) trains what is
missing, reusing every finished run, and writes DIR/report.md,
DIR/results.json and DIR/recipes.png. The default design is 162 runs:
the sweep 84, its probe 12, the carried part 24 and the panel 42 (its 3
sources of rows of 512). On the 2-core AMD EPYC Zen 5 VM that was 38.7
CPU-minutes, the sweep with the carried part and the panel side by side
in 30 minutes of wall time (docs/results.md). --quick: sources of 160 and
80 steps and the 'tiny' panel, one shorter length carried, about a minute
and a half. At least 2 sources (--source_seeds): the unit of replication.
"""

from __future__ import annotations

import pathlib

from infra.cli import check_output_dir, exit_on_user_error, positive_int
from infra.cli import ArgumentParser
from infra.errors import UserError
from studies.uptrain import recipe, recipe_report


def main():
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--out', required=True)
  parser.add_argument('--part', default='all',
                      choices=('all', *recipe.PARTS),
                      help='train one part only, no report')
  parser.add_argument('--source_seeds', type=positive_int,
                      default=recipe.SOURCE_SEEDS,
                      help='sources per part, seeds 0.. (at least 2)')
  parser.add_argument('--quick', action='store_true',
                      help='sources of a few steps: the design, in minutes')
  parser.add_argument('--report_only', action='store_true',
                      help='rebuild the report from results.json in --out')
  args = parser.parse_args()
  check_output_dir(args.out)
  if args.source_seeds < 2 and not args.report_only:
    raise UserError(f'--source_seeds={args.source_seeds}: give at least 2; '
                    'the sources are the unit of replication, and one has no '
                    'interval')
  out = pathlib.Path(args.out)
  if args.report_only:
    recipe_report.rebuild(out)
    return
  results = recipe.run(out, args.part, args.source_seeds, args.quick)
  if results is not None:  # --part=all: every part trained.
    recipe_report.write(out, results)


if __name__ == '__main__':
  exit_on_user_error(main)
