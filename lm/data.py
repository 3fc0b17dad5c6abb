"""Token data: where it comes from, and batches as a pure function of (seed, step).

Sources, by `data.path` (with `data.task='lm'`, the default):
  ''                 the embedded default: the bytes of this Python's standard
                     library source and its documentation topics (pydoc_data),
                     vocabulary 256, built once and cached;
  DIR with meta.json a corpus tokenized by `train.prepare_data`: uint16 or
                     uint32 shards, documents ending in EOS, whole documents
                     held out; bits per byte from its recorded byte counts;
  DIR with train.bin nanoGPT's pre-tokenised uint16 files (train.bin, val.bin);
  FILE.bin           one uint16 token file, its tail held out;
  FILE or DIR        text, read as bytes (vocabulary 256), the tail held out.

Text (the embedded corpus included) is read as bytes unless a tokenizer is
given (`data.tokenizer`, or the workdir's tokenizer.json): then it is
tokenized once and cached as a token file (uint16, or uint32 where the
vocabulary exceeds 65,536), keyed by the tokenizer and the text.

`data.task='recall'` is made by the code instead: multi-query associative
recall (Arora et al. 2023, "Zoology"), a probe of what attention can look up.
Each row lists P key-value pairs, then asks for every key again in a random
order; only the answers are scored:

  k1 v1 ... kP vP  f ... f  q1 a1 ... qP aP  0 ...   (qj = some ki, aj = vi)

Keys are distinct ids from the lower half of the vocabulary, values any ids
from the upper half. `data.recall_gap` filler tokens f (the last id, a value
id that no query can match) sit between the pairs and the queries, so that
every key lies more than that many positions before its query: beyond a
local layer's window (0: none, the queries follow the pairs). A model must
store every pair and retrieve by content, which is where fewer K/V heads
(less K/V capacity per layer) can cost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import sysconfig
import zlib
from typing import Literal, Protocol

from etils import epath
import numpy as np

from lm import tokenizer as tokenizer_lib
from infra.errors import UserError
from infra.progress import Progress
from infra.storage import refuse_url

_SKIP_DIRS = {'test', 'tests', 'site-packages', 'idlelib', '__pycache__',
              'lib2to3', 'ensurepip'}


Split = Literal['train', 'val']  # 'val': the held-out part.
Task = Literal['lm', 'recall']


class Source(Protocol):
  """What the training loop reads: a text/token Dataset or the RecallTask."""
  vocab_size: int
  bytes_per_token: float | None  # For bits per byte; None if not text.
  description: str
  loss_weights: np.ndarray | None  # [seq_len] target weights; None: all.

  def batch(self, split: Split, *, seed: int, step: int, batch_size: int,
            seq_len: int, shard: int = 0, num_shards: int = 1,
            stream: int = 0) -> np.ndarray:
    """Shard `shard` of num_shards of the global batch: rows [batch_size //
    num_shards, seq_len + 1] int32, a pure function of (seed, step, stream).
    Held-out batches use split 'val' and stream 1."""

  def summary(self) -> str:
    """One line for the log."""


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A token stream; `batch` cuts random windows from its train or val split."""
  train: np.ndarray  # [num_tokens] uint8 or uint16, possibly memory-mapped.
  val: np.ndarray
  vocab_size: int  # Tokens are < vocab_size.
  bytes_per_token: float | None  # 1.0 for byte-level text, None if unknown.
  description: str
  # A prepared folder's tokenizer (train.prepare_data); None otherwise.
  tokenizer_fingerprint: str | None = None
  loss_weights = None  # Every target counts.

  def batch(self, split: Split, *, seed: int, step: int, batch_size: int,
            seq_len: int, shard: int = 0, num_shards: int = 1,
            stream: int = 0) -> np.ndarray:
    return batch(self.train if split == 'train' else self.val, seed=seed,
                 step=step, batch_size=batch_size, seq_len=seq_len,
                 shard=shard, num_shards=num_shards, stream=stream)

  def summary(self) -> str:
    return (f'{self.description}: {len(self.train):,} training and '
            f'{len(self.val):,} held-out tokens')


@dataclasses.dataclass(frozen=True)
class RecallTask:
  """Multi-query associative recall (module docstring), made per batch."""
  num_pairs: int  # P.
  vocab_size: int
  seq_len: int
  gap: int = 0  # Filler tokens between the pairs and the queries.
  bytes_per_token = None  # Not text.

  @property
  def description(self) -> str:
    gap = f', {self.gap} filler tokens' if self.gap else ''
    return (f'associative recall: {self.num_pairs} key-value pairs{gap}, '
            f'then {self.num_pairs} queries (vocabulary {self.vocab_size})')

  @property
  def loss_weights(self) -> np.ndarray:
    """[seq_len]: 1 where the target is an answer (target t is token t + 1)."""
    weights_T = np.zeros(self.seq_len, np.float32)
    first = 2 * self.num_pairs + self.gap  # The first query's position.
    weights_T[first:first + 2 * self.num_pairs:2] = 1.0
    return weights_T

  def summary(self) -> str:
    return f'{self.description}, made for each batch'

  def accuracy_by_query(self, predicted_BT, tokens_BT1) -> np.ndarray:
    """[P]: how often the j-th query's answer is predicted, over the rows of
    tokens_BT1 (predicted_BT: the argmax at every input position)."""
    answers_T = self.loss_weights == 1  # The scored targets, in query order.
    return (np.asarray(predicted_BT)[:, answers_T]
            == np.asarray(tokens_BT1)[:, 1:][:, answers_T]).mean(0)

  def batch(self, split: Split, *, seed: int, step: int, batch_size: int,
            seq_len: int, shard: int = 0, num_shards: int = 1,
            stream: int = 0) -> np.ndarray:
    """Only this shard's rows are made: each row has its own generator,
    seeded by (stream, seed, step, P, row), so the rows do not depend on how
    the batch is split over hosts. The split only names the caller's intent:
    held-out batches differ by `stream` (1), as for text."""
    del split
    P, half = self.num_pairs, self.vocab_size // 2
    q = 2 * P + self.gap  # The first query's position.
    per_shard = batch_size // num_shards
    tokens = np.zeros((per_shard, seq_len + 1), np.int32)
    for i, row in enumerate(range(shard * per_shard, (shard + 1) * per_shard)):
      rng = np.random.default_rng([stream, seed, step, P, row])
      keys_P = rng.permutation(half)[:P]  # Distinct.
      values_P = rng.integers(half, self.vocab_size, P)
      order_P = rng.permutation(P)
      tokens[i, 0:2 * P:2], tokens[i, 1:2 * P:2] = keys_P, values_P
      tokens[i, 2 * P:q] = self.vocab_size - 1  # The gap's filler.
      tokens[i, q:q + 2 * P:2] = keys_P[order_P]
      tokens[i, q + 1:q + 2 * P:2] = values_P[order_P]
    return tokens


def load(path: str, *, val_fraction: float, seq_len: int,
         cache_dir: str | None = None, task: Task = 'lm', recall_pairs: int = 0,
         recall_gap: int = 0, vocab_size: int = 256, tokenizer=None
         ) -> Source:
  """Loads the data named by `path`; raises UserError if it cannot be used.

  For task='recall', `path` is ignored and `recall_pairs` (0: as many as fit,
  (seq_len + 1 - recall_gap) // 4), `recall_gap` and `vocab_size` shape the
  task. `tokenizer` (a `lm.tokenizer` one; None or bytes: bytes)
  tokenizes text.
  """
  if task == 'recall':
    room = seq_len + 1 - recall_gap  # For P pairs and P queries: 4P.
    pairs = recall_pairs or room // 4
    if not 1 <= pairs <= min(room // 4, vocab_size // 2):
      gap = f' - data.recall_gap {recall_gap}' if recall_gap else ''
      raise UserError(
          f'data.recall_pairs={pairs} does not fit: P pairs and P queries take '
          f'4P <= data.seq_len + 1{gap} = {room} tokens, and keys are '
          f'distinct ids below model.vocab_size / 2 = {vocab_size // 2}; use '
          f'1..{min(room // 4, vocab_size // 2)}')
    return RecallTask(pairs, vocab_size, seq_len, recall_gap)
  if task != 'lm':
    raise UserError(f"data.task={task!r}; use 'lm' (text or tokens from "
                    "data.path) or 'recall' (the synthetic recall probe)")
  if not path:
    train, val = _stdlib_corpus(cache_dir or _default_cache_dir())
    data = Dataset(train, val, 256, 1.0,
                   f'Python {sysconfig.get_python_version()} stdlib source + '
                   'pydoc topics (bytes)')
  else:
    data = _from_path(path, val_fraction)
  data = _with_tokenizer(data, tokenizer, cache_dir or _default_cache_dir())
  for split, tokens in (('training', data.train), ('validation', data.val)):
    if len(tokens) < seq_len + 1:
      raise UserError(
          f'{data.description}: the {split} split has {len(tokens)} tokens, '
          f'fewer than data.seq_len + 1 = {seq_len + 1}; use more data or a '
          'shorter --config.data.seq_len')
  return data


def for_model(dc, mc, path: epath.Path, is_chief: bool) -> Source:
  """The data of config section `dc` in the workdir at `path`, checked
  against model config `mc`; the workdir remembers the tokenizer it was read
  with (written by process 0, `is_chief`)."""
  tokenizer = _workdir_tokenizer(dc, path)
  dataset = load(dc.path, val_fraction=dc.val_fraction, seq_len=dc.seq_len,
                 cache_dir=dc.cache_dir or None, task=dc.task,
                 recall_pairs=dc.recall_pairs, recall_gap=dc.recall_gap,
                 vocab_size=mc.vocab_size, tokenizer=tokenizer)
  as_bytes = tokenizer is not None and tokenizer.name == 'bytes' and (
      dataset.bytes_per_token == 1.0)
  if as_bytes and mc.vocab_size != 256:
    raise UserError(
        f'{dataset.description} is read as UTF-8 bytes (256 ids), but '
        f'model.vocab_size={mc.vocab_size}: give the model\'s tokenizer '
        f'(data.tokenizer, or {tokenizer_lib.FILE} in the workdir) or '
        'token ids (.bin), or set model.vocab_size=256')
  if dataset.vocab_size > mc.vocab_size:
    raise UserError(f'{dataset.description} has token ids up to '
                    f'{dataset.vocab_size - 1}; set model.vocab_size >= '
                    f'{dataset.vocab_size}')
  remembered = path / tokenizer_lib.FILE  # Once the data is known to fit.
  if tokenizer is not None and tokenizer.name != 'bytes' and is_chief and (
      not remembered.exists()):
    remembered.write_bytes(epath.Path(tokenizer.name).read_bytes())
  return dataset


def _workdir_tokenizer(dc, path: epath.Path):
  """data.tokenizer, which the workdir then remembers, or the workdir's own;
  a fresh workdir training on a prepared corpus remembers the corpus's."""
  remembered = path / tokenizer_lib.FILE
  if dc.task != 'lm':
    return None
  source = dc.get('tokenizer') or (
      None if remembered.exists() else prepared_tokenizer(dc.path))
  if not source:
    return tokenizer_lib.of_workdir(path)
  given = tokenizer_lib.load(source)
  if remembered.exists():
    if tokenizer_lib.load(remembered).fingerprint != given.fingerprint:
      raise UserError(f'{path} was trained with the tokenizer in {remembered}, '
                      f'not data.tokenizer={dc.tokenizer!r}; unset '
                      'data.tokenizer, or use a new --workdir')
  return given


# A train.prepare_data folder: meta.json once finished, progress.jsonl
# while under way, and the tokenizer it was made with.
PREPARED_META = 'meta.json'
PREPARED_PROGRESS = 'progress.jsonl'


class Shards:
  """A prepared split's shards as one token sequence: len() and slices,
  which may span two shards; nothing is read until sliced."""

  def __init__(self, arrays: list[np.ndarray]):
    self.arrays = arrays
    self.ends = np.cumsum([len(a) for a in arrays])
    self.dtype = arrays[0].dtype

  def __len__(self) -> int:
    return int(self.ends[-1])

  def __getitem__(self, index: slice) -> np.ndarray:
    start, stop, _ = index.indices(len(self))
    pieces = []
    while start < stop:
      i = int(np.searchsorted(self.ends, start, side='right'))
      begin = start - (self.ends[i - 1] if i else 0)
      piece = self.arrays[i][begin:begin + stop - start]
      pieces.append(piece)
      start += len(piece)
    return np.concatenate(pieces) if pieces else self.arrays[0][:0]


def prepared(p: pathlib.Path) -> Dataset:
  """A `train.prepare_data` folder: a memory map per shard, nothing loaded."""
  try:
    meta = json.loads((p / PREPARED_META).read_text())
    dtype = np.dtype(meta['dtype'])
    splits = {name: meta['splits'][name] for name in ('train', 'val')}
  except (ValueError, KeyError, TypeError) as e:
    raise UserError(f'{p / PREPARED_META} is not a prepared corpus\'s '
                    f'({e}); prepare it again with train.prepare_data'
                    ) from None
  arrays = {}
  for name, split in splits.items():
    arrays[name] = []
    for shard in split['shards']:
      path = p / shard['file']
      if not path.exists() or path.stat().st_size != (
          shard['tokens'] * dtype.itemsize):
        raise UserError(f'{path} is missing or not the size {PREPARED_META} '
                        'records; prepare the corpus again')
      arrays[name].append(np.memmap(path, dtype, 'r'))
  train, val = (Shards(arrays[n]) if len(arrays[n]) > 1 else arrays[n][0]
                for n in ('train', 'val'))
  # A corpus made before the tokenizer counted gaps in its ids may hold ids
  # past its vocab_size; its max_id says so.
  vocab_size = max(meta['vocab_size'], meta.get('max_id', -1) + 1)
  return Dataset(train, val, vocab_size,
                 splits['val']['bytes'] / splits['val']['tokens'],
                 f'{p} (prepared, {dtype.name})',
                 meta['tokenizer']['fingerprint'])


def prepared_tokenizer(path: str) -> pathlib.Path | None:
  """The tokenizer.json a prepared folder at `path` was made with, if any."""
  p = pathlib.Path(path).expanduser() if path else None
  if p and (p / PREPARED_META).exists() and (p / tokenizer_lib.FILE).exists():
    return p / tokenizer_lib.FILE
  return None


def _from_path(path: str, val_fraction: float) -> Dataset:
  """The data at data.path (module docstring), by what is there."""
  refuse_url(path, 'data.path')
  p = pathlib.Path(path).expanduser()
  if not p.exists():
    raise UserError(f'data.path {path!r} does not exist; give a text file, '
                    "a folder of text files, a .bin token file, or '' for "
                    'the embedded corpus')
  if p.is_dir() and (p / PREPARED_PROGRESS).exists() and not (
      p / PREPARED_META).exists():
    raise UserError(f'{p} is a train.prepare_data run that did not finish '
                    f'(no {PREPARED_META}); rerun it with the same flags to '
                    'finish it')
  if p.is_dir() and (p / PREPARED_META).exists():
    return prepared(p)
  shards = sorted(p.glob('train-*.bin')) if p.is_dir() else []
  if shards:
    raise UserError(f'{p} is not a prepared corpus: it holds {shards[0].name} '
                    f'but no {PREPARED_META}, which train.prepare_data writes '
                    'last, once complete; prepare the text again into a new '
                    'folder (python -m train.prepare_data --input=TEXT '
                    '--tokenizer=TOKENIZER --out=NEW) and give that')
  if p.is_dir() and (p / 'train.bin').exists():
    if not (p / 'val.bin').exists():
      raise UserError(f'{p} has train.bin but no val.bin; add one, or point '
                      'data.path at train.bin to hold out its tail')
    train, val = _tokens(p / 'train.bin'), _tokens(p / 'val.bin')
    return Dataset(train, val, _vocab(train, val), None, f'{p} (uint16)')
  if p.suffix == '.bin':
    train, val = _split(_tokens(p), val_fraction, p)
    return Dataset(train, val, _vocab(train, val), None, f'{p} (uint16)')
  train, val = _split(_text_bytes(p), val_fraction, p)
  return Dataset(train, val, 256, 1.0, f'{p} (bytes)')


def _with_tokenizer(data: Dataset, tokenizer, cache_dir: str) -> Dataset:
  """Text tokenized by `tokenizer` (cached); a prepared corpus checked to
  be its tokenizer's; bytes as they are."""
  if data.tokenizer_fingerprint is not None:  # Prepared: tokenized already.
    if tokenizer is not None and (tokenizer.fingerprint
                                  != data.tokenizer_fingerprint):
      raise UserError(
          f'{data.description} was prepared with the tokenizer '
          f'{data.tokenizer_fingerprint} (its {PREPARED_META}), but this '
          f'run\'s is {tokenizer.name} ({tokenizer.fingerprint}); prepare it '
          'with this run\'s tokenizer (train.prepare_data --tokenizer='
          'WORKDIR) or use another --workdir')
    return data
  if tokenizer is None or tokenizer.name == 'bytes':
    return data
  if data.bytes_per_token != 1.0:
    raise UserError(f'{data.description} holds token ids already; a '
                    'tokenizer applies to text (prepare text with '
                    'train.prepare_data, or unset data.tokenizer)')
  return _tokenized(data, tokenizer, cache_dir)


def batch(tokens: np.ndarray, *, seed: int, step: int, batch_size: int,
          seq_len: int, shard: int = 0, num_shards: int = 1,
          stream: int = 0) -> np.ndarray:
  """Rows [batch_size // num_shards, seq_len + 1] of random windows, int32.

  A pure function of (seed, step): a resumed run sees exactly the data of an
  uninterrupted one. Held-out batches use stream 1 (step = batch index), so
  every evaluation sees the same rows. Shard i of num_shards (one per host) is rows
  [i * b, (i + 1) * b) of the global batch, so hosts load only their part.
  """
  rng = np.random.default_rng([stream, seed, step])
  starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
  per_shard = batch_size // num_shards
  starts = starts[shard * per_shard:(shard + 1) * per_shard]
  return np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def _tokenized(data: Dataset, tokenizer, cache_dir: str) -> Dataset:
  """`data`'s text as the tokenizer's tokens, made once and cached."""
  dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
  digest = hashlib.sha256(tokenizer.fingerprint.encode())
  digest.update(tokenizer_lib.PIECE_RULE.encode())  # Cuts move tokens.
  for split in (data.train, data.val):
    digest.update(np.asarray(split).tobytes())
  cache = pathlib.Path(cache_dir).expanduser() / f'tokens-{digest.hexdigest()[:16]}'
  if not (cache / 'val.bin').exists():
    cache.mkdir(parents=True, exist_ok=True)
    for name, split in (('train.bin', data.train), ('val.bin', data.val)):
      tokens = _encode(tokenizer, bytes(np.asarray(split)).decode(
          'utf-8', 'replace'), name).astype(dtype)
      tmp = cache / f'{name}.tmp{os.getpid()}'
      tokens.tofile(tmp)
      tmp.replace(cache / name)  # Atomic, as for the corpus.
  train = np.memmap(cache / 'train.bin', dtype, 'r')
  val = np.memmap(cache / 'val.bin', dtype, 'r')
  return Dataset(train, val, tokenizer.vocab_size,
                 (len(data.train) + len(data.val)) / (len(train) + len(val)),
                 f'{data.description.removesuffix(" (bytes)")} '
                 f'(tokenized by {tokenizer.name})')


def _encode(tokenizer, text: str, name: str, chunk: int = 1 << 19,
            batch: int = 16) -> np.ndarray:
  """Tokens of `text`, encoded in ~1 MB pieces (tokenizer.PIECE_RULE),
  `batch` pieces at a time in parallel, with a progress line."""
  pieces = list(tokenizer_lib.pieces(text, chunk))
  ids = []
  with Progress(f'tokenizing {name}', len(text), unit='M chars',
                scale=1e6) as bar:
    for i in range(0, len(pieces), batch):
      ids += tokenizer.encode_pieces(pieces[i:i + batch], [
          j > 0 for j in range(i, min(i + batch, len(pieces)))])
      bar.advance(sum(map(len, pieces[i:i + batch])))
  return np.fromiter((i for piece in ids for i in piece), np.int64)


def _default_cache_dir() -> str:
  return os.path.join(os.environ.get('XDG_CACHE_HOME', '~/.cache'), 'gqa-lab')


def stdlib_files(root: pathlib.Path) -> list[pathlib.Path]:
  """The standard library's .py files in a fixed order, tests and vendored
  packages left out: the embedded corpus (and `prepare_data`'s 'embedded')."""
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    files += [pathlib.Path(dirpath, f) for f in sorted(filenames)
              if f.endswith('.py')]
  return files


def _stdlib_corpus(cache_dir: str):
  """The standard library's .py files and pydoc topics; ~2% of files held out."""
  import pydoc_data.topics  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  files = stdlib_files(root)
  fingerprint = hashlib.sha256(repr([
      (str(f.relative_to(root)), f.stat().st_size) for f in files
  ]).encode()).hexdigest()[:12]
  cache = pathlib.Path(cache_dir).expanduser() / f'stdlib-{fingerprint}'
  if not (cache / 'val.bin').exists():
    print(f'building the embedded corpus from {len(files):,} files of '
          f'{root} (once; cached in {cache})', file=sys.stderr, flush=True)
    train, val = [], []
    for f in files:
      # A stable hash of the path decides the split, whatever else changes.
      rel = str(f.relative_to(root))
      (val if zlib.crc32(rel.encode()) % 50 == 0 else train).append(
          f.read_bytes())
    train += [t.encode() for _, t in sorted(pydoc_data.topics.topics.items())]
    cache.mkdir(parents=True, exist_ok=True)
    for name, parts in (('train.bin', train), ('val.bin', val)):
      tmp = cache / f'{name}.tmp{os.getpid()}'
      tmp.write_bytes(b'\n'.join(parts))
      tmp.replace(cache / name)  # Atomic: a concurrent reader never sees half.
  return (np.memmap(cache / 'train.bin', np.uint8, 'r'),
          np.memmap(cache / 'val.bin', np.uint8, 'r'))


def folder_files(root: pathlib.Path, *, leave_out: pathlib.Path | None = None,
                 say=lambda line: print(line, file=sys.stderr),
                 skip_folder=lambda path: None) -> list[pathlib.Path]:
  """The files below the folder `root`, sorted by path. Hidden files and
  folders below it are skipped (root's own path may have any); linked
  folders are followed, but not a link back to a folder it is inside (a
  loop: said); `leave_out` (an output folder inside root) is left out, and
  so is a folder for which skip_folder(path) gives a reason (what it is:
  said in one note for them all)."""
  files, skipped = [], []
  real = {str(root): {os.path.realpath(root)}}  # Per folder: its chain.
  for folder, subfolders, names in os.walk(root, followlinks=True):
    kept = []
    for sub in sorted(subfolders):
      path, target = os.path.join(folder, sub), os.path.realpath(
          os.path.join(folder, sub))
      if sub.startswith('.') or (leave_out is not None and
                                 target == os.path.realpath(leave_out)):
        continue
      if target in real[folder]:
        say(f'note: skipping {path}, a link to {target}, which it is inside')
        continue
      reason = skip_folder(pathlib.Path(path))
      if reason:
        skipped.append(f'{path} ({reason})')
        continue
      real[path] = real[folder] | {target}
      kept.append(sub)
    subfolders[:] = kept
    files += [pathlib.Path(folder, n) for n in names if not n.startswith('.')
              and os.path.isfile(os.path.join(folder, n))]
  if skipped:
    say(f'note: skipping {len(skipped)} folder'
        f'{"s" if len(skipped) > 1 else ""} of outputs, not inputs: '
        + ', '.join(skipped))
  return sorted(files)


UTF8_BOM = b'\xef\xbb\xbf'  # Marks a file as UTF-8 (Windows editors); not text.


def _text_bytes(p: pathlib.Path) -> np.ndarray:
  files = [p] if p.is_file() else folder_files(p)
  parts = []
  for f in files:
    if f.suffix == '.bin' and f != p:
      raise UserError(
          f'{f} is a token file inside a folder of text; data.path takes '
          'one .bin file, a folder with train.bin and val.bin (nanoGPT), or '
          'a folder of text files; move it or point data.path at it')
    content = f.read_bytes().removeprefix(UTF8_BOM)
    _check_text(f, content)
    parts.append(content)
  data = b'\n'.join(parts)
  if not data:
    raise UserError(f'data.path {str(p)!r} is empty; give it some text')
  return np.frombuffer(data, np.uint8)


MAX_INVALID_UTF8 = 0.01  # Share of undecodable bytes that text may hold.


def _check_text(f: pathlib.Path, content: bytes):
  """Raises UserError if `content` looks binary: NUL bytes or mostly not UTF-8.

  Text is trained on as its bytes, so a stray image or archive would be
  learnt as noise; token files are read as tokens only when named *.bin.
  """
  sample = content[:1 << 20]
  invalid = len(sample) - len(sample.decode('utf-8', 'ignore').encode())
  if b'\0' in content or invalid > MAX_INVALID_UTF8 * len(sample):
    raise UserError(
        f'{f} is not text (NUL bytes or invalid UTF-8); remove it from '
        'data.path, or name pre-tokenised uint16 files *.bin')


def _tokens(p: pathlib.Path) -> np.ndarray:
  size = p.stat().st_size
  if size == 0 or size % 2:
    raise UserError(f'{p} has {size} bytes; a .bin token file holds uint16 '
                    'tokens (nanoGPT format), so a positive even size')
  return np.memmap(p, np.uint16, 'r')


def _vocab(*splits, chunk: int = 1 << 26) -> int:
  """1 + the largest id: every token read, a chunk at a time (memory-mapped
  files of billions of tokens stay on disk; ~1 s per GB)."""
  return max(int(s[i:i + chunk].max()) for s in splits
             for i in range(0, len(s), chunk)) + 1


def _split(tokens: np.ndarray, val_fraction: float, p: pathlib.Path):
  if not 0 < val_fraction < 1:
    raise UserError(f'data.val_fraction must be in (0, 1), got {val_fraction}')
  n_val = int(len(tokens) * val_fraction)
  return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
