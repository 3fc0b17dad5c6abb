"""The single-source design (`python -m scripts.uptrain_study
--single_source`): one MHA source (seed 0), a learning-rate pilot, every
conversion with a fresh and a carried-over Adam, MHA -> MLA at each K's
cache bytes, from-scratch compute curves, the recall arm, and (--tasks)
lm-evaluation-harness scores. Its statistics and report:
`studies.uptrain.single_summary`, `single_reading`, `single_tables`."""

from __future__ import annotations

import dataclasses
import json
import pathlib

from infra import progress, provenance
from infra.errors import UserError
from lm import config_lib
from studies import stats, study, task_scores
from studies.uptrain import results as results_lib
from studies.uptrain.design import (ALPHAS, METHODS, MLA, NEAR, PAPER_ALPHA,
                                    PILOT_RATES, RECALL_TARGET, Arm, mla_plan,
                                    plan_arms, source_config, unit_steps,
                                    uptrain_config)
from studies.uptrain.runs import (convert_mla, convert_one, recorded,
                                  scratch, steps_to, train_source, uptrain)
from train.convert import to_mla

COMMAND = 'scripts.uptrain_study'  # The entry point, as provenance names it.


def run(args):
  """The design the flags ask for (--steps, --quick, --kv_heads, --seeds,
  --recall_config, --recall_steps, --tasks), refused, if bad, before any
  trains; then results.json and the report (`results.write`)."""
  config = source_config(args.config, args.steps)
  if args.quick and not args.steps:
    config = source_config(args.config, config.train.steps // 4)
  recall = source_config(args.recall_config, args.recall_steps)
  recall.train.eval_every = max(1, recall.train.steps // 40)
  N = config.model.num_heads
  kv_heads = args.kv_heads or ([1] if args.quick else
                               sorted({max(1, N // 2), 1}, reverse=True))
  seeds = list(range(1, 1 + (args.seeds or (3 if args.quick else 4))))
  for name, n in (('source', N), ('recall source', recall.model.num_heads)):
    bad = [k for k in kv_heads if k < 1 or n % k or k == n]
    if bad:
      raise UserError(f'--kv_heads={bad[0]}: give divisors of the {name}\'s '
                      f'{n} query heads below {n} (K = N is the control, '
                      'always run)')
  for c in (config, recall):
    config_lib.validate(c, batch_shards=1)
  tasks = task_scores.spec(args)
  out = pathlib.Path(args.out)
  results = {'provenance': provenance.record(COMMAND, out,
                                            statistics=stats.CONVENTION),
             'lm': lm_arm(out, config, kv_heads, seeds),
             'recall': recall_arm(out, recall, kv_heads, seeds)}
  if tasks:
    results['lm']['tasks'] = score_lm(out, config, results['lm'], tasks)
  results_lib.write(out, results)


def pilot(out: pathlib.Path, source_dir: pathlib.Path, source, K: int,
          unit: int) -> dict:
  """The learning-rate pilot (seed 0, alpha = 0.05): each candidate's
  mean-pooled and control losses, and the rate chosen by the rule fixed in
  advance (the module docstring)."""
  steps = round(PAPER_ALPHA / ALPHAS[0]) * unit
  rows = []
  for ratio in PILOT_RATES:
    rate = source.train.learning_rate * ratio
    row = {'rate': rate}
    for arm in (Arm('mean', K), Arm('identity', source.model.num_heads)):
      curve = uptrain(out, f'pilot/{rate:g}/{arm.name}',
                      convert_one(out, source_dir, arm, 0), source, steps,
                      rate, 0, steps)
      row[arm.method] = curve[-1]['loss']
    row['drift'] = row['identity'] - curve[0]['loss']
    rows.append(row)
  calm = [r for r in rows if abs(r['drift']) <= NEAR]
  chosen = (min(calm, key=lambda r: r['mean']) if calm else
            min(rows, key=lambda r: abs(r['drift'])))
  return {'K': K, 'steps': steps, 'rows': rows, 'rate': chosen['rate']}


def lm_arm(out: pathlib.Path, config, kv_heads, seeds) -> dict:
  S, N = config.train.steps, config.model.num_heads
  unit = unit_steps(S)
  top = unit * 2 ** (len(ALPHAS) - 1)
  source_dir = out / 'source'
  print(f'=== the MHA source: {S} steps', flush=True)
  source = train_source(source_dir, config)
  print('=== the learning-rate pilot', flush=True)
  chosen = pilot(out, source_dir, config, min(kv_heads), unit)
  plan = [(arm, seed) for arm in plan_arms(N, kv_heads) for seed in seeds]
  runs = []
  for arm, seed in progress.runs(
      plan, lambda p: f'{p[0].method} -> K={p[0].K}, {p[0].start} Adam, '
      f'seed {p[1]}', reused=lambda p: study.finished(
          out / 'runs' / p[0].name / f's{p[1]}')):
    curve = uptrain(out, f'runs/{arm.name}/s{seed}',
                    convert_one(out, source_dir, arm, seed), config, top,
                    chosen['rate'], seed, unit)
    runs.append({**dataclasses.asdict(arm), 'seed': seed, 'curve': curve})
  mla = mla_arm(out, source_dir, config, kv_heads, seeds, chosen['rate'], top,
                unit)
  scratches = []
  for K, seed in progress.runs(
      [(K, s) for K in [N, *kv_heads] for s in seeds],
      lambda p: f'K={p[0]} from scratch, seed {p[1]}',
      reused=lambda p: study.finished(out / 'scratch' / f'K{p[0]}_s{p[1]}')):
    scratches.append({'K': K, 'seed': seed, 'curve': scratch(
        out, config, K, seed, S + top)})
  return {'source': source, 'pilot': chosen, 'runs': runs,
          'scratch': scratches, 'mla': mla,
          'plan': {'kv_heads': kv_heads, 'seeds': seeds, 'num_heads': N,
                   'steps': S, 'alpha_steps': [unit * 2 ** i for i in range(
                       len(ALPHAS))], 'alphas': list(ALPHAS),
                   'near': NEAR, 'paper_alpha': PAPER_ALPHA,
                   'vocab_size': config.model.vocab_size,
                   'config': config.to_dict()}}


def recall_arm(out: pathlib.Path, config, kv_heads, seeds) -> dict:
  S, N = config.train.steps, config.model.num_heads
  unit = unit_steps(S)
  budget = unit * 2 ** (len(ALPHAS) - 1)
  source_dir = out / 'recall' / 'source'
  print(f'=== the recall-probe MHA source: {S} steps', flush=True)
  source = train_source(source_dir, config)
  plan = [(Arm(m, N if m == 'identity' else K), seed) for m in METHODS
          for K in kv_heads for seed in seeds
          if m != 'identity' or K == kv_heads[0]]
  runs = []
  every = max(1, budget // 20)
  for arm, seed in progress.runs(
      plan, lambda p: f'recall: {p[0].method} -> K={p[0].K}, seed {p[1]}',
      reused=lambda p: study.finished(
          out / 'recall' / 'runs' / p[0].name / f's{p[1]}')):
    curve = uptrain(out / 'recall', f'runs/{arm.name}/s{seed}',
                    convert_one(out / 'recall', source_dir, arm, seed),
                    config, budget, config.train.learning_rate, seed, every,
                    stop=True)
    runs.append({**dataclasses.asdict(arm), 'seed': seed, 'curve': curve,
                 'steps_to_target': steps_to(curve)})
  mla = mla_arm(out / 'recall', source_dir, config, kv_heads, seeds,
                config.train.learning_rate, budget, every, stop=True)
  scratches = []
  for K, seed in progress.runs(
      [(K, s) for K in kv_heads for s in seeds],
      lambda p: f'recall: K={p[0]} from scratch, seed {p[1]}',
      reused=lambda p: study.finished(
          out / 'recall' / 'scratch' / f'K{p[0]}_s{p[1]}')):
    curve = scratch(out / 'recall', config, K, seed, S, stop=True)
    scratches.append({'K': K, 'seed': seed, 'curve': curve,
                      'steps_to_target': steps_to(curve)})
  return {'source': {**source, 'steps_to_target': steps_to(source['curve'])},
          'runs': runs, 'scratch': scratches, 'mla': mla,
          'plan': {'kv_heads': kv_heads, 'seeds': seeds, 'num_heads': N,
                   'steps': S, 'budget': budget, 'target': RECALL_TARGET,
                   'eval_every': every, 'config': config.to_dict()}}


def score_lm(out: pathlib.Path, config, lm: dict, what) -> dict:
  """Task scores (--tasks) of the LM arm, per seed (`task_scores.score`):
  the source; each fresh-Adam conversion (the identity control, mean,
  first, random to each K) at the paper's alpha and at the largest; MHA
  and each K from scratch at their end. An uptraining run keeps only its
  last checkpoint (the largest alpha), so the paper's alpha is a replay:
  the same config from the same conversion, ended at that step; its
  held-out loss is kept beside the run's there, which it must equal."""
  plan = lm['plan']
  unit, top = unit_steps(plan['steps']), plan['alpha_steps'][-1]
  at = plan['alpha_steps'][plan['alphas'].index(PAPER_ALPHA)]
  where = out / 'tasks'
  print('=== task scores: ' + ', '.join(what.tasks), flush=True)
  source = task_scores.score(what, out / 'source', where / 'source')
  scored = {k: source[k] for k in ('settings', 'documents',
                                   'higher_is_better')}
  scored.update(source=source['scores'], runs=[], scratch=[])
  arms = [a for a in plan_arms(plan['num_heads'], plan['kv_heads'])
          if a.start == 'fresh']
  for arm, seed in progress.runs(
      [(a, s) for a in arms for s in plan['seeds']],
      lambda p: f'task scores: {p[0].method} -> K={p[0].K}, seed {p[1]}'):
    name = f'{arm.name}/s{seed}'
    run = next(r for r in lm['runs'] if (r['method'], r['K'], r['start'],
                                         r['seed']) == (arm.method, arm.K,
                                                        arm.start, seed))
    replay = where / 'replay' / name
    converted = convert_one(out, out / 'source', arm, seed)
    study.train(uptrain_config(converted, config, top, lm['pilot']['rate'],
                               seed, unit), replay, replay / 'log.txt',
                on_eval=lambda step, *_: step >= at, start=converted)
    replayed = json.loads((replay / 'final.json').read_text())
    for step, workdir in ((at, replay), (top, out / 'runs' / name)):
      scored['runs'].append({
          **dataclasses.asdict(arm), 'seed': seed, 'step': step,
          'scores': task_scores.score(what, workdir, where / 'runs' / name
                                      / f'step{step}')['scores'],
          **({'replay_loss': replayed['eval_loss'], 'run_loss': next(
              p['loss'] for p in run['curve'] if p['step'] == at)}
             if step == at else {})})
  for r in lm['scratch']:
    name = f'K{r["K"]}_s{r["seed"]}'
    scored['scratch'].append({
        'K': r['K'], 'seed': r['seed'], 'step': r['curve'][-1]['step'],
        'scores': task_scores.score(what, out / 'scratch' / name,
                                    where / 'scratch' / name)['scores']})
  return scored


def mla_arm(out: pathlib.Path, source_dir: pathlib.Path, config, kv_heads,
            seeds, rate: float, steps: int, every: int,
            stop: bool = False) -> dict:
  """MHA -> MLA at each K's cache bytes (`mla_plan`), uptrained as the GQA
  arms are: fresh Adam, one run per seed of `steps` at `rate`, evaluated
  every `every` (stop: ending at the recall target, with its steps)."""
  mc = config_lib.model_config(config)
  conversions, runs = [], []
  for K in kv_heads:
    plan = mla_plan(mc, K)
    converted, info = convert_mla(out, source_dir, plan)
    conversions.append(recorded(plan, info))
    latent = to_mla.latent(plan)
    for seed in progress.runs(seeds, lambda s: (
        f'MHA -> MLA at K={K}\'s bytes (kv_lora_rank {latent.width}, '
        f'RoPE dims {latent.rope}), seed {s}'), reused=lambda s: study.finished(
            out / 'runs' / Arm(MLA, K).name / f's{s}')):
      curve = uptrain(out, f'runs/{Arm(MLA, K).name}/s{seed}', converted,
                      config, steps, rate, seed, every, stop)
      runs.append({'method': MLA, 'K': K, 'start': 'fresh', 'seed': seed,
                   'curve': curve, **(
                       {'steps_to_target': steps_to(curve)} if stop else {})})
  return {'conversions': conversions, 'runs': runs}
