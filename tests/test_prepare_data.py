"""train.prepare_data: a corpus tokenized once into shards, and trained on.

The corpus must decode back to its documents, EOS after each; the held-out
split is whole documents; a killed preparation resumes to the same bytes;
every bad input is one line; train.main reads the shards and refuses a
corpus made with another tokenizer.
"""

import gzip
import json
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import tiny
from train import data, loop, prepare_data
from train import tokenizer as tokenizer_lib
from train.errors import UserError

REPO = pathlib.Path(__file__).parent.parent


def _word_tokenizer(path: pathlib.Path, size: int, eos: bool = True):
  """A word-level tokenizer of `size` ids (w0, w1, ..., [UNK], </s>, <s>);
  its post-processor puts <s> first, as Llama's does."""
  from tokenizers import (Tokenizer, models, pre_tokenizers, processors,  # pylint: disable=import-outside-toplevel
                          decoders)
  specials = ['[UNK]', '</s>', '<s>'] if eos else ['[UNK]', '<s>']
  words = size - len(specials)
  vocab = {f'w{i}': i for i in range(words)}
  vocab.update({s: words + i for i, s in enumerate(specials)})
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.decoder = decoders.WordPiece(prefix='##')  # Joins with spaces.
  tokenizer.post_processor = processors.TemplateProcessing(
      single='<s> $A', special_tokens=[('<s>', vocab['<s>'])])
  tokenizer.save(str(path))
  return path, vocab


def _corpus(root: pathlib.Path, n_files=12, n_records=30):
  """Text files (one gzipped) and a JSON Lines file; returns the documents."""
  rng = np.random.default_rng(0)
  words = lambda n: ' '.join(f'w{i}' for i in rng.integers(0, 90, n))
  (root / 'texts').mkdir(parents=True)
  docs = []
  for i in range(n_files):
    text = words(5 + i)
    docs.append(text)
    if i == 0:
      with gzip.open(root / 'texts' / 'a0.txt.gz', 'wt') as f:
        f.write(text)
    else:
      (root / 'texts' / f'a{i:02d}.txt').write_text(text)
  records = [words(3 + i % 7) for i in range(n_records)]
  with open(root / 'records.jsonl', 'w') as f:
    for i, text in enumerate(records):
      f.write(json.dumps({'id': i, 'text': text}) + '\n')
      if i == 4:
        f.write('\n')  # Blank lines are skipped.
  return docs + records


def _tokens(out: pathlib.Path, split: str) -> np.ndarray:
  meta = json.loads((out / 'meta.json').read_text())
  return np.concatenate([np.fromfile(out / s['file'], meta['dtype'])
                         for s in meta['splits'][split]['shards']])


def test_a_prepared_corpus_decodes_back_to_its_documents_with_eos_between(
    tmp_path):
  path, vocab = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  docs = _corpus(tmp_path)
  meta = prepare_data.prepare(
      [str(tmp_path / 'texts'), str(tmp_path / 'records.jsonl')], str(path),
      str(tmp_path / 'out'), val_fraction=0.2, shard_tokens=50)
  eos, bos = vocab['</s>'], vocab['<s>']
  assert (meta['eos_id'], meta['bos_id'], meta['dtype']) == (eos, bos,
                                                             'uint16')
  tokenizer = tokenizer_lib.load(path)
  decoded = {}
  for split in ('train', 'val'):
    tokens = _tokens(tmp_path / 'out', split)
    assert tokens[-1] == eos  # Shards end at document boundaries.
    pieces = np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]
    assert all(p[0] == bos and p[-1] == eos for p in pieces)
    decoded[split] = [tokenizer.decode(p[1:-1]) for p in pieces]
    counts = meta['splits'][split]
    assert counts['documents'] == len(pieces) and counts['tokens'] == len(
        tokens)
    assert counts['bytes'] == sum(len(d.encode()) for d in decoded[split])
  assert sorted(decoded['train'] + decoded['val']) == sorted(docs)
  assert 0 < len(decoded['val']) < len(docs) / 2  # Whole documents held out.
  assert len(meta['splits']['train']['shards']) > 3
  assert meta['tokenizer']['fingerprint'] == tokenizer.fingerprint
  assert meta['validation']['fraction'] == 0.2
  assert (tmp_path / 'out' / 'tokenizer.json').read_bytes() == path.read_bytes()
  loaded = data.load(str(tmp_path / 'out'), val_fraction=0.1, seq_len=8)
  assert loaded.bytes_per_token == pytest.approx(
      meta['splits']['val']['bytes'] / meta['splits']['val']['tokens'])
  # Windows that span shards read across them, as one sequence.
  np.testing.assert_array_equal(loaded.train[40:140],
                                _tokens(tmp_path / 'out', 'train')[40:140])


@pytest.mark.slow
def test_a_vocabulary_above_65536_gives_uint32_shards_that_train(tmp_path):
  path, vocab = _word_tokenizer(tmp_path / 'tokenizer.json', 70_001)
  _corpus(tmp_path, n_files=40, n_records=200)
  with open(tmp_path / 'records.jsonl', 'a') as f:  # Ids above 65,535.
    f.write(json.dumps({'text': 'w69990 w69997 ' * 50}) + '\n')
  meta = prepare_data.prepare([str(tmp_path)], str(path),
                              str(tmp_path / 'out'), val_fraction=0.1)
  assert meta['dtype'] == 'uint32' and meta['max_id'] == vocab['<s>']
  assert _tokens(tmp_path / 'out', 'train').max() >= 69_990 or _tokens(
      tmp_path / 'out', 'val').max() >= 69_990
  config = tiny.get_config()
  config.model.vocab_size = 70_001
  config.data.update(path=str(tmp_path / 'out'), seq_len=16)
  config.train.update(steps=3, warmup_steps=1, eval_every=3, eval_batches=1)
  record = loop.train_and_evaluate(config, str(tmp_path / 'w'))
  assert np.isfinite(record['eval_loss']) and 'eval_bpb' in record
  # The workdir remembers the corpus's tokenizer, for sampling, which stops
  # at the EOS that separated its documents.
  assert (tmp_path / 'w' / 'tokenizer.json').read_bytes() == path.read_bytes()
  assert tokenizer_lib.of_workdir(tmp_path / 'w').eos_ids == (vocab['</s>'],)


def test_a_corpus_made_with_another_tokenizer_is_refused(tmp_path):
  path, _ = _word_tokenizer(tmp_path / 'a.json', 100)
  other, _ = _word_tokenizer(tmp_path / 'b.json', 120)
  _corpus(tmp_path)
  prepare_data.prepare([str(tmp_path / 'texts')], str(path),
                       str(tmp_path / 'out'), val_fraction=0.3)
  config = tiny.get_config()
  config.data.update(path=str(tmp_path / 'out'), seq_len=8,
                     tokenizer=str(other))
  config.model.vocab_size = 120
  fingerprint = tokenizer_lib.load(path).fingerprint
  with pytest.raises(UserError, match=(
      f'was prepared with the tokenizer {fingerprint} .* but this run\'s is '
      f'.*b.json \\({tokenizer_lib.load(other).fingerprint}\\); prepare it')):
    loop.train_and_evaluate(config, str(tmp_path / 'w'))
  config.model.vocab_size = 64  # Every id of the corpus must fit the model.
  config.data.tokenizer = str(path)
  with pytest.raises(UserError, match='set model.vocab_size >= 100'):
    loop.train_and_evaluate(config, str(tmp_path / 'w2'))
  assert not (tmp_path / 'w').exists() and not (tmp_path / 'w2').exists()


def _prepare(*args, timeout=300):
  return subprocess.run([sys.executable, '-m', 'train.prepare_data', *args],
                        cwd=REPO, capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.slow
def test_a_kill_mid_prepare_then_a_rerun_gives_the_same_shards(tmp_path):
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  rng = np.random.default_rng(1)
  with open(tmp_path / 'records.jsonl', 'w') as f:  # 2,000 documents, 6 MB.
    for _ in range(2000):
      text = ' '.join(f'w{i}' for i in rng.integers(0, 97, 800))
      f.write(json.dumps({'text': text}) + '\n')
  args = [f'--input={tmp_path / "records.jsonl"}', f'--tokenizer={path}',
          '--shard_tokens=20000', '--batch_mb=0.05', '--val_fraction=0.05']
  straight = _prepare(*args, f'--out={tmp_path / "straight"}')
  assert straight.returncode == 0, straight.stderr[-2000:]
  assert f'preparing {tmp_path / "straight"} from the start' in straight.stderr

  killed = tmp_path / 'killed'
  proc = subprocess.Popen(
      [sys.executable, '-m', 'train.prepare_data', *args, f'--out={killed}'],
      cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  listed = lambda: len((killed / 'progress.jsonl').read_text().splitlines()) \
      if (killed / 'progress.jsonl').exists() else 0
  deadline = time.time() + 120
  while proc.poll() is None and listed() < 4 and time.time() < deadline:
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL  # Killed mid-way, not finished.
  assert not (killed / 'meta.json').exists()  # Not a corpus yet.
  with pytest.raises(UserError, match='a train.prepare_data run that did not finish'):
    data.load(str(killed), val_fraction=0.1, seq_len=8)

  resumed = _prepare(*args, f'--out={killed}')
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert 'continuing an interrupted preparation: ' in resumed.stderr
  files = lambda d: {p.name: p.read_bytes() for p in d.iterdir()}
  assert files(killed) == files(tmp_path / 'straight')
  again = _prepare(*args, f'--out={killed}')
  assert 'already prepared from these inputs; nothing to do' in again.stderr


def _bad(tmp_path, **changes):
  """prepare() on a small valid corpus, with `changes` to its arguments."""
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  if not (tmp_path / 'texts').exists():
    _corpus(tmp_path)
  kwargs = dict(inputs=[str(tmp_path / 'texts')], tokenizer_path=str(path),
                out=str(tmp_path / 'out'), val_fraction=0.3)
  kwargs.update(changes)
  return prepare_data.prepare(**kwargs)


def test_every_bad_input_is_one_line_naming_the_file(tmp_path):
  _corpus(tmp_path)
  (tmp_path / 'latin1.txt').write_bytes('caf\xe9'.encode('latin-1'))
  (tmp_path / 'bad.jsonl').write_text('{"text": "ok"}\n{"text": \n')
  (tmp_path / 'nofield.jsonl').write_text('{"text": "ok"}\n{"body": "x"}\n')
  (tmp_path / 'empty').mkdir()
  no_eos, _ = _word_tokenizer(tmp_path / 'no_eos.json', 50, eos=False)
  cases = [
      (dict(inputs=[str(tmp_path / 'nope')]), "--input '.*nope' does not "
       'exist'),
      (dict(inputs=[str(tmp_path / 'empty')]), "--input '.*empty' is empty"),
      (dict(inputs=[str(tmp_path / 'latin1.txt')]),
       r'latin1.txt is not UTF-8 text \(byte 3\)'),
      (dict(inputs=[str(tmp_path / 'bad.jsonl')]),
       r'bad.jsonl line 2 is not JSON \(Expecting value\)'),
      (dict(inputs=[str(tmp_path / 'nofield.jsonl')]),
       'nofield.jsonl line 2 has no "text" field holding a string; set '
       '--text_field'),
      (dict(tokenizer_path=str(no_eos)),
       'no_eos.json names no end-of-sequence token .*; give --eos_id=N'),
      (dict(val_fraction=1e-9), 'no document went to the val split'),
      (dict(val_fraction=1.5), r'--val_fraction=1.5 must be in \(0, 1\)'),
  ]
  for i, (changes, message) in enumerate(cases):
    with pytest.raises(UserError, match=message):
      _bad(tmp_path, **changes, out=str(tmp_path / f'out_bad{i}'))
    assert not (tmp_path / f'out_bad{i}' / 'meta.json').exists()
  _bad(tmp_path, tokenizer_path=str(no_eos), eos_id=3,
       out=str(tmp_path / 'told'))  # Told which id ends a document.
  _bad(tmp_path)
  with pytest.raises(UserError, match='holds another corpus'):
    _bad(tmp_path, val_fraction=0.4)
  (tmp_path / 'other').mkdir()
  (tmp_path / 'other' / 'notes.txt').write_text('mine')
  with pytest.raises(UserError, match='holds other files'):
    _bad(tmp_path, out=str(tmp_path / 'other'))


def test_the_command_line_is_one_line_too(tmp_path):
  result = _prepare(f'--input={tmp_path / "nope"}',
                    f'--tokenizer={tmp_path}', f'--out={tmp_path / "out"}')
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      f'error: --tokenizer={tmp_path}: no tokenizer.json there; give a '
      'workdir with one (an imported model) or the file']
