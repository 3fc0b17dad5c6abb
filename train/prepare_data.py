r"""Tokenizes a corpus once into shards of token ids: `python -m train.prepare_data`.

  python -m train.prepare_data --input=PATH[,PATH...] --out=DIR \
      --tokenizer=WORKDIR_OR_tokenizer.json [--text_field=text] \
      [--val_fraction=0.005] [--seed=0] [--eos_id=N]

Inputs: text files and folders of them (a file is a document), JSON Lines
(*.jsonl: a record's --text_field is a document), either gzipped (*.gz);
`embedded` is the embedded corpus (the standard library's .py files and the
pydoc topics, a document each). A document becomes its tokens, with the BOS
that the tokenizer's post-processor adds (as transformers does), then EOS.

DIR gets shards of uint16 ids (a vocabulary of at most 65,536) or uint32, each
ending at a document boundary (train-00000.bin, ..., val-00000.bin), the
tokenizer.json, and last meta.json: the dtype, the vocabulary, the
tokenizer's identity, EOS/BOS ids, per split its shards and their token,
document and UTF-8 byte counts, and how the held-out documents were chosen
(whole documents, by a seeded hash of where they come from). A folder without
meta.json is not a corpus. Train on it with --config.data.path=DIR.

Streaming: documents are read and encoded --batch_mb at a time by the
`tokenizers` batch encoder, which uses every core; a long document is encoded
in pieces (lm.tokenizer.PIECE_RULE, recorded in meta.json), so memory is
bounded by the batch and the largest document's text, not by the corpus.
Folders are walked in order, links to folders followed, the output folder
left out, and so are prepared corpora and workdirs inside them (in a note).
Restartable: a shard is renamed into place when complete and then
listed in DIR/progress.jsonl; a rerun after a kill (or Ctrl-C, or a full
disk) deletes what is not listed, skips the documents the listed shards hold,
and continues, to a result byte-identical to an uninterrupted run. That needs
the same inputs: each input file's size and modification time is recorded at
the start, and its content hash (blake2b) with the first shard after it is
read; a rerun over inputs that changed is refused, naming the file, and so is
one over a finished corpus (meta.json records them too). A run that ends
with no text or an empty split removes what it wrote: it could never finish,
and the rerun with other settings starts clean. DIR/lock keeps a second run
out while one writes (infra.workdir).
"""

from __future__ import annotations

import dataclasses
import errno
import gzip
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import struct
import sys
import sysconfig
from typing import Iterator

import numpy as np

from lm import data
from lm import tokenizer as tokenizer_lib
from infra import workdir as workdir_lib
from infra.errors import UserError
from infra.storage import refuse_url
from infra.cli import run_app
from infra.progress import Progress

META = data.PREPARED_META
PROGRESS = data.PREPARED_PROGRESS
BATCH_MB = 1.0  # Of text encoded at once: ~40 MB of encodings.
FORMAT = 'gqa-lab prepared tokens, version 1'
SPLITS = ('train', 'val')
HELD_OUT_RULE = ('whole documents: a document is held out when '
                 'blake2b(f"{seed}/{source}/{index}") / 2**64 < fraction')


@dataclasses.dataclass
class Document:
  source: str  # Where it comes from: a path (and a JSONL record's index).
  index: int  # The record's line in a JSON Lines file; 0 for a file.
  text: str
  nbytes: int  # Bytes of the input read for it (gzipped or not): progress.


# --- Inputs ------------------------------------------------------------------

def input_files(inputs: list[str], out: pathlib.Path | None = None, say=print
                ) -> list[tuple[pathlib.Path, str]]:
  """(file, its name in the corpus) for every input; folders walked in
  order (`data.folder_files`), the output folder `out` left out. UserError
  for a missing or empty input, or one inside `out`."""
  files = []
  inside = lambda path, folder: out is not None and pathlib.Path(
      os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
  for given in inputs:
    if given == 'embedded':
      root = pathlib.Path(sysconfig.get_paths()['stdlib'])
      files += [(f, f'embedded/{f.relative_to(root)}')
                for f in data.stdlib_files(root)]
      continue
    path = pathlib.Path(given).expanduser()
    if not path.exists():
      raise UserError(f'--input {given!r} does not exist; give text or .jsonl '
                      "files, folders of them, or 'embedded'")
    if inside(path, out):
      raise UserError(f'--input {given!r} is inside --out={out}, which this '
                      'command writes; give an --out outside it')
    if path.is_dir() and (what := output_folder(path)):
      raise UserError(f'--input {given!r} is {what}, not text; give the '
                      'text it was made from')
    found = [path] if path.is_file() else data.folder_files(
        path, leave_out=out, say=say, skip_folder=output_folder)
    if not found or all(f.stat().st_size == 0 for f in found):
      raise UserError(f'--input {given!r} is empty; give it some documents')
    files += [(f, str(pathlib.Path(path.name) / f.relative_to(path))
               if f != path else path.name) for f in found]
  return files


def output_folder(path: pathlib.Path) -> str | None:
  """What the folder is, if an output of this project and not text: a
  prepared corpus (finished or partial) or a workdir (a config.json and
  checkpoints, or a infra.workdir lock); else None."""
  def first_json(file: pathlib.Path):
    try:
      with open(file, 'rb') as f:
        return json.loads(f.readline() if file.suffix == '.jsonl' else
                          f.read(1 << 20))
    except (OSError, ValueError):
      return None
  for name in (META, PROGRESS):
    record = first_json(path / name) if (path / name).is_file() else None
    if isinstance(record, dict) and record.get('format') == FORMAT:
      return 'a prepared corpus' if name == META else (
          'a partial prepared corpus')
  if (path / 'config.json').is_file() and (path / 'checkpoints').is_dir():
    return 'a workdir'
  lock = path / workdir_lib.LOCK_NAME
  if lock.is_file() and lock.stat().st_size < 200 and re.fullmatch(
      rb'(host \S+ pid \d+)?\s*', lock.read_bytes()):
    return 'a workdir'
  return None


def documents(files, text_field: str, begin=lambda index, path: None
              ) -> Iterator[Document]:
  """The documents of `files` in order; the pydoc topics follow the
  embedded corpus's files. begin(index, path) is called before a file's
  documents are read."""
  for index, (path, name) in enumerate(files):
    begin(index, path)
    if _is_jsonl(path):
      yield from _records(path, name, text_field)
    else:
      text = _decode(_open(path).read(), path)  # Not the bytes too.
      yield Document(name, 0, text, path.stat().st_size)
  if any(name.startswith('embedded/') for _, name in files):
    import pydoc_data.topics  # pylint: disable=import-outside-toplevel
    for key, text in sorted(pydoc_data.topics.topics.items()):
      yield Document(f'embedded/pydoc_data/{key}', 0, text, 0)


def _is_jsonl(path: pathlib.Path) -> bool:
  return path.name.removesuffix('.gz').endswith('.jsonl')


def _open(path: pathlib.Path):
  return gzip.open(path, 'rb') if path.suffix == '.gz' else open(path, 'rb')


def _records(path: pathlib.Path, name: str, field: str) -> Iterator[Document]:
  with open(path, 'rb') as raw, (gzip.GzipFile(fileobj=raw) if path.suffix
                                 == '.gz' else raw) as f:
    read = 0  # Of the file on disk: what the progress bar counts.
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(_decode(line, path, number))
      except json.JSONDecodeError as e:
        raise UserError(f'{path} line {number} is not JSON ({e.msg}); fix or '
                        'remove that line') from None
      if not isinstance(record, dict) or not isinstance(record.get(field),
                                                        str):
        raise UserError(f'{path} line {number} has no "{field}" field holding '
                        'a string; set --text_field to the field that holds '
                        'the text')
      position = raw.tell()
      yield Document(name, number, record[field], position - read)
      read = position


def _decode(raw: bytes, path: pathlib.Path, line: int | None = None) -> str:
  """UTF-8 text, a byte-order mark at its start dropped (not text)."""
  try:
    return raw.decode('utf-8').removeprefix('\ufeff')
  except UnicodeDecodeError as e:
    where = f'line {line}' if line else f'byte {e.start}'
    raise UserError(f'{path} is not UTF-8 text ({where}); convert it to UTF-8 '
                    'or leave it out of --input') from None


def input_bytes(files) -> int:
  """The bytes `documents` will report consuming, for the progress bar."""
  return sum(f.stat().st_size for f, _ in files)


def held_out(seed: int, doc: Document, fraction: float) -> bool:
  key = f'{seed}/{doc.source}/{doc.index}'.encode()
  digest = hashlib.blake2b(key, digest_size=8).digest()
  return struct.unpack('<Q', digest)[0] / 2**64 < fraction


# --- The tokenizer -----------------------------------------------------------

def load_tokenizer(given: str, eos_id: int | None):
  """(tokenizer, its tokenizer.json, EOS id, the ids its post-processor puts
  (before, after) a document)."""
  path = pathlib.Path(given).expanduser()
  file = path / tokenizer_lib.FILE if path.is_dir() else path
  if not file.is_file():
    raise UserError(f'--tokenizer={given}: no {tokenizer_lib.FILE} there; give '
                    'a workdir with one (an imported model) or the file')
  tokenizer = (tokenizer_lib.of_workdir(path) if path.is_dir() else
               tokenizer_lib.load(file))
  if eos_id is None:
    eos_id = _eos_of(tokenizer, file)
  if not 0 <= eos_id < tokenizer.vocab_size:
    raise UserError(f'--eos_id={eos_id} is not an id of {file} (0..'
                    f'{tokenizer.vocab_size - 1})')
  return tokenizer, file, eos_id, tokenizer.special_ends()


def _eos_of(tokenizer, file: pathlib.Path) -> int:
  """The model's EOS: its config, tokenizer_config.json, or a known name."""
  eos = tokenizer.eos_ids or tokenizer_lib.named_eos(
      tokenizer, file.with_name('tokenizer_config.json'))
  if not eos:
    raise UserError(f'{file} names no end-of-sequence token (none of '
                    f'{", ".join(tokenizer_lib.EOS_NAMES)}); give --eos_id=N, '
                    'the id that ends each document')
  return eos[0]


# --- What the inputs were ---------------------------------------------------

def digest(path: pathlib.Path) -> str:
  """blake2b of the file's bytes on disk."""
  hashed = hashlib.blake2b(digest_size=16)
  with open(path, 'rb') as f:
    while chunk := f.read(1 << 20):
      hashed.update(chunk)
  return hashed.hexdigest()


class Inputs:
  """The input files as read: [name, size, mtime_ns, blake2b] by index in
  `files`, hashed as each is begun, checked against what an earlier run
  recorded, and handed to the next shard listed (`take`)."""

  def __init__(self, files, recorded: dict[int, list], changed):
    self.files, self.recorded, self._changed = files, recorded, changed
    self.read = dict(recorded)
    self._new = []

  def begin(self, index: int, path: pathlib.Path):
    info = path.stat()
    state = [self.files[index][1], info.st_size, info.st_mtime_ns,
             digest(path)]
    if index in self.recorded and self.recorded[index][3] != state[3]:
      raise self._changed(f'{state[0]} changed (its content)')
    if index not in self.recorded:
      self._new.append([index, *state])
    self.read[index] = state

  def take(self) -> list[list]:
    """[index, name, size, mtime_ns, blake2b] of the files begun since the
    last call: the documents of a shard listed now come from them or from
    those recorded before."""
    new, self._new = self._new, []
    return new


def changed(recorded: dict[int, list], files, *, exactly: bool) -> str | None:
  """The inputs that differ from `recorded` ({index: [name, size, mtime_ns,
  blake2b]}), in words, or None: a file moved in the list or gone, another
  size, or another content where the time differs. exactly: `files` must be
  no more than those recorded (a finished corpus), not only begin with them
  (a partial one, which has not read the rest)."""
  found, names = [], [name for _, name in files]
  for index, (name, size, mtime, content) in sorted(recorded.items()):
    if index >= len(files) or names[index] != name:
      found.append(f'{name} is gone' if name not in names else
                   f'files were added or removed before {name}')
      break  # The rest moved with it.
    now = files[index][0].stat()
    if now.st_size != size:
      found.append(f'{name} changed ({size:,} -> {now.st_size:,} bytes)')
    elif now.st_mtime_ns != mtime and digest(files[index][0]) != content:
      found.append(f'{name} changed (its content)')
  if exactly and not found and len(files) > len(recorded):
    found += [f'{name} is new' for name in names[len(recorded):]]
  if not found:
    return None
  return found[0] + (f' and {len(found) - 1} more' if len(found) > 1 else '')


# --- Shards ------------------------------------------------------------------

class ShardWriter:
  """One split's shards: each written as it fills (a hidden .tmp file, so
  memory does not grow with the shard), renamed into place when complete,
  then listed in progress.jsonl with the inputs begun since the last one
  listed."""

  def __init__(self, out: pathlib.Path, split: str, dtype, shard_tokens: int,
               done: list[dict], inputs: Inputs):
    self.out, self.split, self.dtype = out, split, dtype
    self.shard_tokens = shard_tokens
    self.shards = list(done)
    self.inputs = inputs
    self._file = None

  def add(self, ids: list[int], nbytes: int, end: bool = True):
    """A document's ids, or a piece of them; `end`: its last. A shard ends
    only at a document's end."""
    if self._file is None:
      self._name = f'{self.split}-{len(self.shards):05d}.bin'
      self._file = open(self.out / f'.{self._name}.tmp', 'wb')
      self._tokens = self._docs = self._bytes = self._max = 0
    array = np.asarray(ids, self.dtype)
    self._file.write(array.tobytes())
    self._tokens += array.size
    self._bytes += nbytes
    self._max = max(self._max, int(array.max(initial=0)))
    if end:
      self._docs += 1
      if self._tokens >= self.shard_tokens:
        self.flush()

  def flush(self):
    if self._file is None:
      return
    self._file.close()
    self._file = None
    (self.out / f'.{self._name}.tmp').replace(self.out / self._name)
    shard = dict(split=self.split, file=self._name, tokens=self._tokens,
                 documents=self._docs, bytes=self._bytes, max_id=self._max,
                 inputs=self.inputs.take())
    with open(self.out / PROGRESS, 'a') as f:  # Listed: complete.
      f.write(json.dumps(shard) + '\n')
      f.flush()
      os.fsync(f.fileno())
    self.shards.append(shard)


def _differences(before, now: dict) -> str:
  """' (--flag old -> new, ...)': the settings that differ, or ''."""
  if not isinstance(before, dict):
    return ''
  flags = dict(inputs='--input', tokenizer='--tokenizer')
  found = [f'{flags.get(key, "--" + key)} {before.get(key)} -> {now.get(key)}'
           for key in now if before.get(key) != now.get(key)]
  return f' ({", ".join(found)})' if found else ''


def start(out: pathlib.Path, settings: dict, files, say
          ) -> tuple[dict[str, list[dict]], Inputs] | None:
  """Readies OUT for `settings`; returns the shards already done per split
  (none on a clean start) and the inputs they were read from, or None if OUT
  is that corpus, finished. UserError if OUT holds anything else, or if the
  inputs changed since it was (partly) prepared."""
  if (out / META).exists():
    meta = json.loads((out / META).read_text())
    if meta.get('settings') != settings:
      raise UserError(f'--out={out} holds another corpus'
                      f'{_differences(meta.get("settings"), settings)}; give a '
                      'new --out')
    what = changed(dict(enumerate(meta.get('input_files', []))), files,
                   exactly=True)
    if what:
      raise UserError(f'--out={out} was prepared from inputs that changed '
                      f'since: {what}; give a new --out (or remove {out}) to '
                      'prepare them as they are now')
    return None
  listed = []
  if (out / PROGRESS).exists():
    lines = (out / PROGRESS).read_text().splitlines()
    try:
      header = json.loads(lines[0]) if lines else None
    except ValueError:
      header = None
    if header != settings:
      raise UserError(f'--out={out} holds a partial preparation of another '
                      f'corpus{_differences(header, settings)}; give a new '
                      f'--out, or remove {out} to prepare this one instead')
    listed = [json.loads(line) for line in lines[1:] if line.endswith('}')]
  elif set(os.listdir(out)) - {workdir_lib.LOCK_NAME}:
    raise UserError(f'--out={out} holds other files; give a new or empty '
                    'folder')
  refuse = lambda what: UserError(
      f'--out={out} holds a partial preparation of inputs that changed '
      f'since: {what}; restore them, or give a new --out (or remove {out}) '
      'to prepare them as they are now')
  recorded = {r[0]: r[1:] for s in listed for r in s.get('inputs', [])}
  what = changed(recorded, files, exactly=False)
  if what:
    raise refuse(what)
  keep = {s['file'] for s in listed} | {PROGRESS, workdir_lib.LOCK_NAME}
  for stray in out.iterdir():  # Shards a kill left unlisted, or half-written.
    if stray.name not in keep:
      stray.unlink()
  tmp = out / f'.{PROGRESS}.tmp'
  tmp.write_text(''.join(json.dumps(x) + '\n' for x in [settings, *listed]))
  tmp.replace(out / PROGRESS)
  if listed:
    say(f'continuing an interrupted preparation: {len(listed)} shard(s), '
        f'{sum(s["documents"] for s in listed):,} documents done')
  else:
    say(f'preparing {out} from the start')
  return ({split: [s for s in listed if s['split'] == split]
           for split in SPLITS}, Inputs(files, recorded, refuse))


# --- The command -------------------------------------------------------------

def prepare(inputs: list[str], tokenizer_path: str, out: str, *,
            text_field: str = 'text', val_fraction: float = 0.005,
            seed: int = 0, eos_id: int | None = None,
            shard_tokens: int = 1 << 27, batch_mb: float = BATCH_MB,
            say=print) -> dict:
  """Writes the corpus to OUT (module docstring); returns its meta.json."""
  if not 0 < val_fraction < 1:
    raise UserError(f'--val_fraction={val_fraction} must be in (0, 1)')
  for flag, paths in (('--input', inputs), ('--tokenizer', [tokenizer_path]),
                      ('--out', [out])):
    for path in paths:
      refuse_url(path, flag)
  tokenizer, file, eos_id, ends = load_tokenizer(tokenizer_path, eos_id)
  out = pathlib.Path(out).expanduser().absolute()
  files = input_files(inputs, out, say)
  settings = dict(
      format=FORMAT, inputs=[str(pathlib.Path(i).absolute()) if i !=
                             'embedded' else i for i in inputs],
      tokenizer=tokenizer.fingerprint, text_field=text_field,
      val_fraction=val_fraction, seed=seed, eos_id=eos_id,
      shard_tokens=shard_tokens, piece_chars=tokenizer_lib.PIECE_CHARS)
  if out.exists() and not out.is_dir():
    raise UserError(f'--out={out} is a file; give a folder')
  with workdir_lib.new_or_existing(str(out), '--out'), workdir_lib.lock(
      out, say=say, flag='--out'):
    try:
      return _prepare(out, files, settings, tokenizer, file, ends,
                      batch_mb, say)
    except OSError as e:
      if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        raise
      raise UserError(
          f'no space left on the disk of --out={out} '
          f'({shutil.disk_usage(out).free / 1e6:,.1f} MB free); free space '
          '(or give another --out), then rerun the same command to continue '
          'from its complete shards') from None


def _prepare(out, files, settings, tokenizer, file, ends, batch_mb, say):
  """`prepare` in OUT, locked."""
  begun = start(out, settings, files, say)
  if begun is None:
    say(f'{out} is already prepared from these inputs; nothing to do')
    return json.loads((out / META).read_text())
  done, inputs = begun
  dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
  writers = {split: ShardWriter(out, split, dtype, settings['shard_tokens'],
                                done[split], inputs) for split in SPLITS}
  skip = {split: sum(s['documents'] for s in done[split]) for split in SPLITS}
  seed, fraction = settings['seed'], settings['val_fraction']
  _encode_all(documents(files, settings['text_field'], inputs.begin),
              tokenizer, writers, skip, lambda d: held_out(seed, d, fraction),
              settings['eos_id'], ends, settings['piece_chars'],
              int(batch_mb * 1e6),
              input_bytes(files))
  for writer in writers.values():
    writer.flush()
  return _finish(out, writers, tokenizer, file, ends, settings,
                 [inputs.read[i] for i in range(len(files))])


@dataclasses.dataclass
class Piece:
  """A document's text, or a piece of it (tokenizer.pieces), to encode."""
  split: str
  text: str
  first: bool
  last: bool


def _encode_all(docs, tokenizer, writers, skip, is_val, eos_id: int, ends,
                piece_chars: int, batch_bytes: int, total_bytes: int):
  """Encodes `docs` a batch at a time into the writers, skipping each
  split's first `skip[split]` documents (done before an interruption)."""
  seen = dict.fromkeys(SPLITS, 0)
  batch, size = [], 0
  with Progress('tokenizing', max(total_bytes, 1), unit='MB',
                scale=1e6) as bar:
    for doc in docs:
      split = 'val' if is_val(doc) else 'train'
      seen[split] += 1
      bar.advance(doc.nbytes)
      if seen[split] <= skip[split]:
        continue
      pieces = tokenizer_lib.pieces(doc.text, piece_chars)
      piece, first = next(pieces), True
      while piece is not None:
        after = next(pieces, None)
        batch.append(Piece(split, piece, first, after is None))
        size += len(piece)
        if size >= batch_bytes:
          _encode_batch(batch, tokenizer, writers, eos_id, ends)
          batch, size = [], 0
        piece, first = after, False
    _encode_batch(batch, tokenizer, writers, eos_id, ends)


def _encode_batch(batch: list[Piece], tokenizer, writers, eos_id: int, ends):
  """Pieces encoded in parallel; a document's first begins with the
  post-processor's ids (a BOS, for most), its last ends in EOS."""
  before, after = ends
  for piece, ids in zip(batch, tokenizer.encode_pieces(
      [piece.text for piece in batch], [not piece.first for piece in batch])):
    ids = (before if piece.first else []) + ids + (after if piece.last else [])
    if piece.last and (not ids or ids[-1] != eos_id):  # Unless added.
      ids.append(eos_id)
    writers[piece.split].add(ids, len(piece.text.encode()), end=piece.last)


def _documents(count: int) -> str:
  return f'{count:,} document{"" if count == 1 else "s"}'


def _discard(out: pathlib.Path, shards: list[dict]):
  """Removes a preparation that can never finish with its settings (its
  shards and progress.jsonl: no rerun could continue it), so that the rerun
  the error advises, with other settings, is not refused as another corpus's
  partial preparation; a folder this run created goes too
  (workdir.new_or_existing)."""
  for shard in shards:
    (out / shard['file']).unlink(missing_ok=True)
  (out / PROGRESS).unlink(missing_ok=True)


def _finish(out, writers, tokenizer, file, ends, settings, inputs):
  shards = [s for w in writers.values() for s in w.shards]
  kept = f'; nothing was kept in --out={out}'
  if not sum(s['bytes'] for s in shards):
    count = sum(s['documents'] for s in shards)
    _discard(out, shards)
    raise UserError(
        f'--input {",".join(settings["inputs"])} holds no text ('
        + (f'{_documents(count)}, all empty' if count else 'only blank lines')
        + ')' + kept + '; give it documents with text')
  splits = {}
  for split, writer in writers.items():
    if not writer.shards:
      _discard(out, shards)
      raise UserError(
          f'no document went to the {split} split '
          f'({_documents(sum(s["documents"] for s in shards))}, '
          f'--val_fraction={settings["val_fraction"]})' + kept + '; '
          + ('raise --val_fraction, or give more, smaller documents (a text '
             'file is one document)' if split == 'val' else
             'lower --val_fraction'))
    splits[split] = dict(
        tokens=sum(s['tokens'] for s in writer.shards),
        documents=sum(s['documents'] for s in writer.shards),
        bytes=sum(s['bytes'] for s in writer.shards),
        shards=[{k: s[k] for k in ('file', 'tokens', 'documents', 'bytes')}
                for s in writer.shards])
  before, _ = ends
  meta = dict(
      format=FORMAT, dtype=np.dtype(writers['train'].dtype).name,
      vocab_size=tokenizer.vocab_size,
      max_id=max(s['max_id'] for s in shards),
      tokenizer=dict(fingerprint=tokenizer.fingerprint, source=str(file)),
      eos_id=settings['eos_id'],
      bos_id=before[0] if len(before) == 1 else None, splits=splits,
      validation=dict(rule=HELD_OUT_RULE, fraction=settings['val_fraction'],
                      seed=settings['seed']),
      long_documents=dict(rule=tokenizer_lib.PIECE_RULE,
                          piece_chars=settings['piece_chars']),
      settings=settings, input_files=inputs)
  shutil.copyfile(file, out / tokenizer_lib.FILE)
  tmp = out / f'.{META}.tmp'
  tmp.write_text(json.dumps(meta, indent=1))
  tmp.replace(out / META)  # Last: now the folder is a corpus.
  (out / PROGRESS).unlink()
  return meta


def main(argv):
  from absl import flags  # pylint: disable=import-outside-toplevel
  del argv
  f = flags.FLAGS
  try:
    meta = prepare([i for i in f.input.split(',') if i], f.tokenizer, f.out,
                   text_field=f.text_field, val_fraction=f.val_fraction,
                   seed=f.seed, eos_id=None if f.eos_id < 0 else f.eos_id,
                   shard_tokens=f.shard_tokens, batch_mb=f.batch_mb,
                   say=lambda text: print(text, file=sys.stderr))
  except KeyboardInterrupt:  # Ctrl-C: the listed shards are complete.
    print(f'\ninterrupted; {f.out} keeps its complete shards: rerun the same '
          'command to continue', file=sys.stderr)
    sys.exit(128 + signal.SIGINT)
  train, val = meta['splits']['train'], meta['splits']['val']
  print(f'wrote {f.out}: {train["tokens"]:,} training tokens '
        f'({_documents(train["documents"])}) and {val["tokens"]:,} held '
        f'out ({val["documents"]:,}), {meta["dtype"]}, vocabulary '
        f'{meta["vocab_size"]:,}')


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('input', None, "text/.jsonl files or folders, comma-"
                      "separated; 'embedded' for the embedded corpus")
  flags.DEFINE_string('tokenizer', None, 'a workdir or a tokenizer.json')
  flags.DEFINE_string('out', None, 'the folder to write')
  flags.DEFINE_string('text_field', 'text', 'the text of a JSON Lines record')
  flags.DEFINE_float('val_fraction', 0.005, 'documents held out')
  flags.DEFINE_integer('seed', 0, 'which documents are held out')
  flags.DEFINE_integer('eos_id', -1, "the id ending each document; -1: the "
                       "tokenizer's")
  flags.DEFINE_integer('shard_tokens', 1 << 27, 'tokens per shard (at least)',
                       lower_bound=1)
  flags.DEFINE_float('batch_mb', BATCH_MB, 'text encoded at once (MB)',
                    lower_bound=0)
  run_app(main, required=['input', 'tokenizer', 'out'])


if __name__ == '__main__':
  run()
