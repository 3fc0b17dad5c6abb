"""Training the frontier's runs and reading every trained model through its
decode cache: per seed the NLL and accuracy of the scored targets (and, on
the recall probe, the first query's), through a float and an int8 cache,
the KL between their predictions, and the cache's bytes per token."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from infra import provenance, storage
from lm import checkpoint, config_lib, evaluator
from lm import data as data_lib
from lm import model as model_lib
from studies import stats, study
from studies.kv_frontier import tables
from studies.kv_frontier.design import CACHES, Panel, Plan, Variant
from studies.kv_frontier.design import variant_config
from train import convert

COMMAND = 'scripts.kv_frontier'  # The entry point, as provenance names it.


def run(plans: dict[str, Plan], out: pathlib.Path) -> dict:
  """Each panel of PLANS trained (or reused) in OUT/<panel>/runs and
  measured, its conversions too; then OUT/frontier.json, report.md and
  frontier.png (`tables.write`). Returns the result."""
  start, cpu = time.perf_counter(), time.process_time()
  result = {'provenance': provenance.record(COMMAND, out,
                                            statistics=stats.CONVENTION),
            'panels': {}}
  trained = []  # Every run trained (or reused), for its record.
  for name, (panel, variants, steps, seeds, conversions) in plans.items():
    base = variant_config(panel.config, variants[0], 1, steps, panel.window)
    models = [measure(out / name, panel, v, seeds, steps, trained)
              for v in variants]
    for source, target, uptrain_steps in conversions:
      models += measure_conversion(out / name, source, target, seeds,
                                   uptrain_steps, trained)
    result['panels'][name] = {
        'config': panel.config, 'window': panel.window,
        'steps': base.train.steps, 'seeds': seeds,
        'task': (f'the recall probe, {base.data.recall_pairs} key-value '
                 f'pairs, {base.data.recall_gap} filler tokens, then the '
                 'queries' if base.data.task == 'recall' else
                 'held-out text'),
        'layers': base.model.num_layers, 'models': models,
        'families': [f for f in (family.record(variants)
                                 for family in panel.families) if f]}
  provenance.ended(result['provenance'])
  result['provenance']['runs'] = study.run_records(trained)
  result['minutes'] = (time.perf_counter() - start) / 60
  # All threads' CPU time: on an idle machine the wall time is about this
  # or less (less where XLA runs operations on both cores at once).
  result['cpu_minutes'] = (time.process_time() - cpu) / 60
  tables.write(out, result)
  return result


def measure(out: pathlib.Path, panel: Panel, v: Variant, seeds, steps: int,
            trained: list) -> dict:
  """One model's per-seed values through each cache, and its bytes; its
  runs' folders appended to TRAINED."""
  workdirs = []
  for seed in seeds:
    config = variant_config(panel.config, v, seed, steps, panel.window)
    workdir = out / 'runs' / f'{v.name}_s{seed}'
    print(f'=== {v.name}, seed {seed}{_reused(workdir)}', flush=True)
    study.train(config, workdir, workdir / 'log.txt')
    workdirs.append(workdir)
  trained.extend(workdirs)
  return _record(v.name, v, workdirs)


def _reused(workdir: pathlib.Path) -> str:
  """What a run's announcement adds when a rerun reuses it."""
  return ': reused (finished before)' if study.finished(workdir) else ''


def _record(name: str, v: Variant, workdirs, **fields) -> dict:
  """The models in WORKDIRS (one per seed) read through each cache: the
  per-seed values, and the cache's bytes per token; the layout named as
  the config names it (`Variant.layout`), its query heads and its
  parameters (`model.num_params`)."""
  per_seed = {cache: {} for cache in CACHES}
  kl = []
  for workdir in workdirs:
    readout = read_through_caches(workdir)
    for cache in CACHES:
      for metric, value in readout[cache].items():
        per_seed[cache].setdefault(metric, []).append(value)
    kl.append(readout['kl'])
  mc = checkpoint.load_workdir(str(workdirs[-1]))[0]
  nbytes = {cache: model_lib.kv_bytes_per_token(dataclasses.replace(
      mc, kv_cache_dtype=None if cache == 'float' else cache))
            for cache in CACHES}
  print(f'{name}: {nbytes["float"]:,.0f} B/token, NLL float '
        f'{np.mean(per_seed["float"]["nll"]):.4f}, int8 '
        f'{np.mean(per_seed["int8"]["nll"]):.4f}', flush=True)
  return dict(variant=name, num_kv_heads=mc.num_kv_heads,
              attention_pattern=v.pattern, kv_share=v.share, **v.layout(),
              num_heads=mc.num_heads, params=model_lib.num_params(mc),
              kv_bytes_per_token=nbytes, seeds=per_seed, kl=kl, **fields)


def measure_conversion(out: pathlib.Path, source: Variant, target: Variant,
                       seeds, uptrain_steps: int, trained: list
                       ) -> list[dict]:
  """SOURCE's trained runs converted into MLA (`train.convert`'s
  --to_mla with TARGET's MLA settings), read through each cache as
  converted (no training) and after UPTRAIN_STEPS steps of the
  conversion's uptraining recipe: two records, each naming its source;
  the uptrained runs' folders appended to TRAINED."""
  converted, uptrained = [], []
  name = f'{target.name}_from_{source.name}'
  for seed in seeds:
    workdir = out / 'runs' / f'{name}_s{seed}'
    source_dir = out / 'runs' / f'{source.name}_s{seed}'
    def make(workdir=workdir, source_dir=source_dir):
      with (out / 'runs' / 'convert_log.txt').open('a') as f, (
          contextlib.redirect_stdout(f)), contextlib.redirect_stderr(f):
        convert.convert_to_mla(str(source_dir), str(workdir),
                               **target.layout()['mla'])
    study.made_once(workdir, {'source': study.fingerprint(source_dir),
                              'conversion': 'convert_to_mla',
                              'kv_lora_rank': target.latent,
                              'qk_rope_head_dim': target.rope}, make)
    converted.append(workdir)
    up = out / 'runs' / f'{name}_up{uptrain_steps}_s{seed}'
    config = config_lib.load(str(workdir))
    config.seed = seed
    config.train.update(steps=uptrain_steps, eval_every=uptrain_steps,
                        checkpoint_every=uptrain_steps,
                        log_every=max(1, uptrain_steps // 10),
                        warmup_steps=min(config.train.warmup_steps,
                                         uptrain_steps // 4))
    print(f'=== {name}, uptraining {uptrain_steps} steps, seed {seed}'
          f'{_reused(up)}', flush=True)
    study.train(config, up, up / 'log.txt', start=workdir)
    uptrained.append(up)
  trained.extend(uptrained)
  return [_record(f'{name} converted', target, converted,
                  source=source.name, uptrain_steps=0),
          _record(f'{name} +{uptrain_steps}', target, uptrained,
                  source=source.name, uptrain_steps=uptrain_steps)]


_READOUTS: dict = {}


def read_through_caches(workdir: pathlib.Path) -> dict:
  """WORKDIR's model on the held-out batches of the loop's evaluator, read
  through a float and an int8 decode cache: per cache the mean NLL and
  accuracy of the scored targets (`evaluator.eval_step`) and, for the recall
  task, the first query's accuracy; 'kl': the mean KL(float || int8) of
  the next-token distributions at the scored targets, nats."""
  mc, params, config = checkpoint.load_workdir(str(workdir))
  # The dataset as the loop reads it (and evaluate_workdir does).
  dataset = data_lib.for_model(config.data, mc, storage.path(str(workdir)),
                               is_chief=False)
  weights_T = dataset.loss_weights
  if weights_T is None:
    weights_T = np.ones(config.data.seq_len, np.float32)
  key = repr(mc)
  if key not in _READOUTS:
    _READOUTS[key] = jax.jit(lambda p, b, w: _readout(mc, p, b, w))
  sums = None
  for i in range(config.train.eval_batches):
    batch = dataset.batch('val', seed=0, step=i,
                          batch_size=config.train.batch_size,
                          seq_len=config.data.seq_len, stream=1)
    values = jax.device_get(_READOUTS[key](params, batch, weights_T))
    sums = values if sums is None else jax.tree.map(np.add, sums, values)
  mean = jax.tree.map(lambda x: float(x) / config.train.eval_batches, sums)
  if config.data.task != 'recall':
    for cache in CACHES:
      del mean[cache]['first']
  return mean


def _readout(mc, params, tokens_BT1, weights_T) -> dict:
  """One held-out batch through both caches (see read_through_caches)."""
  out, log_p = {}, {}
  first = jnp.argmax(weights_T)  # The first scored target (recall: answer 1).
  for cache in CACHES:
    model = model_lib.ThroughCache(dataclasses.replace(
        mc, kv_cache_dtype=None if cache == 'float' else cache))
    nll, accuracy = evaluator.eval_step(params, tokens_BT1, model=model,
                                        weights_T=weights_T)
    logits_BTV = model.apply({'params': params}, tokens_BT1[:, :-1])
    log_p[cache] = jax.nn.log_softmax(logits_BTV.astype(jnp.float32))
    hits_B = logits_BTV[:, first].argmax(-1) == tokens_BT1[:, first + 1]
    out[cache] = {'nll': nll, 'accuracy': accuracy, 'first': hits_B.mean()}
  kl_BT = (jnp.exp(log_p['float'])
           * (log_p['float'] - log_p['int8'])).sum(-1)
  out['kl'] = (kl_BT * weights_T).sum() / (weights_T.sum() * kl_BT.shape[0])
  return out
