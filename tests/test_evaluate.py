"""Specification of evaluation with lm-evaluation-harness (`evaluation.harness`,
`evaluation.evaluate`).

Three local tasks (tests/lm_eval_tasks: multiple choice, rolling perplexity,
generation up to a stop sequence; nothing downloaded) score the same
through the `gqa-lab` model as through lm_eval's own `hf` model on the
workdir exported with `--to_hf`, and as log-probabilities and greedy
tokens computed here directly from the model.
"""

import functools
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # Before datasets loads.

import flax.linen as nn  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position
from etils import epath  # pylint: disable=wrong-import-position

lm_eval = pytest.importorskip('lm_eval')
pytest.importorskip('transformers')

from lm_eval.api.instance import Instance  # pylint: disable=wrong-import-position
from lm_eval.tasks import TaskManager  # pylint: disable=wrong-import-position

from configs import tiny  # pylint: disable=wrong-import-position
from evaluation import evaluate as evaluate_lib  # pylint: disable=wrong-import-position
from evaluation import harness  # pylint: disable=wrong-import-position
from scripts import make_hf_model  # pylint: disable=wrong-import-position
from lm import checkpoint, config_lib, evaluator  # pylint: disable=wrong-import-position
from train import convert, loop, prepare_data  # pylint: disable=wrong-import-position
from train.convert import workdirs  # pylint: disable=wrong-import-position
from infra.errors import UserError  # pylint: disable=wrong-import-position
from lm.model import Transformer  # pylint: disable=wrong-import-position

REPO = pathlib.Path(__file__).parent.parent
TASKS_DIR = REPO / 'tests' / 'lm_eval_tasks'
TASKS = ['gqa_lab_choice', 'gqa_lab_rolling', 'gqa_lab_generate']

pytestmark = pytest.mark.xdist_group('evaluate')  # One worker builds llama.


@pytest.fixture(scope='module')
def llama(tmp_path_factory):
  """(our workdir, its --to_hf export) of a random Llama-style GQA model
  (max_len 64, so that task texts overrun it), imported with the
  tokenizer_config.json a downloaded model has (BOS <s>, EOS </s>)."""
  root = tmp_path_factory.mktemp('llama')
  make_hf_model.make(str(root / 'hf'), d_model=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, mlp_dim=128, vocab_size=300, max_len=64,
                     init_std=0.1)
  (root / 'hf' / 'tokenizer_config.json').write_text(json.dumps(
      {'bos_token': '<s>', 'eos_token': '</s>'}))
  convert.import_hf(str(root / 'hf'), str(root / 'ours'))
  convert.export_hf(str(root / 'ours'), str(root / 'exported'))
  return root / 'ours', root / 'exported'


def _responses(model, model_args: str, limit=None) -> dict:
  """{task: [each document's responses]} from lm_eval.simple_evaluate."""
  results = lm_eval.simple_evaluate(
      model=model, model_args=model_args, tasks=TASKS, limit=limit,
      task_manager=TaskManager(include_path=str(TASKS_DIR),
                               include_defaults=False),
      log_samples=True, bootstrap_iters=0)
  return {task: [s['filtered_resps'] for s in results['samples'][task]]
          for task in TASKS}


@pytest.mark.slow
def test_local_tasks_score_as_lm_evals_hf_model_on_the_export(llama):
  """The issue's criterion: log-likelihoods within 1e-4 (a continuation
  truncated from the left and a document in several windows among them),
  the same greedy generations."""
  workdir, exported = llama
  ours = _responses('gqa-lab', f'workdir={workdir},batch_size=3')
  theirs = _responses('hf', f'pretrained={exported},dtype=float32,'
                      'device=cpu,batch_size=2')
  for task in ('gqa_lab_choice', 'gqa_lab_rolling'):
    flat = lambda rows: [r if isinstance(r, tuple) else (r, None)
                         for doc in rows for r in doc]
    mine, reference = flat(ours[task]), flat(theirs[task])
    assert len(mine) == len(reference) > 1
    np.testing.assert_allclose([r[0] for r in mine],
                               [r[0] for r in reference], atol=1e-4, rtol=0)
    assert [r[1] for r in mine] == [r[1] for r in reference]
  assert ours['gqa_lab_generate'] == theirs['gqa_lab_generate']
  assert any(doc[0] for doc in ours['gqa_lab_generate'])  # Not all empty.


def _requests(kind: str, args: list) -> list:
  return [Instance(request_type=kind, doc={}, arguments=a, idx=i)
          for i, a in enumerate(args)]


def _direct_logprob(loaded, tokens: list[int], n: int) -> float:
  """log p(the last n tokens | the ones before), by one full pass of
  `loaded` (checkpoint.load_workdir's) over the tokens, zeros after them to
  max_len (causal: unseen; one program for every call), in float64."""
  mc, params, _ = loaded
  inputs = np.zeros((1, mc.max_len), np.int32)
  inputs[0, :len(tokens) - 1] = tokens[:-1]
  logits = np.asarray(_forward(mc, params, inputs), np.float64)[0]
  logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
  return float(sum(logp[t - 1, tokens[t]]
                   for t in range(len(tokens) - n, len(tokens))))


@functools.partial(jax.jit, static_argnums=0)
def _forward(mc, params, tokens_BT):
  return Transformer(mc).apply({'params': params}, tokens_BT)


@pytest.mark.slow
def test_log_likelihoods_are_the_models_own_log_probabilities(trained,
                                                               caplog):
  """A byte-level workdir (max_len 32): the continuation's log-probability
  after its context; an empty context starts from a line break; a text
  over max_len keeps its last max_len + 1 bytes, said once; a document
  within max_len is every byte's log-probability after the line break."""
  model = harness.WorkdirLM(str(trained), batch_size=2)
  long_context = 'The following text is longer than the model. ' * 2
  with caplog.at_level(logging.WARNING):
    got = model.loglikelihood(_requests('loglikelihood', [
        ('def main', '():'), ('', 'import os'), (long_context, ' done'),
        (long_context + 'x', ' done')]))
    rolling = model.loglikelihood_rolling(_requests(
        'loglikelihood_rolling', [('return x + 1',)]))
  as_bytes = lambda text: list(text.encode())
  loaded = checkpoint.load_workdir(str(trained))
  expected = [
      _direct_logprob(loaded, as_bytes('def main():'), 3),
      _direct_logprob(loaded, as_bytes('\nimport os'), 9),
      # lm_eval moves the context's trailing space to the continuation.
      _direct_logprob(loaded, as_bytes(long_context + ' done')[-33:], 6),
      _direct_logprob(loaded, as_bytes(long_context + 'x done')[-33:], 5)]
  np.testing.assert_allclose([g[0] for g in got], expected, atol=1e-4,
                             rtol=0)
  np.testing.assert_allclose(rolling, [_direct_logprob(
      loaded, as_bytes('\nreturn x + 1'), 12)], atol=1e-4, rtol=0)
  said = [r.message for r in caplog.records if 'truncated' in r.message]
  assert said == ['2 of 4 loglikelihood requests are longer than max_len 32 '
                  "and were truncated from the left, as lm_eval's hf model "
                  'does'], said


def _workdir_with_local_and_shared_layers(path: pathlib.Path):
  """A random tiny model: local and global layers, K/V shared in pairs."""
  config = tiny.get_config()
  config.model.update(num_layers=4, attention_pattern='LLGG', local_window=8,
                      kv_share=2)
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=3))
  path.mkdir()
  workdirs._write_step0(epath.Path(path), jax.device_get(params), config, {})  # pylint: disable=protected-access
  return mc, params


@pytest.mark.slow
def test_generation_is_greedy_decoding_cut_at_the_stop_sequence(tmp_path):
  """Through the KV cache of local layers' ring buffers and shared K/V: the
  tokens of greedy full passes (no cache), cut at the first stop
  sequence, which a stop string taken from their middle shows."""
  mc, params = _workdir_with_local_and_shared_layers(tmp_path / 'w')
  prompt, new = 'def f(x):\n  return', 12
  P = len(prompt.encode())
  # Greedy, one full pass a token, over a fixed length (zeros after the
  # tokens so far: causal attention cannot see them; one program).
  tokens = np.zeros((1, P + new), np.int32)
  tokens[0, :P] = list(prompt.encode())
  forward = jax.jit(lambda t: Transformer(mc).apply({'params': params}, t))
  for t in range(P, P + new):
    tokens[0, t] = int(np.argmax(forward(tokens)[0, t - 1]))
  text = bytes(tokens[0, P:].tolist()).decode('utf-8', 'replace')
  stop = text[4:6]
  model = harness.WorkdirLM(str(tmp_path / 'w'), batch_size=2)
  got = model.generate_until(_requests('generate_until', [
      (prompt, {'until': [stop], 'max_gen_toks': new, 'do_sample': False}),
      (prompt, {'until': ['\x00\x00'], 'max_gen_toks': new})]))
  assert got == [text.split(stop)[0], text]
  assert len(got[0]) <= 4 < len(text)


@pytest.mark.slow
def test_evaluate_writes_results_for_a_trained_and_an_imported_model(
    trained, llama, tmp_path):
  """The issue's criterion: a workdir trained here (byte-level) and an
  imported random-weight Llama-style model, the three tasks each; the
  imported one with held-out loss and bits per byte on a corpus prepared
  with its tokenizer, through the training loop's evaluator."""
  workdir, _ = llama
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'docs' / 'a.txt').write_text(
      (TASKS_DIR / 'rolling.jsonl').read_text() * 20)
  (tmp_path / 'docs' / 'b.txt').write_text(
      (TASKS_DIR / 'choice.jsonl').read_text() * 20)
  prepare_data.prepare([str(tmp_path / 'docs')], str(workdir),
                       str(tmp_path / 'corpus'), val_fraction=0.5,
                       say=lambda *_: None)
  for name, path, data in [('trained', trained, None),
                           ('imported', workdir, str(tmp_path / 'corpus'))]:
    out = tmp_path / name
    record = evaluate_lib.write_results(
        str(path), TASKS, str(out), include_path=str(TASKS_DIR), limit=2,
        batch_size=3, data=data, argv=['--limit=2'])  # Programs as above.
    written = json.loads((out / 'results.json').read_text())
    assert set(written['results']) == set(TASKS), name
    # What was scored, by content (a study's reuse of scores checks it).
    _, state = checkpoint.restore_latest(path)
    assert written['checkpoint']['parameters'] == checkpoint.fingerprint(
        state['params']), name
    assert written['results']['gqa_lab_choice']['sample_len'] == 2
    assert 0 < written['results']['gqa_lab_rolling']['bits_per_byte,none']
    assert written['provenance']['command'] == (
        'python -m evaluation.evaluate --limit=2')
    report = (out / 'report.md').read_text()
    assert 'gqa_lab_generate' in report and written['provenance']['commit'] in report
    assert record['held_out'] == written['held_out']
  held_out = written['held_out']
  expected = evaluator.evaluate_workdir(str(workdir), data_path=data)
  assert held_out['eval_loss'] == expected['eval_loss']
  assert held_out['eval_bpb'] > 0 and 'bits per byte' in report


def test_gqa_lab_is_lm_evals_and_its_model_args_win(trained):
  """lm_eval's command line passes --batch_size (default 1) beside
  model_args: batch_size in both must not collide, and model_args win."""
  assert lm_eval.api.registry.get_model('gqa-lab') is harness.WorkdirLM
  model = harness.WorkdirLM.create_from_arg_string(
      f'workdir={trained},batch_size=3',
      {'batch_size': 1, 'max_batch_size': None, 'device': 'cpu'})
  assert model.batch_size == 3


def test_an_unknown_task_is_refused_naming_it():
  with pytest.raises(UserError, match=r"unknown task 'no_such_task': "):
    evaluate_lib.task_manager(['gqa_lab_choice', 'no_such_task'],
                              str(TASKS_DIR), include_defaults=False)


@pytest.mark.slow
def test_a_workdir_without_its_tokenizer_is_one_line(llama, tmp_path):
  workdir, _ = llama
  shutil.copytree(workdir, tmp_path / 'w',
                  ignore=shutil.ignore_patterns('tokenizer.json', 'lock'))
  result = subprocess.run(
      [sys.executable, '-m', 'evaluation.evaluate',
       f'--workdir={tmp_path / "w"}', '--tasks=gqa_lab_choice',
       f'--include_path={TASKS_DIR}', f'--out={tmp_path / "out"}'], cwd=REPO,
      capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and 'has no tokenizer.json' in lines[0], (
      result.stderr[-3000:])
  assert not (tmp_path / 'out').exists()


def _never_scored(*args, **kwargs):
  raise AssertionError('a task was scored before the bad input was refused')


def test_a_generation_task_without_room_is_refused_before_any_scoring(
    trained, tmp_path, monkeypatch):
  """The generation task's max_gen_toks (lm_eval's default 256 where the
  task sets none) was checked only when its requests ran, after the other
  tasks were scored, and all of it was thrown away. `tiny`'s max_len: 32."""
  tasks = tmp_path / 'tasks'
  shutil.copytree(TASKS_DIR, tasks)
  yaml = (tasks / 'gqa_lab_generate.yaml').read_text()
  (tasks / 'gqa_lab_generate.yaml').write_text(
      yaml.replace('  max_gen_toks: 12\n', ''))
  monkeypatch.setattr(lm_eval, 'simple_evaluate', _never_scored)
  with pytest.raises(UserError) as e:
    evaluate_lib.write_results(str(trained), TASKS, str(tmp_path / 'out'),
                               include_path=str(tasks), limit=2)
  message = str(e.value)
  assert '\n' not in message
  assert message.startswith('task gqa_lab_generate generates up to '
                            "max_gen_toks=256 tokens, not below the model's "
                            'max_len (32)')
  assert '--max_gen_toks' in message
  assert not (tmp_path / 'out').exists()
  # --max_gen_toks is the room it asks for: checked, then scored.
  monkeypatch.undo()
  record = evaluate_lib.write_results(
      str(trained), ['gqa_lab_generate'], str(tmp_path / 'out'),
      include_path=str(tasks), limit=2, max_gen_toks=8)
  assert 'gqa_lab_generate' in record['results']


def test_a_wrong_data_path_is_refused_before_any_scoring(trained, tmp_path,
                                                        monkeypatch):
  monkeypatch.setattr(lm_eval, 'simple_evaluate', _never_scored)
  missing = tmp_path / 'no_corpus'
  with pytest.raises(UserError, match=rf'^--data={missing}: .*does not exist'):
    evaluate_lib.write_results(str(trained), TASKS, str(tmp_path / 'out'),
                               include_path=str(TASKS_DIR), limit=2,
                               data=str(missing))
  assert not (tmp_path / 'out').exists()


def test_a_missing_workdir_is_named_by_the_commands_own_flag(tmp_path):
  """evaluation.evaluate names its --workdir; lm_eval's command line, where
  the workdir is a model_arg, names that."""
  missing = str(tmp_path / 'nowhere')
  with pytest.raises(UserError, match=rf'^--workdir={missing} is not a '):
    evaluate_lib.evaluate(missing, TASKS, include_path=str(TASKS_DIR))
  with pytest.raises(UserError, match=rf'^model_args workdir={missing} is '):
    harness.WorkdirLM(missing)
