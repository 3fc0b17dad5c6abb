"""Specification of `serve.generate`'s reruns and reading (issue 62): reuse
keyed by content (the checkpoint's parameters, each request's hash), not by
a path or an id; prompt lines read as the engine has room (a pipe's first
line served before it ends); and the smaller faults, each one line or none.
"""

import json
import os
import pathlib
import select
import shutil
import subprocess
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import pytest
from etils import epath

from configs import tiny
from serve import engine, generate
from serve import prompts as prompts_lib
from tests.test_faults import _one_line_error
from train import loop
from train.convert import workdirs as convert
from lm import config_lib
from lm import inference
from lm import sampling
from infra.errors import UserError
from lm.model import Transformer

REPO = pathlib.Path(__file__).parent.parent


def _write(path, lines):
  path.write_text(''.join((line if isinstance(line, str) else json.dumps(line))
                          + '\n' for line in lines))
  return path


def _lines(out):
  return [json.loads(line) for line in out.read_text().splitlines()]


def _generate(workdir, prompts, out, **kwargs):
  kwargs = dict(dict(kv_memory='1MiB', max_new_tokens=4, page_size=8,
                     slots=2), **kwargs)
  return generate.generate_file(str(workdir), str(prompts), str(out),
                                **kwargs)


def _random_workdir(path: pathlib.Path, seed: int, **model):
  """A workdir holding a random `tiny` model at step 0 (as a conversion
  writes one): two seeds, two models at the same path and step."""
  config = tiny.get_config()
  config.model.update(**model)
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=seed))
  shutil.rmtree(path, ignore_errors=True)
  path.mkdir(parents=True)
  convert._write_step0(epath.Path(path), jax.device_get(params), config, {})  # pylint: disable=protected-access
  return path


def _alone(workdir, prompt: bytes, new: int) -> list[int]:
  mc, params, _ = inference.load_language_model(str(workdir))
  out = inference.generate(params, np.array([list(prompt)], np.int32),
                        model=Transformer(mc, decode=True),
                        max_new_tokens=new)
  return np.asarray(out[0]).tolist()


@pytest.mark.slow
def test_a_workdir_trained_again_at_the_same_path_is_refused(tmp_path):
  """The issue's probe: the workdir trained again, at the same path and to
  the same step, as another model (num_kv_heads=1, another seed). The old
  rerun checked path and step, printed "all requests are already in" and
  kept the old model's texts, exit 0."""
  workdir = _random_workdir(tmp_path / 'w', seed=1)
  prompts = _write(tmp_path / 'prompts.jsonl', [{'id': 'a', 'prompt': 'def '}])
  out = tmp_path / 'out.jsonl'
  _generate(workdir, prompts, out)
  before = out.read_text()
  _random_workdir(workdir, seed=2, num_kv_heads=1)
  with pytest.raises(UserError, match=r'^--out=.*out.jsonl holds results of '
                     r'another checkpoint \(parameters [0-9a-f]{16}, now '
                     r'[0-9a-f]{16}: the workdir trained again, or another '
                     r'one\); give another --out, or delete out.jsonl'):
    _generate(workdir, prompts, out)
  assert out.read_text() == before
  # The same parameters from another path are the same checkpoint.
  _random_workdir(workdir, seed=1)
  shutil.move(workdir, tmp_path / 'moved')
  assert _generate(tmp_path / 'moved', prompts, out) is None  # Already in.
  assert out.read_text() == before


@pytest.mark.slow
def test_an_edited_prompt_or_its_max_new_tokens_is_generated_again(trained,
                                                                    tmp_path):
  """Resume went by id alone: an id's new prompt, or its line's new
  "max_new_tokens", kept the old continuation, exit 0. Now the request's
  hash decides: those two are generated again, the rest kept, and OUT
  ends with one line per id."""
  prompts = _write(tmp_path / 'prompts.jsonl', [
      {'id': 'a', 'prompt': 'def '}, {'id': 'b', 'prompt': 'import'},
      {'id': 'c', 'prompt': 'class'}])
  out = tmp_path / 'out.jsonl'
  _generate(trained, prompts, out)
  first = {e['id']: e for e in _lines(out)}
  _write(prompts, [{'id': 'a', 'prompt': 'return'},
                   {'id': 'b', 'prompt': 'import', 'max_new_tokens': 6},
                   {'id': 'c', 'prompt': 'class'}])
  stats = _generate(trained, prompts, out)
  assert stats.done == 2
  again = _lines(out)
  by_id = {e['id']: e for e in again}
  assert sorted(e['id'] for e in again) == ['a', 'b', 'c']
  assert by_id['a']['tokens'] == _alone(trained, b'return', 4)
  assert by_id['b']['tokens'] == _alone(trained, b'import', 6)
  assert by_id['c'] == first['c']  # Kept: its time as measured then.
  assert by_id['a']['request'] != first['a']['request']
  assert _generate(trained, prompts, out) is None  # All in, now.
  # Edited into a line that is refused: its error replaces its result.
  _write(prompts, [{'id': 'a', 'prompt': ''}, {'id': 'b', 'prompt': 'import',
                                                'max_new_tokens': 6},
                   {'id': 'c', 'prompt': 'class'}])
  _generate(trained, prompts, out)
  assert sorted((e['id'], 'error' in e) for e in _lines(out)) == [
      ('a', True), ('b', False), ('c', False)]


def test_a_request_hash_names_what_decides_the_text():
  base = prompts_lib.request_hash('def ', 4, sampling.SamplingParams())
  changed = [prompts_lib.request_hash('def', 4, sampling.SamplingParams()),
             prompts_lib.request_hash('def ', 5, sampling.SamplingParams()),
             prompts_lib.request_hash('def ', 4, sampling.SamplingParams(
                 temperature=1.0)),
             prompts_lib.request_hash('def ', 4, sampling.SamplingParams(
                 stop=('\n',)))]
  assert len({base, *changed}) == 5
  # Greedy: seed, top_k and top_p change no text, nor the hash.
  assert prompts_lib.request_hash('def ', 4, sampling.SamplingParams(
      seed=9, top_k=3, top_p=0.5)) == base
  hot = lambda seed: prompts_lib.request_hash(
      'def ', 4, sampling.SamplingParams(temperature=1.0, seed=seed))
  assert hot(1) != hot(2)


class _Bytes:
  eos_ids = ()
  encode = staticmethod(lambda text: np.frombuffer(text.encode(), np.uint8))
  decode = staticmethod(lambda ids: bytes(ids).decode('utf-8', 'replace'))


def test_the_engine_takes_requests_as_it_has_room_not_all_first():
  """Engine.run pulls from its iterable while fewer than `slots` wait: the
  first output comes when a few of 40 requests have been read."""
  config = tiny.get_config()
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=1))
  served = engine.Engine(mc, params, kv_memory=2**20, page_size=8, slots=2)
  read = []
  def requests():
    for i in range(40):
      read.append(i)
      yield engine.Request(i, np.array([1 + i % 7, 2], np.int32), 2)
  outputs = served.run(requests())
  next(outputs)
  assert len(read) <= 6
  assert len([next(outputs) for _ in range(39)]) == 39
  assert len(read) == 40 and not served.has_unfinished()


def test_a_file_is_read_as_the_engine_has_room(trained, tmp_path,
                                               monkeypatch):
  """The first result is written when few lines have been read (old main
  read and queued every line before the first step)."""
  prompts = _write(tmp_path / 'prompts.jsonl',
                   [{'id': i, 'prompt': f'x{i}'} for i in range(60)])
  read, at_first = [], []
  get = prompts_lib.Lines.get
  def spy(self, block=True):
    item = get(self, block)
    if isinstance(item, tuple):
      read.append(item[0])
    return item
  finished = generate._Run._finished  # pylint: disable=protected-access
  def first(self, entry):
    if not at_first:
      at_first.append(len(read))
    return finished(self, entry)
  monkeypatch.setattr(prompts_lib.Lines, 'get', spy)
  monkeypatch.setattr(generate._Run, '_finished', first)  # pylint: disable=protected-access
  _generate(trained, prompts, tmp_path / 'out.jsonl', max_new_tokens=2)
  assert at_first[0] <= 8 and len(read) == 60


def _first_line(process, timeout: float) -> str | None:
  """process's first stdout line, or None if none came within timeout."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    ready, _, _ = select.select([process.stdout], [], [], 1.0)
    if ready:
      return process.stdout.readline()
    if process.poll() is not None:
      return None
  return None


@pytest.mark.slow
def test_a_pipes_first_line_is_served_before_the_pipe_ends(trained):
  """--prompts=- with --out=-: the first result comes while stdin is still
  open (old main read stdin to its end first); stderr names the checkpoint
  step it loaded."""
  process = subprocess.Popen(
      [sys.executable, '-m', 'serve.generate', f'--workdir={trained}',
       '--prompts=-', '--out=-', '--kv_memory=1MiB', '--max_new_tokens=3',
       '--page_size=8'], cwd=REPO, stdin=subprocess.PIPE,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    process.stdin.write(json.dumps({'id': 'first', 'prompt': 'def '}) + '\n')
    process.stdin.flush()
    line = _first_line(process, timeout=240)
    assert line is not None, 'no result while stdin was open'
    assert json.loads(line)['id'] == 'first'
    process.stdin.write(json.dumps({'id': 'second', 'prompt': 'x'}) + '\n')
    process.stdin.close()
    process.wait(timeout=120)
    rest, err = process.stdout.read(), process.stderr.read()
  finally:
    process.kill()
  assert process.returncode == 0, err[-3000:]
  assert [json.loads(r)['id'] for r in rest.splitlines()] == ['second']
  assert f'generate: {trained} at step 20 (parameters ' in err


@pytest.mark.slow
def test_a_byte_order_mark_a_null_id_and_a_bad_line_read_apart(trained,
                                                               tmp_path):
  """A UTF-8 BOM before the first line is not part of it (the valid first
  line read as "not JSON"); a request whose id is null gets its result
  with "id": null, and a malformed line's record has no "id" at all (the
  two read alike); a rerun keeps the first and retries the second."""
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_bytes(b'\xef\xbb\xbf' + json.dumps(
      {'id': 'bom', 'prompt': 'def '}).encode() + b'\n' + json.dumps(
          {'id': None, 'prompt': 'import'}).encode() + b'\n{"id": \n')
  out = tmp_path / 'out.jsonl'
  stats = _generate(trained, prompts, out)
  assert (stats.done, stats.refused) == (2, 1)
  lines = _lines(out)
  assert [e['id'] for e in lines if 'id' in e] == ['bom', None]
  [bad] = [e for e in lines if 'id' not in e]
  assert bad['line'] == 3 and bad['error'].startswith('line 3: not JSON')
  assert 'text' in next(e for e in lines if e.get('id', 0) is None)
  stats = _generate(trained, prompts, out)
  assert (stats.done, stats.refused) == (0, 1)
  assert len(_lines(out)) == 3


def test_a_refused_or_finished_run_leaves_no_lock(trained, tmp_path):
  prompts = _write(tmp_path / 'prompts.jsonl', [{'id': 'a', 'prompt': 'x'}])
  notes = tmp_path / 'notes.txt'
  notes.write_text('mine')
  with pytest.raises(UserError, match='is a file this command did not write'):
    _generate(trained, prompts, notes)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['notes.txt',
                                                         'prompts.jsonl']


@pytest.mark.slow
def test_a_finished_run_leaves_its_results_and_settings_only(trained,
                                                             tmp_path):
  prompts = _write(tmp_path / 'prompts.jsonl', [{'id': 'a', 'prompt': 'x'}])
  _generate(trained, prompts, tmp_path / 'out.jsonl', max_new_tokens=2)
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      'out.jsonl', 'out.jsonl.settings.json', 'prompts.jsonl']


def test_a_bogus_cpu_kernel_setting_is_one_line(trained):
  result = subprocess.run(
      [sys.executable, '-m', 'serve.generate', f'--workdir={trained}',
       '--prompts=x', '--out=y'], cwd=REPO, capture_output=True, text=True,
      timeout=180, env={**os.environ, 'GQA_LAB_CPU_KERNEL': 'bogus'})
  _one_line_error(result, "error: GQA_LAB_CPU_KERNEL='bogus'; use one of "
                  "('auto', 'off', 'require')")


def test_a_duplicate_id_on_stdin_is_refused_by_its_line():
  """Read as it comes, a pipe's duplicate cannot be refused before anything
  is written: its later line is, as a record of that line (no "id", so it
  never stands for the first request's result)."""
  added, written = [], []
  class Engine:  # What the loop asks of the engine here: to take a request.
    add_request = staticmethod(added.append)
  run = generate._Run(Engine(), _Bytes, 4, sampling.SamplingParams(), 1e9)  # pylint: disable=protected-access
  run._finished = written.append  # pylint: disable=protected-access
  for number, prompt in ((1, 'x'), (2, 'y')):
    run._add(number, json.dumps({'id': 'a', 'prompt': prompt}))  # pylint: disable=protected-access
  assert [r.id for r in added] == ['a']
  assert written == [{'line': 2, 'error': 'line 2: id "a" is on line 1 too; '
                      'give each prompt its own id'}]
