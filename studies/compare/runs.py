"""Training the comparison's runs (`studies.study.train`: a finished run is
reused only under its settings), timing each variant's decoding, and what
results.json holds of them: the values as the runs gave them, before any
reading (`studies.compare.analysis`)."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from infra import progress, provenance
from lm import checkpoint, config_lib, data, flops
from lm import model as model_lib
from lm.model import Transformer
from studies import stats, study, task_scores, timing
from studies.compare import design, text
from train.metrics import read_metrics

COMMAND = 'scripts.compare'  # The entry point, as provenance names it.


def run(args):
  """Every run the flags ask for (`design.plan`), trained (or reused),
  each variant's decode timed, then OUT/results.json, report.md and the
  plots (`text.write`). Every run's settings are refused, if bad, before
  any trains."""
  out = pathlib.Path(args.out)
  # The commit as the command starts: the code that runs (a commit made
  # while it trains, which its modules were not read from, is not it).
  prov = provenance.record(COMMAND, out, statistics=stats.CONVENTION)
  configs = design.plan(args)
  for (K, seed), config in configs.items():
    config_lib.validate(config, batch_shards=1)
    study.check_reusable(config, out / f'{design.run_name(K)}_s{seed}')
  tasks = task_scores.spec(args)
  control_K = design.reference_K(
      args.kv_heads, config_lib.load(args.config).model.num_heads)
  runs = train(out, configs, control_K, tasks)
  decode = {}
  for K in sorted({r['K'] for r in runs['variants']}):
    mc = config_lib.model_config(next(r['config'] for r in runs['variants']
                                      if r['K'] == K))
    decode[K] = design.DECODE_BATCH / timing.decode_step_seconds(
        mc, design.DECODE_BATCH, design.DECODE_CONTEXT, repeats=5)
    print(f'decode K={K}: {decode[K]:,.0f} tokens/s', flush=True)
  prov = provenance.ended(prov)
  prov['runs'] = study.run_records(
      out / f'{design.run_name(K)}_s{seed}' for K, seed in configs)
  text.write(out, results(
      runs['variants'], decode, timing.read_bandwidth(5), out, args,
      runs['control'], runs['aa'], prov=prov))


def train(out: pathlib.Path, configs: dict, control_K: int, tasks
          ) -> dict[str, list[dict]]:
  """Each (K, seed) of CONFIGS trained in OUT/{run_name(K)}_s{seed}: its
  config, final record (with its task scores and, on the recall probe, its
  accuracy by query) and metrics, grouped as 'variants', 'control' and
  'aa' (the controls' K: control_K, the reference's)."""
  runs = {'variants': [], 'control': [], 'aa': []}
  for (K, seed), config in progress.runs(
      list(configs.items()),
      lambda c: {'control': f'control (K={control_K}, no context)',
                 'aa': f'A/A (K={control_K}, K/V initialisation redrawn)'}.get(
                     c[0][0], f'num_kv_heads={c[0][0]}') + f' seed={c[0][1]}',
      reused=lambda c: study.finished(
          out / f'{design.run_name(c[0][0])}_s{c[0][1]}')):
    workdir = out / f'{design.run_name(K)}_s{seed}'
    if K == 'aa':
      design.aa_start(workdir, config, seed)
    record = study.train(config, workdir, workdir / 'log.txt')
    print(f'{design.run_name(K)} seed={seed}: held-out loss '
          f'{record["eval_loss"]:.4f} (log: {workdir / "log.txt"})',
          flush=True)
    run = dict(K=K, seed=seed, config=config, record=record,
               metrics=read_metrics(workdir))
    if K in ('control', 'aa'):
      runs[K].append(run | {'K': control_K})
      continue
    if tasks:  # Its final checkpoint, as evaluation.evaluate scores it.
      record['tasks'] = task_scores.score(tasks, workdir,
                                          out / 'tasks' / f'K{K}_s{seed}')
    if config.data.task == 'recall':
      record['accuracy_by_query'] = recall_accuracy_by_query(workdir)
    runs['variants'].append(run)
  return runs


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


# --- results.json: what the runs gave -----------------------------------------

def unit(config) -> str:
  """What one held-out loss value is per: 'byte' (no tokenizer), 'token'
  (a tokenizer's), or 'answer token' (the recall probe)."""
  if config.data.task == 'recall':
    return 'answer token'
  return 'token' if config.data.get('tokenizer') else 'byte'


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


def _variant(K: int, runs: list[dict], decode: dict, bandwidth: float
             ) -> dict:
  """Variant K's size, speeds and per-seed values (`runs`: its runs)."""
  mine = sorted((r for r in runs if r['K'] == K), key=lambda r: r['seed'])
  c = mine[0]['config']
  mc = config_lib.model_config(c)
  return dict(
      K=K, params=model_lib.num_params(mc), mlp_dim=c.model.mlp_dim,
      kv_bytes_per_token=float(model_lib.kv_bytes_per_token(mc)),
      decode_tokens_per_sec=float(decode[K]),
      decode_roofline_tokens_per_sec=float(
          flops.decode_roofline_tokens_per_sec(
              mc, design.DECODE_BATCH, design.DECODE_CONTEXT, bandwidth,
              flops.peak_flops()[0])['roofline']),
      seeds=[_seed_values(run) for run in mine])


def results(runs, decode, bandwidth, out, args, control_runs=(), aa_runs=(),
            prov: dict | None = None) -> dict:
  """OUT/results.json's values, as the runs gave them (`analysis.analyse`
  adds what is read from them): the provenance (PROV, the command's
  `provenance.record` as it started, with `runs`: where each run was
  trained, `study.run_records`; recorded now when not given), the
  settings, the decode timings, per variant its size, speeds and per-seed
  values (each run's curve too), the controls' per-seed losses, and the
  task scores' settings (--tasks)."""
  variants = [_variant(K, runs, decode, bandwidth)
              for K in sorted({r['K'] for r in runs}, reverse=True)]
  prov = prov or provenance.record(COMMAND, out, statistics=stats.CONVENTION)
  reference = next(r for r in runs if r['K'] == variants[0]['K'])
  result = dict(
      provenance=prov,
      settings=settings(reference['config'], args),
      decode=dict(batch=design.DECODE_BATCH, context=design.DECODE_CONTEXT,
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
