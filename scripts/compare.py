"""Trains MHA, GQA and MQA on the same data and budget, and writes a report.

  python -m scripts.compare --out=out/compare [--quick] [--kv_heads=8,2,1]
      [--seeds=1] [--equal_params] [--steps=N] [--config=gqa_small]
      [--no_control] [--no_aa]
      [--tasks=T1,T2 [--include_path=DIR] [--task_limit=N]]

Each variant (and seed) trains with train.main's loop into OUT/K{k}_s{seed}
(scripts/study.py: a finished run is reused only if it was trained with these
settings); then decoding is timed per variant as bench_decode times it
(batch 16, context 256, scripts/timing.py: the cache donated, updated in
place). OUT/report.md gets the table (num_kv_heads, parameters, KV bytes per
token, held-out loss and bits per byte, training and decode tokens/s, mean ±
sd over seeds), each variant's held-out loss by seed and its paired
difference from MHA with the smallest difference the seeds can detect
(scripts/stats.py), what that lets it say about the papers, and the plots
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
(scripts/task_scores.py, into OUT/tasks/K{k}_s{seed}, reused on rerun) and
reports them by seed and paired against MHA (docs/evaluation.md).
"""

from __future__ import annotations

import math
import pathlib

import numpy as np

from studies import report, stats, study, task_scores, timing
import jax
from flax import linen as nn

from infra import progress
from lm import checkpoint, config_lib, data, flops
from train import convert, loop
from infra.cli import check_output_dir, exit_on_user_error
from infra.errors import UserError
from lm import model as model_lib
from infra import provenance as provenance_lib
from lm.model import Transformer
from train.metrics import read_metrics

DECODE_BATCH, DECODE_CONTEXT = 16, 256


def variant_config(base, K, seed, steps, equal_params):
  config = config_lib.load(base)
  m = config.model
  if equal_params:
    m.mlp_dim = flops.equal_params_mlp_dim(m.mlp_dim, m.num_heads, K,
                                           m.head_dim)
  m.num_kv_heads = K
  config.seed = seed
  if steps:
    config.train.update(steps=steps, eval_every=max(steps // 3, 1),
                        checkpoint_every=steps,
                        warmup_steps=min(config.train.warmup_steps, steps // 4))
  return config


def control_config(base, K, seed, steps):
  """The negative control: variant K (not widened) with every layer's
  attention a window of 1 key, its own token: no context."""
  config = variant_config(base, K, seed, steps, equal_params=False)
  config.model.update(attention_pattern='L', local_window=1)
  return config


AA_REDRAW = 1_000  # The A/A run's K/V initialisation seed: seed + this.


def aa_start(workdir: pathlib.Path, config, seed: int):
  """The A/A run's step 0 in WORKDIR (once): the parameters `config` starts
  from with `seed`, its K/V projections (`convert.is_kv_kernel`) drawn with
  seed + AA_REDRAW instead; `train.main` then trains it with `seed`'s data
  order and a fresh optimizer."""
  if (workdir / 'config.json').exists():
    return
  model = Transformer(config_lib.model_config(config))
  base, other = (nn.unbox(loop.init_params(model, s))
                 for s in (seed, seed + AA_REDRAW))
  params = jax.tree_util.tree_map_with_path(
      lambda path, a, b: b if convert.is_kv_kernel(path) else a, base, other)
  workdir.mkdir(parents=True, exist_ok=True)
  checkpoint.save_params(workdir, params)
  (workdir / 'config.json').write_text(config.to_json(indent=2))


def reference_K(kv_heads, num_heads: int) -> int:
  """What the variants are compared against: MHA (K = num_heads) when it
  runs, else the variant with the most K/V heads."""
  return num_heads if num_heads in kv_heads else max(kv_heads)


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
  steps = 120 if args.quick and not args.steps else args.steps
  check_output_dir(args.out)
  out = pathlib.Path(args.out)
  if args.report_only:
    if args.tasks:
      raise UserError('--tasks scores runs as compare trains them, not with '
                      '--report_only; rerun without it (finished runs are '
                      'reused)')
    result = study.saved(out / 'results.json')
    report.record_rebuild(result['provenance'], 'scripts.compare', out)
    write(out, result)
    print(f'wrote {out}/report.md (from {out}/results.json)')
    return
  configs = {(K, seed): variant_config(args.config, K, seed, steps,
                                       args.equal_params)
             for K in args.kv_heads for seed in range(args.seeds)}
  num_heads = config_lib.load(args.config).model.num_heads
  control_K = reference_K(args.kv_heads, num_heads)
  # One seed cannot resolve anything, the control included: not trained.
  controls = {} if args.no_control or args.seeds < 2 else {
      ('control', seed): control_config(args.config, control_K, seed, steps)
      for seed in range(args.seeds)}
  if not args.no_aa and args.seeds >= 2:
    controls.update({('aa', seed): configs[control_K, seed]
                     for seed in range(args.seeds)
                     if (control_K, seed) in configs})
  everything = {**configs, **controls}
  for (K, seed), config in everything.items():  # Refused before any trains.
    config_lib.validate(config, batch_shards=1)
    study.check_reusable(config, out / f'{_name(K)}_s{seed}')
  tasks = task_scores.spec(args)
  runs, control_runs, aa_runs = [], [], []
  for (K, seed), config in progress.runs(
      list(everything.items()),
      lambda c: {'control': f'control (K={control_K}, no context)',
                 'aa': f'A/A (K={control_K}, K/V initialisation redrawn)'}.get(
                     c[0][0], f'num_kv_heads={c[0][0]}') + f' seed={c[0][1]}'):
    workdir = out / f'{_name(K)}_s{seed}'
    if K == 'aa':
      aa_start(workdir, config, seed)
    record = study.train(config, workdir, workdir / 'log.txt')
    print(f'{_name(K)} seed={seed}: held-out loss '
          f'{record["eval_loss"]:.4f} (log: {workdir / "log.txt"})',
          flush=True)
    run = dict(K=K, seed=seed, config=config, record=record,
               metrics=read_metrics(workdir))
    if K in ('control', 'aa'):
      (control_runs if K == 'control' else aa_runs).append(
          run | {'K': control_K})
      continue
    if tasks:  # Its final checkpoint, as evaluation.evaluate scores it.
      record['tasks'] = task_scores.score(tasks, workdir,
                                          out / 'tasks' / f'K{K}_s{seed}')
    if config.data.task == 'recall':
      record['accuracy_by_query'] = recall_accuracy_by_query(workdir)
    runs.append(run)
  decode = {}
  for K in sorted({r['K'] for r in runs}):
    mc = config_lib.model_config(next(r['config'] for r in runs if r['K'] == K))
    decode[K] = DECODE_BATCH / timing.decode_step_seconds(
        mc, DECODE_BATCH, DECODE_CONTEXT, repeats=5)
    print(f'decode K={K}: {decode[K]:,.0f} tokens/s', flush=True)
  bandwidth = timing.read_bandwidth(5)
  write_report(out, runs, decode, bandwidth, args, control_runs, aa_runs,
               trained=study.trained_by(
                   out / f'{_name(K)}_s{seed}' for K, seed in everything))
  print(f'wrote {out}/report.md')


def _name(K) -> str:
  """A run's folder name in OUT, before _s{seed}: K{k}, control or aa."""
  return K if K in ('control', 'aa') else f'K{K}'


def recall_accuracy_by_query(workdir, rows: int = 512) -> list[float]:
  """Held-out answer accuracy of the j-th query, j = 1..P, for a recall run.

  The first query is the pure retrieval test: later ones can be guessed
  partly by crossing out values already asked for.
  """
  mc, params, config = checkpoint.load_workdir(str(workdir))
  task = data.load('', val_fraction=0.1, seq_len=config.data.seq_len,
                   task='recall', recall_pairs=config.data.recall_pairs,
                   recall_gap=config.data.recall_gap,
                   vocab_size=mc.vocab_size)
  tokens = task.batch('val', seed=0, step=0, batch_size=rows,
                      seq_len=config.data.seq_len, stream=1)
  logits = Transformer(mc).apply({'params': params}, tokens[:, :-1])
  return task.accuracy_by_query(logits.argmax(-1), tokens).tolist()


# The margins the verdicts use, fixed in advance. Neither is a paper's claim
# as the paper frames it: Shazeer's MQA cost (2019, Tables 1, 3) is
# log-perplexity per subword token or word piece at equal parameters, not
# nats per token of this data; Ainslie et al.'s GQA "close to MHA" (2023) is
# about models uptrained from MHA (scripts/uptrain_study.py tests that).
SHAZEER_MQA_COST = (0.010, 0.015)  # MQA - MHA, Shazeer's numbers as a margin.
NEAR_MHA = 0.02  # This lab's "GQA near MHA" for models trained from scratch.


def comparisons(losses: dict, num_heads: int | None,
                per: str = 'byte') -> list[dict]:
  """Each variant's held-out loss against the reference's, paired by seed.

  losses: {K: {seed: held-out loss}}. The reference is MHA (K = num_heads)
  when it ran, else the variant with the most K/V heads (then no paper's
  claim is tested; nor when num_heads is None, not recorded). One dict per
  other variant: K, the reference's K, both arms' per-seed losses, the
  paired difference K - reference (a `stats.Estimate`), the smallest
  difference its seeds detect (`stats.detectable` of the differences' sd)
  and the verdict on the paper's claim (`verdict`), in nats per `per`.
  """
  kvs = sorted(losses, reverse=True)
  reference = reference_K(kvs, num_heads)
  base = losses[reference]
  found = []
  for K in kvs:
    if K == reference:
      continue
    mine = losses[K]
    seeds = sorted(mine.keys() & base.keys())
    a, b = [mine[s] for s in seeds], [base[s] for s in seeds]
    difference = stats.paired(a, b)
    detectable = stats.detectable(difference.sd, difference.n)
    found.append(dict(
        K=K, reference_K=reference, seeds=seeds, losses=a,
        reference_losses=b, difference=difference, detectable=detectable,
        verdict=verdict(K, reference, num_heads, difference, detectable,
                        per)))
  return found


def unit(config) -> str:
  """What one held-out loss value is per: 'byte' (no tokenizer), 'token'
  (a tokenizer's), or 'answer token' (the recall probe)."""
  if config.data.task == 'recall':
    return 'answer token'
  return 'token' if config.data.get('tokenizer') else 'byte'


def _paired_arm(arm: dict, losses: dict) -> tuple:
  """(K, seeds, the arm's losses, the reference's) over the seeds both
  have: a control arm as results.json holds it ({'K', 'seeds', 'losses'})
  against variant K's losses ({K: {seed: loss}})."""
  K = arm['K']
  mine = dict(zip(arm['seeds'], arm['losses']))
  base = losses.get(K, {})
  seeds = sorted(mine.keys() & base.keys())
  return K, seeds, [mine[s] for s in seeds], [base[s] for s in seeds]


def control_check(arm: dict | None, losses: dict) -> dict | None:
  """The negative control against the reference, paired by seed. arm: the
  control as results.json holds it ({'K', 'seeds', 'losses'}; None without
  one); losses: {K: {seed: loss}} of the variants. K (the reference's),
  seeds, both arms' losses, the difference control - reference (a
  `stats.Estimate`), its detectable effect, whether the setup sees it
  (`seen`: `stats.decide` resolves it, and worse) and the reading."""
  if not arm:
    return None
  K, seeds, a, b = _paired_arm(arm, losses)
  d = stats.paired(a, b)
  detectable = stats.detectable(d.sd, d.n)
  decided = stats.decide(d)
  seen = decided == 'resolved' and d.mean > 0
  if decided == 'one seed':
    reading = ('one seed: the control cannot be tested, so nothing is '
               'claimed (rerun with --seeds=3 or more)')
  elif decided == 'equal on all seeds':
    reading = (f'equal on all {d.n} seeds ({d.mean:+.3f} nats): no '
               'interval, so the control is not counted as seen')
  elif seen:
    reading = (f'the setup sees attention: without context the held-out '
               f'loss is {d.mean:+.3f} nats worse, resolved by {d.n} seeds')
  elif decided == 'resolved':
    reading = (f'resolved BETTER without context ({d.mean:+.3f} nats): '
               f'K={K} does not use its context (too few steps, or a bug), '
               'so no difference below can be interpreted')
  else:
    reading = (f'not claimed ({d.n} seeds detect {detectable:.3f} nats): '
               'these seeds and this evaluation cannot tell a model '
               f'without context from K={K}, so an unresolved difference '
               'between the variants says nothing about K')
  return dict(K=K, seeds=seeds, losses=a, reference_losses=b, difference=d,
              detectable=detectable, seen=seen, reading=reading)


def seeds_to_detect(sd: float, effect: float, most: int = 100) -> int | None:
  """The fewest seeds whose paired test detects `effect` (80% power) at
  this sd; None if more than `most`."""
  return next((n for n in range(2, most + 1)
               if stats.detectable(sd, n) <= effect), None)


def verdict(K: int, reference: int, num_heads: int | None, d: stats.Estimate,
            detectable: float, per: str = 'byte') -> str:
  """What difference d (K - MHA, nats per `per`) lets the report say, by
  `stats.decide`. K = 1: the difference alone; Shazeer's MQA cost is
  log-perplexity per subword token at equal parameters, another unit, so it
  is named and never compared with a loss per byte (nor with another
  tokenizer's tokens). 1 < K < N: against this lab's margin NEAR_MHA, in
  this loss's own unit: agrees when the interval lies within it (both edges
  resolved inside), disagrees when resolved beyond it, otherwise cannot
  resolve it, with the seeds that would."""
  if num_heads is None:
    return (f'results.json does not record the query heads, so whether '
            f'K={reference} is MHA is unknown: no paper\'s claim is tested')
  if reference != num_heads:
    return (f'the reference is K={reference}, not MHA (K={num_heads}): no '
            "paper's claim is tested")
  decided = stats.decide(d)
  if decided in ('one seed', 'equal on all seeds'):
    return (f'{decided}: no interval, nothing claimed (rerun with --seeds=3 '
            'or more)')
  more = lambda effect: (
      f'; about {n} seeds would detect {effect:.3f}'
      if (n := seeds_to_detect(d.sd, effect)) else '')
  if K == 1:
    low, high = SHAZEER_MQA_COST
    return (f'MQA minus MHA {d.mean:+.3f} nats per {per}: {decided} '
            f'(detectable {detectable:.3f}). Shazeer\'s MQA cost '
            f'({low:.3f}-{high:.3f} nats) is per subword token at equal '
            f'parameters, another unit: not compared')
  paper = (f'GQA near MHA (within ±{NEAR_MHA} nats per {per}, this lab\'s '
           'margin; Ainslie et al.\'s claim is about uptrained models)')
  above, below = (stats.decide(stats.shifted(d, m))
                  for m in (NEAR_MHA, -NEAR_MHA))
  if (above == 'resolved' and d.mean > NEAR_MHA) or (
      below == 'resolved' and d.mean < -NEAR_MHA):
    return f'farther from MHA than ±{NEAR_MHA} nats: disagrees with {paper}'
  if (above == 'resolved' and d.mean < NEAR_MHA and below == 'resolved'
      and d.mean > -NEAR_MHA):
    return f'agrees with {paper}: the interval lies within it'
  return (f'cannot resolve {paper}: {d.n} seeds detect {detectable:.3f} '
          'nats or more' + more(NEAR_MHA))


def aa_check(arm: dict | None, losses: dict, found) -> dict | None:
  """The A/A control against the reference, paired by seed (arm and
  losses as `control_check` takes them): the difference A/A - reference,
  its sd beside each variant's paired sd (`found`: `comparisons`), and the
  reading (`stats.decide`: an A/A difference should not be resolved); None
  without A/A runs."""
  if not arm:
    return None
  K, seeds, a, b = _paired_arm(arm, losses)
  d = stats.paired(a, b)
  decided = stats.decide(d)
  variants = [c for c in found if stats.as_estimate(c['difference']).n > 1]
  sds = ', '.join(f'K={c["K"]} {stats.as_estimate(c["difference"]).sd:.4f}'
                  for c in variants)
  reading = (
      f'the reference with only its K/V initialisation redrawn differs by '
      f'{d.mean:+.4f} nats ({decided}), sd {d.sd:.4f} over seeds' + (
          f' against the variants\' paired sd ({sds}): ' + (
              'a redraw alone makes that much of their spread'
              if d.n > 1 and d.sd > 0 else 'no spread to compare')
          if variants else
          '; no other variant ran beside it here, so there is no paired sd '
          'of a variant to set it against')
      + ('; resolved, so the K/V initialisation alone moves the loss beyond '
         'what the seeds detect, and a variant\'s difference of that size '
         'says nothing about K' if decided == 'resolved' else ''))
  return dict(K=K, seeds=seeds, losses=a, reference_losses=b, difference=d,
              detectable=stats.detectable(d.sd, d.n), verdict=decided,
              reading=reading)


# --- results.json: what the runs gave, then what is read from it -----------

def settings(config, args) -> dict:
  """The settings the report states, from a variant's config (the
  reference's shape: its MLP is not widened) and the flags."""
  m, t, d = config.model, config.train, config.data
  recall = d.task == 'recall'
  return dict(config=getattr(args, 'config', None), num_layers=m.num_layers,
              d_model=m.d_model, num_heads=m.num_heads, head_dim=m.head_dim,
              dtype=str(m.dtype), steps=t.steps, batch_size=t.batch_size,
              seq_len=d.seq_len, seeds=args.seeds,
              equal_params=bool(args.equal_params), task=d.task,
              data_path=d.path or '', unit=unit(config),
              recall_pairs=d.recall_pairs if recall else None)


def _curve(metrics) -> list[dict]:
  """A run's training curve as results.json keeps it: step, training loss
  and (where evaluated) held-out loss."""
  return [dict(step=m['step'], loss=m['loss'],
               **({'eval_loss': m['eval_loss']} if 'eval_loss' in m else {}))
          for m in metrics]


def _seed_values(run) -> dict:
  record = run['record']
  return dict(
      seed=run['seed'],
      **{key: float(record.get(key, math.nan))
         for key in ('eval_loss', 'eval_bpb', 'eval_accuracy')},
      train_tokens_per_sec=float(np.median(
          [m['tokens_per_sec'] for m in run['metrics']])),
      **({'tasks': record['tasks']['scores']} if 'tasks' in record else {}),
      **({'accuracy_by_query': list(record['accuracy_by_query'])}
         if 'accuracy_by_query' in record else {}),
      curve=_curve(run['metrics']))


def _arm(runs) -> dict | None:
  """A control arm as results.json holds it: K, seeds and losses."""
  if not runs:
    return None
  runs = sorted(runs, key=lambda r: r['seed'])
  return dict(K=runs[0]['K'], seeds=[r['seed'] for r in runs],
              losses=[float(r['record']['eval_loss']) for r in runs])


def results(runs, decode, bandwidth, out, args, control_runs=(), aa_runs=(),
            trained=None, argv=None) -> dict:
  """OUT/results.json's values, as the runs gave them (`analyse` adds what
  is read from them): the provenance (`trained`: where the runs were
  trained, `study.trained_by`), the settings, the decode timings, per
  variant its size, speeds and per-seed values (each run's curve too), the
  controls' per-seed losses, and the task scores' settings (--tasks)."""
  variants = []
  for K in sorted({r['K'] for r in runs}, reverse=True):
    mine = sorted((r for r in runs if r['K'] == K), key=lambda r: r['seed'])
    c = mine[0]['config']
    mc = config_lib.model_config(c)
    variants.append(dict(
        K=K, params=model_lib.num_params(mc), mlp_dim=c.model.mlp_dim,
        kv_bytes_per_token=float(model_lib.kv_bytes_per_token(mc)),
        decode_tokens_per_sec=float(decode[K]),
        decode_roofline_tokens_per_sec=float(
            flops.decode_roofline_tokens_per_sec(
                mc, DECODE_BATCH, DECODE_CONTEXT, bandwidth,
                flops.peak_flops()[0])['roofline']),
        seeds=[_seed_values(run) for run in mine]))
  prov = provenance_lib.record('scripts.compare', out, argv,
                               statistics=stats.CONVENTION)
  if trained:
    prov['trained'] = trained
  reference = next(r for r in runs if r['K'] == variants[0]['K'])
  result = dict(
      provenance=prov,
      settings=settings(reference['config'], args),
      decode=dict(batch=DECODE_BATCH, context=DECODE_CONTEXT,
                  read_bandwidth=float(bandwidth)),
      variants=variants, comparisons=[], control=_arm(control_runs),
      aa=_arm(aa_runs))
  first = next((r['record']['tasks'] for r in runs
                if 'tasks' in r['record']), None)
  if first:
    result['tasks'] = dict(settings=first['settings'],
                           documents=first['documents'],
                           higher_is_better=first['higher_is_better'])
  return result


def _losses(result) -> dict:
  """{K: {seed: held-out loss}} of the variants in results.json."""
  return {v['K']: {s['seed']: s['eval_loss'] for s in v['seeds']}
          for v in result['variants']}


def _saved(found: dict) -> dict:
  """A comparison or control as results.json holds it (the Estimate as a
  dict)."""
  return found and {**found, 'difference': stats.as_estimate(
      found['difference']).as_dict()}


def analyse(result: dict) -> dict:
  """RESULT (results.json, as `results` makes it or as saved) with what is
  read from its values, made again from them: the comparisons against the
  reference, the negative and A/A controls, the task scores' comparisons.
  Every verdict is `stats.decide`'s (through `verdict`, `control_check`,
  `aa_check`); nothing is taken from an earlier reading."""
  s = result.get('settings') or {}
  losses = _losses(result)
  found = comparisons(losses, s.get('num_heads'),
                      s.get('unit', '(unit not recorded)'))
  result['comparisons'] = [_saved(c) for c in found]
  result['control'] = _saved(control_check(result.get('control'), losses))
  result['aa'] = _saved(aa_check(result.get('aa'), losses, found))
  if 'tasks' in result:
    arms, reference = _task_arms(result)
    result['tasks']['comparisons'] = task_scores.comparisons(arms, reference)
  return result


def write_report(out, runs, decode, bandwidth, args, control_runs=(),
                 aa_runs=(), trained=None):
  """results.json from the runs as trained (`results`), then `write`:
  report.md, loss.png and throughput.png in OUT. trained: where the runs
  were trained (`study.trained_by`)."""
  write(out, results(runs, decode, bandwidth, out, args, control_runs,
                     aa_runs, trained))


def write(out, result: dict):
  """OUT/results.json (`analyse`d), OUT/report.md (`text`: a function of
  results.json alone, so --report_only rebuilds it identically) and the
  plots (loss.png only where results.json holds the training curves)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  analyse(result)
  (out / 'results.json').write_text(study.to_json(result))
  (out / 'report.md').write_text(text(result))
  if _has_curves(result):
    _plot_loss(out / 'loss.png', result)
  _plot_throughput(out / 'throughput.png', _rows(result))


def _has_curves(result) -> bool:
  return all('curve' in s for v in result['variants'] for s in v['seeds'])


# --- the report: a function of results.json ---------------------------------

def _spread(values):
  values = np.asarray(values, float)
  if np.isnan(values).all():
    return '-'  # Not measured: bits/byte of non-text data, or older runs.
  if len(values) == 1:
    return f'{values[0]:.3f}'
  return f'{values.mean():.3f} ± {values.std(ddof=1):.3f}'


def _rows(result) -> list[dict]:
  """One row a variant (K): its size, its losses over seeds, its speeds."""
  rows = []
  for v in sorted(result['variants'], key=lambda v: -v['K']):
    seeds = v['seeds']
    spread = lambda key: _spread([s.get(key, math.nan) for s in seeds])
    rows.append(dict(
        K=v['K'], params=v['params'], kv=v['kv_bytes_per_token'],
        mlp=v['mlp_dim'], loss=spread('eval_loss'), bpb=spread('eval_bpb'),
        accuracy=spread('eval_accuracy'),
        first=_spread([s.get('accuracy_by_query', [math.nan])[0]
                       for s in seeds]),
        train=np.mean([s['train_tokens_per_sec'] for s in seeds]),
        decode=v['decode_tokens_per_sec'],
        roofline=v['decode_roofline_tokens_per_sec']))
  return rows


def _reading(rows, found, control=None) -> str:
  """What the negative control shows, each paired difference with
  `stats.decide`'s verdict, then decoding; from the numbers."""
  parts = ['Negative control (a model without context): ' + (
      f'{control["reading"]}.' if control else
      'left out (--no_control, or one seed): nothing shows that these '
      'seeds can '
      'see what attention does.')]
  if found:
    est = [stats.as_estimate(c['difference']) for c in found]
    parts.append(
        f'Each variant minus K={found[0]["reference_K"]}, by scripts/'
        'stats.py\'s rule: ' + '; '.join(
            f'K={c["K"]} {d.mean:+.3f} nats, {stats.decide(d)}'
            + (f' (detectable: {c["detectable"]:.3f})' if d.n > 1 else '')
            for c, d in zip(found, est)) + '.'
        + (' A difference below the detectable one is not claimed.'
           if est[0].n > 1 else ' Rerun with --seeds=3 or more.'))
  if len(rows) > 1:
    fastest = max(rows, key=lambda r: r['decode'])
    slowest = min(rows, key=lambda r: r['decode'])
    parts.append(f'Decoding is fastest with K={fastest["K"]}, '
                 f'{fastest["decode"] / slowest["decode"]:.1f}x '
                 f'K={slowest["K"]}.')
  return ' '.join(parts)


def made(prov: dict) -> str:
  """Where the runs were trained and where results.json was written (the
  decode timed), as results.json records them, and its note."""
  where = (f'`{prov["command"]}` at commit {prov["commit"]}'
           + (f' on {provenance_lib.describe(prov["machine"])}'
              if prov.get('machine') else ''))
  return ((f'Runs trained by {prov["trained"]}; decode timed and '
           f'results.json written by {where}.' if prov.get('trained') else
           f'Made by {where}.')
          + (f' {prov["note"]}' if prov.get('note') else ''))


def _settings_line(result) -> str:
  s, d = result.get('settings'), result['decode']
  decode = (f'Decode: batch {d["batch"]}, context {d["context"]}, the cache '
            'updated in place as train.sample runs it (scripts/timing.py); '
            f'read bandwidth {d["read_bandwidth"] / 1e9:.1f} GB/s. Every '
            'value by seed, and the comparisons: results.json.')
  if not s:
    return ('Settings (layers, width, heads, steps, batch, sequence length, '
            'compute dtype, data): not in this results.json (written before '
            'scripts.compare saved them); the command above names them. '
            + decode)
  return (f'{s["num_layers"]} layers, d_model {s["d_model"]}, '
          f'{s["num_heads"]} query heads of {s["head_dim"]}; '
          f'{s["steps"]} steps of {s["batch_size"]} x {s["seq_len"]} '
          f'tokens each, {s["seeds"]} seed(s) per variant'
          + (', MLP widened to equal parameters' if s['equal_params'] else '')
          + f'. Compute dtype {s["dtype"]}. ' + decode
          + (f' {s["note"]}' if s.get('note') else ''))


def _data_line(s) -> str:
  if not s:
    return ('Data: not in this results.json (written before scripts.compare '
            'saved its settings).')
  if s['task'] == 'recall':
    return (f'Data: the recall probe, {s["recall_pairs"]} key-value pairs '
            'per row; accuracy counts the answers only.')
  return (f'Data: {s["data_path"] or "the embedded stdlib corpus"} '
          f'({s["unit"]}s; every loss is nats per {s["unit"]}).')


def text(result: dict) -> str:
  """report.md: a function of results.json alone (`analyse`d), so that
  --report_only rebuilds it identically."""
  prov, s = result['provenance'], result.get('settings')
  recall = bool(s) and s['task'] == 'recall'
  rows = _rows(result)
  found = result['comparisons']
  lines = [
      '# Comparing MHA, GQA and MQA', '', made(prov), '',
      *report.rebuilt_lines(prov, 'results.json'),
      _settings_line(result), '',
      _reading(rows, found, result.get('control')), '',
      _data_line(s), '',
      f'Statistics: {stats.CONVENTION}', '',
      '| num_kv_heads | params | mlp_dim | KV bytes/token | held-out '
      'loss (nats) | bits/byte | next-token accuracy | '
      + ('first-query accuracy | ' if recall else '')
      + 'train tok/s | decode tok/s | decode roofline tok/s |',
      '|---' * (10 + recall) + '|']
  for r in rows:
    lines.append(f'| {r["K"]} | {r["params"]:,} | {r["mlp"]} | {r["kv"]:,.0f} | '
                 f'{r["loss"]} | {r["bpb"]} | {r["accuracy"]} | '
                 + (f'{r["first"]} | ' if recall else '')
                 + f'{r["train"]:,.0f} | {r["decode"]:,.0f} | '
                 f'{r["roofline"]:,.0f} |')
  lines += ['', *_paired_lines(result), *_control_lines(result['control']),
            *_aa_lines(result['aa']), *_task_lines(result)]
  if recall:  # Later queries can be guessed by crossing out; not the first.
    lines += ['', 'Answer accuracy by query (1st ... last):', '']
    for v in sorted(result['variants'], key=lambda v: -v['K']):
      by_query = np.mean([s['accuracy_by_query'] for s in v['seeds']], axis=0)
      lines.append(f'- K={v["K"]}: ' + ' '.join(f'{a:.2f}' for a in by_query))
  if not _has_curves(result):
    lines += ['', 'Training curves: not in this results.json (written before '
              'scripts.compare saved them), so --report_only does not draw '
              'loss.png; the loss.png beside this report was drawn from the '
              'run folders by the command that wrote results.json.']
  return '\n'.join(lines + ['', '![loss](loss.png)', '',
                            '![throughput](throughput.png)', ''])


def _paired_lines(result) -> list[str]:
  """Held-out loss by seed, and each variant minus the reference: the
  paired mean with its interval, the detectable difference, the verdict."""
  found = result['comparisons']
  if not found:
    return []
  losses = _losses(result)
  kvs = sorted(losses, reverse=True)
  seeds = sorted({seed for by_seed in losses.values() for seed in by_seed})
  reference = found[0]['reference_K']
  s = result.get('settings') or {}
  lines = ['Held-out loss (nats) by seed:', '',
           '| seed | ' + ' | '.join(f'K={K}' for K in kvs) + ' |',
           '|---' * (len(kvs) + 1) + '|']
  for seed in seeds:
    lines.append(f'| {seed} | ' + ' | '.join(
        f'{losses[K][seed]:.4f}' if seed in losses[K] else '-' for K in kvs)
                 + ' |')
  lines += ['', f'Paired by seed (a seed fixes the data order), each variant '
            f'minus K={reference} (positive: worse than it); verdicts against the papers only where the '
            'seeds can tell' + ('' if s.get('equal_params', True)
                                 or reference != kvs[0]
                                 else ' (Shazeer compared at equal '
                                 'parameters: --equal_params)') + ':', '',
            '| K | difference (nats) [95% interval] | sd of differences | '
            'detectable | verdict |', '|---|---|---|---|---|']
  for c in found:
    d = stats.as_estimate(c['difference'])
    sd = f'{d.sd:.4f}' if d.n > 1 else '-'
    detectable = (f'{c["detectable"]:.4f}' if math.isfinite(c['detectable'])
                  else '-')
    lines.append(f'| {c["K"]} | {d:+.4f} | {sd} | {detectable} | '
                 f'{c["verdict"]} |')
  return lines


def _aa_lines(aa) -> list[str]:
  """The A/A control's paired difference and what its sd says."""
  if not aa:
    return []
  d = stats.as_estimate(aa['difference'])
  return ['', f'A/A control: K={aa["K"]} again, the same seeds, its K/V '
          'projections initialised from another seed (held-out loss by '
          'seed: ' + ', '.join(f'{a:.4f}' for a in aa['losses'])
          + f'), minus K={aa["K"]}: {d:+.4f}, sd {d.sd:.4f}, detectable '
          + (f'{aa["detectable"]:.4f}' if math.isfinite(aa['detectable'])
             else '-') + f'. Reading: {aa["reading"]}.']


def _control_lines(control) -> list[str]:
  """The negative control's paired difference, as the variants' are."""
  if not control:
    return []
  d = stats.as_estimate(control['difference'])
  seeds = ', '.join(f'{a:.4f}' for a in control['losses'])
  return ['', f'Negative control: K={control["K"]} with every layer '
          'attending to its own token only (a window of 1 key: no '
          f'context), the same seeds (held-out loss by seed: {seeds}), '
          f'minus K={control["K"]}:', '',
          '| arm | difference (nats) [95% interval] | sd of differences | '
          'detectable | reading |', '|---|---|---|---|---|',
          f'| no context | {d:+.4f} | '
          + (f'{d.sd:.4f}' if d.n > 1 else '-') + ' | '
          + (f'{control["detectable"]:.4f}'
             if math.isfinite(control['detectable']) else '-')
          + f' | {control["reading"]} |']


def _task_arms(result) -> tuple[dict, str]:
  """({'K=k': {seed: task scores}}, the reference's label): the reference
  as `comparisons` picks it, MHA when it ran."""
  kvs = sorted((v['K'] for v in result['variants']), reverse=True)
  num_heads = (result.get('settings') or {}).get('num_heads')
  arms = {f'K={v["K"]}': {s['seed']: s['tasks'] for s in v['seeds']}
          for v in sorted(result['variants'], key=lambda v: -v['K'])}
  return arms, f'K={reference_K(kvs, num_heads)}'


def _task_lines(result) -> list[str]:
  """The task scores' tables (--tasks), beside held-out loss."""
  if 'tasks' not in result:
    return []
  tasks = result['tasks']
  arms, reference = _task_arms(result)
  return ['', '### Task scores (lm-evaluation-harness)', '',
          f'Each run\'s final checkpoint scored on '
          f'{", ".join(tasks["settings"]["tasks"])} as '
          '`python -m evaluation.evaluate` scores a workdir (lm_eval\'s '
          '`gqa-lab` model; each command in tasks/K*_s*/results.json), '
          'documents a task: ' + ', '.join(
              f'{t} {n}' for t, n in tasks['documents'].items())
          + '. Intervals are over seeds (what training varies), not over '
          'documents (lm_eval\'s stderr, in those results.json).', '',
          *task_scores.lines(arms, reference, tasks['higher_is_better'])]


def _plot_loss(path, result):
  """Training loss (mean over seeds) and held-out loss with its seed band,
  against step; the held-out loss of the last half, zoomed."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (by_step, zoom) = plt.subplots(1, 2, figsize=(11, 4))
  variants = sorted(result['variants'], key=lambda v: -v['K'])
  for i, v in enumerate(variants):
    curves = [s['curve'] for s in v['seeds']]
    steps = [m['step'] for m in curves[0]]
    train = np.mean([[m['loss'] for m in c] for c in curves], 0)
    by_step.plot(steps, train, color=f'C{i}', alpha=0.4)
    evals = [[m for m in c if 'eval_loss' in m] for c in curves]
    at = [m['step'] for m in evals[0]]
    held = np.array([[m['eval_loss'] for m in e] for e in evals])
    for ax in (by_step, zoom):
      ax.plot(at, held.mean(0), 'o-', color=f'C{i}', label=f'K={v["K"]}')
      if len(curves) > 1:  # ± sd over seeds, the report's convention.
        sd = held.std(0, ddof=1)
        ax.fill_between(at, held.mean(0) - sd, held.mean(0) + sd,
                        color=f'C{i}', alpha=0.2)
  last = max(m['step'] for v in variants for s in v['seeds']
             for m in s['curve'])
  zoom.set_xlim(last / 2, last * 1.02)
  zoom.autoscale(axis='y')
  by_step.set(xlabel='step', ylabel='loss (nats/token)',
              title='train (faint) and held-out loss, band: ± sd over seeds')
  zoom.set(xlabel='step', ylabel='held-out loss (nats/token)',
           title='held-out loss, second half')
  by_step.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _plot_throughput(path, rows):
  """Training tokens/s (bars), decode tokens/s and its roofline (points on
  a log axis)."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (train_ax, decode_ax) = plt.subplots(1, 2, figsize=(11, 4))
  names = [f'K={r["K"]}' for r in rows]
  train_ax.bar(names, [r['train'] for r in rows], color='C0')
  train_ax.set(ylabel='tokens/s', title='training throughput')
  decode_ax.plot(names, [r['decode'] for r in rows], 'o', color='C1',
                 markersize=10, label='measured')
  decode_ax.plot(names, [r['roofline'] for r in rows], 'k_', markersize=30,
                 mew=2, label='roofline (bytes or FLOPs, the lower)')
  decode_ax.set(ylabel='tokens/s (log)', yscale='log',
                title=f'decode (batch {DECODE_BATCH}, context '
                      f'{DECODE_CONTEXT})')
  decode_ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)

if __name__ == '__main__':
  exit_on_user_error(main)
