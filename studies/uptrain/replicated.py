"""The source-replicated design (`python -m scripts.uptrain_study`, issue
#49): sources of several lengths S, each with its own seeds, every one
converted to each arm (the identity control, mean-pooled, first-head and
random K/V heads; MLA below GQA's width, GTA and TPA at (or nearest) its
bytes, GLA at its latent width), each uptrained once per uptraining seed
and read at alpha = 0.05 of S and at a fixed number of steps, and each K
trained from scratch by the source's recipe and seed. Its statistics and report:
`studies.uptrain.replicated_summary`, `replicated_report`."""

from __future__ import annotations

import dataclasses
import pathlib

from infra import progress, provenance
from infra.errors import UserError
from lm import config_lib
from studies import stats, study
from studies.uptrain import results as results_lib
from studies.uptrain.design import (FIXED_STEPS, GLA, GLA_GROUPS, GTA,
                                    MLA_BELOW, NEAR, PAPER_ALPHA,
                                    QUICK_SOURCE_STEPS, RATE_RATIO, TPA, Arm,
                                    gla_plan, gta_plan, mla_below_plan, reads,
                                    replicated_arms, source_config, tpa_plan,
                                    unit_steps)
from studies.uptrain.runs import (convert_gta, convert_mla, convert_one,
                                  convert_tpa, recorded, scratch,
                                  train_source, uptrain)
from train.convert import to_mla

COMMAND = 'scripts.uptrain_study'  # The entry point, as provenance names it.


def run(args):
  """The design the flags ask for (--source_steps or --quick,
  --source_seeds, --kv_heads, --seeds, --config), refused, if bad, before
  any trains; then results.json (its provenance naming the passes before
  this one into the same --out, and where each run was trained) and the
  report (`results.write`)."""
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
  earlier = earlier_passes(out)
  results = {'provenance': provenance.record(
      COMMAND, out, statistics=stats.CONVENTION,
      **({'earlier': earlier} if earlier else {})),
             **replicated(out, args.config, args.source_steps,
                          args.source_seeds, kv_heads,
                          list(range(1, 1 + (args.seeds or 2))))}
  results['provenance']['trained'] = study.trained_by(workdirs(out, results))
  (out / 'results.json').write_text(study.to_json(results))
  results_lib.write(out, results)


def one_source(out: pathlib.Path, config, kv_heads, seeds, fixed: int,
               scratch_kv_heads: list[int]) -> dict:
  """One source (config: its steps and seed) in OUT: trained, converted to
  each arm (`replicated_arms`; `latent_arms`) and uptrained once per seed
  at RATE_RATIO x its peak rate (warmup over alpha = 0.0125 of its steps,
  then constant) to both `reads`; and each of `scratch_kv_heads` trained
  from scratch for the source's steps by its recipe and seed (`scratch`:
  the same initialisation of the weights of equal shape, the same data
  order), evaluated every S/40 steps as the source is (claim 3)."""
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
      f'uptraining seed {p[1]}', reused=lambda p: study.finished(
          out / 'runs' / p[0].name / f's{p[1]}')):
    curve = uptrain(out, f'runs/{arm.name}/s{seed}',
                    convert_one(out, source_dir, arm, seed), config,
                    read['top'], rate, seed, read['every'])
    runs.append({**dataclasses.asdict(arm), 'seed': seed, 'curve': curve})
  latent, latent_runs = latent_arms(out, source_dir, config, kv_heads, seeds,
                                    rate, read)
  scratches = [{'K': K, 'seed': config.seed, 'curve': scratch(
      out, config, K, config.seed, S)} for K in progress.runs(
          scratch_kv_heads, lambda K: f'S={S} seed {config.seed}: K={K} from '
          f'scratch, {S} steps', reused=lambda K: study.finished(
              out / 'scratch' / f'K{K}_s{config.seed}'))]
  return {'steps': S, 'seed': config.seed, 'source': source,
          'runs': runs + latent_runs, 'scratch': scratches,
          'reads': read, 'rate': rate,
          'warmup': min(unit_steps(S), read['top'] - 1),  # uptrain_config's.
          'mla': latent[MLA_BELOW], 'gta': latent[GTA],
          'gla': latent.get(GLA), 'tpa': latent[TPA]}


def latent_arms(out: pathlib.Path, source_dir: pathlib.Path, config,
                kv_heads, seeds, rate: float, read: dict
                ) -> tuple[dict, list[dict]]:
  """MLA below GQA's width (`mla_below_plan`), GTA at (or nearest) its
  cache bytes and GLA at its latent width (issue #51), TPA nearest its
  cache bytes (issue #63), converted from the source in SOURCE_DIR and
  uptrained as the GQA arms are (at `rate`, to `read`): ({method: its plan
  with its conversion's record}, the runs)."""
  S = config.train.steps
  mc = config_lib.model_config(config)
  plan = mla_below_plan(mc, kv_heads)
  gta = gta_plan(mc, plan['kv_bytes_per_token'], kv_heads)
  gla = gla_plan(mc, kv_heads)
  tpa = tpa_plan(mc, plan['kv_bytes_per_token'], kv_heads)
  if gla is None:
    print(f'=== no GLA arm: {GLA_GROUPS} latent groups do not divide K = '
          f'{mc.num_heads} and the latent {to_mla.latent(plan).width}',
          flush=True)
  latent = [(plan, *convert_mla(out, source_dir, plan)),
            (gta, *convert_gta(out, source_dir, gta))]
  if gla is not None:
    latent.append((gla, *convert_mla(out, source_dir, gla)))
  latent.append((tpa, *convert_tpa(out, source_dir, tpa)))
  runs = []
  for arm, at, seed in progress.runs(
      [(a, w, s) for a, w, _ in latent for s in seeds],
      lambda p: f'S={S} seed {config.seed}: {p[0]["method"]} at '
      f'{p[0]["kv_bytes_per_token"]:g} bytes/token, uptraining seed {p[2]}',
      reused=lambda p: study.finished(
          out / 'runs' / Arm(p[0]['method'], p[0]['K']).name / f's{p[2]}')):
    curve = uptrain(out, f'runs/{Arm(arm["method"], arm["K"]).name}/s{seed}',
                    at, config, read['top'], rate, seed, read['every'])
    runs.append({'method': arm['method'], 'K': arm['K'], 'start': 'fresh',
                 'seed': seed, 'curve': curve})
  return {a['method']: recorded(a, i) for a, _, i in latent}, runs


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
