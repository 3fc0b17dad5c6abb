"""The KV-memory frontier on a task where the cache matters: GQA beside local
layers, cross-layer sharing and int8 caches, compared at equal bytes.

  python -m scripts.kv_frontier --out=DIR [--quick] [--seeds=N]
      [--panels=recall,lm] [--steps=N] [--lm_steps=N] [--variants=A,B,..]
      [--report_only]

Two panels, each a grid of layouts (Variant: K/V heads K, layer pattern,
kv_share, and MLA's latent width) trained with train.main's loop
(`scripts.study.train`), one run per seed, into DIR/<panel>/runs/:

- recall (configs/kv_recall.py): the recall probe with a gap of filler
  tokens between the pairs and the queries, wider than a stack of local
  layers reaches (4 layers of the panel's window of 2 keys each: 4
  (window - 1) positions). Layouts: all-global 'G', 'LLGG', and all-local
  'L', the negative control: no pair is within its reach, so it must fail
  where the global layouts succeed, or the setup cannot see attention at
  all. MQA, GQA-2 with CLA2 and MLA with a latent of MQA's width hold the
  same bytes per token. MQA's runs are also converted into MLA at half its
  bytes (`train.convert --to_mla`), read as converted and after 100 steps
  of the conversion's uptraining recipe.
- lm (configs/gqa_small.py): held-out loss on text: MQA, GQA-2 with CLA2
  and MLA (a latent of 48 and a RoPE key of 16), all at MQA's bytes.

Every trained model is then read through its decode cache twice, float and
int8 (`model.ThroughCache`: the logits decoding gives, each held-out row of
the loop's evaluator prefilled into an empty cache): the NLL of the scored
targets, their accuracy (recall: the answers, and the first query's alone,
which crossing out cannot help) and the KL from the float cache's
predictions to the int8 cache's. Its cost: the cache's bytes per token of
context at max_len (`model.kv_bytes_per_token`).

Comparisons are paired by seed (scripts/stats.py): the negative control
against all-global; the equal-bytes pairs (GQA-2 with CLA2 against MQA, in
each pattern, and MLA against both); the main effects of the pattern, of
kv_share and of K over the GQA grid, Holm-corrected as one family; each
conversion against its source; int8 against float for every model. A point
is on the frontier when its NLL is resolved lower (paired interval) than
that of every point with fewer bytes: no point is there by noise. The
negative control is a control, not a design: it is left out of the frontier.

Writes DIR/frontier.json (per-seed values, the comparisons, provenance),
DIR/report.md and DIR/frontier.png. A rerun reuses finished runs;
--report_only rebuilds the report from DIR/frontier.json alone (report.md is
a function of it: the reading included, every verdict `stats.decide`'s; the
provenance's `note`, where a run's history is recorded, rendered as saved),
recording the rebuild beside the command that measured. The default: the
recall panel's 9 layouts at 1,000 steps and the conversion; the LM panel's
5 at 40 steps of gqa_small; 3 seeds each (about 70 CPU-minutes here by the
per-run costs of docs/results/kv_frontier/report.md, a run that predates
the 3 recall and 2 LM layouts of GTA and GLA, published apart in
docs/results/kv_frontier/zadouri/). --variants=NAME,... trains a subset.
--quick: the recall
panel only, its 6 layouts at 100 steps, 3 seeds, no conversion (6.7
CPU-minutes here, docs/results/kv_frontier/quick/): a check that everything runs and reports, too short for
retrieval to be learnt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from studies import report as report_lib
from studies import stats, study
from infra import provenance, storage
from lm import checkpoint, config_lib, evaluator
from lm import data as data_lib
from train import convert
from lm import model as model_lib
from infra.cli import check_output_dir, exit_on_user_error, positive_int
from infra.errors import UserError

CACHES = ('float', 'int8')
RETRIEVES = 0.95  # First-query accuracy read as retrieval by content.


@dataclasses.dataclass(frozen=True)
class Variant:
  K: int  # K/V heads (MLA: 0, as many as the query heads, as MLA needs).
  pattern: str  # model.attention_pattern.
  share: int  # model.kv_share.
  latent: int = 0  # model.kv_lora_rank (0: not MLA).
  # model.qk_rope_head_dim of MLA/GLA or GTA (0: a model without RoPE).
  rope: int = 0
  tie: bool = False  # model.tie_kv: grouped-tied attention (GTA).
  groups: int = 1  # model.latent_groups: grouped latent attention (GLA).

  @property
  def name(self) -> str:
    rope = f'r{self.rope}' if self.rope else ''
    if self.latent:
      kv = (f'GLA{self.latent}g{self.groups}' if self.groups > 1
            else f'MLA{self.latent}') + rope
    else:
      kv = f'GTA{self.K}{rope}' if self.tie else f'K{self.K}'
    return f'{kv}_{self.pattern}_share{self.share}'


def _key(m: dict) -> tuple:
  """A model record's Variant fields (as `measure` writes it; a record
  from before GTA and GLA: neither)."""
  latent = m.get('kv_lora_rank') or 0
  return (0 if latent else m['num_kv_heads'], m['attention_pattern'],
          m['kv_share'], latent, m.get('qk_rope_head_dim') or 0,
          bool(m.get('tie_kv')), m.get('latent_groups') or 1)


def _grouped_query(key: tuple) -> bool:
  """Whether a _key is a point of the GQA grid (not MLA, GLA or GTA)."""
  return not key[3] and not key[5]


def _grid(kv_heads, patterns, shares) -> tuple[Variant, ...]:
  return tuple(Variant(K, p, s) for K in kv_heads for p in patterns
               for s in shares)


@dataclasses.dataclass(frozen=True)
class Panel:
  """One task's grid: its config, local window, layouts and budget."""
  config: str
  window: int
  variants: tuple[Variant, ...]
  quick_variants: tuple[Variant, ...]
  steps: int
  quick_steps: int
  seeds: int
  quick_seeds: int
  # (source, MLA target, uptraining steps): the source's runs converted
  # into MLA (`train.convert --to_mla`), not in --quick.
  conversions: tuple = ()


# The negative control and what it must fail against: all-local and
# all-global at the same K and sharing (MQA, in both grids).
CONTROL, REFERENCE = Variant(1, 'L', 1), Variant(1, 'G', 1)
# Brandon et al.'s comparison at equal bytes: GQA-2 with CLA2 against MQA
# (in each pattern). An MLA layout (kv_share 1) whose latent costs what
# MQA's K and V cost is compared with both.
EQUAL_BYTES = (Variant(2, 'G', 2), Variant(1, 'G', 1))

# The control, its reference and the two equal-bytes pairs.
_QUICK = (REFERENCE, Variant(2, 'G', 2), Variant(1, 'LLGG', 1),
          Variant(2, 'LLGG', 2), CONTROL)
# MLA with a latent as wide as MQA's K and V (configs/kv_recall.py: 2 x 16
# numbers, no RoPE; gqa_small: 2 x 32, 16 of them the shared RoPE key).
_MLA_RECALL, _MLA_LM = Variant(0, 'G', 1, latent=32), Variant(
    0, 'G', 1, latent=48, rope=16)
# Zadouri, Strauss and Dao 2025's two layouts (issue #51). GTA with K heads
# caches K·H + Y numbers: without RoPE (recall) GTA-2 holds MQA's bytes and
# GTA-1 half of them; with the LM panel's RoPE key of 16, GTA-1 holds 48 of
# MQA's 64. GLA splits MLA's latent in two: MLA's bytes. Each is paired by
# seed with GQA of the same K (GTA: the paper's "GQA's quality at about half
# its cache") and with the layouts of equal bytes (GLA: MLA's).
_ZADOURI_RECALL = (Variant(2, 'G', 1, tie=True), Variant(1, 'G', 1, tie=True),
                   Variant(0, 'G', 1, latent=32, groups=2))
_ZADOURI_LM = (Variant(1, 'G', 1, rope=16, tie=True),
               Variant(0, 'G', 1, latent=48, rope=16, groups=2))
PANELS = {
    # Local layers of 2 keys (themselves and the one before): enough for a
    # previous-token head, and four of them reach 4 positions back, short of
    # configs/kv_recall.py's gap (test_scripts checks the geometry).
    'recall': Panel(
        'kv_recall', window=2,
        variants=_QUICK + (_MLA_RECALL,) + _ZADOURI_RECALL,
        quick_variants=_QUICK + (_MLA_RECALL,), steps=0,  # 0: the config's.
        quick_steps=100, seeds=3, quick_seeds=3,
        # MQA converted into MLA at half its bytes (a latent of 16), then
        # the conversion's uptraining recipe.
        conversions=((REFERENCE, Variant(0, 'G', 1, latent=16), 100),)),
    'lm': Panel(
        'gqa_small', window=64,
        variants=(REFERENCE, Variant(2, 'G', 2), _MLA_LM) + _ZADOURI_LM,
        quick_variants=(), steps=40, quick_steps=0, seeds=3, quick_seeds=0),
}


def variant_config(base: str, v: Variant, seed: int, steps: int,
                   window: int):
  """BASE with v's layout; `steps` > 0 replaces its steps (0 keeps them)."""
  config = config_lib.load(base)
  # MLA: each query head's K/V from the latent (num_kv_heads = num_heads).
  config.model.update(num_kv_heads=v.K or config.model.num_heads,
                      attention_pattern=v.pattern,
                      local_window=window if 'L' in v.pattern else None,
                      kv_share=v.share)
  if v.latent:
    config.model.update(attention='mla', mla=dict(
        kv_lora_rank=v.latent, qk_rope_head_dim=v.rope,
        latent_groups=v.groups))
  elif v.tie:
    config.model.update(attention='gta', gta=dict(qk_rope_head_dim=v.rope))
  config.seed = seed
  steps = steps or config.train.steps
  config.train.update(steps=steps, eval_every=steps, checkpoint_every=steps,
                      log_every=max(1, steps // 10),
                      warmup_steps=min(config.train.warmup_steps, steps // 4))
  return config


def main():
  parser = study.parser(
      __doc__, config='kv_recall', report_only='frontier.json in --out',
      helps=dict(config="the recall panel's config",
                 kv_heads='train only the variants with these K (MLA: '
                 'num_heads)',
                 steps="the recall panel's steps (default: the config's)"))
  parser.add_argument('--panels', default=None,
                      help="comma-separated of 'recall', 'lm' (default both; "
                      '--quick: recall)')
  parser.add_argument('--lm_steps', type=positive_int, default=None)
  parser.add_argument('--variants', default=None,
                      help='comma-separated variant names (e.g. '
                      'K1_G_share1,GTA2_G_share1): train only these of the '
                      "panels' grids (default all)")
  args = parser.parse_args()
  check_output_dir(args.out)
  out = pathlib.Path(args.out)
  if args.report_only:
    # The per-seed values as measured; the statistics and the reading as
    # this commit makes them (the provenance says which did which).
    result = study.saved(out / 'frontier.json')
    report_lib.record_rebuild(result['provenance'], 'scripts.kv_frontier', out)
    write(out, result)
    print(f'wrote {out}/report.md and frontier.png (from frontier.json)')
    return
  names = (args.panels.split(',') if args.panels else
           ['recall'] if args.quick else list(PANELS))
  if set(names) - set(PANELS):
    raise UserError(f'--panels={args.panels}; use a comma-separated list of '
                    f'{", ".join(PANELS)}')
  plans = {}
  wanted = set(args.variants.split(',')) if args.variants else None
  if wanted:
    known = {v.name for name in names for v in (
        PANELS[name].quick_variants if args.quick else PANELS[name].variants)}
    if wanted - known:
      raise UserError(f'--variants: {", ".join(sorted(wanted - known))} not '
                      f'in the panels\' grids; pick from {", ".join(sorted(known))}')
  for name in names:
    panel = PANELS[name]
    variants = panel.quick_variants if args.quick else panel.variants
    if wanted:
      variants = tuple(v for v in variants if v.name in wanted)
    if name == 'recall':
      panel = dataclasses.replace(panel, config=args.config)
    if args.kv_heads:  # MLA's K: as many as the query heads.
      heads = config_lib.load(panel.config).model.num_heads
      variants = tuple(v for v in variants if (v.K or heads) in args.kv_heads)
    steps = ((args.steps if name == 'recall' else args.lm_steps)
             or (panel.quick_steps if args.quick else panel.steps))
    seeds = args.seeds or (panel.quick_seeds if args.quick else panel.seeds)
    if not variants or not seeds:
      raise UserError(f'the {name} panel has no variant to train (its '
                      '--quick grid is empty, or --kv_heads or --variants '
                      'left none); run without --quick, with other '
                      '--kv_heads or --variants, or name --panels')
    conversions = () if args.quick else tuple(
        c for c in panel.conversions if c[0] in variants)
    plans[name] = (panel, variants, steps, list(range(1, 1 + seeds)),
                   conversions)
    for v in variants:  # Every bad setting refused before any training.
      config_lib.validate(variant_config(panel.config, v, 1, steps,
                                         panel.window), batch_shards=1)
  start, cpu = time.perf_counter(), time.process_time()
  result = {'provenance': provenance.record('scripts.kv_frontier', out,
                                           statistics=stats.CONVENTION),
            'panels': {}}
  for name, (panel, variants, steps, seeds, conversions) in plans.items():
    base = variant_config(panel.config, variants[0], 1, steps, panel.window)
    models = [measure(out / name, panel, v, seeds, steps) for v in variants]
    for source, target, uptrain_steps in conversions:
      models += measure_conversion(out / name, source, target, seeds,
                                   uptrain_steps)
    result['panels'][name] = {
        'config': panel.config, 'window': panel.window,
        'steps': base.train.steps, 'seeds': seeds,
        'task': (f'the recall probe, {base.data.recall_pairs} key-value '
                 f'pairs, {base.data.recall_gap} filler tokens, then the '
                 'queries' if base.data.task == 'recall' else
                 'held-out text'),
        'layers': base.model.num_layers, 'models': models}
  result['minutes'] = (time.perf_counter() - start) / 60
  # All threads' CPU time: on an idle machine the wall time is about this
  # or less (less where XLA runs operations on both cores at once).
  result['cpu_minutes'] = (time.process_time() - cpu) / 60
  write(out, result)
  print(f'wrote {out}/report.md, frontier.json and frontier.png '
        f'({result["minutes"]:.1f} min)')


def write(out: pathlib.Path, result: dict):
  """DIR/frontier.json (each panel analysed again from its per-seed
  values), DIR/report.md (`report`: a function of frontier.json alone, so
  --report_only rebuilds it identically) and DIR/frontier.png."""
  for panel in result['panels'].values():
    panel['analysis'] = analyse(panel['models'])
  (out / 'frontier.json').write_text(study.to_json(result))
  (out / 'report.md').write_text(report(result))
  plot(result, out / 'frontier.png')


def measure(out: pathlib.Path, panel: Panel, v: Variant, seeds, steps: int
            ) -> dict:
  """One model's per-seed values through each cache, and its bytes."""
  workdirs = []
  for seed in seeds:
    config = variant_config(panel.config, v, seed, steps, panel.window)
    workdir = out / 'runs' / f'{v.name}_s{seed}'
    print(f'=== {v.name}, seed {seed}', flush=True)
    study.train(config, workdir, workdir / 'log.txt')
    workdirs.append(workdir)
  return _record(v.name, v, workdirs)


def _record(name: str, v: Variant, workdirs, **fields) -> dict:
  """The models in WORKDIRS (one per seed) read through each cache: the
  per-seed values, and the cache's bytes per token."""
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
              attention_pattern=v.pattern, kv_share=v.share,
              kv_lora_rank=v.latent, qk_rope_head_dim=v.rope,
              tie_kv=v.tie, latent_groups=v.groups,
              kv_bytes_per_token=nbytes, seeds=per_seed, kl=kl, **fields)


def measure_conversion(out: pathlib.Path, source: Variant, target: Variant,
                       seeds, uptrain_steps: int) -> list[dict]:
  """SOURCE's trained runs converted into MLA (`train.convert`'s
  --to_mla: TARGET's kv_lora_rank and qk_rope_head_dim), read through each
  cache as converted (no training) and after UPTRAIN_STEPS steps of the
  conversion's uptraining recipe: two records, each naming its source."""
  converted, uptrained = [], []
  name = f'{target.name}_from_{source.name}'
  for seed in seeds:
    workdir = out / 'runs' / f'{name}_s{seed}'
    if not (workdir / 'convert.json').exists():
      shutil.rmtree(workdir, ignore_errors=True)  # An interrupted one.
      with (out / 'runs' / 'convert_log.txt').open('a') as f, (
          contextlib.redirect_stdout(f)), contextlib.redirect_stderr(f):
        convert.convert_to_mla(str(out / 'runs' / f'{source.name}_s{seed}'),
                               str(workdir), target.latent, target.rope)
    converted.append(workdir)
    up = out / 'runs' / f'{name}_up{uptrain_steps}_s{seed}'
    config = config_lib.load(str(workdir))
    config.seed = seed
    config.train.update(steps=uptrain_steps, eval_every=uptrain_steps,
                        checkpoint_every=uptrain_steps,
                        log_every=max(1, uptrain_steps // 10),
                        warmup_steps=min(config.train.warmup_steps,
                                         uptrain_steps // 4))
    if not up.exists():
      shutil.copytree(workdir, up)
    print(f'=== {name}, uptraining {uptrain_steps} steps, seed {seed}',
          flush=True)
    study.train(config, up, up / 'log.txt')
    uptrained.append(up)
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


# The analysis: pure functions of the per-seed values, so a test can feed it
# made-up results.


def points(models: list[dict]) -> list[dict]:
  """Every model through each cache: a point of (bytes, per-seed NLL)."""
  return [dict(name=f'{m["variant"]} {cache}', variant=m['variant'],
               cache=cache, kv_bytes_per_token=m['kv_bytes_per_token'][cache],
               **m['seeds'][cache]) for m in models for cache in CACHES]


def _compare(a: dict, b: dict, cache: str = 'float') -> dict:
  """a - b, paired by seed, for each metric both have; with the smallest
  difference the seeds could detect."""
  out = {}
  for metric in a['seeds'][cache]:
    d = stats.paired(a['seeds'][cache][metric], b['seeds'][cache][metric])
    out[metric] = {**d.as_dict(), 'resolved': stats.decide(d) == 'resolved',
                   'detectable': stats.detectable(d.sd, d.n)}
  return out


def analyse(models: list[dict]) -> dict:
  """The negative control, the equal-bytes pairs, the main effects (Holm),
  int8 against float per model, and the frontier."""
  # Conversions are points of the frontier, compared with their source;
  # not layouts of the grid.
  designs = [m for m in models if 'source' not in m]
  by = {_key(m): m for m in designs}
  # The negative control is not a design anyone would choose: it is left
  # out of the frontier (neither on it nor a point the others must beat).
  out = {'control': None, 'equal_bytes': [], 'main_effects': [], 'int8': [],
         'frontier': frontier(points([m for m in models
                                      if m['variant'] != CONTROL.name])),
         'frontier_excludes': CONTROL.name}
  control, reference = (by.get(dataclasses.astuple(v))
                        for v in (CONTROL, REFERENCE))
  if control and reference:
    diff = _compare(control, reference)
    out['control'] = dict(control=control['variant'],
                          reference=reference['variant'], diff=diff,
                          sees_attention=bool(
                              diff['nll']['resolved']
                              and diff['nll']['mean'] > 0))
  for pattern in sorted({m['attention_pattern'] for m in models} - {'L'}):
    gqa, mqa = (by.get(dataclasses.astuple(dataclasses.replace(v, pattern=
                                                                pattern)))
                for v in EQUAL_BYTES)
    pairs = [(gqa, mqa)] + [
        (m, other) for m in designs
        if not _grouped_query(_key(m)) and m['attention_pattern'] == pattern
        and m['kv_share'] == 1 and mqa
        and m['kv_bytes_per_token']['float']
        == mqa['kv_bytes_per_token']['float'] for other in (mqa, gqa)]
    for a, b in pairs:
      if not (a and b):
        continue
      # Equal float caches (int8's scales differ: one per token and K/V
      # head, MLA's one per token, GLA's one per group, GTA's one per tied
      # head and one for the RoPE key).
      if a['kv_bytes_per_token']['float'] != b['kv_bytes_per_token'][
          'float']:
        raise ValueError(f'{a["variant"]} and {b["variant"]} differ in bytes:'
                         f' {a["kv_bytes_per_token"]}, '
                         f'{b["kv_bytes_per_token"]}')
      out['equal_bytes'].append(dict(a=a['variant'], b=b['variant'],
                                     kv_bytes_per_token=a[
                                         'kv_bytes_per_token'],
                                     diff=_compare(a, b)))
  names = {m['variant']: m for m in models}
  out['conversions'] = [
      dict(model=m['variant'], source=m['source'],
           uptrain_steps=m['uptrain_steps'],
           diff=_compare(m, names[m['source']]))
      for m in models if m.get('source') in names]
  out['same_heads'] = same_heads(designs, by)
  # The factors of the GQA grid; MLA, GLA and GTA layouts are not levels of
  # them.
  out['main_effects'] = main_effects({k: m for k, m in by.items()
                                      if _grouped_query(k)})
  for m in models:
    per_cache = m['seeds']
    delta = {metric: stats.paired(per_cache['int8'][metric],
                                  per_cache['float'][metric]).as_dict()
             for metric in per_cache['float']}
    out['int8'].append(dict(variant=m['variant'], delta=delta,
                            kl=stats.mean(m['kl']).as_dict()))
  return out


def same_heads(designs: list[dict], by: dict) -> list[dict]:
  """Zadouri et al.'s pairs, paired by seed: GTA with K heads minus GQA
  with the same K, pattern and sharing (their claim: GQA's quality at about
  half its cache), and GLA minus MLA of the same latent and RoPE key (their
  claim: MLA's quality, the same bytes), where both were trained."""
  out = []
  for m in designs:
    key = _key(m)
    if key[5]:
      other = by.get(key[:4] + (0, False, 1))
    elif key[3] and key[6] > 1:
      other = by.get(key[:6] + (1,))
    else:
      continue
    if other:
      out.append(dict(a=m['variant'], b=other['variant'],
                      bytes_ratio=m['kv_bytes_per_token']['float']
                      / other['kv_bytes_per_token']['float'],
                      diff=_compare(m, other)))
  return out


def main_effects(by: dict) -> list[dict]:
  """Each factor's effect on the float NLL and accuracy: per seed, the mean
  of the differences over every pair of models that differ in that factor
  alone; Holm's correction over the family (all factors' NLL effects)."""
  factors = []
  for name, axis, levels in (('LLGG vs G', 1, ('LLGG', 'G')),
                             ('kv_share 2 vs 1', 2, (2, 1))):
    factors.append((name, axis, levels))
  kv_heads = sorted({key[0] for key in by}, reverse=True)
  for K in kv_heads[1:]:
    factors.append((f'K={K} vs K={kv_heads[0]}', 0, (K, kv_heads[0])))
  effects = []
  for name, axis, (level, base) in factors:
    pairs = []
    for key, m in by.items():
      if key[axis] != level:
        continue
      other = by.get(key[:axis] + (base,) + key[axis + 1:])
      if other:
        pairs.append((m, other))
    if not pairs:
      continue
    effect = {'factor': name, 'pairs': len(pairs)}
    for metric in ('nll', 'accuracy'):
      per_seed = np.mean([np.subtract(a['seeds']['float'][metric],
                                      b['seeds']['float'][metric])
                          for a, b in pairs], axis=0)
      e = stats.mean(per_seed)
      effect[metric] = {**e.as_dict(),
                        'resolved': stats.decide(e) == 'resolved',
                        'detectable': stats.detectable(e.sd, e.n),
                        'p': stats.p_value(per_seed)}
    effects.append(effect)
  for effect, rejected in zip(effects, stats.holm(
      [e['nll']['p'] for e in effects])):
    effect['holm'] = bool(rejected)
  return effects


def frontier(pts: list[dict]) -> list[str]:
  """The points (names) whose NLL is resolved lower, paired by seed, than
  that of every point with fewer bytes per token, and not resolved higher
  than any point with as few; cheapest first. Resolved: `stats.decide`'s
  (the interval excludes 0 and the difference is at least what the seeds
  detect)."""
  on = []
  for p in sorted(pts, key=lambda p: p['kv_bytes_per_token']):
    beats = lambda o, p=p: _Decided(stats.paired(o['nll'], p['nll']))
    cheaper = [o for o in pts if o['kv_bytes_per_token']
               < p['kv_bytes_per_token']]
    same = [o for o in pts if o is not p
            and o['kv_bytes_per_token'] == p['kv_bytes_per_token']]
    if all(beats(o).resolved and beats(o).mean > 0 for o in cheaper) and (
        not any(beats(o).resolved and beats(o).mean < 0 for o in same)):
      on.append(p['name'])
  return on


class _Decided:
  """A paired difference whose `resolved` is `stats.decide`'s."""

  def __init__(self, est: stats.Estimate):
    self.mean = est.mean
    self.resolved = stats.decide(est) == 'resolved'


# The report.


def _ci(d: dict, fmt: str = '+.4f') -> str:
  return format(stats.Estimate(d['mean'], d['sd'], d['n'], d['low'],
                              d['high']), fmt)


def _sd(values, fmt='.4f') -> str:
  e = stats.mean(values)
  return (f'{e.mean:{fmt}}' if e.n < 2 else
          f'{e.mean:{fmt}} ± {e.sd:{fmt}}')


def report(result: dict) -> str:
  """report.md from frontier.json alone: where it was made (and rebuilt),
  the convention, the reading (`reading`: from the numbers, every verdict
  `stats.decide`'s) and each panel's tables."""
  prov = result['provenance']
  lines = ['# The KV-memory frontier on a task where the cache matters', '',
           f'Made by `{prov["command"]}` at commit {prov["commit"]} (--out '
           f'{prov["out"]})'
           + (f' on {provenance.describe(prov["machine"])}'
              if prov.get('machine') else '')
           + f': {result["minutes"]:.1f} minutes, '
           f'{result.get("cpu_minutes", math.nan):.1f} minutes of CPU time '
           '(what the wall time is at most on an idle machine).'
           + (' A `--quick` run: the recall panel alone, at fewer steps than '
              'the default and without the conversion: too short for '
              'retrieval to be learnt.' if '--quick' in prov['command'].split()
              else '')
           + (' A subset of the default grid (`--variants`), with the '
              'conversions of any source it holds; the default grid\'s runs '
              'are published apart.' if any(
                  w.startswith('--variants') for w in prov['command'].split())
              else '')
           + (f' Runs trained: {prov["trained"]}.' if prov.get('trained')
              else '')
           + (f' {prov["note"]}' if prov.get('note') else ''), '',
           *report_lib.rebuilt_lines(prov, 'frontier.json'),
           stats.CONVENTION, '',
           'Bytes: the decode cache per token of context at max_len '
           '(`model.kv_bytes_per_token`: every layer that owns a cache, local '
           'layers their window, int8 with its float32 scale per token and '
           'K/V head). NLL and accuracy: the scored targets of the loop\'s '
           'held-out batches, read through the decode cache (float or int8, '
           'the whole row prefilled); KL: from the float cache\'s next-token '
           'distribution to the int8 cache\'s.', '', *reading(result)]
  for name, panel in result['panels'].items():
    lines += _panel_lines(name, panel)
  return '\n'.join(lines) + '\n![frontier](frontier.png)\n'


# The reading: what the tables show, in sentences made from the numbers.
# Every verdict on a difference is stats.decide's; a text that reads an
# outcome (the control seen or not, seeds retrieving or not, a pair at the
# floor) is chosen by that outcome.


def _decimals(d: dict) -> int:
  """Decimals that show a difference's interval half-width to two
  significant digits (at least 2; 4 without an interval)."""
  half = (d['high'] - d['low']) / 2
  if not (math.isfinite(half) and half > 0):
    return 4
  return max(2, 1 - math.floor(math.log10(half)))


def _said(d: dict, unit: str = '', rejected: bool | None = None) -> str:
  """A difference with its interval, `stats.decide`'s verdict and what
  the seeds detect: '+0.05 [-0.16, +0.26] nats (not claimed; detectable
  0.26)'."""
  verdict = stats.decide(d, rejected=rejected)
  text = _ci(d, f'+.{_decimals(d)}f')
  if verdict in ('equal on all seeds', 'one seed'):
    return text + unit  # The Estimate says it: no interval.
  lead, _, interval = text.partition(' ')
  return (f'{lead} {interval}{unit} ({verdict}; detectable '
          f'{d["detectable"]:.2g})')


def _retrieves(m: dict) -> tuple[int, int]:
  """(seeds whose first-query accuracy is at least RETRIEVES, seeds)."""
  first = m['seeds']['float']['first']
  return sum(f >= RETRIEVES for f in first), len(first)


def _pct(ratios) -> str:
  low, high = (f'{100 * min(ratios):.0f}', f'{100 * max(ratios):.0f}')
  return f'{low}%' if low == high else f'{low}-{high}%'


def reading(result: dict) -> list[str]:
  """'## What it shows': per panel, bullets from its analysis."""
  lines = ['## What it shows', '',
           'Made from frontier.json as the tables below are: every verdict '
           'is `stats.decide`\'s (resolved, not claimed, equal on all '
           'seeds), at the detectable effect the seeds give; the tables '
           'have every interval.', '']
  for name, panel in result['panels'].items():
    lines += [f'- {b}' for b in _panel_reading(name, panel)]
  return lines + ['']


def _panel_reading(name: str, panel: dict) -> list[str]:
  a, models = panel['analysis'], panel['models']
  by_name = {m['variant']: m for m in models}
  control = a['control']
  designs = [m for m in models if m['variant'] != CONTROL.name]
  first_query = 'first' in models[0]['seeds']['float']
  mean = lambda m, metric, cache='float': float(
      np.mean(m['seeds'][cache][metric]))
  bullets = []
  head = '{head}'  # The panel's name: with its budget on its first bullet.
  if control:
    nll, acc = control['diff']['nll'], control['diff']['accuracy']
    c = by_name[control['control']]
    bullets.append(
        f'{head}, **the negative control**: all-local {control["control"]} '
        f'(every layer a window of {panel["window"]} keys) minus all-global '
        f'{control["reference"]}: NLL {_said(nll, " nats")}, accuracy '
        f'{_said(acc)}; the control\'s NLL is {mean(c, "nll"):.3f} and its '
        f'accuracy {mean(c, "accuracy"):.3f}. ' + (
            f'The setup sees attention reaching the pairs (a '
            f'{nll["mean"]:.2f}-nat effect); that does not show that it can '
            'see an effect of K or of the cache\'s capacity, which may be far '
            'smaller.' if control['sees_attention'] else
            '**The control is not resolved worse: the setup is blind to '
            'attention here, and nothing below can be read as an effect of '
            'the cache.**'))
  if first_query:
    seeds = panel['seeds']
    parts = []
    for m in designs:
      k, n = _retrieves(m)
      near = [(s, f, acc) for s, f, acc in zip(
          seeds, m['seeds']['float']['first'],
          m['seeds']['float']['accuracy']) if 0.5 <= f < RETRIEVES]
      parts.append(f'{m["variant"]} {k}/{n} (first query '
                   f'{mean(m, "first"):.3f}, all answers '
                   f'{mean(m, "accuracy"):.3f}' + ''.join(
                       f'; seed {s} at {f:.3f}, all answers {acc:.3f}, short '
                       f'of {RETRIEVES}' for s, f, acc in near) + ')')
    local = [m for m in designs if 'L' in m['attention_pattern']
             and 'source' not in m]
    glob = [m for m in designs if m['attention_pattern'] == 'G'
            and 'source' not in m]
    bullets.append(
        f'{head}, **retrieval by content** (a seed retrieves when its '
        f'first-query accuracy is at least {RETRIEVES}: all or nothing, so '
        'counted, k of n seeds): ' + '; '.join(parts) + '.' + (
            ' The layouts with local layers retrieve on every seed and the '
            'all-global ones on none: a reading this run does not test is '
            f'that local layers of {panel["window"]} keys make the '
            'previous-token half of the induction circuit easy to find; '
            'whether the all-global layouts only learn later, rather than '
            'hold less, is not tested either.'
            if local and glob and all(_retrieves(m)[0] == _retrieves(m)[1]
                                      for m in local)
            and not any(_retrieves(m)[0] for m in glob) else ''))
  if a['main_effects']:
    family = len(a['main_effects'])
    effects = []
    for e in a['main_effects']:
      text = f'{e["factor"]} {_said(e["nll"], " nats", rejected=e["holm"])}'
      if e['factor'] == 'LLGG vs G':
        ratios = [m['kv_bytes_per_token']['float']
                  / t['kv_bytes_per_token']['float']
                  for m in designs for t in designs
                  if m['attention_pattern'] == 'LLGG'
                  and t['attention_pattern'] == 'G'
                  and _key(m)[0] == _key(t)[0] and _key(m)[2:] == _key(t)[2:]]
        if ratios:
          text += f', LLGG at {_pct(ratios)} of G\'s bytes'
      effects.append(text)
    bullets.append(
        f'{head}, **main effects on NLL** ('
        + (f'Holm over the family of {family}' if family > 1 else
           'a family of 1, uncorrected') + '): ' + '; '.join(effects) + '.')
  if a['equal_bytes']:
    pairs = []
    for e in a['equal_bytes']:
      x, y = by_name[e['a']], by_name[e['b']]
      text = (f'{e["a"]} − {e["b"]} at '
              f'{e["kv_bytes_per_token"]["float"]:,.0f} bytes/token: NLL '
              f'{_said(e["diff"]["nll"], " nats")}, accuracy '
              f'{_said(e["diff"]["accuracy"])}')
      if first_query:
        floor = all(_retrieves(m)[0] == _retrieves(m)[1] for m in (x, y))
        jumps = any(abs(f - g) >= 0.5 for f, g in zip(
            x['seeds']['float']['first'], y['seeds']['float']['first']))
        if floor:
          nlls = [v for m in (x, y) for v in (mean(m, 'nll'),)]
          text += (f'; both retrieve on every seed (NLL '
                   f'{min(nlls):.4f}-{max(nlls):.4f}): at the floor, so the '
                   'pair cannot show a limit of the cache\'s capacity, and '
                   'nothing here tests Brandon et al.\'s capacity claim')
        elif jumps:
          text += ('; on some seed one arm has jumped to retrieval and the '
                   'other not, so the per-seed differences are that jump and '
                   'the seeds detect only large effects')
      pairs.append(text)
    claimed = [e for e in a['equal_bytes']
               if stats.decide(e['diff']['nll']) == 'resolved']
    bullets.append(f'{head}, **equal bytes** (uncorrected): ' + '; '.join(
        pairs) + '. ' + (
        'On NLL nothing is claimed either way.' if not claimed else
        'Resolved on NLL: ' + '; '.join(
            f'{e["a"]} {"worse" if e["diff"]["nll"]["mean"] > 0 else "better"}'
            f' than {e["b"]}' for e in claimed) + '; the rest not claimed.'))
  if a.get('same_heads'):
    pairs = [f'{e["a"]} − {e["b"]} at {e["bytes_ratio"]:.0%} of its bytes: '
             f'NLL {_said(e["diff"]["nll"], " nats")}'
             for e in a['same_heads']]
    bullets.append(
        f'{head}, **Zadouri et al.\'s pairs** (GTA against GQA with as many '
        'K/V heads, their claim being GQA\'s quality at about half its '
        'cache; GLA against MLA of the same bytes, their claim being MLA\'s '
        'quality; uncorrected): ' + '; '.join(pairs) + '. A pair not '
        'resolved is not a match: it is a difference below what these seeds '
        'detect, in either direction. GTA with K heads and a RoPE key of Y '
        'caches (K·H + Y) / (2·K·H) of GQA-K\'s: about half for many heads, '
        'more with few (one head and Y = H/2: 75%).')
  for e in a.get('conversions', []):
    d = e['diff']['nll']
    verdict = stats.decide(d)
    nbytes = {m['variant']: m['kv_bytes_per_token']['float'] for m in models}
    bullets.append(
        f'{head}, **{e["model"]}** minus its source {e["source"]} '
        f'({nbytes[e["source"]]:,.0f} → {nbytes[e["model"]]:,.0f} '
        f'bytes/token): NLL {_said(d, " nats")}'
        + (f', after {e["uptrain_steps"]} steps of the conversion\'s '
           'uptraining recipe; uncorrected, and with no control for the '
           f'source itself training {e["uptrain_steps"]} more steps'
           if e['uptrain_steps'] else ', as converted (no training)')
        + ('. Not claimed: it says neither that the conversion recovers '
           'past its source nor that it falls short of it.'
           if e['uptrain_steps'] and verdict != 'resolved' else '.'))
  deltas = [e for e in a['int8'] if e['variant'] != CONTROL.name]
  if deltas:
    nlls = [e['delta']['nll'] for e in deltas]
    verdicts = [stats.decide(d) for d in nlls]
    counts = ', '.join(f'{verdicts.count(v)} {v}' for v in dict.fromkeys(
        verdicts))
    bound = max(max(abs(d['low']), abs(d['high'])) for d in nlls
                if math.isfinite(d['low']))
    ratios = [m['kv_bytes_per_token']['int8'] / m['kv_bytes_per_token'][
        'float'] for m in designs]
    resolved = [e['variant'] for e, v in zip(deltas, verdicts)
                if v == 'resolved']
    bullets.append(
        f'{head}, **int8 cache** (every model'
        + (' but the control' if len(deltas) < len(a['int8']) else '')
        + '): '
        + (f'NLL resolved for {", ".join(resolved)} ({counts}); '
           if resolved else f'no NLL difference from the float cache is '
           f'resolved ({counts}); ')
        + ('every interval contains 0 and ' if all(
            d['low'] <= 0 <= d['high'] for d in nlls) else '')
        + f'none reaches past ±{bound:.2g} nats; the KL from the float '
        f'cache\'s predictions is at most '
        f'{max(e["kl"]["mean"] for e in deltas):.1e} nats (a mean over '
        f'seeds); int8 caches hold {_pct(ratios)} of the float bytes.')
  on = a['frontier']
  pts = {p['name']: p for p in points(designs)}
  vacuous = [n for n in on if n in pts and not any(
      q['kv_bytes_per_token'] < pts[n]['kv_bytes_per_token']
      for q in pts.values())]
  why = (' on it only because no point'
         + (' but the control' if len(designs) < len(models) else '')
         + ' is cheaper, not by beating a cheaper one')
  bullets.append(
      f'{head}, **frontier**: {", ".join(on) or "no point"}'
      + ((f',{why}' if vacuous == on else f'; {", ".join(vacuous)}{why}')
         if vacuous else '') + '.')
  if first_query:
    glob = [m for m in designs if m['attention_pattern'] == 'G'
            and 'source' not in m]
    floor = any(all(_retrieves(by_name[e[k]])[0] == _retrieves(
        by_name[e[k]])[1] for k in ('a', 'b')) for e in a['equal_bytes'])
    wants = ([f'steps enough that every all-global seed retrieves']
             if any(_retrieves(m)[0] < _retrieves(m)[1] for m in glob)
             else []) + (['more pairs per head or narrower heads, so that '
                          'capacity binds where every arm retrieves']
                         if floor else [])
    if wants:
      bullets.append(f'{head}, **what would make it say more**: '
                     + ', and '.join(wants) + '.')
  heads = [f'**{name}** ({panel["steps"]} steps of `{panel["config"]}`)'] + [
      f'**{name}**'] * (len(bullets) - 1)
  return [b.replace('{head}', h, 1) for b, h in zip(bullets, heads)]


def _panel_lines(name: str, panel: dict) -> list[str]:
  a, models = panel['analysis'], panel['models']
  first_query = 'first' in models[0]['seeds']['float']
  lines = [f'## {name}: {panel["task"]}', '',
           f'`configs/{panel["config"]}.py`, {panel["layers"]} layers, '
           f'local layers (L) of {panel["window"]} keys; {panel["steps"]} '
           f'steps; seeds {panel["seeds"]}.', '']
  c = a['control']
  if c:
    acc, nll = c['diff']['accuracy'], c['diff']['nll']
    ref = next(m for m in models if m['variant'] == c['reference'])
    lines += [
        f'**Negative control.** All-local {c["control"]} against all-global '
        f'{c["reference"]}: NLL {_ci(nll)}, answer accuracy '
        f'{_ci(acc, "+.3f")} (control minus reference). '
        + ('The control is resolved worse on NLL: the setup sees attention.'
           if c['sees_attention'] else
           '**The control is not resolved worse: the setup is blind to '
           'attention, and nothing below can be read as an effect of the '
           'cache.**')]
    if 'first' in ref['seeds']['float']:
      first = stats.mean(ref['seeds']['float']['first'])
      lines[-1] += (
          f' The reference\'s first-query accuracy (retrieval by content '
          f'alone) is {first:.3f}: '
          + ('it retrieves by content.' if first.mean >= RETRIEVES else
             'it has not learnt retrieval by content at this budget; what '
             'separates it from the control is what reaching the pairs '
             'gives (the row\'s values, and crossing out those already '
             'asked for), which also needs the cache.'))
    lines.append('')
  if a['equal_bytes']:
    lines += ['**Equal bytes** (layouts holding the same float bytes per '
              'token: GQA-2 with CLA2 minus MQA, and MLA, GLA or GTA at those '
              'bytes minus each; paired by seed, uncorrected; "detectable": '
              'the smallest NLL difference these seeds find with 80% power):',
              '',
              '| pair | bytes/token | ΔNLL | Δaccuracy | '
              + ('Δfirst query | ' if first_query else '')
              + 'detectable ΔNLL |',
              '|---|---|---|---|' + ('---|' if first_query else '') + '---|']
    for e in a['equal_bytes']:
      d = e['diff']
      lines.append(f'| {e["a"]} − {e["b"]} | '
                   f'{e["kv_bytes_per_token"]["float"]:,.0f} | '
                   f'{_ci(d["nll"])}{_mark(d["nll"])} | '
                   f'{_ci(d["accuracy"], "+.3f")} | '
                   + (f'{_ci(d["first"], "+.3f")} | ' if first_query else '')
                   + f'{d["nll"]["detectable"]:.4f} |')
    lines.append('')
  if a.get('same_heads'):
    lines += ['**Zadouri et al.\'s pairs** (GTA minus GQA with the same K/V '
              'heads, GLA minus MLA with the same latent; paired by seed, '
              'uncorrected):', '',
              '| pair | bytes ratio | ΔNLL | ΔNLL verdict (detectable) | '
              'Δaccuracy |' + (' Δfirst query |' if first_query else ''),
              '|---|---|---|---|---|' + ('---|' if first_query else '')]
    for e in a['same_heads']:
      d = e['diff']
      lines.append(f'| {e["a"]} − {e["b"]} | {e["bytes_ratio"]:.3f} | '
                   f'{_ci(d["nll"])} | {stats.decide(d["nll"])} '
                   f'({d["nll"]["detectable"]:.4f}) | '
                   f'{_ci(d["accuracy"], "+.3f")} |'
                   + (f' {_ci(d["first"], "+.3f")} |' if first_query
                      else ''))
    lines.append('')
  if a['main_effects']:
    family = len(a['main_effects'])
    lines += ['**Main effects** (per seed, the mean difference over every '
              'pair of models differing in that factor alone; '
              + (f'Holm over the family of {family} NLL effects; H0: no '
                 'effect' if family > 1 else
                 'a family of 1, uncorrected; H0: no effect') + '):', '',
              f'| factor | pairs | ΔNLL | {"Holm" if family > 1 else "test"} '
              '| ΔNLL verdict | Δaccuracy | detectable ΔNLL |',
              '|---|---|---|---|---|---|---|']
    for e in a['main_effects']:
      lines.append(f'| {e["factor"]} | {e["pairs"]} | {_ci(e["nll"])} | '
                   f'{"rejects H0" if e["holm"] else "does not reject H0"} | '
                   f'{stats.decide(e["nll"], rejected=e["holm"])} | '
                   f'{_ci(e["accuracy"], "+.3f")} | '
                   f'{e["nll"]["detectable"]:.4f} |')
    lines.append('')
  if a.get('conversions'):
    lines += ['**Conversions into MLA** (`train.convert --to_mla`: the '
              "source's K/V projections factorised jointly by SVD into the "
              "latent; converted minus source, paired by seed, as converted "
              'and after the uptraining recipe\'s steps; no control for the '
              'source training as many more steps itself, and uncorrected):',
              '', '| model | bytes/token | ΔNLL | ΔNLL verdict (detectable) | '
              'Δaccuracy |' + (' Δfirst query |' if first_query else ''),
              '|---|---|---|---|---|' + ('---|' if first_query else '')]
    nbytes = {m['variant']: m['kv_bytes_per_token']['float'] for m in models}
    for e in a['conversions']:
      d = e['diff']
      lines.append(f'| {e["model"]} | {nbytes[e["source"]]:,.0f} → '
                   f'{nbytes[e["model"]]:,.0f} | {_ci(d["nll"])} | '
                   f'{stats.decide(d["nll"])} ({d["nll"]["detectable"]:.4f})'
                   f' | {_ci(d["accuracy"], "+.3f")} |'
                   + (f' {_ci(d["first"], "+.3f")} |' if first_query
                      else ''))
    lines.append('')
  lines += _below_detectable(a)
  deltas = {e['variant']: e for e in a['int8']}
  lines += ['**int8 cache** (int8 minus float, paired by seed, for every '
            'model; no training: the same weights read through the other '
            'cache):', '',
            '| model | bytes/token float → int8 | ΔNLL | KL (nats) | '
            'Δaccuracy |', '|---|---|---|---|---|']
  for m in models:
    e = deltas[m['variant']]
    nb = m['kv_bytes_per_token']
    lines.append(f'| {m["variant"]} | {nb["float"]:,.0f} → {nb["int8"]:,.0f} '
                 f'| {_ci(e["delta"]["nll"], "+.5f")} | '
                 f'{_ci(e["kl"], ".2e")} | '
                 f'{_ci(e["delta"]["accuracy"], "+.4f")} |')
  on = set(a['frontier'])
  excluded = a.get('frontier_excludes')
  lines += ['', '**Frontier** (a point whose NLL is resolved lower than every '
            'point with fewer bytes and not resolved higher than any with as '
            'few; one not resolved lower than a cheaper point is off it' + (
                f'; the negative control {excluded} is left out, as a '
                'control, not a design' if excluded else '') + '): '
            + ', '.join(a['frontier']) + '.', '',
            '| model | cache | bytes/token | NLL (mean ± sd) | accuracy | '
            + (f'first query (seeds ≥ {RETRIEVES}) | ' if 'first' in models[0]['seeds']['float']
               else '') + 'frontier |',
            '|---|---|---|---|---|' + ('---|' if 'first' in models[0]['seeds'][
                'float'] else '') + '---|']
  for p in sorted(points(models), key=lambda p: -p['kv_bytes_per_token']):
    first = (f'{_sd(p["first"], ".3f")} ({_retrieving(p["first"])}) | '
             if 'first' in p else '')
    lines.append(f'| {p["variant"]} | {p["cache"]} | '
                 f'{p["kv_bytes_per_token"]:,.0f} | {_sd(p["nll"])} | '
                 f'{_sd(p["accuracy"], ".3f")} | {first}'
                 f'{"yes" if p["name"] in on else ""} |')
  return lines + ['']


def _retrieving(first: list[float]) -> str:
  """'k/n': how many seeds retrieve by content (all or nothing: counted)."""
  return f'{sum(f >= RETRIEVES for f in first)}/{len(first)}'


def _mark(d: dict) -> str:
  return ' (resolved)' if stats.decide(d) == 'resolved' else ''


def _below_detectable(a: dict) -> list[str]:
  """The comparisons whose NLL difference is not resolved, and the smallest
  difference the seeds could have found."""
  unresolved = [(f'{e["a"]} − {e["b"]}', e['diff']['nll'], None)
                for e in a['equal_bytes']] + [
                    (e['factor'], e['nll'], e['holm'])
                    for e in a['main_effects']]
  unresolved = [(n, d) for n, d, holm in unresolved
                if stats.decide(d, rejected=holm) != 'resolved']
  if not unresolved:
    return []
  return ['Not resolved on NLL (not claimed either way): ' + '; '.join(
      f'{n}: the interval allows differences up to '
      f'{max(abs(d["low"]), abs(d["high"])):.4f}; these seeds detect '
      f'{d["detectable"]:.4f} with 80% power' for n, d in unresolved)
          + '.', '']


def plot(result: dict, path: pathlib.Path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  panels = result['panels']
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5),
                           squeeze=False)
  for ax, (name, panel) in zip(axes[0], panels.items()):
    pts = points(panel['models'])
    kinds = sorted({(m['attention_pattern'], m['kv_share'])
                    for m in panel['models']})
    colors = {kind: f'C{i}' for i, kind in enumerate(kinds)}
    for m, p in ((m, p) for m in panel['models'] for p in pts
                 if p['variant'] == m['variant']):
      e = stats.mean(p['nll'])
      half = 0.0 if e.n < 2 else e.high - e.mean
      color = colors[m['attention_pattern'], m['kv_share']]
      ax.errorbar(p['kv_bytes_per_token'], e.mean, yerr=half, color=color,
                  marker='o' if p['cache'] == 'float' else 's',
                  mfc=color if p['cache'] == 'float' else 'none', capsize=2)
      label = (f'MLA{m["kv_lora_rank"]}' if m.get('kv_lora_rank') else
               f'K{m["num_kv_heads"]}') + (
                   f' from {m["source"]} +{m["uptrain_steps"]}'
                   if m.get('source') else '')
      ax.annotate(label, (p['kv_bytes_per_token'], e.mean),
                  fontsize=7, xytext=(3, 3), textcoords='offset points')
    on = sorted((p for p in pts if p['name'] in panel['analysis']['frontier']),
                key=lambda p: p['kv_bytes_per_token'])
    ax.plot([p['kv_bytes_per_token'] for p in on],
            [np.mean(p['nll']) for p in on], 'k--', lw=1, label='frontier')
    for (pattern, share), color in colors.items():
      ax.plot([], [], 'o', color=color, label=f'{pattern}, kv_share {share}')
    ax.plot([], [], 's', mfc='none', color='k', label='int8 cache (hollow)')
    ax.set(xscale='log', xlabel='KV cache bytes per token (at max_len)',
           ylabel='held-out NLL of the scored targets (nats)',
           title=f'{name}: NLL against bytes (95% intervals over seeds)')
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == '__main__':
  exit_on_user_error(main)
