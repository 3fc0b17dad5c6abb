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
holds every per-seed value, the comparisons and the command, commit and
--out. --equal_params widens the MLP of variants with fewer K/V heads to
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
--report_only rebuilds the report from the runs already in --out.
--tasks=T1,T2 [--include_path=DIR] [--task_limit=N] also scores each run's
final checkpoint on lm-evaluation-harness tasks as evaluation.evaluate does
(scripts/task_scores.py, into OUT/tasks/K{k}_s{seed}, reused on rerun) and
reports them by seed and paired against MHA (docs/evaluation.md).
"""

from __future__ import annotations

import math
import pathlib

import numpy as np

from scripts import stats, study, task_scores, timing
import jax
from flax import linen as nn

from train import checkpoint, config_lib, convert, data, flops, loop, progress
from train.cli import check_output_dir, exit_on_user_error
from train.errors import UserError
from train import model as model_lib
from train import provenance as provenance_lib
from train.model import Transformer
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
                        seeds=1, report_only='the runs already in --out',
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
  configs = {(K, seed): variant_config(args.config, K, seed, steps,
                                       args.equal_params)
             for K in args.kv_heads for seed in range(args.seeds)}
  num_heads = config_lib.load(args.config).model.num_heads
  control_K = reference_K(args.kv_heads, num_heads)
  # One seed cannot resolve anything, the control included: not trained.
  controls = {} if args.no_control or args.seeds < 2 else {
      ('control', seed): control_config(args.config, control_K, seed, steps)
      for seed in range(args.seeds)}
  if not args.no_aa and args.seeds >= 2:  # Older --out have none: skipped.
    controls.update({('aa', seed): configs[control_K, seed]
                     for seed in range(args.seeds)
                     if (control_K, seed) in configs and (
                         not args.report_only or
                         (out / f'aa_s{seed}' / 'final.json').exists())})
  everything = {**configs, **controls}
  for (K, seed), config in everything.items():  # Refused before any trains.
    config_lib.validate(config, batch_shards=1)
    study.check_reusable(config, out / f'{_name(K)}_s{seed}')
  tasks = task_scores.spec(args)
  runs, control_runs = [], []
  todo = list(everything.items()) if args.report_only else progress.runs(
      list(everything.items()),
      lambda c: {'control': f'control (K={control_K}, no context)',
                 'aa': f'A/A (K={control_K}, K/V initialisation redrawn)'}.get(
                     c[0][0], f'num_kv_heads={c[0][0]}') + f' seed={c[0][1]}')
  aa_runs = []
  for (K, seed), config in todo:
    workdir = out / f'{_name(K)}_s{seed}'
    if args.report_only and K == 'control' and not (
        workdir / 'final.json').exists():
      raise UserError(f'{workdir / "final.json"} not found: this --out has '
                      'no negative control (trained before it existed, or '
                      'with --no_control); add --no_control, or rerun '
                      'without --report_only to train it')
    if args.report_only:
      record = study.saved(workdir / 'final.json')
    else:
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


def comparisons(runs) -> list[dict]:
  """Each variant's held-out loss against the reference's, paired by seed.

  The reference is MHA (K = num_heads) when it ran, else the variant with
  the most K/V heads (then no paper's claim is tested). One dict per other
  variant: K, the reference's K, both arms' per-seed losses, the paired
  difference K - reference (a `stats.Estimate`), the smallest difference
  its seeds detect (`stats.detectable` of the differences' sd) and the
  verdict on the paper's claim (`verdict`).
  """
  kvs = sorted({r['K'] for r in runs}, reverse=True)
  num_heads = runs[0]['config'].model.num_heads
  reference = reference_K(kvs, num_heads)
  by_seed = lambda K: {r['seed']: r['record']['eval_loss'] for r in runs
                       if r['K'] == K}
  base = by_seed(reference)
  found = []
  for K in kvs:
    if K == reference:
      continue
    mine = by_seed(K)
    seeds = sorted(mine.keys() & base.keys())
    a, b = [mine[s] for s in seeds], [base[s] for s in seeds]
    difference = stats.paired(a, b)
    detectable = stats.detectable(difference.sd, difference.n)
    found.append(dict(
        K=K, reference_K=reference, seeds=seeds, losses=a,
        reference_losses=b, difference=difference, detectable=detectable,
        verdict=verdict(K, reference, num_heads, difference, detectable,
                        unit(runs[0]['config']))))
  return found


def unit(config) -> str:
  """What one held-out loss value is per: 'byte' (no tokenizer), 'token'
  (a tokenizer's), or 'answer token' (the recall probe)."""
  if config.data.task == 'recall':
    return 'answer token'
  return 'token' if config.data.get('tokenizer') else 'byte'


def control_check(control_runs, runs) -> dict | None:
  """The negative control against the reference, paired by seed: K (the
  reference's), seeds, both arms' losses, the difference control -
  reference (a `stats.Estimate`), its detectable effect, whether the setup
  sees it (`seen`: resolved, and worse) and the reading; None without
  control runs."""
  if not control_runs:
    return None
  K = control_runs[0]['K']
  mine = {r['seed']: r['record']['eval_loss'] for r in control_runs}
  base = {r['seed']: r['record']['eval_loss'] for r in runs if r['K'] == K}
  seeds = sorted(mine.keys() & base.keys())
  a, b = [mine[s] for s in seeds], [base[s] for s in seeds]
  d = stats.paired(a, b)
  detectable = stats.detectable(d.sd, d.n)
  seen = d.resolved and d.mean > 0
  if d.n < 2:
    reading = ('one seed: the control cannot be tested, so nothing is '
               'claimed (rerun with --seeds=3 or more)')
  elif d.sd == 0:
    reading = (f'equal on all {d.n} seeds ({d.mean:+.3f} nats): no '
               'interval, so the control is not counted as seen')
  elif seen:
    reading = (f'the setup sees attention: without context the held-out '
               f'loss is {d.mean:+.3f} nats worse, resolved by {d.n} seeds')
  elif d.resolved:
    reading = (f'resolved BETTER without context ({d.mean:+.3f} nats): '
               f'K={K} does not use its context (too few steps, or a bug), '
               'so no difference below can be interpreted')
  else:
    reading = (f'not resolved ({d.n} seeds detect {detectable:.3f} nats): '
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


def verdict(K: int, reference: int, num_heads: int, d: stats.Estimate,
            detectable: float, per: str = 'byte') -> str:
  """What difference d (K - MHA, nats per `per`) lets the report say, by
  `stats.decide`. K = 1: the difference alone; Shazeer's MQA cost is
  log-perplexity per subword token at equal parameters, another unit, so it
  is named and never compared with a loss per byte (nor with another
  tokenizer's tokens). 1 < K < N: against this lab's margin NEAR_MHA, in
  this loss's own unit: agrees when the interval lies within it (both edges
  resolved inside), disagrees when resolved beyond it, otherwise cannot
  resolve it, with the seeds that would."""
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


def aa_check(aa_runs, runs, found) -> dict | None:
  """The A/A control against the reference, paired by seed: the
  difference A/A - reference, its sd beside each variant's paired sd, and
  the reading (`stats.decide`: an A/A difference should not be resolved);
  None without A/A runs."""
  if not aa_runs:
    return None
  K = aa_runs[0]['K']
  mine = {r['seed']: r['record']['eval_loss'] for r in aa_runs}
  base = {r['seed']: r['record']['eval_loss'] for r in runs if r['K'] == K}
  seeds = sorted(mine.keys() & base.keys())
  d = stats.paired([mine[s] for s in seeds], [base[s] for s in seeds])
  decided = stats.decide(d)
  sds = ', '.join(f'K={c["K"]} {c["difference"].sd:.4f}' for c in found
                  if c['difference'].n > 1)
  reading = (
      f'the reference with only its K/V initialisation redrawn differs by '
      f'{d.mean:+.4f} nats ({decided}), sd {d.sd:.4f} over seeds against '
      f'the variants\' paired sd ({sds}): ' + (
          'a redraw alone makes that much of their spread'
          if d.n > 1 and d.sd > 0 else 'no spread to compare')
      + ('; resolved, so the K/V initialisation alone moves the loss beyond '
         'what the seeds detect, and a variant\'s difference of that size '
         'says nothing about K' if decided == 'resolved' else ''))
  return dict(K=K, seeds=seeds, losses=[mine[s] for s in seeds],
              reference_losses=[base[s] for s in seeds], difference=d,
              detectable=stats.detectable(d.sd, d.n), verdict=decided,
              reading=reading)


def results(runs, rows, found, bandwidth, out, argv=None, control=None,
            aa=None) -> dict:
  """OUT/results.json: per variant its per-seed values and speeds, the
  paired comparisons, the command, commit and --out (`study.to_json`
  writes an unbounded interval or a missing value as 'inf' or 'nan')."""
  variants = []
  for r in rows:
    variants.append(dict(
        K=r['K'], params=r['params'], mlp_dim=r['mlp'],
        kv_bytes_per_token=r['kv'], decode_tokens_per_sec=r['decode'],
        decode_roofline_tokens_per_sec=r['roofline'],
        seeds=[dict(seed=run['seed'], **{
            key: float(run['record'].get(key, math.nan))
            for key in ('eval_loss', 'eval_bpb', 'eval_accuracy')},
                    train_tokens_per_sec=float(np.median(
                        [m['tokens_per_sec'] for m in run['metrics']])),
                    **({'tasks': run['record']['tasks']['scores']}
                       if 'tasks' in run['record'] else {}))
               for run in sorted(runs, key=lambda run: run['seed'])
               if run['K'] == r['K']]))
  return dict(
      provenance=provenance_lib.record('scripts.compare', out, argv,
                                     statistics=stats.CONVENTION),
      decode=dict(batch=DECODE_BATCH, context=DECODE_CONTEXT,
                  read_bandwidth=bandwidth),
      variants=variants,
      comparisons=[dict(
          K=c['K'], reference_K=c['reference_K'], seeds=c['seeds'],
          losses=c['losses'], reference_losses=c['reference_losses'],
          difference=c['difference'].as_dict(),
          detectable=c['detectable'], verdict=c['verdict'])
                   for c in found],
      control=control and {**control,
                           'difference': control['difference'].as_dict()},
      aa=aa and {**aa, 'difference': aa['difference'].as_dict()},
      **_task_results(runs))


def write_report(out, runs, decode, bandwidth, args, control_runs=(),
                 aa_runs=(), trained=None):
  """report.md (the command, a reading, the tables), results.json,
  loss.png and throughput.png in OUT. trained: where the runs were trained
  (`study.trained_by`); without it, a rebuild names the command of the
  results.json it replaces (which may itself have reused older runs)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  rows = _rows(runs, decode, bandwidth)
  found = comparisons(runs)
  control = control_check(control_runs, runs)
  aa = aa_check(aa_runs, runs, found)
  result = results(runs, rows, found, bandwidth, out, control=control, aa=aa)
  if trained:
    result['provenance']['trained'] = trained
  elif getattr(args, 'report_only', False):  # Who trained the runs, kept.
    result['provenance']['trained'] = _trained_by(out / 'results.json')
  (out / 'results.json').write_text(study.to_json(result))
  (out / 'report.md').write_text('\n'.join(
      _report_lines(runs, rows, found, bandwidth, args,
                    result['provenance'], control, aa)))
  _plot_loss(out / 'loss.png', runs)
  _plot_throughput(out / 'throughput.png', rows)


def _trained_by(path) -> str | None:
  """The command and commit that trained the runs of the results.json at
  path (its own, or the one it was rebuilt from); None if unknown."""
  if not path.exists():
    return None
  before = study.saved(path).get('provenance', {})
  if before.get('trained') or '--report_only' not in before.get(
      'command', '--report_only'):
    return before.get('trained') or (
        f'`{before["command"]}` at commit {before.get("commit", "?")}')
  return None


def _spread(values):
  values = np.asarray(values, float)
  if np.isnan(values).all():
    return '-'  # Not measured: bits/byte of non-text data, or older runs.
  if len(values) == 1:
    return f'{values[0]:.3f}'
  return f'{values.mean():.3f} ± {values.std(ddof=1):.3f}'


def _rows(runs, decode, bandwidth) -> list[dict]:
  """One row a variant (K): its size, its losses over seeds, its speeds."""
  rows = []
  for K in sorted({r['K'] for r in runs}, reverse=True):
    mine = [r for r in runs if r['K'] == K]
    c = mine[0]['config']
    mc = config_lib.model_config(c)
    record = lambda key, default=np.nan: _spread(
        [r['record'].get(key, default) for r in mine])
    rows.append(dict(
        K=K, params=model_lib.num_params(mc),
        kv=model_lib.kv_bytes_per_token(mc), mlp=c.model.mlp_dim,
        loss=record('eval_loss'), bpb=record('eval_bpb'),
        accuracy=record('eval_accuracy'),
        first=_spread([r['record'].get('accuracy_by_query', [np.nan])[0]
                       for r in mine]),
        mean_loss=np.mean([r['record']['eval_loss'] for r in mine]),
        train=np.mean([np.median([m['tokens_per_sec'] for m in r['metrics']])
                       for r in mine]),
        decode=decode[K],
        roofline=flops.decode_roofline_tokens_per_sec(
            mc, DECODE_BATCH, DECODE_CONTEXT, bandwidth,
            flops.peak_flops()[0])['roofline']))
  return rows


def _reading(rows, found, control=None) -> str:
  """What the negative control shows, what the paired differences
  resolve, then decoding; from the numbers."""
  resolved = [c for c in found if c['difference'].resolved]
  unresolved = [c for c in found if not c['difference'].resolved]
  parts = ['Negative control (a model without context): ' + (
      f'{control["reading"]}.' if control else
      'left out (--no_control, or one seed): nothing shows that these '
      'seeds can '
      'see what attention does.')]
  if resolved:
    parts.append('Resolved against K={}: '.format(found[0]['reference_K'])
                 + '; '.join(f'K={c["K"]} {c["difference"].mean:+.3f} nats'
                             for c in resolved) + '.')
  if unresolved:
    n = unresolved[0]['difference'].n
    parts.append(
        ('Not resolved' if n > 1 else 'Not testable with one seed')
        + ' against K={}: '.format(unresolved[0]['reference_K'])
        + '; '.join(f'K={c["K"]} {c["difference"].mean:+.3f} nats'
                    + (f' (detectable: {c["detectable"]:.3f})' if n > 1
                       else '') for c in unresolved)
        + ('. A difference below the detectable one is not claimed.'
           if n > 1 else '; rerun with --seeds=3 or more.'))
  fastest = max(rows, key=lambda r: r['decode'])
  slowest = min(rows, key=lambda r: r['decode'])
  parts.append(f'Decoding is fastest with K={fastest["K"]}, '
               f'{fastest["decode"] / slowest["decode"]:.1f}x '
               f'K={slowest["K"]}.')
  return ' '.join(parts)


def _report_lines(runs, rows, found, bandwidth, args, provenance,
                  control=None, aa=None) -> list[str]:
  c = runs[0]['config']
  recall = c.data.task == 'recall'
  lines = [
      '# Comparing MHA, GQA and MQA', '',
      (f'Runs trained by {provenance["trained"]}; this report made by '
       if provenance.get('trained') else 'Made by ')
      + f'`{provenance["command"]}` at commit {provenance["commit"]}'
      + (f' on {provenance_lib.describe(provenance["machine"])}'
         if provenance.get('machine') else '') + ': '
      f'{c.model.num_layers} layers, d_model {c.model.d_model}, '
      f'{c.model.num_heads} query heads of {c.model.head_dim}; '
      f'{c.train.steps} steps of {c.train.batch_size} x {c.data.seq_len} '
      f'tokens each, {args.seeds} seed(s) per variant'
      + (', MLP widened to equal parameters' if args.equal_params else '')
      + f'. Compute dtype {c.model.dtype}. Decode: batch {DECODE_BATCH}, '
      f'context {DECODE_CONTEXT}, the cache updated in place as '
      'train.sample runs it (scripts/timing.py); '
      f'read bandwidth {bandwidth / 1e9:.1f} GB/s. Every value by seed, '
      'and the comparisons: results.json.', '',
      _reading(rows, found, control), '',
      (f'Data: the recall probe, {c.data.recall_pairs} key-value pairs per '
       'row; accuracy counts the answers only.' if recall else
       f'Data: {c.data.path or "the embedded stdlib corpus"} '
       f'({unit(c)}s; every loss is nats per {unit(c)}).'), '',
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
  lines += ['', *_paired_lines(runs, found, args), *_control_lines(control),
            *_aa_lines(aa),
            *_task_lines(runs)]
  if recall:  # Later queries can be guessed by crossing out; not the first.
    lines += ['', 'Answer accuracy by query (1st ... last):', '']
    for r in rows:
      by_query = np.mean([run['record']['accuracy_by_query'] for run in runs
                          if run['K'] == r['K']], axis=0)
      lines.append(f'- K={r["K"]}: ' + ' '.join(f'{a:.2f}' for a in by_query))
  return lines + ['', '![loss](loss.png)', '', '![throughput](throughput.png)',
                  '']


def _paired_lines(runs, found, args) -> list[str]:
  """Held-out loss by seed, and each variant minus the reference: the
  paired mean with its interval, the detectable difference, the verdict."""
  if not found:
    return []
  kvs = sorted({r['K'] for r in runs}, reverse=True)
  seeds = sorted({r['seed'] for r in runs})
  loss = {(r['K'], r['seed']): r['record']['eval_loss'] for r in runs}
  reference = found[0]['reference_K']
  lines = ['Held-out loss (nats) by seed:', '',
           '| seed | ' + ' | '.join(f'K={K}' for K in kvs) + ' |',
           '|---' * (len(kvs) + 1) + '|']
  for seed in seeds:
    lines.append(f'| {seed} | ' + ' | '.join(
        f'{loss[K, seed]:.4f}' if (K, seed) in loss else '-' for K in kvs)
                 + ' |')
  lines += ['', f'Paired by seed (a seed fixes the data order), each variant '
            f'minus K={reference} (positive: worse than it); verdicts against the papers only where the '
            'seeds can tell' + ('' if args.equal_params or reference != kvs[0]
                                 else ' (Shazeer compared at equal '
                                 'parameters: --equal_params)') + ':', '',
            '| K | difference (nats) [95% interval] | sd of differences | '
            'detectable | verdict |', '|---|---|---|---|---|']
  for c in found:
    d = c['difference']
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
  d = aa['difference']
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
  d = control['difference']
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


def _task_arms(runs) -> tuple[dict, str]:
  """({'K=k': {seed: task scores}}, the reference's label): the reference
  as `comparisons` picks it, MHA when it ran."""
  kvs = sorted({r['K'] for r in runs}, reverse=True)
  num_heads = runs[0]['config'].model.num_heads
  arms = {f'K={K}': {r['seed']: r['record']['tasks']['scores'] for r in runs
                     if r['K'] == K} for K in kvs}
  return arms, f'K={reference_K(kvs, num_heads)}'


def _task_results(runs) -> dict:
  """results.json's task scores (--tasks): the settings, documents a task,
  each variant minus the reference paired by seed; {} without them."""
  if not any('tasks' in r['record'] for r in runs):
    return {}
  first = runs[0]['record']['tasks']
  arms, reference = _task_arms(runs)
  return {'tasks': dict(settings=first['settings'],
                        documents=first['documents'],
                        comparisons=task_scores.comparisons(arms, reference))}


def _task_lines(runs) -> list[str]:
  """The task scores' tables (--tasks), beside held-out loss."""
  if not any('tasks' in r['record'] for r in runs):
    return []
  first = runs[0]['record']['tasks']
  arms, reference = _task_arms(runs)
  settings = first['settings']
  return ['', '### Task scores (lm-evaluation-harness)', '',
          f'Each run\'s final checkpoint scored on '
          f'{", ".join(settings["tasks"])} as `python -m evaluation.evaluate` '
          'scores a workdir (lm_eval\'s `gqa-lab` model; each command in '
          'tasks/K*_s*/results.json), documents a task: ' + ', '.join(
              f'{t} {n}' for t, n in first['documents'].items())
          + '. Intervals are over seeds (what training varies), not over '
          'documents (lm_eval\'s stderr, in those results.json).', '',
          *task_scores.lines(arms, reference, first['higher_is_better'])]


def _plot_loss(path, runs):
  """Training loss (mean over seeds) and held-out loss with its seed band,
  against step; the held-out loss of the last half, zoomed."""
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (by_step, zoom) = plt.subplots(1, 2, figsize=(11, 4))
  for i, K in enumerate(sorted({r['K'] for r in runs}, reverse=True)):
    mine = [r for r in runs if r['K'] == K]
    steps = [m['step'] for m in mine[0]['metrics']]
    train = np.mean([[m['loss'] for m in r['metrics']] for r in mine], 0)
    by_step.plot(steps, train, color=f'C{i}', alpha=0.4)
    evals = [[m for m in r['metrics'] if 'eval_loss' in m] for r in mine]
    at = [m['step'] for m in evals[0]]
    held = np.array([[m['eval_loss'] for m in e] for e in evals])
    for ax in (by_step, zoom):
      ax.plot(at, held.mean(0), 'o-', color=f'C{i}', label=f'K={K}')
      if len(mine) > 1:  # ± sd over seeds, the report's convention.
        sd = held.std(0, ddof=1)
        ax.fill_between(at, held.mean(0) - sd, held.mean(0) + sd,
                        color=f'C{i}', alpha=0.2)
  last = max(m['step'] for r in runs for m in r['metrics'])
  zoom.set_xlim(last / 2, last * 1.02)
  zoom.autoscale(axis='y')
  by_step.set(xlabel='step', ylabel='loss (nats/token)',
              title='train (faint) and held-out loss, band: ± sd over seeds')
  zoom.set(xlabel='step', ylabel='held-out loss (nats/token)',
           title='held-out loss, second half')
  by_step.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


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

if __name__ == '__main__':
  exit_on_user_error(main)
