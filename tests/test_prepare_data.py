"""train.prepare_data: a corpus tokenized once into shards, and trained on.

The corpus must decode back to its documents, EOS after each; the held-out
split is whole documents; a killed preparation resumes to the same bytes;
every bad input is one line; train.main reads the shards and refuses a
corpus made with another tokenizer.
"""

import errno
import gzip
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import tiny
from lm import data
from train import loop, prepare_data
from lm import tokenizer as tokenizer_lib
from infra.errors import UserError

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
  _stop_mid_way(args, killed, signal.SIGKILL)
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

  # Ctrl-C: one line (no traceback), and the same again.
  stopped = _stop_mid_way(args, tmp_path / 'ctrl_c', signal.SIGINT)
  assert stopped.returncode == 128 + signal.SIGINT
  assert stopped.stderr.strip().splitlines()[-1] == (
      f'interrupted; {tmp_path / "ctrl_c"} keeps its complete shards: rerun '
      'the same command to continue')
  assert 'Traceback' not in stopped.stderr
  assert _prepare(*args, f'--out={tmp_path / "ctrl_c"}').returncode == 0
  assert files(tmp_path / 'ctrl_c') == files(tmp_path / 'straight')


def _stop_mid_way(args, out: pathlib.Path, signum: int):
  """Runs the command into OUT, sending it `signum` once 3 shards are
  listed; the finished process (stderr read)."""
  # The child at the lowest priority: on a busy machine this process could
  # wake only after the child had finished all 80 shards (the signal then
  # reached no one: a flaky pass of 0); now it wakes first.
  # (`nice` execs the command: the signal reaches the child itself.)
  # If it still finishes before the signal (nothing was interrupted, so
  # nothing was tested), it is run again into a fresh OUT, up to 3 times.
  listed = lambda: len((out / 'progress.jsonl').read_text().splitlines()) \
      if (out / 'progress.jsonl').exists() else 0
  for _ in range(3):
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.Popen(
        ['nice', '-n', '19', sys.executable, '-m', 'train.prepare_data',
         *args, f'--out={out}'],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    deadline = time.time() + 120
    while proc.poll() is None and listed() < 4 and time.time() < deadline:
      time.sleep(0.01)
    proc.send_signal(signum)
    _, proc.stderr = proc.communicate(timeout=60)
    if proc.returncode != 0:
      break
  assert proc.returncode in (-signum, 128 + signum), proc.stderr[-2000:]
  return proc  # Stopped mid-way, not finished.


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


# --- Reruns, inputs and faults (issue 39) -------------------------------------

def _records(path: pathlib.Path, n: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  with open(path, 'w') as f:
    for _ in range(n):
      f.write(json.dumps({'text': ' '.join(
          f'w{i}' for i in rng.integers(0, 90, 6))}) + '\n')


def _interrupted(monkeypatch, after: int, exception=KeyboardInterrupt):
  """Makes the next prepare() raise `exception` as it is about to list its
  shard number `after` + 1 (the shards before it listed)."""
  flush, calls = prepare_data.ShardWriter.flush, []

  def failing(writer):
    if writer._file is not None:
      calls.append(1)
      if len(calls) > after:
        monkeypatch.setattr(prepare_data.ShardWriter, 'flush', flush)
        raise exception
    flush(writer)
  monkeypatch.setattr(prepare_data.ShardWriter, 'flush', failing)


def _files(folder: pathlib.Path) -> dict:
  return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_rerun_over_changed_inputs_is_refused_naming_the_file(
    tmp_path, monkeypatch):
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  inputs = tmp_path / 'in'
  inputs.mkdir()
  _records(inputs / 'a.jsonl', 60)
  _records(inputs / 'b.jsonl', 30, seed=1)
  run = lambda out: prepare_data.prepare(
      [str(inputs)], str(path), str(tmp_path / out), val_fraction=0.2,
      shard_tokens=40, batch_mb=1e-4, say=lambda _: None)
  _interrupted(monkeypatch, after=3)
  with pytest.raises(KeyboardInterrupt):
    run('out')  # Three shards of a.jsonl listed; b.jsonl not yet read.
  a = (inputs / 'a.jsonl').read_text()
  (inputs / 'a.jsonl').write_text(a[:len(a) // 2])  # Shrunk.
  before = _files(tmp_path / 'out')
  with pytest.raises(UserError, match=(
      'holds a partial preparation of inputs that changed since: in/a.jsonl '
      r'changed \(.* -> .* bytes\); restore them, or give a new --out')):
    run('out')
  assert _files(tmp_path / 'out') == before  # Nothing deleted.
  # The same size and time, another content: found as it is read again.
  stat = (inputs / 'a.jsonl').stat()
  (inputs / 'a.jsonl').write_text(a.replace('w1 ', 'w2 '))
  os.utime(inputs / 'a.jsonl', ns=(stat.st_atime_ns, stat.st_mtime_ns))
  with pytest.raises(UserError, match=r'in/a.jsonl changed \(its content\)'):
    run('out')
  # Restored (a copy: another time), and a file not read yet replaced: the
  # rerun gives what a fresh run on today's inputs gives.
  (inputs / 'a.jsonl').write_text(a)
  _records(inputs / 'b.jsonl', 20, seed=2)
  run('out')
  run('fresh')
  assert _files(tmp_path / 'out') == _files(tmp_path / 'fresh')

  # A finished corpus: a rerun says "nothing to do" only over the same
  # inputs (a file touched is the same), and names what changed.
  said = []
  rerun = lambda: prepare_data.prepare(
      [str(inputs)], str(path), str(tmp_path / 'out'), val_fraction=0.2,
      shard_tokens=40, batch_mb=1e-4, say=said.append)
  os.utime(inputs / 'a.jsonl')
  rerun()
  assert said[-1].endswith('is already prepared from these inputs; nothing '
                           'to do')
  b = (inputs / 'b.jsonl').read_text()
  (inputs / 'b.jsonl').write_text(b[:-50])
  with pytest.raises(UserError, match=(
      'was prepared from inputs that changed since: in/b.jsonl changed '
      r'\(.* bytes\); give a new --out')):
    rerun()
  (inputs / 'b.jsonl').write_text(b)
  (inputs / 'c.jsonl').write_text('{"text": "w1"}\n')
  with pytest.raises(UserError, match='in/c.jsonl is new; give a new --out'):
    rerun()
  assert _files(tmp_path / 'out') == _files(tmp_path / 'fresh')


def test_linked_folders_are_read_and_a_link_loop_is_skipped_with_a_note(
    tmp_path):
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'elsewhere').mkdir()
  (tmp_path / 'docs' / 'a.txt').write_text('w1 w2')
  for i in range(3):
    (tmp_path / 'elsewhere' / f'b{i}.txt').write_text(f'w{i} w9')
  (tmp_path / 'docs' / 'more').symlink_to(tmp_path / 'elsewhere')
  (tmp_path / 'elsewhere' / 'again').symlink_to(tmp_path / 'docs')  # A loop.
  said = []
  meta = prepare_data.prepare([str(tmp_path / 'docs')], str(path),
                              str(tmp_path / 'out'), val_fraction=0.5,
                              say=said.append)
  assert [name for name, *_ in meta['input_files']] == [
      'docs/a.txt', 'docs/more/b0.txt', 'docs/more/b1.txt', 'docs/more/b2.txt']
  assert sum(meta['splits'][s]['documents'] for s in ('train', 'val')) == 4
  assert any(line.startswith(f'note: skipping {tmp_path}/docs/more/again, a '
                             'link to') for line in said)
  # Text read as bytes by train.main follows them too.
  loaded = data.load(str(tmp_path / 'docs'), val_fraction=0.5, seq_len=4)
  assert len(loaded.train) + len(loaded.val) == len(
      'w1 w2\nw0 w9\nw1 w9\nw2 w9')


def test_a_second_preparation_into_a_held_out_folder_is_one_line(tmp_path):
  from infra import workdir  # pylint: disable=import-outside-toplevel
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  _corpus(tmp_path)
  out = tmp_path / 'out'
  out.mkdir()
  (out / '.train-00000.bin.tmp').write_bytes(b'the holder\'s')
  with workdir.lock(out):
    holder = (out / 'lock').read_text().strip()
    result = _prepare(f'--input={tmp_path / "texts"}', f'--tokenizer={path}',
                      f'--out={out}')
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f'error: {out} is in use by another run ({holder}); wait for it to '
        'finish or stop it, or use another --out']
    assert (out / '.train-00000.bin.tmp').exists()  # Not the loser's to take.


def test_the_output_folder_inside_an_input_folder_is_left_out(
    tmp_path, monkeypatch):
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  _corpus(tmp_path)
  run = lambda out: prepare_data.prepare(
      [str(tmp_path)], str(path), str(out), val_fraction=0.3, shard_tokens=40,
      batch_mb=1e-4, say=lambda _: None)
  _interrupted(monkeypatch, after=2)
  with pytest.raises(KeyboardInterrupt):
    run(tmp_path / 'texts' / 'out')  # progress.jsonl is under --input now.
  meta = run(tmp_path / 'texts' / 'out')
  assert not [name for name, *_ in meta['input_files'] if '/out/' in name]
  (tmp_path / 'texts' / 'out').rename(tmp_path.parent / 'moved')
  assert run(tmp_path.parent / 'fresh')['splits'] == meta['splits']
  with pytest.raises(UserError, match=r"--input '.*texts' is inside --out="
                     '.*; give an --out outside it'):
    prepare_data.prepare([str(tmp_path / 'texts')], str(path), str(tmp_path))


def test_outputs_inside_an_input_folder_are_skipped_with_one_note(
    tmp_path, monkeypatch):
  from infra import workdir  # pylint: disable=import-outside-toplevel
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  _corpus(tmp_path)
  texts = tmp_path / 'texts'
  run = lambda out, said=None: prepare_data.prepare(
      [str(texts)], str(path), str(out), val_fraction=0.3, shard_tokens=40,
      batch_mb=1e-4, say=(said.append if said is not None else
                          lambda _: None))
  first = run(texts / 'out')  # A corpus made inside its input, then ...
  _interrupted(monkeypatch, after=1)
  with pytest.raises(KeyboardInterrupt):
    run(texts / 'partial')  # ... one half made, ...
  (texts / 'run' / 'checkpoints').mkdir(parents=True)  # ... a workdir ...
  (texts / 'run' / 'config.json').write_text('{}')
  (texts / 'run' / 'notes.txt').write_text('w1 w2')
  (texts / 'locked').mkdir()  # ... and a workdir a run holds.
  with workdir.lock(texts / 'locked'):
    said = []
    second = run(texts / 'out2', said)
  assert [name for name, *_ in second['input_files']] == [
      name for name, *_ in first['input_files']]
  assert second['splits'] == first['splits']
  notes = [line for line in said if 'skipping' in line]
  assert notes == [
      f'note: skipping 4 folders of outputs, not inputs: {texts}/locked (a '
      f'workdir), {texts}/out (a prepared corpus), {texts}/'
      f'partial (a partial prepared corpus), {texts}/run (a workdir)']
  with pytest.raises(UserError, match=r"--input '.*out' is a prepared corpus, "
                     'not text; give the text it was made from'):
    prepare_data.prepare([str(texts / 'out')], str(path), str(tmp_path / 'x'))


def test_the_advised_rerun_works_and_a_refusal_names_the_settings(
    tmp_path, monkeypatch):
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  (tmp_path / 'docs').mkdir()
  for i in range(3):
    (tmp_path / 'docs' / f'{i}.txt').write_text(f'w{i} w9')
  run = lambda out, **kw: prepare_data.prepare(
      [str(tmp_path / 'docs')], str(path), str(tmp_path / out),
      say=lambda _: None, **kw)
  (tmp_path / 'given').mkdir()
  for out in ('new', 'given'):  # A folder it made goes; one given is emptied.
    with pytest.raises(UserError, match=(
        r'no document went to the val split \(3 documents, --val_fraction='
        r'0.005\); nothing was kept in --out=.*; raise --val_fraction')):
      run(out)
    meta = run(out, val_fraction=0.5)  # As advised.
    assert meta['splits']['val']['documents'] >= 1
  with pytest.raises(UserError, match=r'\(1 document, --val_fraction'):
    prepare_data.prepare([str(tmp_path / 'docs' / '0.txt')], str(path),
                         str(tmp_path / 'one'), say=lambda _: None)
  # A partial preparation with other settings: the refusal names them.
  _interrupted(monkeypatch, after=1)
  with pytest.raises(KeyboardInterrupt):
    run('partial', val_fraction=0.5, shard_tokens=2)
  with pytest.raises(UserError, match=(
      r'holds a partial preparation of another corpus \(--val_fraction 0.5 '
      r'-> 0.4, --seed 0 -> 1\); give a new --out, or remove .*partial to '
      'prepare this one instead')):
    run('partial', val_fraction=0.4, seed=1, shard_tokens=2)
  with pytest.raises(UserError, match=(
      r'holds another corpus \(--val_fraction 0.5 -> 0.4\); give a new')):
    run('new', val_fraction=0.4)


def test_a_full_disk_or_ctrl_c_keeps_the_shards_and_a_rerun_finishes(
    tmp_path, monkeypatch):
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  _corpus(tmp_path)
  run = lambda out: prepare_data.prepare(
      [str(tmp_path / 'texts'), str(tmp_path / 'records.jsonl')], str(path),
      str(tmp_path / out), val_fraction=0.2, shard_tokens=30,
      say=lambda _: None)
  _interrupted(monkeypatch, after=2, exception=OSError(
      errno.ENOSPC, 'No space left on device'))
  with pytest.raises(UserError, match=(
      r'^no space left on the disk of --out=.*out \([\d,.]+ MB free\); free '
      'space .*, then rerun the same command to continue from its complete '
      'shards$')):
    run('out')
  assert len((tmp_path / 'out' / 'progress.jsonl').read_text().splitlines()
             ) == 3  # The settings and two shards.
  _interrupted(monkeypatch, after=2)
  with pytest.raises(KeyboardInterrupt):
    run('out')
  run('out')
  run('straight')
  assert _files(tmp_path / 'out') == _files(tmp_path / 'straight')



def test_a_long_text_is_cut_before_a_space_after_other_than_whitespace():
  text = ' '.join(f'w{i}' for i in range(2000))
  pieces = list(tokenizer_lib.pieces(text, 64))
  assert ''.join(pieces) == text and len(pieces) > 50
  assert all(64 <= len(p) <= 128 for p in pieces[:-1])
  assert len(pieces[-1]) <= 128
  assert all(p.startswith(' ') and not q[-1].isspace()
             for q, p in zip(pieces, pieces[1:]))
  assert list(tokenizer_lib.pieces(text[:128], 64)) == [text[:128]]
  # Without such a space, a hard cut every 2 * 64 characters.
  assert [len(p) for p in tokenizer_lib.pieces('x' * 300, 64)] == [128, 128, 44]


_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
                   r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|"
                   r"\s+")


@pytest.mark.parametrize('pattern', ['gpt2', 'llama3', 'llama2'])
def test_a_long_document_in_pieces_has_the_whole_documents_tokens(
    tmp_path, monkeypatch, pattern):
  from tokenizers import (Regex, Tokenizer, decoders, models, normalizers,  # pylint: disable=import-outside-toplevel
                          pre_tokenizers, processors, trainers)
  text = ''.join(  # Prose, numbers, contractions, code, runs of spaces.
      f"Line {i}: it's {i * 7919 % 10007} o'clock, isn't it?\n    if x{i} =="
      f" {i}:  return 'done'  # {'a' * (i % 9)}...\n\n" for i in range(400))
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = {
      'gpt2': pre_tokenizers.ByteLevel(add_prefix_space=False),
      'llama3': pre_tokenizers.Sequence([
          pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), 'isolated'),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
      'llama2': pre_tokenizers.Metaspace()}[pattern]
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator([text], trainers.BpeTrainer(
      vocab_size=400, special_tokens=['<|begin_of_text|>', '<|endoftext|>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if pattern == 'llama2':  # Its tokenizer.json: no pre-tokenizer, but "▁"
    # put before the text and for every space, by the normalizer.
    tokenizer.pre_tokenizer = None
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend('▁'), normalizers.Replace(' ', '▁')])
  tokenizer.post_processor = processors.TemplateProcessing(
      single='<|begin_of_text|> $A', special_tokens=[('<|begin_of_text|>', 0)])
  tokenizer.save(str(tmp_path / 'tokenizer.json'))
  docs = [text, text[:3000]] + [f'short {i}' for i in range(20)]
  with open(tmp_path / 'docs.jsonl', 'w') as f:
    for doc in docs:
      f.write(json.dumps({'text': doc}) + '\n')
  monkeypatch.setattr(tokenizer_lib, 'PIECE_CHARS', 200)  # Dozens of pieces.
  meta = prepare_data.prepare([str(tmp_path / 'docs.jsonl')],
                              str(tmp_path / 'tokenizer.json'),
                              str(tmp_path / 'out'), val_fraction=0.3)
  assert meta['long_documents']['piece_chars'] == 200
  assert meta['long_documents']['rule'] == tokenizer_lib.PIECE_RULE
  tokens = np.concatenate([_tokens(tmp_path / 'out', s)
                           for s in ('train', 'val')])
  prepared = np.split(tokens, np.flatnonzero(tokens == 1) + 1)[:-1]
  whole = lambda doc: (0, *tokenizer.encode(doc, add_special_tokens=False).ids,
                       1)
  assert sorted(tuple(p) for p in prepared) == sorted(map(whole, docs))


@pytest.mark.slow
def test_memory_does_not_grow_with_a_documents_size(tmp_path):
  # Encoded whole, a 12 MB line took 2.4 GB (~200 bytes per character).
  path, _ = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'docs' / 'one_line.txt').write_text('w1 w22 w3 w45 ' * 900_000)
  for i in range(5):
    (tmp_path / 'docs' / f'{i}.txt').write_text(f'w{i} w2')
  code = (f'from train import prepare_data; prepare_data.prepare('
          f'[{str(tmp_path / "docs")!r}], {str(path)!r}, '
          f'{str(tmp_path / "out")!r}, val_fraction=0.5); '
          "print([l for l in open('/proc/self/status') "
          "if l.startswith('VmHWM')][0].split()[1])")
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  peak_mb = int(result.stdout.split()[-1]) / 1024
  assert peak_mb < 600, peak_mb


def test_ids_past_the_models_vocabulary_are_named_before_training(tmp_path):
  path, vocab = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  content = json.loads(path.read_text())  # </s> moved to id 5000: a gap.
  content['model']['vocab']['</s>'] = 5000
  path.write_text(json.dumps(content))
  assert tokenizer_lib.load(path).vocab_size == 5001
  _corpus(tmp_path)
  meta = prepare_data.prepare([str(tmp_path / 'texts')], str(path),
                              str(tmp_path / 'out'), val_fraction=0.3)
  assert (meta['vocab_size'], meta['max_id'], meta['eos_id']) == (5001, 5000,
                                                                  5000)
  config = tiny.get_config()
  config.model.vocab_size = 100  # As many ids as the tokenizer has.
  config.data.update(path=str(tmp_path / 'out'), seq_len=8)
  with pytest.raises(UserError, match='has token ids up to 5000; set '
                     'model.vocab_size >= 5001'):
    loop.train_and_evaluate(config, str(tmp_path / 'w'))
  # A corpus whose meta.json says less than its ids (made before gaps were
  # counted): its max_id decides.
  meta['vocab_size'] = 100
  (tmp_path / 'out' / 'meta.json').write_text(json.dumps(meta))
  assert data.load(str(tmp_path / 'out'), val_fraction=0.1,
                   seq_len=8).vocab_size == 5001


def test_a_corpus_folder_without_meta_json_is_named_not_a_prepared_corpus(
    tmp_path):
  _bad(tmp_path)
  (tmp_path / 'out' / 'meta.json').unlink()
  with pytest.raises(UserError, match=(
      'out is not a prepared corpus: it holds train-00000.bin but no '
      'meta.json, which train.prepare_data writes last, once complete; '
      'prepare the text again into a new folder')):
    data.load(str(tmp_path / 'out'), val_fraction=0.1, seq_len=8)


def test_inputs_without_text_are_named_so(tmp_path):
  (tmp_path / 'blank.jsonl').write_text('\n\n  \n' * 20)
  (tmp_path / 'empty.jsonl').write_text('{"text": ""}\n' * 20)
  for name, what in (('blank.jsonl', 'only blank lines'),
                     ('empty.jsonl', '20 documents, all empty')):
    with pytest.raises(UserError, match=(
        f'--input .*{name} holds no text \\({what}\\); nothing was kept in '
        '--out=.*; give it documents with text')):
      _bad(tmp_path, inputs=[str(tmp_path / name)],
           out=str(tmp_path / f'out_{name}'))
    assert not (tmp_path / f'out_{name}').exists()  # Made, then removed.


def test_a_byte_order_mark_is_not_text(tmp_path):
  path, vocab = _word_tokenizer(tmp_path / 'tokenizer.json', 100)
  (tmp_path / 'docs').mkdir()
  for i in range(8):
    (tmp_path / 'docs' / f'{i}.txt').write_bytes(
        b'\xef\xbb\xbf' + f'w{i} w9'.encode())
  (tmp_path / 'docs.jsonl').write_bytes(b'\xef\xbb\xbf{"text": "w1"}\n')
  prepare_data.prepare([str(tmp_path / 'docs'), str(tmp_path / 'docs.jsonl')],
                       str(path), str(tmp_path / 'out'), val_fraction=0.3)
  tokens = np.concatenate([_tokens(tmp_path / 'out', s)
                           for s in ('train', 'val')])
  assert vocab['[UNK]'] not in tokens  # Not '\ufeffw0'.
  assert len(tokens) == 8 * 4 + 3
  # Read as bytes, too.
  loaded = data.load(str(tmp_path / 'docs'), val_fraction=0.5, seq_len=4)
  assert b'\xef' not in bytes(np.concatenate([loaded.train,
                                                        loaded.val]))
