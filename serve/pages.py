"""The paged KV cache's pages on the host: the memory budget parsed, and
which pages each sequence owns, grown on demand.

Page 0 is the pool's scratch page (SCRATCH_PAGE): padding rows and unused
page-table entries write there, so it is never handed out and a pool of
num_pages holds num_pages - 1 usable pages. A sequence's pages are listed in
position order: position p lives in page pages(seq_id)[p // page_size], slot
p % page_size. Pure Python (no jax): the scheduler and its tests run without
a model; the device side (the pool's arrays, the forward pass over them) is
`serve.runner`.
"""

from __future__ import annotations

import math
import re

from infra.errors import UserError

SCRATCH_PAGE = 0

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


class KVPageError(UserError):
  """Pages asked for or returned wrongly."""


class DoubleFree(KVPageError):
  """A sequence's pages returned when it holds none (twice, or never given)."""


class KVPageManager:
  """Hands out pages 1..num_pages-1 to sequences as their contexts grow, all
  or nothing, and takes a finished (or preempted) sequence's pages back."""

  def __init__(self, num_pages: int, page_size: int):
    if num_pages < 2 or page_size < 1:
      raise KVPageError(
          f'KVPageManager(num_pages={num_pages}, page_size={page_size}): give '
          'num_pages >= 2 (the scratch page and one for a sequence) and '
          'page_size >= 1')
    self.num_pages, self.page_size = num_pages, page_size
    self._allocator = Allocator(num_pages)
    self._owned: dict[str, list[int]] = {}  # Insertion order: first ensured.

  def pages_for(self, num_tokens: int) -> int:
    """Pages that num_tokens positions occupy: ceil(num_tokens / page_size)."""
    return pages_for(num_tokens, self.page_size)

  @property
  def usable(self) -> int:
    """Pages sequences can hold: all but the scratch page."""
    return self._allocator.usable

  @property
  def free_count(self) -> int:
    return self.usable - self._allocator.in_use

  @property
  def in_use(self) -> int:
    return self._allocator.in_use

  @property
  def high_water(self) -> int:
    """The most pages ever in use at once."""
    return self._allocator.high_water

  def ensure(self, seq_id: str, num_tokens: int) -> bool:
    """Grows seq_id's pages to hold positions 0..num_tokens-1. False, with
    nothing taken, when too few pages are free."""
    if num_tokens < 0:
      raise ValueError(f'ensure({seq_id!r}, num_tokens={num_tokens}): '
                       'num_tokens must be >= 0')
    owned = self._owned.get(seq_id, [])
    more = self.pages_for(num_tokens) - len(owned)
    if more > 0:
      got = self._allocator.allocate(more)
      if got is None:
        return False
      owned = owned + got
    self._owned[seq_id] = owned
    return True

  def pages(self, seq_id: str) -> list[int]:
    """seq_id's pages in position order (a copy); [] if it holds none."""
    return list(self._owned.get(seq_id, ()))

  def free(self, seq_id: str):
    """Returns all of seq_id's pages to the pool."""
    if seq_id not in self._owned:
      raise DoubleFree(f'free({seq_id!r}): it holds no pages (freed already, '
                       'or never ensured); free each sequence once')
    self._allocator.release(self._owned.pop(seq_id))

  def check(self):
    """Raises AssertionError unless every usable page is either free or owned
    by exactly one sequence, and the scratch page is neither."""
    owned = [p for pages in self._owned.values() for p in pages]
    free = self._allocator.free
    problems = []
    if len(set(owned)) != len(owned):
      problems.append('a page is owned twice')
    if set(owned) & set(free) or len(set(free)) != len(free):
      problems.append('a page is both owned and free, or free twice')
    if SCRATCH_PAGE in owned or SCRATCH_PAGE in free:
      problems.append(f'the scratch page {SCRATCH_PAGE} is in circulation')
    if set(owned) | set(free) != set(range(1, self.num_pages)):
      problems.append(f'owned + free != pages 1..{self.num_pages - 1}')
    if problems:  # A bug in the caller or here, not bad input: a traceback.
      raise AssertionError('KV pages corrupt: ' + '; '.join(problems))
