"""Tokenizes a corpus once into shards of token ids: `python -m train.prepare_data`.

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
`tokenizers` batch encoder, which uses every core; memory is bounded by the
batch and the largest document, not by the corpus. Restartable: a shard is
renamed into place when complete and then listed in DIR/progress.jsonl; a
rerun after a kill deletes what is not listed, skips the documents the listed
shards hold, and continues, to a result byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import pathlib
import shutil
import struct
import sys
import sysconfig
from typing import Iterator

import numpy as np

from train import data
from train import tokenizer as tokenizer_lib
from train.errors import UserError
from train.storage import refuse_url
from train.cli import run_app
from train.progress import Progress

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

def input_files(inputs: list[str]) -> list[tuple[pathlib.Path, str]]:
  """(file, its name in the corpus) for every input; folders walked in
  order, hidden files skipped. UserError for a missing or empty input."""
  files = []
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
    found = [path] if path.is_file() else sorted(
        f for f in path.rglob('*') if f.is_file() and not any(
            part.startswith('.') for part in f.relative_to(path).parts))
    if not found or all(f.stat().st_size == 0 for f in found):
      raise UserError(f'--input {given!r} is empty; give it some documents')
    files += [(f, str(pathlib.Path(path.name) / f.relative_to(path))
               if f != path else path.name) for f in found]
  return files


def documents(files, text_field: str) -> Iterator[Document]:
  """The documents of `files` in order; the pydoc topics follow the
  embedded corpus's files."""
  for path, name in files:
    if _is_jsonl(path):
      yield from _records(path, name, text_field)
    else:
      raw = _open(path).read()
      yield Document(name, 0, _decode(raw, path), path.stat().st_size)
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
  try:
    return raw.decode('utf-8')
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
  """(tokenizer, its tokenizer.json, EOS id, BOS id or None)."""
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
  with_special = tokenizer.encode('a')
  plain = tokenizer.encode('a', special=False)
  bos = int(with_special[0]) if len(with_special) > len(plain) and list(
      with_special[1:]) == list(plain) else None
  return tokenizer, file, eos_id, bos


def _eos_of(tokenizer, file: pathlib.Path) -> int:
  """The model's EOS: its config, tokenizer_config.json, or a known name."""
  eos = tokenizer.eos_ids or tokenizer_lib.named_eos(
      tokenizer, file.with_name('tokenizer_config.json'))
  if not eos:
    raise UserError(f'{file} names no end-of-sequence token (none of '
                    f'{", ".join(tokenizer_lib.EOS_NAMES)}); give --eos_id=N, '
                    'the id that ends each document')
  return eos[0]


# --- Shards ------------------------------------------------------------------

class ShardWriter:
  """One split's shards: each written as it fills (a hidden .tmp file, so
  memory does not grow with the shard), renamed into place when complete,
  then listed in progress.jsonl."""

  def __init__(self, out: pathlib.Path, split: str, dtype, shard_tokens: int,
               done: list[dict]):
    self.out, self.split, self.dtype = out, split, dtype
    self.shard_tokens = shard_tokens
    self.shards = list(done)
    self._file = None

  def add(self, ids: list[int], nbytes: int):
    if self._file is None:
      self._name = f'{self.split}-{len(self.shards):05d}.bin'
      self._file = open(self.out / f'.{self._name}.tmp', 'wb')
      self._tokens = self._docs = self._bytes = self._max = 0
    array = np.asarray(ids, self.dtype)
    self._file.write(array.tobytes())
    self._tokens += array.size
    self._docs += 1
    self._bytes += nbytes
    self._max = max(self._max, int(array.max()))
    if self._tokens >= self.shard_tokens:
      self.flush()

  def flush(self):
    if self._file is None:
      return
    self._file.close()
    self._file = None
    (self.out / f'.{self._name}.tmp').replace(self.out / self._name)
    shard = dict(split=self.split, file=self._name, tokens=self._tokens,
                 documents=self._docs, bytes=self._bytes, max_id=self._max)
    with open(self.out / PROGRESS, 'a') as f:  # Listed: complete.
      f.write(json.dumps(shard) + '\n')
      f.flush()
      os.fsync(f.fileno())
    self.shards.append(shard)


def start(out: pathlib.Path, settings: dict, say
          ) -> dict[str, list[dict]] | None:
  """Readies OUT for `settings`; returns the shards already done per split
  (none on a clean start), or None if OUT is that corpus, finished.
  UserError if OUT holds anything else."""
  if (out / META).exists():
    meta = json.loads((out / META).read_text())
    if meta.get('settings') == settings:
      return None
    raise UserError(f'--out={out} holds another corpus (prepared with other '
                    'inputs or settings); give a new --out')
  if out.exists() and not out.is_dir():
    raise UserError(f'--out={out} is a file; give a folder')
  out.mkdir(parents=True, exist_ok=True)
  listed = []
  if (out / PROGRESS).exists():
    lines = (out / PROGRESS).read_text().splitlines()
    try:
      header = json.loads(lines[0]) if lines else None
    except ValueError:
      header = None
    if header != settings:
      raise UserError(f'--out={out} holds a partial preparation of another '
                      'corpus; give a new --out, or remove it')
    listed = [json.loads(line) for line in lines[1:] if line.endswith('}')]
  elif any(out.iterdir()):
    raise UserError(f'--out={out} holds other files; give a new or empty '
                    'folder')
  for stray in out.iterdir():  # Shards a kill left unlisted, or half-written.
    if stray.name not in {s['file'] for s in listed} | {PROGRESS}:
      stray.unlink()
  tmp = out / f'.{PROGRESS}.tmp'
  tmp.write_text(''.join(json.dumps(x) + '\n' for x in [settings, *listed]))
  tmp.replace(out / PROGRESS)
  if listed:
    say(f'continuing an interrupted preparation: {len(listed)} shard(s), '
        f'{sum(s["documents"] for s in listed):,} documents done')
  else:
    say(f'preparing {out} from the start')
  return {split: [s for s in listed if s['split'] == split]
          for split in SPLITS}


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
  tokenizer, file, eos_id, bos_id = load_tokenizer(tokenizer_path, eos_id)
  files = input_files(inputs)
  settings = dict(
      format=FORMAT, inputs=[str(pathlib.Path(i).absolute()) if i !=
                             'embedded' else i for i in inputs],
      tokenizer=tokenizer.fingerprint, text_field=text_field,
      val_fraction=val_fraction, seed=seed, eos_id=eos_id,
      shard_tokens=shard_tokens)
  out = pathlib.Path(out).expanduser()
  done = start(out, settings, say)
  if done is None:
    say(f'{out} is already prepared from these inputs; nothing to do')
    return json.loads((out / META).read_text())
  dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
  writers = {split: ShardWriter(out, split, dtype, shard_tokens, done[split])
             for split in SPLITS}
  skip = {split: sum(s['documents'] for s in done[split]) for split in SPLITS}
  _encode_all(documents(files, text_field), tokenizer, writers, skip,
              lambda d: held_out(seed, d, val_fraction), eos_id,
              int(batch_mb * 1e6), input_bytes(files))
  for writer in writers.values():
    writer.flush()
  return _finish(out, writers, tokenizer, file, eos_id, bos_id, dtype,
                 settings)


def _encode_all(docs, tokenizer, writers, skip, is_val, eos_id: int,
                batch_bytes: int, total_bytes: int):
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
      batch.append((split, doc.text))
      size += len(doc.text)
      if size >= batch_bytes:
        _encode_batch(batch, tokenizer, writers, eos_id)
        batch, size = [], 0
    _encode_batch(batch, tokenizer, writers, eos_id)


def _encode_batch(batch: list[tuple[str, str]], tokenizer, writers,
                  eos_id: int):
  """(split, text) pairs, encoded in parallel, each ending in EOS."""
  for (split, text), ids in zip(batch, tokenizer.encode_documents(
      [text for _, text in batch])):
    if not ids or ids[-1] != eos_id:  # Unless the post-processor adds it.
      ids.append(eos_id)
    writers[split].add(ids, len(text.encode()))


def _finish(out, writers, tokenizer, file, eos_id, bos_id, dtype, settings):
  splits = {}
  for split, writer in writers.items():
    shards = writer.shards
    if not shards:
      total = sum(s['documents'] for w in writers.values() for s in w.shards)
      raise UserError(
          f'no document went to the {split} split ({total:,} documents, '
          f'--val_fraction={settings["val_fraction"]}); '
          + ('raise --val_fraction, or give more, smaller documents (a text '
             'file is one document)' if split == 'val' else
             'lower --val_fraction'))
    splits[split] = dict(
        tokens=sum(s['tokens'] for s in shards),
        documents=sum(s['documents'] for s in shards),
        bytes=sum(s['bytes'] for s in shards),
        shards=[{k: s[k] for k in ('file', 'tokens', 'documents', 'bytes')}
                for s in shards])
  meta = dict(
      format=FORMAT, dtype=np.dtype(dtype).name,
      vocab_size=tokenizer.vocab_size,
      max_id=max(s['max_id'] for w in writers.values() for s in w.shards),
      tokenizer=dict(fingerprint=tokenizer.fingerprint, source=str(file)),
      eos_id=eos_id, bos_id=bos_id, splits=splits,
      validation=dict(rule=HELD_OUT_RULE, fraction=settings['val_fraction'],
                      seed=settings['seed']),
      settings=settings)
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
  meta = prepare([i for i in f.input.split(',') if i], f.tokenizer, f.out,
                 text_field=f.text_field, val_fraction=f.val_fraction,
                 seed=f.seed, eos_id=None if f.eos_id < 0 else f.eos_id,
                 shard_tokens=f.shard_tokens, batch_mb=f.batch_mb,
                 say=lambda text: print(text, file=sys.stderr))
  train, val = meta['splits']['train'], meta['splits']['val']
  print(f'wrote {f.out}: {train["tokens"]:,} training tokens '
        f'({train["documents"]:,} documents) and {val["tokens"]:,} held out '
        f'({val["documents"]:,}), {meta["dtype"]}, vocabulary '
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
