"""The GQA paper's uptraining claims (Ainslie et al. 2023), tested with controls.

  python -m scripts.uptrain_study --out=DIR [--quick] [--config=uptrain_source]
      [--seeds=3] [--kv_heads=K,...] [--alphas=0,0.025,0.05,0.1,0.2]

1. Trains an MHA source (the config's K is set to its N) and checks that its
   held-out loss is flat: under 1% change over the last fifth of its steps.
   Reused from DIR/source when present.
2. Converts it: identity (K = N, the control: no conversion, the same
   uptraining), and mean, first and random to each --kv_heads (default: GQA
   with N/4 heads, or N/2 for N < 8, and MQA).
3. Uptrains every conversion for alpha x the source's steps (its tokens), per
   seed (the data order, and random's initialisation), by two recipes:
   paper      the pre-training recipe re-warmed: its peak rate, warmup
              fraction and decay, over the uptraining steps;
   continued  what `train.convert` writes into a converted workdir: warmup 2%
              to the rate the source's schedule ended at, cosine to 10%.
   Every run is `train.main`'s loop (`loop.train_and_evaluate`), evaluated by
   its evaluator on its held-out batches; alpha = 0 evaluates the conversion.
4. Trains each --kv_heads from scratch for the source's tokens plus
   alpha = 0.05's (the paper's compute argument).
5. Writes DIR/report.md (the reading, tables, paired differences between
   methods over seeds), DIR/results.json, loss_vs_alpha.png and curves.png.

A rerun with the same --out reuses every finished run (DIR/runs/.../final.json)
and resumes an interrupted one; each run keeps its workdir (about 0.4 GB in
all by default) to sample from or inspect. --quick: a quarter of the source's
steps, K = 1 only, alphas 0, 0.05, 0.2, 2 seeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil

from scripts import study, uptrain_report
from scripts.uptrain_report import METHODS, RECIPES, SCRATCH_ALPHA
from train import config_lib, convert, loop, progress
from train.errors import UserError
from train.cli import check_output_dir, exit_on_user_error, float_list
from train.metrics import read_metrics

CURVE_POINTS = 8  # Evaluations along the largest alpha's runs.


@dataclasses.dataclass(frozen=True)
class Run:
  """One uptraining run (alpha = 0: the conversion, evaluated)."""
  recipe: str
  method: str
  K: int
  alpha: float
  seed: int

  @property
  def name(self) -> str:
    return (f'runs/{self.recipe}/{self.method}_K{self.K}/'
            f'a{self.alpha:g}_s{self.seed}')

  def describe(self) -> str:
    return (f'{self.method} -> K={self.K}, {self.recipe} recipe, '
            f'alpha={self.alpha:g}, seed {self.seed}')


def source_config(name: str, steps: int | None):
  config = config_lib.load(name)
  config.model.num_kv_heads = config.model.num_heads
  if steps:
    config.train.steps = steps
  steps = config.train.steps
  config.train.update(eval_every=max(1, steps // 10), checkpoint_every=steps,
                      log_every=max(1, steps // 10), keep_checkpoints=1)
  return config


def recipe_config(converted: pathlib.Path, source, run: Run):
  """The converted workdir's config, set to uptrain by `run`'s recipe."""
  config = config_lib.load(str(converted))
  steps = max(1, round(run.alpha * source.train.steps))
  config.train.steps = steps
  if run.recipe == 'paper':
    st = source.train
    config.train.update(
        learning_rate=st.learning_rate,
        warmup_steps=min(max(1, round(steps * st.warmup_steps / st.steps)),
                         steps - 1),
        min_learning_rate_ratio=st.min_learning_rate_ratio)
  else:
    convert.apply_recipe(config, convert.source_rate(converted, source))
  config.seed = run.seed
  config.train.update(checkpoint_every=steps, keep_checkpoints=1,
                      log_every=steps, eval_every=steps)
  return config


def train_source(out: pathlib.Path, config) -> dict:
  """The MHA source, trained (or reused: it must be this config's) and
  checked for flatness."""
  workdir = out / 'source'
  written = workdir / 'config.json'
  if written.exists() and (
      config_lib.load(str(written)).to_dict() != config.to_dict()):
    raise UserError(f'{workdir} holds a source trained with another config '
                    f'({written}); use a new --out, or the same flags as the '
                    'run that wrote it')
  print(f'=== the MHA source: {config.train.steps} steps', flush=True)
  record = study.train(config, workdir, workdir / 'log.txt')
  curve = [(r['step'], r['eval_loss']) for r in read_metrics(workdir)
           if 'eval_loss' in r]
  last_fifth = [loss for step, loss in curve
                if step >= 0.8 * config.train.steps]
  change = (max(last_fifth) - last_fifth[-1]) / last_fifth[-1]
  return {'loss': record['eval_loss'], 'curve': curve, 'change': change,
          'steps': config.train.steps,
          'tokens': config.train.steps * config.train.batch_size *
                    config.data.seq_len}


def convert_all(out: pathlib.Path, kv_heads, seeds, num_heads: int) -> dict:
  """{(method, K, seed): converted workdir}; random depends on the seed."""
  done = {}
  (out / 'converted').mkdir(parents=True, exist_ok=True)
  targets = [('identity', num_heads)] + [
      (m, k) for m in METHODS[1:] for k in kv_heads]
  for method, K in targets:
    for seed in seeds:
      key = f'{method}_K{K}' + (f'_s{seed}' if method == 'random' else '')
      workdir = out / 'converted' / key
      if not (workdir / 'config.json').exists():
        shutil.rmtree(workdir, ignore_errors=True)  # An interrupted one.
        with (out / 'converted' / 'log.txt').open('a') as f, (
            contextlib.redirect_stdout(f)), contextlib.redirect_stderr(f):
          convert.convert_workdir(str(out / 'source'), str(workdir), K,
                                  'mean' if method == 'identity' else method,
                                  seed=seed)
      done[method, K, seed] = workdir
  return done


def uptrain(out: pathlib.Path, run: Run, converted: pathlib.Path, source,
            curve: bool) -> dict:
  """One run's held-out loss and (curve: evaluated along the way) its
  learning curve."""
  if run.alpha == 0:
    return {'loss': loop.evaluate_workdir(str(converted))['eval_loss'],
            'curve': []}
  workdir = out / run.name
  config = recipe_config(converted, source, run)
  if curve:
    config.train.eval_every = max(1, config.train.steps // CURVE_POINTS)
  if not workdir.exists():
    shutil.copytree(converted, workdir)
  record = study.train(config, workdir, workdir / 'log.txt')
  return {'loss': record['eval_loss'], 'curve': [
      (r['step'], r['eval_loss']) for r in read_metrics(workdir)
      if 'eval_loss' in r]}


def scratch(out: pathlib.Path, source, K: int, seed: int) -> dict:
  """K heads trained from scratch for the source's tokens plus alpha's."""
  config = source.copy_and_resolve_references()
  config.model.num_kv_heads = K
  config.seed = seed
  steps = round((1 + SCRATCH_ALPHA) * source.train.steps)
  config.train.update(steps=steps, checkpoint_every=steps)
  workdir = out / 'scratch' / f'K{K}_s{seed}'
  record = study.train(config, workdir, workdir / 'log.txt')
  return {'K': K, 'seed': seed, 'loss': record['eval_loss']}


def run_study(out: pathlib.Path, config, kv_heads, alphas, seeds) -> dict:
  """Every run of the plan, in order of cost; the results as one dict."""
  source = train_source(out, config)
  converted = convert_all(out, kv_heads, seeds, config.model.num_heads)
  targets = [('identity', config.model.num_heads)] + [
      (m, k) for m in METHODS[1:] for k in kv_heads]
  plan = [Run(recipe, method, K, alpha, seed)
          for alpha in alphas for recipe in RECIPES
          for method, K in targets for seed in seeds
          if alpha or recipe == RECIPES[0]]  # alpha 0 is recipe-free.
  steps = config.train.steps
  results = []
  for run in progress.runs(plan, Run.describe,
                           cost=lambda r: r.alpha * steps + 10):
    result = uptrain(out, run, converted[run.method, run.K, run.seed],
                     config, curve=run.alpha == alphas[-1])
    for recipe in (RECIPES if run.alpha == 0 else [run.recipe]):
      results.append({**dataclasses.asdict(run), 'recipe': recipe, **result})
  scratch_runs = [(K, seed) for K in kv_heads for seed in seeds]
  scratches = [scratch(out, config, K, seed) for K, seed in progress.runs(
      scratch_runs, lambda c: f'K={c[0]} from scratch, seed {c[1]}')]
  return {'source': source, 'runs': results, 'scratch': scratches,
          'plan': {'kv_heads': kv_heads, 'alphas': alphas, 'seeds': seeds,
                   'num_heads': config.model.num_heads,
                   'config': config.to_dict()}}


def main():
  parser = study.parser(
      __doc__, config='uptrain_source', helps=dict(
          config="the source's config (K is set to its N)",
          steps="source steps (default: the config's)",
          kv_heads='targets (default: N/4 and 1)'))
  parser.add_argument('--alphas', type=float_list, default=None)
  args = parser.parse_args()
  check_output_dir(args.out)
  quick = args.quick
  config = source_config(args.config, args.steps)
  if quick and not args.steps:
    config = source_config(args.config, config.train.steps // 4)
  N = config.model.num_heads
  gqa = N // 4 if N >= 8 else N // 2  # GQA with 4 (or 2) heads a group.
  kv_heads = args.kv_heads or ([1] if quick else sorted({max(1, gqa), 1},
                                                         reverse=True))
  alphas = sorted(set(args.alphas or ([0, 0.05, 0.2] if quick else
                                      [0, 0.025, 0.05, 0.1, 0.2]))
                  | {0, SCRATCH_ALPHA})  # Always the control's and scratch's.
  seeds = list(range(1, 1 + (args.seeds or (2 if quick else 3))))
  bad = [k for k in kv_heads if k < 1 or N % k or k == N]
  if bad:
    raise UserError(f'--kv_heads={bad[0]}: give divisors of the source\'s '
                    f'{N} query heads below {N} (K = {N} is the control, '
                    'always run)')
  config_lib.validate(config, batch_shards=1)
  out = pathlib.Path(args.out)
  results = run_study(out, config, kv_heads, alphas, seeds)
  (out / 'results.json').write_text(json.dumps(results, indent=1))
  uptrain_report.write(out, results)


if __name__ == '__main__':
  exit_on_user_error(main)
