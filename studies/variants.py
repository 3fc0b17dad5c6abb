"""The layouts a benchmark names on its command line (bench_decode's and
bench_serve's --variants): K<k>, GTA<k>, MLA<a>, GLA<a>g<g>, TPA<r>,
TPAKV<r>, each the config's model with its attention set to that layout."""

from __future__ import annotations

import argparse
import dataclasses
import re

from attention import layout as layout_lib
from lm import config_lib

GRAMMAR = ('K<k> (GQA, k K/V heads), GTA<k> (grouped-tied, k heads), MLA<a> '
           '(latent of a), GLA<a>g<g> (MLA\'s latent in g groups), TPA<r> '
           '(tensor product, K/V of rank r), TPAKV<r> (the same, per-head '
           'queries), comma-separated')


@dataclasses.dataclass(frozen=True)
class Variant:
  """A layout --variants names: the model fields it sets on the config
  (model.attention and that layout's settings, every other layout's left at
  its defaults, so that a config's own MLA or GTA does not leak into
  another variant); num_kv_heads None is the config's num_heads (MLA's)."""
  name: str
  num_kv_heads: int | None
  attention: str = 'gqa'
  settings: tuple[tuple[str, int], ...] = ()  # The layout's own, set.

  PATTERNS = {  # Name -> the fields of its numbers.
      r'K(\d+)': lambda k: dict(num_kv_heads=k),
      r'GTA(\d+)': lambda k: dict(num_kv_heads=k, attention='gta'),
      r'MLA(\d+)': lambda a: dict(num_kv_heads=None, attention='mla',
                                  settings=(('kv_lora_rank', a),)),
      r'GLA(\d+)g(\d+)': lambda a, g: dict(
          num_kv_heads=None, attention='mla',
          settings=(('kv_lora_rank', a), ('latent_groups', g))),
      r'TPA(\d+)': lambda r: dict(num_kv_heads=None, attention='tpa',
                                  settings=(('k_rank', r), ('v_rank', r))),
      r'TPAKV(\d+)': lambda r: dict(
          num_kv_heads=None, attention='tpa',
          settings=(('q_rank', 0), ('k_rank', r), ('v_rank', r))),
  }

  @classmethod
  def parse(cls, name: str) -> 'Variant':
    """'GLA48g2' -> its Variant; ValueError for a name not in GRAMMAR."""
    for pattern, fields in cls.PATTERNS.items():
      match = re.fullmatch(pattern, name)
      if match and all(int(n) > 0 for n in match.groups()):
        return cls(name, **fields(*map(int, match.groups())))
    raise ValueError(f'{name!r} is not a variant')

  @property
  def is_gqa(self) -> bool:
    return self.attention == 'gqa'

  @property
  def label(self) -> str:
    """'K=2' for grouped-query attention's K<k>, else the name."""
    return f'K={self.num_kv_heads}' if self.is_gqa else self.name

  def apply_to(self, model):
    """Sets the variant's fields on `model` (a config's model section)."""
    defaults = config_lib.defaults().model
    model.update(num_kv_heads=self.num_kv_heads or model.num_heads,
                 attention=self.attention)
    for name in layout_lib.names():
      if name in model:
        model[name] = defaults[name]
    if self.settings:
      model[self.attention].update(dict(self.settings))


def variant_list(text: str) -> list[Variant]:
  """'K8,GTA2' -> [Variant, ...]: an argparse type."""
  try:
    return [Variant.parse(name) for name in text.split(',')]
  except ValueError as e:
    raise argparse.ArgumentTypeError(f'{e}; give {GRAMMAR}') from None
