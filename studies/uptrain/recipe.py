"""The recipe study (`python -m scripts.uptrain_recipe`, issue #60): the GQA
paper's claims 1 and 3 read under a swept uptraining recipe, with both
endpoints annealed under the cosine recipes, and at a longer context (rows
of 512 tokens).

The replicated study (`studies.uptrain.replicated`) read claims 1 and 3
under one recipe: a third of the source's peak rate, re-warmed, then
constant, against GQA trained from scratch for S steps and annealed. Here
the recipe is a factor, fixed in advance (RATES x SCHEDULES at ALPHAS):

- 'sweep': MHA sources of SWEEP_STEPS steps (seeds 0 .. SOURCE_SEEDS - 1,
  the source the unit of replication), each converted to the identity
  control (K = N) and mean-pooled GQA (K = N/2), each uptrained by every
  recipe: 'constant' re-warms over alpha = 0.0125 of S and holds the rate
  (one run to max(ALPHAS), read at each alpha: the same recipe stopped
  earlier); 'cosine' re-warms the same and anneals to the source's
  end ratio at alpha x S (one run per alpha, so each endpoint is annealed).
  Beside each source, GQA trained from scratch by the source's recipe for
  S(1 + alpha) steps per alpha, annealed at its end: the compute the
  uptrained model had.
- 'carried': sources of CARRIED_STEPS, the sweep's best recipe for the
  GQA arm (`best`: the lowest mean loss at PAPER_ALPHA) carried to them at
  PAPER_ALPHA, so the claims' trend over S is read under that recipe.
- 'panel': PANEL's source (rows of 512 tokens, d_model 128) of
  PANEL['steps'] steps, every recipe at PAPER_ALPHA.
- 'probe': the sweep's sources uptrained at PROBE_RATE (the source's own
  peak, above the grid) by both schedules at PAPER_ALPHA: a diagnostic of
  the grid's edge, added after the sweep's first source showed GQA's best
  recipe at the grid's highest rate; outside every Holm family, not
  judged.

One uptraining seed (SEED) per source: the control and GQA share its data
order. Its statistics: `recipe_summary`; its report: `recipe_report`."""

from __future__ import annotations

import dataclasses
import pathlib

from infra import progress
from lm import config_lib
from studies import study
from studies.uptrain.design import PAPER_ALPHA, Arm, source_config
from studies.uptrain.runs import convert_one, scratch, train_source, uptrain

COMMAND = 'scripts.uptrain_recipe'
RATES = (1e-4, 3e-4, 1e-3)  # The uptraining peak rate (source's: 3e-3).
SCHEDULES = ('constant', 'cosine')
ALPHAS = (0.05, 0.1, 0.2)  # Uptraining steps as a fraction of S.
SWEEP_STEPS = 3200
CARRIED_STEPS = (400, 1600)
PANEL = {'config': 'uptrain_source_long', 'steps': 600}
SOURCE_SEEDS = 3
SEED = 1  # The uptraining seed (the replicated study's first).
# The replicated study's recipe, which the sweep holds: its runs at
# PAPER_ALPHA are retrained here and compared with the published ones.
PUBLISHED = {'rate': 1e-3, 'schedule': 'constant'}
# --quick: the same design on sources of a few steps (minutes; tests).
QUICK = {'sweep': 160, 'carried': (80,), 'panel': {'config': 'tiny',
                                                    'steps': 80}}
PROBE_RATE = 3e-3
PARTS = ('sweep', 'carried', 'panel', 'probe')
FOLDER = {'probe': 'sweep'}  # The probe uptrains the sweep's sources.


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Uptraining at peak `rate`, re-warmed, then held ('constant') or
  annealed to the source's end ratio by the run's last step ('cosine')."""
  rate: float
  schedule: str

  @property
  def name(self) -> str:
    return f'{self.schedule}_{self.rate:g}'

  def end_ratio(self, source) -> float:
    return (1.0 if self.schedule == 'constant'
            else source.train.min_learning_rate_ratio)


def recipes() -> list[Recipe]:
  return [Recipe(r, s) for s in SCHEDULES for r in RATES]


def alpha_steps(S: int, alpha: float) -> int:
  return max(1, round(alpha * S))


def _jobs(recipes_: list[Recipe], alphas: tuple) -> list[tuple]:
  """(recipe, alpha) per uptraining run: a constant recipe's one run to
  max(alphas) is read at every alpha (alpha None), a cosine one's per
  alpha."""
  return [(r, None) if r.schedule == 'constant' else (r, a)
          for r in recipes_
          for a in (alphas[:1] if r.schedule == 'constant' else alphas)]


def one_source(out: pathlib.Path, config, recipes_: list[Recipe],
               alphas: tuple) -> dict:
  """One source (config: its steps and seed) in OUT: trained, converted to
  the control and mean-pooled K = N/2, each uptrained by every recipe
  (`_jobs`), and GQA from scratch for S(1 + alpha) steps per alpha."""
  S, N, seed = config.train.steps, config.model.num_heads, config.seed
  K = max(1, N // 2)
  arms = {'control': Arm('identity', N), 'gqa': Arm('mean', K)}
  source_dir = out / 'source'
  print(f'=== source seed {seed}, {S} steps', flush=True)
  source = train_source(source_dir, config)
  converted = {a: convert_one(out, source_dir, arm, SEED)
               for a, arm in arms.items()}

  def where(job):
    (recipe, alpha), arm = job
    return f'runs/{recipe.name}/{arms[arm].name}/' + (
        'held' if alpha is None else f'a{alpha:g}')
  runs = []
  for job in progress.runs(
      [(j, a) for j in _jobs(recipes_, alphas) for a in arms],
      lambda j: f'S={S} seed {seed}: {where(j)}',
      reused=lambda j: study.finished(out / where(j))):
    (recipe, alpha), arm = job
    steps = alpha_steps(S, max(alphas) if alpha is None else alpha)
    every = alpha_steps(S, alphas[0]) if alpha is None else steps
    curve = uptrain(out, where(job), converted[arm], config, steps,
                    recipe.rate, SEED, every,
                    end_ratio=recipe.end_ratio(config))
    read = alphas if alpha is None else (alpha,)
    runs.append({'arm': arm, **dataclasses.asdict(arms[arm]),
                 **dataclasses.asdict(recipe), 'seed': SEED, 'steps': steps,
                 'curve': curve, 'reads': [
                     {'alpha': a, 'step': alpha_steps(S, a),
                      'loss': next(p['loss'] for p in curve
                                   if p['step'] == alpha_steps(S, a))}
                     for a in read]})
  scratches = []
  for alpha in progress.runs(
      list(alphas), lambda a: f'S={S} seed {seed}: K={K} from scratch, '
      f'{S + alpha_steps(S, a)} steps', reused=lambda a: study.finished(
          out / 'scratch' / f'K{K}_a{a:g}_s{seed}')):
    steps = S + alpha_steps(S, alpha)
    curve = scratch(out, config, K, seed, steps, name=f'K{K}_a{alpha:g}_s'
                    f'{seed}', eval_every=steps)
    scratches.append({'alpha': alpha, 'K': K, 'steps': steps,
                      'loss': curve[-1]['loss']})
  return {'steps': S, 'seed': seed, 'K': K, 'N': N, 'source': source,
          'runs': runs, 'scratch': scratches}


def part(out: pathlib.Path, name: str, config_name: str, steps: int,
         recipes_: list[Recipe], alphas: tuple, seeds: int) -> list[dict]:
  """Every source seed of one part, in OUT/NAME/S{steps}_s{seed}."""
  sources = []
  for seed in range(seeds):
    config = source_config(config_name, steps)
    config.seed = seed
    config_lib.validate(config, batch_shards=1)
    sources.append(one_source(out / name / f'S{steps}_s{seed}', config,
                              recipes_, alphas))
  return sources


def best(sources: list[dict], arm: str, alpha: float = PAPER_ALPHA
         ) -> Recipe:
  """The recipe whose mean loss over SOURCES for ARM at ALPHA is lowest
  (fixed in advance as the one carried to the other lengths)."""
  means = {}
  for s in sources:
    for r in s['runs']:
      for read in r['reads']:
        if r['arm'] == arm and read['alpha'] == alpha:
          means.setdefault((r['rate'], r['schedule']), []).append(
              read['loss'])
  (rate, schedule), _ = min(means.items(),
                            key=lambda kv: sum(kv[1]) / len(kv[1]))
  return Recipe(rate, schedule)


def workdirs(out: pathlib.Path, results: dict) -> list[pathlib.Path]:
  """Every run of RESULTS in OUT: sources, uptraining and scratch runs."""
  found = []
  for name in PARTS:
    for s in results['parts'].get(name, []):
      root = out / FOLDER.get(name, name) / f'S{s["steps"]}_s{s["seed"]}'
      found.append(root / 'source')
      for r in s['runs']:
        alpha = ('held' if r['schedule'] == 'constant'
                 else f'a{r["reads"][0]["alpha"]:g}')
        found.append(root / 'runs' / Recipe(r['rate'], r['schedule']).name
                     / Arm(r['method'], r['K'], r['start']).name / alpha)
      found += [root / 'scratch' / f'K{c["K"]}_a{c["alpha"]:g}_s{s["seed"]}'
                for c in s['scratch']]
  return list(dict.fromkeys(found))  # The probe's sources are the sweep's.


# The replicated study's published results: its sources and its runs of
# PUBLISHED's recipe at PAPER_ALPHA, which this study retrains.
REFERENCE = (pathlib.Path(__file__).resolve().parents[2] / 'docs' /
             'results' / 'uptrain' / 'results.json')


def reference(sources: list[dict]) -> dict:
  """For each of SOURCES the published study also trained (same S and
  seed): its source loss there, and its control's and mean-pooled GQA's
  loss at PAPER_ALPHA under PUBLISHED's recipe with uptraining seed SEED;
  beside the published study's commit. Empty without that file."""
  if not REFERENCE.exists():
    return {}
  published = study.saved(REFERENCE)
  by = {(s['steps'], s['seed']): s for s in published['sources']}
  rows = []
  for s in sources:
    p = by.get((s['steps'], s['seed']))
    if p is None:
      continue
    step = alpha_steps(s['steps'], PAPER_ALPHA)
    def at(method, K):
      return next(pt['loss'] for r in p['runs']
                  if (r['method'], r['K'], r['seed'], r['start']) ==
                  (method, K, SEED, 'fresh')
                  for pt in r['curve'] if pt['step'] == step)
    rows.append({'steps': s['steps'], 'seed': s['seed'],
                 'source': p['source']['loss'],
                 'control': at('identity', s['N']), 'gqa': at('mean', s['K'])})
  return {'path': str(REFERENCE.relative_to(REFERENCE.parents[3])),
          'commit': published['provenance'].get('commit'), 'sources': rows}


def run(out: pathlib.Path, which: str, seeds: int, quick: bool
        ) -> dict | None:
  """Trains the part WHICH (or 'all': every part, reusing finished runs)
  into OUT; for 'all', the results (runs, plan, reference, provenance
  of where each run was trained) to report, else None."""
  sweep_steps = QUICK['sweep'] if quick else SWEEP_STEPS
  carried_steps = QUICK['carried'] if quick else CARRIED_STEPS
  panel = QUICK['panel'] if quick else PANEL
  parts = {}
  if which in ('all', 'sweep', 'carried'):
    parts['sweep'] = part(out, 'sweep', 'uptrain_source', sweep_steps,
                          recipes(), ALPHAS, seeds)
  if which in ('all', 'carried'):
    carried = best(parts['sweep'], 'gqa')
    parts['carried'] = [s for S in carried_steps for s in part(
        out, 'carried', 'uptrain_source', S, [carried], (PAPER_ALPHA,),
        seeds)]
  if which in ('all', 'probe'):
    parts['probe'] = part(out, 'sweep', 'uptrain_source', sweep_steps,
                          [Recipe(PROBE_RATE, s) for s in SCHEDULES],
                          (PAPER_ALPHA,), seeds)
  if which in ('all', 'panel'):
    parts['panel'] = part(out, 'panel', panel['config'], panel['steps'],
                          recipes(), (PAPER_ALPHA,), seeds)
  if which != 'all':
    print(f'=== part {which} trained; --part=all writes the report',
          flush=True)
    return None
  plan = {'rates': list(RATES), 'schedules': list(SCHEDULES),
          'alphas': list(ALPHAS), 'paper_alpha': PAPER_ALPHA,
          'sweep_steps': sweep_steps, 'carried_steps': list(carried_steps),
          'probe_rate': PROBE_RATE,
          'panel': panel, 'source_seeds': seeds, 'seed': SEED,
          'published': PUBLISHED, 'quick': quick,
          'configs': {name: source_config(c, S).to_dict() for name, c, S in (
              ('sweep', 'uptrain_source', sweep_steps),
              ('panel', panel['config'], panel['steps']))}}
  results = {'plan': plan, 'parts': parts,
             'reference': reference(parts['sweep'] + parts['carried'])}
  runs = workdirs(out, results)
  results['trained'] = study.trained_by(runs)
  results['cost'] = cost(out, runs)
  return results


def cost(out: pathlib.Path, runs: list[pathlib.Path]) -> dict:
  """Per part: its runs, the steps they trained and the seconds their
  training loops took (final.json's train_seconds: without compilation,
  evaluation or conversion)."""
  out_ = {}
  for run in runs:
    final = study.saved(run / 'final.json')
    config = study.saved(run / 'config.json')
    row = out_.setdefault(run.relative_to(out).parts[0],
                          {'runs': 0, 'steps': 0, 'train_seconds': 0.0})
    row['runs'] += 1
    row['steps'] += config['train']['steps']
    row['train_seconds'] += final.get('train_seconds', 0.0)
  return out_
