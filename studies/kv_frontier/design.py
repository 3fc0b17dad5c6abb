"""What the KV-memory frontier trains: its layouts (`Variant`), its two
panels (`PANELS`: a task, a grid, a budget), each variant's config, the
plan the flags ask for, and where a saved model record sits in the design
(`point`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from attention.layout import Layout
from configs import _json
from infra.errors import UserError
from lm import config_lib

CACHES = ('float', 'int8')
RETRIEVES = 0.95  # First-query accuracy read as retrieval by content.


@dataclasses.dataclass(frozen=True)
class Variant:
  """A layout of the grid, in the study's words: K/V heads K (MLA: 0, as
  many as the query heads, as MLA needs), the layer pattern, kv_share,
  and the other layouts' choices: MLA's latent width (0: not MLA), its
  latent groups (GLA), a RoPE key's width (MLA/GLA or GTA; 0: a model
  without RoPE) and tie (grouped-tied attention, GTA)."""
  K: int
  pattern: str  # model.attention_pattern.
  share: int  # model.kv_share.
  latent: int = 0
  rope: int = 0
  tie: bool = False
  groups: int = 1

  @property
  def name(self) -> str:
    rope = f'r{self.rope}' if self.rope else ''
    if self.latent:
      kv = (f'GLA{self.latent}g{self.groups}' if self.groups > 1
            else f'MLA{self.latent}') + rope
    else:
      kv = f'GTA{self.K}{rope}' if self.tie else f'K{self.K}'
    return f'{kv}_{self.pattern}_share{self.share}'

  def layout(self) -> dict:
    """The config's model fields that name its layout: model.attention
    and that layout's settings (as a config section)."""
    if self.latent:
      return {'attention': 'mla', 'mla': dict(
          kv_lora_rank=self.latent, qk_rope_head_dim=self.rope,
          latent_groups=self.groups)}
    if self.tie:
      return {'attention': 'gta', 'gta': dict(qk_rope_head_dim=self.rope)}
    return {'attention': 'gqa'}


class Point(NamedTuple):
  """Where a saved model sits in the design: its K/V heads (the config's,
  so MLA's are its query heads), pattern, sharing and layout."""
  K: int
  pattern: str
  share: int
  layout: Layout


def point(m: dict) -> Point:
  """A model record's Point (as `measure` writes it). Its layout is the
  one its fields name (`lm.config_lib.layout_of`); records written before
  layouts had names hold MLA's and GTA's settings flat, which
  `configs._json.upgrade_model` reads (as it reads configs of then), and
  the first ones none at all (grouped-query attention)."""
  model = _json.upgrade_model(dict(m))
  model.setdefault('attention', 'gqa')
  return Point(m['num_kv_heads'], m['attention_pattern'], m['kv_share'],
               config_lib.layout_of(model))


def grouped_query(p: Point) -> bool:
  """Whether a point is of the GQA grid (not MLA, GLA or GTA)."""
  return p.layout.name == 'gqa'


def zadouri_partner(p: Point) -> Point | None:
  """Zadouri et al.'s comparison for a point: GTA with K heads against
  GQA with the same K (and pattern and sharing), GLA against the MLA of
  its latent and RoPE key; None for any other point."""
  if p.layout.name == 'gta':
    return p._replace(layout=config_lib.layout_of({'attention': 'gqa'}))
  if p.layout.name == 'mla':
    mla = dataclasses.replace(p.layout, latent_groups=1)
    return p._replace(layout=mla) if mla != p.layout else None
  return None


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
                      kv_share=v.share, **v.layout())
  config.seed = seed
  steps = steps or config.train.steps
  config.train.update(steps=steps, eval_every=steps, checkpoint_every=steps,
                      log_every=max(1, steps // 10),
                      warmup_steps=min(config.train.warmup_steps, steps // 4))
  return config


class Plan(NamedTuple):
  """One panel as the flags ask for it."""
  panel: Panel
  variants: tuple[Variant, ...]
  steps: int
  seeds: list[int]
  conversions: tuple


def _variants(names: list[str], args) -> dict[str, tuple[Variant, ...]]:
  """Each panel's grid (--quick's, where asked), cut to --variants; an
  unknown name refused."""
  grids = {name: (PANELS[name].quick_variants if args.quick
                  else PANELS[name].variants) for name in names}
  if not args.variants:
    return grids
  wanted = set(args.variants.split(','))
  known = {v.name for grid in grids.values() for v in grid}
  if wanted - known:
    raise UserError(f'--variants: {", ".join(sorted(wanted - known))} not '
                    'in the panels\' grids; pick from '
                    f'{", ".join(sorted(known))}')
  return {name: tuple(v for v in grid if v.name in wanted)
          for name, grid in grids.items()}


def plan(args) -> dict[str, Plan]:
  """The panels the flags ask for (--panels, --quick, --variants,
  --kv_heads, --steps, --lm_steps, --seeds, --config), every variant's
  config refused, if bad, before any trains."""
  names = (args.panels.split(',') if args.panels else
           ['recall'] if args.quick else list(PANELS))
  if set(names) - set(PANELS):
    raise UserError(f'--panels={args.panels}; use a comma-separated list of '
                    f'{", ".join(PANELS)}')
  plans = {}
  for name, variants in _variants(names, args).items():
    panel = PANELS[name]
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
    plans[name] = Plan(panel, variants, steps, list(range(1, 1 + seeds)),
                       conversions)
    for v in variants:
      config_lib.validate(variant_config(panel.config, v, 1, steps,
                                         panel.window), batch_shards=1)
  return plans
