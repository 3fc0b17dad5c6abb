"""What the KV-memory frontier trains: its layouts (`Variant`), its
panels (`PANELS`: a task, a grid, a budget, the families of pairs read
together, `Family`), each variant's config, the plan the flags ask for, and
where a saved model record sits in the design (`point`)."""

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
  """A layout of the grid, in the study's words: K/V heads K (MLA and TPA:
  0, as many as the query heads, as they need), the layer pattern,
  kv_share, and the other layouts' choices: MLA's latent width (0: not
  MLA), its latent groups (GLA), a RoPE key's width (MLA/GLA or GTA; 0: a
  model without RoPE), tie (grouped-tied attention, GTA), and TPA's rank
  of K and of V (0: not TPA) with kv_only (per-head queries, the paper's
  TPA-KV-only; else T6's factored queries, the config's model.tpa.q_rank).
  Its name is the benchmarks' (`studies.variants`): TPA<r>, TPAKV<r>.
  heads: its query heads N (0: the config's), named 'h<N>' after the
  layout (TPA2h17): a point with other heads than its panel's."""
  K: int
  pattern: str  # model.attention_pattern.
  share: int  # model.kv_share.
  latent: int = 0
  rope: int = 0
  tie: bool = False
  groups: int = 1
  rank: int = 0
  kv_only: bool = False
  heads: int = 0

  @property
  def name(self) -> str:
    rope = f'r{self.rope}' if self.rope else ''
    if self.rank:
      kv = f'TPA{"KV" if self.kv_only else ""}{self.rank}'
    elif self.latent:
      kv = (f'GLA{self.latent}g{self.groups}' if self.groups > 1
            else f'MLA{self.latent}') + rope
    else:
      kv = f'GTA{self.K}{rope}' if self.tie else f'K{self.K}'
    if self.heads:
      kv += f'h{self.heads}'
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
    if self.rank:  # T6's queries: the config's q_rank (the layout's default).
      return {'attention': 'tpa', 'tpa': dict(
          k_rank=self.rank, v_rank=self.rank,
          **({'q_rank': 0} if self.kv_only else {}))}
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
  # Comparisons read together, each family Holm-corrected (`Family`).
  families: tuple['Family', ...] = ()


@dataclasses.dataclass(frozen=True)
class Family:
  """Paired comparisons read together, fixed before any run: a name, the
  claim they test (as its authors state it, and what is held equal here),
  and the pairs (a minus b, paired by seed); Holm's correction over the
  family's NLL differences (`analysis.families`)."""
  name: str
  claim: str
  pairs: tuple[tuple[Variant, Variant], ...]

  def record(self, variants) -> dict | None:
    """The family as frontier.json holds it (so that the report names the
    family it corrected over), cut to the pairs whose two arms are among
    VARIANTS (the trained ones); None when none is."""
    pairs = [[a.name, b.name] for a, b in self.pairs
             if a in variants and b in variants]
    return dict(name=self.name, claim=self.claim,
                pairs=pairs) if pairs else None


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
# Tensor product attention (Zhang et al. 2025; issue #63), T6's factored
# queries (model.tpa.q_rank) and K/V of rank R each: 2R(N + H) numbers per
# token and layer. With N query heads of H, every layout here has the
# panel's N: TPA is compared at equal heads, at the bytes nearest its
# partner's (R_K = R_V; recall, N = 4, H = 16: TPA1 caches 40 against
# MQA's 32; lm, N = 8, H = 32: TPA1 80 against MQA's and MLA's 64, TPA2 160
# against GQA-2's 128), and in the heads panel, where N = H makes TPA-R's
# 4RH numbers GQA-2R's 2·2R·H, at exactly equal bytes.
TPA = {R: Variant(0, 'G', 1, rank=R) for R in (1, 2)}
TPAKV1 = Variant(0, 'G', 1, rank=1, kv_only=True)
_PAPER = ('Zhang et al. (NeurIPS 2025, arXiv 2501.06425): T6 "matches or '
          'beats MHA/MQA/GQA/MLA on perplexity", each baseline at T6\'s '
          'parameter count (so with other query heads: 47 for T6 against '
          'MHA\'s 16 at "medium")')
_BYTES = Family('TPA, bytes-matched', (
    f'{_PAPER}. Here at equal query heads, TPA of rank R_K = R_V at the '
    'cache nearest each baseline\'s.'),
    ((TPA[1], REFERENCE), (TPA[1], _MLA_LM), (TPA[2], Variant(2, 'G', 1))))
_HEADS = Family('TPA, heads-matched', (
    'A public critique: the paper matched parameters, not heads, so T6 ran '
    'about 3x the heads of its MHA baseline and its gain may be head '
    f'count, not factorisation. {_PAPER}. Here the query heads and the '
    'cache bytes are equal: TPA-R against GQA-2R, with T6\'s factored '
    'queries and with TPA-KV-only\'s per-head ones (GQA\'s).'),
    ((TPA[1], Variant(2, 'G', 1)), (TPA[2], Variant(4, 'G', 1)),
     (TPAKV1, Variant(2, 'G', 1))))
# The paper's framing beside it: T6 with the query heads that bring its
# parameters to MHA's (gqa_small: 17 heads, 3.55M against MHA-8's 3.54M, at
# 38% of its bytes), and T6 with MHA's 8 heads (fewer parameters).
TPA2_PARAMS, MHA8 = Variant(0, 'G', 1, rank=2, heads=17), Variant(8, 'G', 1)
_PARAMS = Family('TPA, parameter-matched (the paper\'s framing)', (
    f'{_PAPER}. Here as the paper compares: T6 (ranks 6/2/2) with the '
    'query heads that bring its parameters to MHA\'s, beside T6 with '
    'MHA\'s heads; if the first gains where the second does not, the head '
    'count, not the factorisation, made the difference.'),
    ((TPA2_PARAMS, MHA8), (TPA[2], MHA8)))
PANELS = {
    # Local layers of 2 keys (themselves and the one before): enough for a
    # previous-token head, and four of them reach 4 positions back, short of
    # configs/kv_recall.py's gap (test_scripts checks the geometry).
    'recall': Panel(
        'kv_recall', window=2,
        variants=_QUICK + (_MLA_RECALL,) + _ZADOURI_RECALL + (TPA[1],),
        quick_variants=_QUICK + (_MLA_RECALL,), steps=0,  # 0: the config's.
        quick_steps=100, seeds=3, quick_seeds=3,
        # MQA converted into MLA at half its bytes (a latent of 16), then
        # the conversion's uptraining recipe.
        conversions=((REFERENCE, Variant(0, 'G', 1, latent=16), 100),),
        families=(Family(_BYTES.name, _BYTES.claim,
                         ((TPA[1], REFERENCE),)),)),
    'lm': Panel(
        'gqa_small', window=64,
        variants=(REFERENCE, Variant(2, 'G', 2), _MLA_LM) + _ZADOURI_LM + (
            Variant(2, 'G', 1), TPA[1], TPA[2], MHA8, TPA2_PARAMS),
        quick_variants=(), steps=40, quick_steps=0, seeds=3, quick_seeds=0,
        families=(_BYTES, _PARAMS)),
    # gqa_small with 16 query heads of 16 (configs/gqa_small_h16.py): TPA
    # and GQA at equal heads and exactly equal bytes.
    'heads': Panel(
        'gqa_small_h16', window=64,
        variants=(Variant(2, 'G', 1), Variant(4, 'G', 1), TPA[1], TPA[2],
                  TPAKV1),
        quick_variants=(), steps=40, quick_steps=0, seeds=3, quick_seeds=0,
        families=(_HEADS,)),
}


def variant_config(base: str, v: Variant, seed: int, steps: int,
                   window: int):
  """BASE with v's layout; `steps` > 0 replaces its steps (0 keeps them)."""
  config = config_lib.load(base)
  heads = v.heads or config.model.num_heads
  # MLA: each query head's K/V from the latent (num_kv_heads = num_heads).
  config.model.update(num_heads=heads, num_kv_heads=v.K or heads,
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
      variants = tuple(v for v in variants
                       if (v.K or v.heads or heads) in args.kv_heads)
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
