"""The paged cache's bookkeeping on the host: the memory budget parsed, and
the pages handed out and returned.

Page 0 is the pool's scratch page (`serve.paged`): idle slots and unused
page-table entries point at it, so it is never handed out.
"""

from __future__ import annotations

import math
import re

from infra.errors import UserError

_UNITS = {'': 1, 'b': 1, 'kb': 10**3, 'mb': 10**6, 'gb': 10**9, 'tb': 10**12,
          'kib': 2**10, 'mib': 2**20, 'gib': 2**30, 'tib': 2**40}


def parse_bytes(text: str, flag: str = '--kv_memory') -> int:
  """'256MiB' -> 268435456: a number with an optional unit (B, KB, MB, GB,
  TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024)."""
  match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*',
                       str(text).lower())
  if not match or match.group(2) not in _UNITS:
    raise UserError(f'{flag}={text!r} is not a size; give bytes with a unit, '
                    'e.g. 256MiB, 1GB or 1048576')
  value = float(match.group(1)) * _UNITS[match.group(2)]
  if value < 1:
    raise UserError(f'{flag}={text!r} must be at least one byte')
  return int(value)


def pages_for(tokens: int, page_size: int) -> int:
  """Pages a sequence of `tokens` positions occupies."""
  return math.ceil(tokens / page_size)


class Allocator:
  """Pages 1..num_pages-1 handed out whole and returned; counts the most
  ever in use at once (the high-water mark)."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, 0, -1))  # Pops the lowest first.
    self.high_water = 0

  @property
  def usable(self) -> int:
    """Pages a sequence can hold: all but the scratch page."""
    return self.num_pages - 1

  @property
  def in_use(self) -> int:
    return self.usable - len(self._free)

  @property
  def free(self) -> list[int]:
    """The pages not handed out (a copy, for checks)."""
    return list(self._free)

  def allocate(self, count: int) -> list[int] | None:
    """`count` free pages, or None (nothing taken) when fewer are free."""
    if count > len(self._free):
      return None
    pages = [self._free.pop() for _ in range(count)]
    self.high_water = max(self.high_water, self.in_use)
    return pages

  def release(self, pages: list[int]):
    """Returns a finished sequence's pages to the pool."""
    self._free.extend(reversed(pages))
