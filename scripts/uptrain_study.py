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
cache bytes (`gta_plan`: K/V heads mean-pooled, then tied) and GLA with
GLA_GROUPS latent groups at its latent width (`gla_plan`, issue #51), each
uptrained once per uptraining seed (--seeds, default 2) at RATE_RATIO x
the source's peak rate (warmup over alpha = 0.0125 of S, then constant)
with a fresh Adam and read at alpha = 0.05 of S and at FIXED_STEPS
steps. Beside each source, each
--kv_heads K is trained from scratch for S steps by the source's recipe
and seed (.../scratch/K{K}_s{seed}, evaluated every S/40 steps: claim 3,
the cost). The statistics (`scripts.uptrain_replication`) average within
a source and give intervals over sources, and the alpha = 0.05 gaps'
trends over S paired by source seed; GTA is compared with the mean-pooled
GQA arm of nearest bytes, GLA with the MLA, paired within the source. The
default run (3 sources x 400, 1,600, 3,200 steps; 171 runs before the GTA
and GLA arms, 207 with them) is about 28 CPU-minutes on the 2-core
machine (docs/results/uptrain/: its first 117 runs 14 min 54 s of wall
time at 3401e24, the 54 of the random and from-scratch arms 23 min 52 s
beside other jobs at 1638762, the 36 of the GTA and GLA arms 5 min 9 s
beside other jobs at b73ef2c); --quick: sources of 200 and 400 steps
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
   reach it (paired by seed; `uptrain_report.equivalent_steps`).
6. The recall arm: an MHA recall-probe source (accuracy 1.000 by
   construction), converted as in 3 (fresh Adam) and uptrained up to 0.2 x S_r
   steps at its peak rate; steps to regain accuracy >= 0.95 against K trained
   from scratch (up to S_r steps) per seed; each run ends when it gets there.
   MLA at each K's bytes too (uptrain_recall has no RoPE: R = 2·K·H).
7. DIR/report.md (`scripts.uptrain_report`), DIR/results.json (per-seed
   values, the provenance) and plots.
8. --tasks: lm-evaluation-harness scores (`score_lm`, as evaluation.evaluate
   scores a workdir) of the source, the fresh-Adam conversions at alpha =
   0.05 and 0.2 and the from-scratch end points, per seed, paired against
   the identity control and MHA from scratch (docs/evaluation.md).

Every run is `train.main`'s loop (`scripts.study.train`); a rerun with the
same --out reuses finished runs and resumes an interrupted one (one made
before the MLA arm: only the MLA runs train; a default-design one made
before the random and from-scratch arms, or the GTA and GLA arms: only
those train, and
results.json's provenance names the earlier passes and each run's commit). --single_source: 4 seeds,
38.5 CPU-minutes with the MLA arm (the most its wall time is on an idle
2-core machine; docs/results/uptrain/single_source/report.md); with
--quick: S/4, K = 1 only, 3 seeds, 5 min 30 s on the idle machine (9.1
CPU-minutes, at d3fc18f).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import shutil

import numpy as np

from scripts import uptrain_replication
from studies import stats, study, task_scores
from scripts import uptrain_report
from infra import progress, provenance
from lm import config_lib, evaluator
from train import convert
from train.convert import to_gta, to_mla
from lm import model as model_lib
from infra import workdir as workdir_lib
from infra.cli import (check_output_dir, exit_on_user_error, int_list,
                       positive_int)
from infra.errors import UserError
from train.metrics import read_metrics

ALPHAS = (0.0125, 0.025, 0.05, 0.1, 0.2)  # Each twice the one before.
PAPER_ALPHA = 0.05  # The paper's test point.
NEAR = 0.02  # "Near MHA": at most this many nats above the control.
PILOT_RATES = (1.0, 1 / 3, 1 / 10)  # x the source's peak rate.
METHODS = ('identity', 'mean', 'first', 'random')
RECALL_TARGET = 0.95  # Held-out recall accuracy counted as regained.


@dataclasses.dataclass(frozen=True)
class Arm:
  """One conversion: K/V heads by `method`, the optimizer's `start`."""
  method: str
  K: int
  start: str = 'fresh'

  @property
  def name(self) -> str:
    return f'{self.start}/{self.method}_K{self.K}'


def unit_steps(steps: int) -> int:
  """Steps of the smallest alpha; alpha i is this x 2^i steps."""
  return max(1, round(ALPHAS[0] * steps))


def source_config(name: str, steps: int | None):
  config = config_lib.load(name)
  config.model.num_kv_heads = config.model.num_heads
  tc = config.train
  warmup = tc.warmup_steps * (steps or tc.steps) / tc.steps  # Its fraction.
  steps = steps or tc.steps
  config.train.update(steps=steps,
                      warmup_steps=min(max(1, round(warmup)), steps - 1),
                      eval_every=2 * unit_steps(steps),
                      log_every=2 * unit_steps(steps),
                      checkpoint_every=steps, keep_checkpoints=1)
  return config


def _reached(step, params, record) -> bool:
  """The recall arm's runs end once they answer RECALL_TARGET of queries."""
  del step, params
  return record['eval_accuracy'] >= RECALL_TARGET


def _trained(config, workdir: pathlib.Path, stop: bool = False
             ) -> list[dict]:
  """Trains (or reuses) `config` in WORKDIR; its evaluations. stop: end
  at the recall target (`_reached`)."""
  study.train(config, workdir, workdir / 'log.txt',
              on_eval=_reached if stop else None)
  return [{'step': r['step'], 'loss': r['eval_loss'],
           'accuracy': r['eval_accuracy']}
          for r in read_metrics(workdir) if 'eval_loss' in r]


def train_source(workdir: pathlib.Path, config) -> dict:
  curve = _trained(config, workdir)
  return {'loss': curve[-1]['loss'], 'accuracy': curve[-1]['accuracy'],
          'curve': curve, 'steps': config.train.steps,
          'learning_rate': config.train.learning_rate,
          'tokens': config.train.steps * config.train.batch_size *
                    config.data.seq_len}


def convert_one(out: pathlib.Path, source: pathlib.Path, arm: Arm,
                seed: int) -> pathlib.Path:
  """ARM's converted workdir (random's depends on the seed)."""
  key = arm.name + (f'_s{seed}' if arm.method == 'random' else '')
  workdir = out / 'converted' / key
  if not (workdir / 'config.json').exists():
    shutil.rmtree(workdir, ignore_errors=True)  # An interrupted one.
    workdir.parent.mkdir(parents=True, exist_ok=True)
    with (out / 'converted' / 'log.txt').open('a') as f, (
        contextlib.redirect_stdout(f)), contextlib.redirect_stderr(f):
      convert.convert_workdir(
          str(source), str(workdir), arm.K,
          'mean' if arm.method == 'identity' else arm.method, seed=seed,
          optimizer=arm.start)
  return workdir


def uptrain_config(converted: pathlib.Path, source, steps: int, rate: float,
                   seed: int, eval_every: int):
  """The converted workdir's config set to uptrain `steps` at `rate`: warmup
  over the first alpha point's steps, then constant."""
  config = config_lib.load(str(converted))
  warmup = min(unit_steps(source.train.steps), steps - 1) if steps > 1 else 0
  config.train.update(steps=steps, learning_rate=rate, warmup_steps=warmup,
                      min_learning_rate_ratio=1.0, checkpoint_every=steps,
                      keep_checkpoints=1, log_every=eval_every,
                      eval_every=eval_every)
  config.seed = seed
  return config


_AT0: dict = {}


def uptrain(out: pathlib.Path, name: str, converted: pathlib.Path, source,
            steps: int, rate: float, seed: int, eval_every: int,
            stop: bool = False) -> list[dict]:
  """The conversion's evaluation (step 0) and its uptraining curve."""
  workdir = out / name
  config = uptrain_config(converted, source, steps, rate, seed, eval_every)
  if converted not in _AT0:  # Deterministic: once per conversion.
    _AT0[converted] = evaluator.evaluate_workdir(str(converted))
  at0 = _AT0[converted]
  if not workdir.exists():
    shutil.copytree(converted, workdir)
  curve = _trained(config, workdir, stop)
  return [{'step': 0, 'loss': at0['eval_loss'],
           'accuracy': at0['eval_accuracy']}, *curve]


def scratch(out: pathlib.Path, source, K: int, seed: int, steps: int,
            stop: bool = False) -> list[dict]:
  """K heads trained from scratch for `steps` by the source's recipe."""
  config = source.copy_and_resolve_references()
  config.model.num_kv_heads = K
  config.seed = seed
  config.train.update(steps=steps, checkpoint_every=steps)
  return _trained(config, out / 'scratch' / f'K{K}_s{seed}', stop)


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


def plan_arms(N: int, kv_heads: list[int]) -> list[Arm]:
  return ([Arm('identity', N)] +
          [Arm(m, K) for m in METHODS[1:] for K in kv_heads] +
          [Arm('identity', N, 'pooled')] +
          [Arm('mean', K, 'pooled') for K in kv_heads])


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
      f'seed {p[1]}'):
    curve = uptrain(out, f'runs/{arm.name}/s{seed}',
                    convert_one(out, source_dir, arm, seed), config, top,
                    chosen['rate'], seed, unit)
    runs.append({**dataclasses.asdict(arm), 'seed': seed, 'curve': curve})
  mla = mla_arm(out, source_dir, config, kv_heads, seeds, chosen['rate'], top,
                unit)
  scratches = []
  for K, seed in progress.runs(
      [(K, s) for K in [N, *kv_heads] for s in seeds],
      lambda p: f'K={p[0]} from scratch, seed {p[1]}'):
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


def steps_to(curve: list[dict], target: float = RECALL_TARGET) -> int | None:
  """The first evaluated step with accuracy >= target (None: never)."""
  return next((p['step'] for p in curve if p['accuracy'] >= target), None)


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
      plan, lambda p: f'recall: {p[0].method} -> K={p[0].K}, seed {p[1]}'):
    curve = uptrain(out / 'recall', f'runs/{arm.name}/s{seed}',
                    convert_one(out / 'recall', source_dir, arm, seed),
                    config, budget, config.train.learning_rate, seed, every,
                    stop=True)
    runs.append({**dataclasses.asdict(arm), 'seed': seed, 'curve': curve,
                 'steps_to_target': steps_to(curve)})
  mla = mla_arm(out / 'recall', source_dir, config, kv_heads, seeds,
                config.train.learning_rate, budget, every, stop=True)
  scratches = []
  for K, seed in progress.runs([(K, s) for K in kv_heads for s in seeds],
                               lambda p: f'recall: K={p[0]} from scratch, '
                               f'seed {p[1]}'):
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
    if not replay.exists():
      shutil.copytree(converted, replay)
    study.train(uptrain_config(converted, config, top, lm['pilot']['rate'],
                               seed, unit), replay, replay / 'log.txt',
                on_eval=lambda step, *_: step >= at)
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


# --- MHA -> MLA at GQA-K's cache bytes ------------------------------------

MLA = uptrain_report.MLA  # Its runs: runs/fresh/mla_K{K}, K: GQA's match.


def mla_plan(mc, K: int, numbers: int | None = None) -> dict:
  """The MLA conversion of the MHA source `mc` [N heads of H] caching what
  GQA-K caches per token: qk_rope_head_dim Y = 2·N (one RoPE frequency pair
  per head, the fewest `train.convert.to_mla` keeps, so the rest goes to the
  shared latent; 0 without RoPE) and kv_lora_rank R = 2·K·H - Y, so that
  R + Y = 2·K·H numbers per token and layer, as K heads' keys and values.
  Where that R is out of `to_mla`'s range [1, min(D, 2·N·H - Y)], the nearest
  in it (the bytes then differ, and both are recorded). The bytes are
  `lm.model.kv_bytes_per_token`'s, as final.json reports them.
  numbers: R + Y other than 2·K·H (a latent below GQA-K's width, compared
  with GQA-K's bytes all the same)."""
  N, H = mc.num_heads, mc.head_dim
  Y = 2 * N if mc.use_rope else 0
  numbers = 2 * K * H if numbers is None else numbers
  R = min(max(1, numbers - Y), mc.d_model, 2 * N * H - Y)
  pairs = (to_mla.select_pairs(np.zeros((N, H // 2)), Y) if mc.use_rope
           else None)  # Which pairs does not change the cache's size.
  mla_mc, _ = to_mla.target_config(mc, R, Y, pairs)
  return {'K': K, 'kv_lora_rank': R, 'qk_rope_head_dim': Y,
          'd_model': mc.d_model,
          'kv_bytes_per_token': model_lib.kv_bytes_per_token(mla_mc),
          'gqa_kv_bytes_per_token': model_lib.kv_bytes_per_token(
              dataclasses.replace(mc, num_kv_heads=K))}


def convert_mla(out: pathlib.Path, source: pathlib.Path, plan: dict
                ) -> tuple[pathlib.Path, dict]:
  """PLAN's MLA conversion of SOURCE (deterministic: one for every seed)
  and its convert.json record (the energy kept per layer); plan['method']
  names its workdir (default MLA)."""
  workdir = out / 'converted' / Arm(plan.get('method', MLA), plan['K']).name
  if not (workdir / 'config.json').exists():
    shutil.rmtree(workdir, ignore_errors=True)  # An interrupted one.
    workdir.parent.mkdir(parents=True, exist_ok=True)
    with (out / 'converted' / 'log.txt').open('a') as f, (
        contextlib.redirect_stdout(f)), contextlib.redirect_stderr(f):
      convert.convert_to_mla(str(source), str(workdir), plan['kv_lora_rank'],
                             plan['qk_rope_head_dim'],
                             plan.get('latent_groups', 1))
  return workdir, json.loads((workdir / workdir_lib.CONVERT_INFO).read_text())


def convert_gta(out: pathlib.Path, source: pathlib.Path, plan: dict
                ) -> tuple[pathlib.Path, dict]:
  """PLAN's GTA conversion of SOURCE (`gta_plan`: K/V heads mean-pooled
  to its K, then tied; deterministic, one for every seed) and its
  convert.json record."""
  workdir = out / 'converted' / Arm(plan['method'], plan['K']).name
  if not (workdir / 'config.json').exists():
    shutil.rmtree(workdir, ignore_errors=True)  # An interrupted one.
    workdir.parent.mkdir(parents=True, exist_ok=True)
    with (out / 'converted' / 'log.txt').open('a') as f, (
        contextlib.redirect_stdout(f)), contextlib.redirect_stderr(f):
      convert.convert_to_gta(str(source), str(workdir), plan['K'],
                             plan['qk_rope_head_dim'], plan['pooling'])
  return workdir, json.loads((workdir / workdir_lib.CONVERT_INFO).read_text())


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
    conversions.append({**plan, 'energy_kept': info['energy_kept'],
                        'rope_pairs': info['rope_pairs'],
                        'converted_kv_bytes_per_token':
                            info['kv_bytes_per_token']})
    for seed in progress.runs(seeds, lambda s: (
        f'MHA -> MLA at K={K}\'s bytes (kv_lora_rank {plan["kv_lora_rank"]}, '
        f'RoPE dims {plan["qk_rope_head_dim"]}), seed {s}')):
      curve = uptrain(out, f'runs/{Arm(MLA, K).name}/s{seed}', converted,
                      config, steps, rate, seed, every, stop)
      runs.append({'method': MLA, 'K': K, 'start': 'fresh', 'seed': seed,
                   'curve': curve, **(
                       {'steps_to_target': steps_to(curve)} if stop else {})})
  return {'conversions': conversions, 'runs': runs}


# --- the source-replicated design (issue #49) ------------------------------

FIXED_STEPS = 80  # The fixed read: alpha = 0.05 of the 1,600-step source.
# x the source's peak rate: the rate the single-source study's pilot chose
# (docs/results/uptrain/single_source/), fixed here in advance for every
# source rather than piloted again on each.
RATE_RATIO = 1 / 3
MLA_BELOW = uptrain_replication.MLA_BELOW  # Latent: half GQA-max(K)'s.
GTA = uptrain_replication.GTA  # Grouped-tied attention (`gta_plan`).
GLA = uptrain_replication.GLA  # MLA_BELOW's latent in GLA_GROUPS groups.
GLA_GROUPS = 2  # Zadouri et al.'s GLA-2.
QUICK_SOURCE_STEPS = [200, 400]  # --quick's source lengths.


def replicated_arms(N: int, kv_heads: list[int]) -> list[Arm]:
  """The identity control, then mean-pooled, first-head and random (fresh
  K/V heads, drawn once per uptraining seed) to each K."""
  return [Arm('identity', N)] + [Arm(m, K) for m in METHODS[1:]
                                 for K in kv_heads]


def mla_below_plan(mc, kv_heads: list[int]) -> dict:
  """MLA whose cache is half of GQA-K's for the largest K (R + Y = K·H
  numbers), so its latent R sits below d_model as in MHA2MLA and TransMLA
  rather than at the width where 2·K·H = d_model makes it near-lossless;
  K = the largest target, method MLA_BELOW."""
  K = max(kv_heads)
  return {**mla_plan(mc, K, numbers=K * mc.head_dim), 'method': MLA_BELOW}


def gta_plan(mc, target_bytes: float, kv_heads: list[int]) -> dict:
  """GTA (`train.convert --to_gta`, K/V heads mean-pooled) of the MHA
  source `mc` [N heads of H] whose cache is nearest `target_bytes` (the
  study passes MLA_BELOW's): over K dividing N and the shared RoPE key's
  width Y (even, 2 .. H - 2; 0 without RoPE) it caches K·H + Y numbers per
  token and layer, against GQA-K's 2·K·H, so equal bytes need not exist; a
  tie goes to the smaller cache (GTA is never given more bytes than a
  layout as near below). partner_K: the mean-pooled GQA arm of kv_heads
  whose bytes are nearest GTA's (ties to the smaller), its comparison.
  Bytes are `lm.model.kv_bytes_per_token`'s."""
  N, H = mc.num_heads, mc.head_dim

  def size(K, Y):
    pairs = np.arange(Y // 2) if mc.use_rope else None  # Any Y / 2 pairs.
    return model_lib.kv_bytes_per_token(to_gta.target_config(
        dataclasses.replace(mc, num_kv_heads=K), Y, pairs)[0])
  widths = range(2, H - 1, 2) if mc.use_rope else (0,)
  layouts = {(K, Y): size(K, Y) for K in range(1, N + 1) if N % K == 0
             for Y in widths}
  (K, Y), got = min(layouts.items(), key=lambda kv: (
      abs(kv[1] - target_bytes), kv[1]))
  gqa = {k: model_lib.kv_bytes_per_token(dataclasses.replace(
      mc, num_kv_heads=k)) for k in kv_heads}
  partner = min(kv_heads, key=lambda k: (abs(gqa[k] - got), gqa[k]))
  return {'K': K, 'qk_rope_head_dim': Y, 'method': GTA, 'pooling': 'mean',
          'kv_bytes_per_token': got, 'target_kv_bytes_per_token': target_bytes,
          'partner_K': partner,
          'partner_kv_bytes_per_token': gqa[partner]}


def gla_plan(mc, kv_heads: list[int], groups: int = GLA_GROUPS
             ) -> dict | None:
  """GLA (`train.convert --to_mla --latent_groups=groups`) of the MHA
  source `mc` at `mla_below_plan`'s latent width and RoPE dims, so its
  cache bytes are MLA_BELOW's; None where the groups do not divide the
  source's K (= N) and the latent (`to_mla.check_source`'s rule)."""
  below = mla_below_plan(mc, kv_heads)
  R, Y = below['kv_lora_rank'], below['qk_rope_head_dim']
  try:
    to_mla.check_source(mc, R, Y, groups)
  except UserError:
    return None
  pairs = (to_mla.select_pairs(np.zeros((mc.num_heads, mc.head_dim // 2)), Y)
           if mc.use_rope else None)
  gla_mc, _ = to_mla.target_config(mc, R, Y, pairs, groups)
  return {**below, 'method': GLA, 'latent_groups': groups,
          'kv_bytes_per_token': model_lib.kv_bytes_per_token(gla_mc),
          'mla_kv_bytes_per_token': below['kv_bytes_per_token']}


def reads(steps: int, fixed: int) -> dict:
  """The uptraining steps read for a source of `steps`: alpha = 0.05 of
  them ('paper') and `fixed`; the run's length and evaluation period."""
  paper = max(1, round(PAPER_ALPHA * steps))
  return {'paper': paper, 'fixed': fixed, 'top': max(paper, fixed),
          'every': math.gcd(paper, fixed)}


def one_source(out: pathlib.Path, config, kv_heads, seeds, fixed: int,
               scratch_kv_heads: list[int]) -> dict:
  """One source (config: its steps and seed) in OUT: trained, converted to
  each arm (`replicated_arms`, the MLA below GQA's width) and uptrained
  once per seed at RATE_RATIO x its peak rate (warmup over alpha = 0.0125
  of its steps, then constant) to both `reads`; and each of
  `scratch_kv_heads` trained from scratch for the source's steps by its
  recipe and seed (`scratch`: the same initialisation of the weights of
  equal shape, the same data order), evaluated every S/40 steps as the
  source is (claim 3)."""
  S, N = config.train.steps, config.model.num_heads
  read = reads(S, fixed)
  rate = config.train.learning_rate * RATE_RATIO
  source_dir = out / 'source'
  print(f'=== source seed {config.seed}, {S} steps', flush=True)
  source = train_source(source_dir, config)
  runs = []
  for arm, seed in progress.runs(
      [(a, s) for a in replicated_arms(N, kv_heads) for s in seeds],
      lambda p: f'S={S} seed {config.seed}: {p[0].method} -> K={p[0].K}, '
      f'uptraining seed {p[1]}'):
    curve = uptrain(out, f'runs/{arm.name}/s{seed}',
                    convert_one(out, source_dir, arm, seed), config,
                    read['top'], rate, seed, read['every'])
    runs.append({**dataclasses.asdict(arm), 'seed': seed, 'curve': curve})
  mc = config_lib.model_config(config)
  plan = mla_below_plan(mc, kv_heads)
  converted, info = convert_mla(out, source_dir, plan)
  # GTA and GLA at MLA_BELOW's cache bytes (issue #51), uptrained alike.
  gta = gta_plan(mc, plan['kv_bytes_per_token'], kv_heads)
  gla = gla_plan(mc, kv_heads)
  if gla is None:
    print(f'=== no GLA arm: {GLA_GROUPS} latent groups do not divide K = '
          f'{N} and the latent {plan["kv_lora_rank"]}', flush=True)
  latent = [(plan, converted, info), (gta, *convert_gta(out, source_dir, gta))]
  if gla is not None:
    latent.append((gla, *convert_mla(out, source_dir, gla)))
  for arm, at, seed in progress.runs(
      [(a, w, s) for a, w, _ in latent for s in seeds],
      lambda p: f'S={S} seed {config.seed}: {p[0]["method"]} at '
      f'{p[0]["kv_bytes_per_token"]:g} bytes/token, uptraining seed {p[2]}'):
    curve = uptrain(out, f'runs/{Arm(arm["method"], arm["K"]).name}/s{seed}',
                    at, config, read['top'], rate, seed, read['every'])
    runs.append({'method': arm['method'], 'K': arm['K'], 'start': 'fresh',
                 'seed': seed, 'curve': curve})
  recorded = {a['method']: {**a, **{k: i[k] for k in ('energy_kept',
                                                      'rope_pairs')
                                    if k in i},
                            'converted_kv_bytes_per_token':
                                i['kv_bytes_per_token']}
              for a, _, i in latent}
  scratches = [{'K': K, 'seed': config.seed, 'curve': scratch(
      out, config, K, config.seed, S)} for K in progress.runs(
          scratch_kv_heads, lambda K: f'S={S} seed {config.seed}: K={K} from '
          f'scratch, {S} steps')]
  return {'steps': S, 'seed': config.seed, 'source': source, 'runs': runs,
          'scratch': scratches,
          'reads': read, 'rate': rate,
          'warmup': min(unit_steps(S), read['top'] - 1),  # uptrain_config's.
          'mla': recorded[MLA_BELOW], 'gta': recorded[GTA],
          'gla': recorded.get(GLA)}


def replicated(out: pathlib.Path, name: str, source_steps: list[int],
               source_seeds: int, kv_heads: list[int], seeds: list[int],
               fixed: int = FIXED_STEPS,
               scratch_kv_heads: list[int] | None = None) -> dict:
  """Every (source length, source seed): `one_source` in
  OUT/sources/S{steps}_s{seed} (scratch_kv_heads: the K trained from
  scratch, default every one of kv_heads); the plan beside them."""
  scratch_kv_heads = kv_heads if scratch_kv_heads is None else scratch_kv_heads
  sources = []
  for steps in source_steps:
    for seed in range(source_seeds):
      config = source_config(name, steps)
      config.seed = seed
      sources.append(one_source(out / 'sources' / f'S{steps}_s{seed}',
                                config, kv_heads, seeds, fixed,
                                scratch_kv_heads))
  config = source_config(name, source_steps[0])
  return {'sources': sources, 'plan': {
      'design': 'sources', 'source_steps': source_steps,
      'source_seeds': list(range(source_seeds)), 'seeds': seeds,
      'kv_heads': kv_heads, 'scratch_kv_heads': scratch_kv_heads,
      'num_heads': config.model.num_heads,
      'head_dim': config.model.head_dim, 'd_model': config.model.d_model,
      'vocab_size': config.model.vocab_size,
      'paper_alpha': PAPER_ALPHA, 'fixed_steps': fixed, 'near': NEAR,
      'rate_ratio': RATE_RATIO, 'config': config.to_dict()}}


def workdirs(out: pathlib.Path, results: dict) -> list[pathlib.Path]:
  """Every run of the replicated design's RESULTS in OUT: the sources, the
  uptraining runs and the from-scratch runs."""
  found = []
  for s in results['sources']:
    where = out / 'sources' / f'S{s["steps"]}_s{s["seed"]}'
    found += [where / 'source'] + [
        where / 'runs' / Arm(r['method'], r['K'], r['start']).name /
        f's{r["seed"]}' for r in s['runs']] + [
            where / 'scratch' / f'K{r["K"]}_s{r["seed"]}'
            for r in s.get('scratch', [])]
  return found


def earlier_passes(out: pathlib.Path) -> list[dict]:
  """The passes that wrote OUT/results.json before this one (whose
  finished runs a rerun reuses): each one's command, commit and machine,
  oldest first; none for a new OUT."""
  path = out / 'results.json'
  if not path.exists():
    return []
  prov = study.saved(path)['provenance']
  return [*prov.get('earlier', []), {k: prov[k] for k in (
      'command', 'commit', 'machine') if k in prov}]


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
    # The per-seed results as trained; the statistics and the reading as
    # this commit computes them (the provenance says which did which).
    out = pathlib.Path(args.out)
    results = study.saved(out / 'results.json')
    now = provenance.record('scripts.uptrain_study', out)
    results['provenance'].update(statistics=stats.CONVENTION, rebuilt={
        'command': now['command'], 'commit': now['commit'],
        'machine': now['machine']})
    _write(out, results)
    return
  if not args.single_source:
    if args.tasks or args.steps:
      raise UserError('--tasks and --steps belong to the --single_source '
                      'design; the source-replicated one takes '
                      '--source_steps and --source_seeds')
    if args.quick:  # Smaller sources, the same design: minutes.
      args.source_steps = QUICK_SOURCE_STEPS
    out = pathlib.Path(args.out)
    config = source_config(args.config, args.source_steps[0])
    N = config.model.num_heads
    kv_heads = args.kv_heads or sorted({max(1, N // 2), 1}, reverse=True)
    bad = [k for k in kv_heads if k < 1 or N % k or k == N]
    if bad:
      raise UserError(f'--kv_heads={bad[0]}: give divisors of the source\'s '
                      f'{N} query heads below {N}')
    config_lib.validate(config, batch_shards=1)
    # A rerun into the same --out reuses its finished runs: the provenance
    # names the passes before it, and where each run was trained.
    earlier = earlier_passes(out)
    results = {'provenance': provenance.record(
        'scripts.uptrain_study', out, statistics=stats.CONVENTION,
        **({'earlier': earlier} if earlier else {})),
               **replicated(out, args.config, args.source_steps,
                            args.source_seeds, kv_heads,
                            list(range(1, 1 + (args.seeds or 2))))}
    results['provenance']['trained'] = study.trained_by(
        workdirs(out, results))
    (out / 'results.json').write_text(study.to_json(results))
    _write(out, results)
    return
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
  results = {'provenance': provenance.record('scripts.uptrain_study', out,
                                            statistics=stats.CONVENTION),
             'lm': lm_arm(out, config, kv_heads, seeds),
             'recall': recall_arm(out, recall, kv_heads, seeds)}
  if tasks:
    results['lm']['tasks'] = score_lm(out, config, results['lm'], tasks)
  _write(out, results)


def _write(out: pathlib.Path, results: dict):
  """OUT/results.json with its summary, and the report of its design."""
  report = (uptrain_replication if 'sources' in results else
            uptrain_report)
  results['summary'] = report.summary(results)
  (out / 'results.json').write_text(study.to_json(results))
  report.write(out, results)


if __name__ == '__main__':
  exit_on_user_error(main)
