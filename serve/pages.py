"""The paged KV cache's pages on the host: the memory budget parsed, which
pages each sequence holds, grown on demand, and the prefix cache over them.

Page 0 is the pool's scratch page (SCRATCH_PAGE): padding rows and unused
page-table entries write there, so it is never handed out and a pool of
num_pages holds num_pages - 1 usable pages. A sequence's pages are listed in
position order: position p lives in page pages(seq_id)[p // page_size], slot
p % page_size. Pure Python (no jax): the scheduler and its tests run without
a model; the device side (the pool's arrays, the forward pass over them) is
`serve.runner`.

Prefix caching (vLLM's automatic prefix caching): a full page, once its
K/V is computed, is keyed by `page_hash` of its tokens and of the hash of
the page before it (so of every token before it), `register`ed. A page is
held by as many sequences as share it (a reference count); when none holds
it, a keyed page stays in the pool with its contents, free but findable
(`cached_prefix`), until an allocation needs it: free pages are handed out
least recently freed first, never-keyed ones before keyed ones, and a keyed
page handed out loses its key (LRU eviction). A sequence whose context
starts with keyed pages `share`s them and skips computing them; it writes
only positions past them, into pages of its own, so a shared page is never
written.
"""

from __future__ import annotations

import collections
import hashlib
import math
import re
import struct

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
  ever in use at once (the high-water mark). Free pages queue in the order
  they are handed out: `release(keep=True)` puts pages at the back (kept
  longest: a prefix cache's pages), plain `release` at the front."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._free = collections.OrderedDict.fromkeys(range(1, num_pages))
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
    """The pages not handed out, next handed out first (a copy)."""
    return list(self._free)

  def allocate(self, count: int) -> list[int] | None:
    """`count` free pages, or None (nothing taken) when fewer are free."""
    if count > len(self._free):
      return None
    pages = [self._free.popitem(last=False)[0] for _ in range(count)]
    self._count()
    return pages

  def take(self, page: int):
    """Hands out one particular free page (a cached one shared again)."""
    del self._free[page]
    self._count()

  def release(self, pages: list[int], keep: bool = False):
    """Returns pages to the pool: handed out next, or (keep) last."""
    for page in pages:
      self._free[page] = None
      if not keep:
        self._free.move_to_end(page, last=False)

  def _count(self):
    self.high_water = max(self.high_water, self.in_use)


class KVPageError(UserError):
  """Pages asked for or returned wrongly."""


class DoubleFree(KVPageError):
  """A sequence's pages returned when it holds none (twice, or never given)."""


def page_hash(parent: bytes | None, tokens) -> bytes:
  """16 bytes naming a full page by its tokens and everything before it:
  BLAKE2b of the previous page's hash (None for the first page) and the
  page's token ids (little-endian int32). Stable across processes."""
  digest = hashlib.blake2b(parent or b'', digest_size=16)
  digest.update(struct.pack(f'<{len(tokens)}i', *tokens))
  return digest.digest()


def page_hashes(tokens, page_size: int, known: list[bytes]) -> list[bytes]:
  """The hashes of every full page of `tokens`, extending `known` (those of
  its first pages, computed before) in place; returns it."""
  for i in range(len(known), len(tokens) // page_size):
    known.append(page_hash(known[-1] if known else None,
                           tokens[i * page_size:(i + 1) * page_size]))
  return known


class KVPageManager:
  """Hands out pages 1..num_pages-1 to sequences as their contexts grow, all
  or nothing, and takes a finished (or preempted) sequence's pages back;
  with prefix_caching, keeps computed full pages findable by their hash
  (see the module docstring)."""

  def __init__(self, num_pages: int, page_size: int,
               prefix_caching: bool = False):
    if num_pages < 2 or page_size < 1:
      raise KVPageError(
          f'KVPageManager(num_pages={num_pages}, page_size={page_size}): give '
          'num_pages >= 2 (the scratch page and one for a sequence) and '
          'page_size >= 1')
    self.num_pages, self.page_size = num_pages, page_size
    self.prefix_caching = prefix_caching
    self._allocator = Allocator(num_pages)
    self._owned: dict[str, list[int]] = {}  # Insertion order: first ensured.
    self._refs: collections.Counter = collections.Counter()  # Held pages.
    self._hash_of: dict[int, bytes] = {}  # Keyed pages, held or free.
    self._page_of: dict[bytes, int] = {}
    self.evictions = 0  # Keyed pages handed out to hold something else.

  def pages_for(self, num_tokens: int) -> int:
    """Pages that num_tokens positions occupy: ceil(num_tokens / page_size)."""
    return pages_for(num_tokens, self.page_size)

  @property
  def usable(self) -> int:
    """Pages sequences can hold: all but the scratch page."""
    return self._allocator.usable

  @property
  def free_count(self) -> int:
    """Pages no sequence holds (cached ones included: they can be taken)."""
    return self.usable - self._allocator.in_use

  @property
  def in_use(self) -> int:
    """Pages some sequence holds (a shared page once)."""
    return self._allocator.in_use

  @property
  def cached(self) -> int:
    """Keyed pages, held or free."""
    return len(self._hash_of)

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
      for page in got:
        self._refs[page] = 1
        if page in self._hash_of:  # The least recently freed keyed page.
          del self._page_of[self._hash_of.pop(page)]
          self.evictions += 1
      owned = owned + got
    self._owned[seq_id] = owned
    return True

  def cached_prefix(self, hashes: list[bytes]) -> list[int]:
    """The keyed pages of the longest prefix of `hashes` (page hashes of a
    context, first page first) the cache holds; [] without prefix_caching."""
    found = []
    if self.prefix_caching:
      for h in hashes:
        page = self._page_of.get(h)
        if page is None:
          break
        found.append(page)
    return found

  def share(self, seq_id: str, pages: list[int]):
    """seq_id, holding no pages yet, takes keyed `pages` (`cached_prefix`'s)
    as its first ones."""
    if seq_id in self._owned:
      raise KVPageError(f'share({seq_id!r}): it holds pages already; share '
                        'before ensure')
    for page in pages:
      if not self._refs[page]:
        self._allocator.take(page)  # Free but cached: in use again.
      self._refs[page] += 1
    self._owned[seq_id] = list(pages)

  def held(self, pages: list[int]) -> int:
    """How many of `pages` some sequence holds."""
    return sum(1 for page in pages if self._refs[page])

  def register(self, page: int, key: bytes):
    """Keys a held page whose positions are all computed (no-op without
    prefix_caching, or when the key or the page has one already: the same
    tokens computed twice at once keep the first page)."""
    if (self.prefix_caching and key not in self._page_of and
        page not in self._hash_of):
      self._hash_of[page], self._page_of[key] = key, page

  def pages(self, seq_id: str) -> list[int]:
    """seq_id's pages in position order (a copy); [] if it holds none."""
    return list(self._owned.get(seq_id, ()))

  def free(self, seq_id: str):
    """Returns seq_id's hold on its pages; a page no one holds any more is
    free (a keyed one kept findable, its last page evicted first)."""
    if seq_id not in self._owned:
      raise DoubleFree(f'free({seq_id!r}): it holds no pages (freed already, '
                       'or never ensured); free each sequence once')
    for page in reversed(self._owned.pop(seq_id)):
      self._refs[page] -= 1
      if not self._refs[page]:
        del self._refs[page]
        self._allocator.release([page], keep=page in self._hash_of)

  def check(self):
    """Raises AssertionError unless every usable page is either free or held
    by as many sequences as its reference count says, the scratch page
    neither, and every key names one page."""
    owned = [p for pages in self._owned.values() for p in pages]
    free = self._allocator.free
    problems = []
    if collections.Counter(owned) != self._refs:
      problems.append('a page is owned twice (or held by fewer sequences '
                      'than its reference count)')
    if any(len(set(pages)) != len(pages) for pages in self._owned.values()):
      problems.append('a sequence holds a page twice')
    if set(owned) & set(free) or len(set(free)) != len(free):
      problems.append('a page is both owned and free, or free twice')
    if SCRATCH_PAGE in owned or SCRATCH_PAGE in free:
      problems.append(f'the scratch page {SCRATCH_PAGE} is in circulation')
    if set(owned) | set(free) != set(range(1, self.num_pages)):
      problems.append(f'owned + free != pages 1..{self.num_pages - 1}')
    if {p: h for h, p in self._page_of.items()} != self._hash_of:
      problems.append('a key names two pages, or a page two keys')
    if problems:  # A bug in the caller or here, not bad input: a traceback.
      raise AssertionError('KV pages corrupt: ' + '; '.join(problems))
