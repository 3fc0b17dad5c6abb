"""The uptraining study's runs, in both designs: the MHA source trained, its
conversions (`train.convert`: K/V heads pooled, MLA, GTA, TPA), each
uptrained from its conversion's evaluation at step 0, and K trained from
scratch by the source's recipe. Every run is `train.main`'s loop
(`studies.study.train`): a finished run is reused, an interrupted one
resumed."""

from __future__ import annotations

import contextlib
import json
import pathlib

from infra import workdir as workdir_lib
from lm import evaluator
from studies import study
from studies.uptrain.design import MLA, RECALL_TARGET, Arm, uptrain_config
from train import convert
from train.convert import to_mla
from train.metrics import read_metrics


def _reached(step, params, record) -> bool:
  """The recall arm's runs end once they answer RECALL_TARGET of queries."""
  del step, params
  return record['eval_accuracy'] >= RECALL_TARGET


def _trained(config, workdir: pathlib.Path, stop: bool = False,
             start: pathlib.Path | None = None) -> list[dict]:
  """Trains (or reuses) `config` in WORKDIR, from the conversion START if
  given (`study.train`); its evaluations. stop: end at the recall target
  (`_reached`)."""
  study.train(config, workdir, workdir / 'log.txt',
              on_eval=_reached if stop else None, start=start)
  return [{'step': r['step'], 'loss': r['eval_loss'],
           'accuracy': r['eval_accuracy']}
          for r in read_metrics(workdir) if 'eval_loss' in r]


def steps_to(curve: list[dict], target: float = RECALL_TARGET) -> int | None:
  """The first evaluated step with accuracy >= target (None: never)."""
  return next((p['step'] for p in curve if p['accuracy'] >= target), None)


def train_source(workdir: pathlib.Path, config) -> dict:
  curve = _trained(config, workdir)
  return {'loss': curve[-1]['loss'], 'accuracy': curve[-1]['accuracy'],
          'curve': curve, 'steps': config.train.steps,
          'learning_rate': config.train.learning_rate,
          'tokens': config.train.steps * config.train.batch_size *
                    config.data.seq_len}


def _convert_once(out: pathlib.Path, name: str, source: pathlib.Path,
                  settings: dict, convert_to) -> pathlib.Path:
  """OUT/converted/NAME, SOURCE converted by convert_to(workdir) (its lines
  in OUT/converted/log.txt), made once for these settings and the
  source's parameters (`study.made_once`: reused while they are the same,
  refused when they are not)."""
  workdir = out / 'converted' / name
  def make():
    with (out / 'converted' / 'log.txt').open('a') as f, (
        contextlib.redirect_stdout(f)), contextlib.redirect_stderr(f):
      convert_to(workdir)
  return study.made_once(workdir, {'source': study.fingerprint(source),
                                   **settings}, make)


def convert_one(out: pathlib.Path, source: pathlib.Path, arm: Arm,
                seed: int) -> pathlib.Path:
  """ARM's converted workdir (random's depends on the seed)."""
  seeded = arm.method == 'random'  # The others do not draw.
  key = arm.name + (f'_s{seed}' if seeded else '')
  method = 'mean' if arm.method == 'identity' else arm.method
  return _convert_once(out, key, source, dict(
      conversion='convert_workdir', num_kv_heads=arm.K, method=method,
      seed=seed if seeded else None, optimizer=arm.start),
      lambda workdir: convert.convert_workdir(
          str(source), str(workdir), arm.K, method, seed=seed,
          optimizer=arm.start))


def convert_mla(out: pathlib.Path, source: pathlib.Path, plan: dict
                ) -> tuple[pathlib.Path, dict]:
  """PLAN's MLA conversion of SOURCE (its arguments passed through,
  `to_mla.arguments`; deterministic: one for every seed) and its
  convert.json record (the energy kept per layer); plan['method'] names
  its workdir (default MLA)."""
  arguments = to_mla.arguments(plan)
  workdir = _convert_once(
      out, Arm(plan.get('method', MLA), plan['K']).name, source,
      dict(conversion='convert_to_mla', **arguments),
      lambda workdir: convert.convert_to_mla(str(source), str(workdir),
                                             **arguments))
  return workdir, json.loads((workdir / workdir_lib.CONVERT_INFO).read_text())


def convert_gta(out: pathlib.Path, source: pathlib.Path, plan: dict
                ) -> tuple[pathlib.Path, dict]:
  """PLAN's GTA conversion of SOURCE (`design.gta_plan`: K/V heads
  mean-pooled to its K, then tied; deterministic, one for every seed) and
  its convert.json record."""
  workdir = _convert_once(
      out, Arm(plan['method'], plan['K']).name, source, dict(
          conversion='convert_to_gta', num_kv_heads=plan['K'],
          qk_rope_head_dim=plan['qk_rope_head_dim'],
          pooling=plan['pooling']),
      lambda workdir: convert.convert_to_gta(
          str(source), str(workdir), plan['K'], plan['qk_rope_head_dim'],
          plan['pooling']))
  return workdir, json.loads((workdir / workdir_lib.CONVERT_INFO).read_text())


def convert_tpa(out: pathlib.Path, source: pathlib.Path, plan: dict
                ) -> tuple[pathlib.Path, dict]:
  """PLAN's TPA conversion of SOURCE (`design.tpa_plan`: K/V heads
  mean-pooled to its K, then rank-K factors with one-hot head factors,
  exactly; deterministic, one for every seed) and its convert.json
  record."""
  workdir = _convert_once(
      out, Arm(plan['method'], plan['K']).name, source, dict(
          conversion='convert_to_tpa', num_kv_heads=plan['K'],
          pooling=plan['pooling']),
      lambda workdir: convert.convert_to_tpa(
          str(source), str(workdir), plan['K'], plan['pooling']))
  return workdir, json.loads((workdir / workdir_lib.CONVERT_INFO).read_text())


# What a conversion's record (convert.json) adds to its plan in results.
KEPT = ('energy_kept', 'rope_pairs')


def recorded(plan: dict, info: dict) -> dict:
  """PLAN with its conversion's record INFO beside it: KEPT, and the
  cache bytes the converted model reports."""
  return {**plan, **{k: info[k] for k in KEPT if k in info},
          'converted_kv_bytes_per_token': info['kv_bytes_per_token']}


_AT0: dict = {}


def uptrain(out: pathlib.Path, name: str, converted: pathlib.Path, source,
            steps: int, rate: float, seed: int, eval_every: int,
            stop: bool = False, end_ratio: float = 1.0) -> list[dict]:
  """The conversion's evaluation (step 0) and its uptraining curve
  (end_ratio: `uptrain_config`'s, 1 for a constant rate)."""
  workdir = out / name
  config = uptrain_config(converted, source, steps, rate, seed, eval_every,
                          end_ratio)
  if converted not in _AT0:  # Deterministic: once per conversion.
    _AT0[converted] = evaluator.evaluate_workdir(str(converted))
  at0 = _AT0[converted]
  curve = _trained(config, workdir, stop, start=converted)
  return [{'step': 0, 'loss': at0['eval_loss'],
           'accuracy': at0['eval_accuracy']}, *curve]


def scratch(out: pathlib.Path, source, K: int, seed: int, steps: int,
            stop: bool = False, name: str | None = None,
            eval_every: int | None = None) -> list[dict]:
  """K heads trained from scratch for `steps` by the source's recipe (its
  warmup, then a cosine anneal ending at `steps`), in OUT/scratch/NAME
  (default K{K}_s{seed}), evaluated every `eval_every` (default the
  source's period)."""
  config = source.copy_and_resolve_references()
  config.model.num_kv_heads = K
  config.seed = seed
  config.train.update(steps=steps, checkpoint_every=steps)
  if eval_every:
    config.train.update(eval_every=eval_every, log_every=eval_every)
  return _trained(config, out / 'scratch' / (name or f'K{K}_s{seed}'), stop)
