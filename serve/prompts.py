"""The prompt lines of `serve.generate`, read one at a time as the engine has
room for them.

A line is {"id": ..., "prompt": "..."} and may carry "max_new_tokens" and
"seed" of its own. `parse` checks one line into a `Line` (its id, its
settings, its request hash, or the one-line reason it is refused); `scan`
reads a whole file once, ahead of the run, for what must be refused before
anything is written (two lines with one id: `Ids`, the one check); `Lines`
hands the lines over as
they come, from a file or from stdin (a reader thread, so that a pipe's
first line is served while the next is still being written).

Memory is flat in the number of lines: nothing holds them all; the ids seen
are kept as 8-byte digests (`digest`), which the duplicate check needs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pathlib
import queue
import sys
import threading
from typing import Iterator

from lm.sampling_params import SamplingParams, request_seed
from infra.errors import UserError

KEYS = frozenset({'id', 'prompt', 'max_new_tokens', 'seed'})
STDIO = '-'  # --prompts=- reads stdin.
LINE_SHAPE = '{"id": ..., "prompt": "..."}'


def digest(text: str) -> int:
  """An 8-byte digest of text (an id as JSON): what sets and maps of ids
  keep, at a fixed size whatever the ids' length."""
  return int.from_bytes(hashlib.blake2b(text.encode('utf-8', 'surrogatepass'),
                                        digest_size=8).digest(), 'big')


def request_hash(prompt: str, max_new_tokens: int,
                 settings: SamplingParams) -> str:
  """16 hex digits naming everything that decides a request's text: its
  prompt, max_new_tokens and sampling settings (a greedy request's seed,
  top_k and top_p left out: they change nothing). A result records it, and
  a rerun regenerates a request whose hash changed."""
  greedy = settings.temperature == 0
  what = {'prompt': prompt, 'max_new_tokens': max_new_tokens,
          'temperature': settings.temperature, 'stop': list(settings.stop),
          **({} if greedy else {'top_k': settings.top_k,
                                'top_p': settings.top_p,
                                'seed': settings.seed})}
  text = json.dumps(what, sort_keys=True, separators=(',', ':'))
  return hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[
      :16]


@dataclasses.dataclass(frozen=True)
class Line:
  """One prompt line, checked. A line with no usable id (not JSON, no
  "id") has has_id False and is refused by its number; any other refusal
  (`error`, one line) is the request's, by its id."""
  number: int
  has_id: bool = False
  id: object = None
  prompt: str | None = None
  max_new_tokens: int = 0
  settings: SamplingParams = SamplingParams()
  defaulted: bool = False  # Takes --max_new_tokens, not one of its own.
  error: str | None = None

  @property
  def key(self) -> str:
    """The id as JSON (how results name it), or 'line N' without one."""
    return json.dumps(self.id) if self.has_id else f'line {self.number}'

  @property
  def request(self) -> str:
    return request_hash(self.prompt, self.max_new_tokens, self.settings)

  def record(self, error: str | None = None) -> dict:
    """Its refusal as a result line: {"id", "error"} for a request,
    {"line", "error"} for a line with no id (no "id" key, so that it never
    reads as the record of a request whose id is null)."""
    error = error or self.error
    return ({'id': self.id, 'error': error} if self.has_id else
            {'line': self.number, 'error': error})


def parse(number: int, text: str, max_new_tokens: int,
          settings: SamplingParams) -> Line | None:
  """Line `number` of a prompt file (None if blank): its request with the
  flags' max_new_tokens and settings where it gives none, and its seed, if
  it names none, derived from the flags' seed and its id
  (`sampling.request_seed`)."""
  if not text.strip():
    return None
  refuse = lambda why, **known: Line(number, error=f'line {number}: {why}',
                                     **known)
  try:
    entry = json.loads(text)
  except json.JSONDecodeError as e:
    return refuse(f'not JSON ({e.msg}); write {LINE_SHAPE}')
  if not isinstance(entry, dict) or 'id' not in entry:
    return refuse(f'needs an "id" and a "prompt" string; write {LINE_SHAPE}')
  known = {'has_id': True, 'id': entry['id']}
  unknown = sorted(set(entry) - KEYS)
  if unknown:
    return refuse(f'unknown key(s) {", ".join(unknown)}; a line takes "id", '
                  '"prompt", "max_new_tokens" and "seed" (the rest of '
                  'sampling is set by the flags)', **known)
  if not isinstance(entry.get('prompt'), str):
    return refuse(f'needs a "prompt" string; write {LINE_SHAPE}', **known)
  new = entry.get('max_new_tokens', max_new_tokens)
  if not _is_int(new) or new < 1:
    return refuse(f'max_new_tokens={new!r} must be an integer >= 1', **known)
  seed = entry.get('seed')
  if seed is None:
    seed = request_seed(settings.seed, entry['id'])
  elif not (_is_int(seed) and 0 <= seed < 1 << 32):
    return refuse(f'seed={seed!r} must be an integer in 0..2**32 - 1',
                  **known)
  return Line(number, prompt=entry['prompt'], max_new_tokens=new,
              settings=SamplingParams(
                  settings.temperature, settings.top_k, settings.top_p, seed,
                  settings.stop),
              defaulted='max_new_tokens' not in entry, **known)


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _unreadable(path, number: int, e: Exception) -> UserError:
  return UserError(f'--prompts={path} cannot be read at line {number} ({e}); '
                   'give a UTF-8 JSON-lines file')


def _numbered(stream, path) -> Iterator[tuple[int, str]]:
  """(number, text) of each line of a text stream opened as utf-8-sig (a
  byte-order mark before the first line is not part of it)."""
  number = 0
  try:
    for number, text in enumerate(stream, 1):
      yield number, text
  except (OSError, UnicodeDecodeError) as e:
    raise _unreadable(path, number + 1, e) from None


class Ids:
  """The ids of the lines read so far, as 8-byte digests with the line that
  had each first: the one duplicate check, O(1) a line."""

  def __init__(self):
    self._first: dict[int, int] = {}

  def earlier(self, key: str, number: int) -> int | None:
    """The line that had id `key` (as JSON) before line `number`, or None
    (then `number` has it now)."""
    first = self._first.setdefault(digest(key), number)
    return None if first == number else first


@dataclasses.dataclass
class Scan:
  """A prompt file read once before the run: its lines (not blank), and how
  many requests take --max_new_tokens rather than their own (the first
  one's id)."""
  lines: int = 0
  defaulted: int = 0
  first_defaulted: object = None


def scan(path: pathlib.Path) -> Scan:
  """Reads the file's lines once, parsing each but keeping only the digests
  of their ids (a few microseconds a line: about 0.3 s for 100k lines):
  a UserError, before anything is written, when two lines share an id (the
  results could not be told apart). The lines' other faults are refused
  one by one as they are served."""
  found, ids = Scan(), Ids()
  try:
    stream = path.open(encoding='utf-8-sig')
  except OSError as e:
    raise _unreadable(path, 1, e) from None
  with stream:
    for number, text in _numbered(stream, path):
      if not text.strip():
        continue
      found.lines += 1
      try:
        entry = json.loads(text)
      except json.JSONDecodeError:
        continue
      if not isinstance(entry, dict) or 'id' not in entry:
        continue
      key = json.dumps(entry['id'])
      first = ids.earlier(key, number)
      if first is not None:
        raise UserError(f'--prompts={path}: id {key} is on lines {first} '
                        f'and {number}; give each prompt its own id (nothing '
                        'was written)')
      if 'max_new_tokens' not in entry and isinstance(entry.get('prompt'),
                                                      str):
        if not found.defaulted:
          found.first_defaulted = entry['id']
        found.defaulted += 1
  return found


END = object()  # What `Lines.get` returns after the last line.


class Lines:
  """The lines of PATH, or of stdin for '-', as (number, text), one `get`
  at a time. stdin is read by a thread into a bounded queue, so `get(block=
  False)` answers at once (None: no line has come yet) and a pipe's first
  line is served before it ends."""

  def __init__(self, path: str, queued: int = 1024):
    self.path = path
    if path != STDIO:
      try:
        self._stream = open(path, encoding='utf-8-sig')  # pylint: disable=consider-using-with
      except OSError as e:
        raise _unreadable(path, 1, e) from None
      self._lines = _numbered(self._stream, path)
      return
    self._queue = queue.Queue(maxsize=queued)
    stdin = io.TextIOWrapper(sys.stdin.buffer, encoding='utf-8-sig')
    threading.Thread(target=self._read, args=(stdin,), daemon=True).start()

  def _read(self, stream):
    try:
      for item in _numbered(stream, 'stdin'):
        self._queue.put(item)
      self._queue.put(END)
    except UserError as e:
      self._queue.put(e)

  def get(self, block: bool = True):
    """The next (number, text), END after the last, or None when no line
    is ready and block is False. A line that cannot be read: UserError."""
    if self.path != STDIO:
      item = next(self._lines, END)
      if item is END:
        self._stream.close()
      return item
    try:
      item = self._queue.get(block)
    except queue.Empty:
      return None
    if isinstance(item, UserError):
      raise item
    return item
