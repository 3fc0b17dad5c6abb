"""The server through clients no one here wrote, on a free localhost port:

- the `openai` Python client, streaming and not: its text is serve.
  generate's for the same prompt, settings and seed, its chunks add up to
  it, and a bad parameter is its BadRequestError carrying our message;
- lm_eval's `local-completions` model (log-likelihoods by echo with
  logprobs, rolling windows, greedy generation up to stop strings, the
  tokenizer through the server's /tokenize routes) scores the lab's local
  tasks (tests/lm_eval_tasks) as the `gqa-lab` model does on the same
  workdir: the same log-likelihoods to 1e-4, the same greedy flags and
  generations, the same metrics. The workdir's max_len (2048) holds every
  task text: past it the two truncate differently (local-completions keeps
  max_length - 1 tokens and a window one shorter, as it does against vLLM
  beside lm_eval's `hf`), so the scores would differ by design.
"""

import os
import pathlib

os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # Before datasets loads.

import numpy as np  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

openai = pytest.importorskip('openai')
lm_eval = pytest.importorskip('lm_eval')

from lm_eval.tasks import TaskManager  # pylint: disable=wrong-import-position

# Registers the gqa-lab model with lm_eval.
from evaluation import harness  # pylint: disable=unused-import,wrong-import-position
from tests import api_server  # pylint: disable=wrong-import-position

TASKS_DIR = pathlib.Path(__file__).parent / 'lm_eval_tasks'
TASKS = ['gqa_lab_choice', 'gqa_lab_rolling', 'gqa_lab_generate']

pytestmark = pytest.mark.slow  # Each waits for the engine's steps.

HOT = dict(temperature=0.9, top_p=0.95)


@pytest.fixture(scope='module')
def client(served):
  _, url = served
  return openai.OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0,
                       timeout=120)


def test_the_openai_client_gets_serve_generates_text(client, served, trained,
                                                     tmp_path):
  server, _ = served
  assert [m.id for m in client.models.list()] == [server.model]
  answer = client.completions.create(
      model=server.model, prompt=['def main', 'import o'], max_tokens=12,
      seed=5, extra_body={'top_k': 40}, **HOT)
  files = api_server.generate_texts(trained, tmp_path, [
      {'id': 'a', 'prompt': 'def main', 'seed': 5},
      {'id': 'b', 'prompt': 'import o', 'seed': 5}], 12, top_k=40, **HOT)
  assert [c.text for c in answer.choices] == [files['a'], files['b']]
  assert answer.usage.prompt_tokens == 16
  assert answer.usage.completion_tokens == 24  # Byte tokens: no EOS.
  scored = client.completions.create(model=server.model, prompt='def main',
                                     max_tokens=0, echo=True, logprobs=1)
  logprobs = scored.choices[0].logprobs
  assert logprobs.tokens == list('def main')
  assert logprobs.token_logprobs[0] is None and all(
      lp < 0 for lp in logprobs.token_logprobs[1:])


def test_the_openai_client_streams_chunks_that_add_up_to_the_text(client,
                                                                  served):
  server, _ = served
  settings = dict(model=server.model, prompt='for i in', max_tokens=16,
                  seed=9, stop=['\n\n'], **HOT)
  whole = client.completions.create(**settings).choices[0]
  chunks = list(client.completions.create(
      stream=True, stream_options={'include_usage': True}, **settings))
  texts = [c.choices[0].text for c in chunks if c.choices]
  assert len(texts) > 1 and ''.join(texts) == whole.text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
      whole.finish_reason)
  assert chunks[-1].usage.completion_tokens > 0


def test_a_bad_parameter_is_the_clients_bad_request_error(client, served):
  server, _ = served
  with pytest.raises(openai.BadRequestError) as raised:
    client.completions.create(model=server.model, prompt='x', top_p=1.5)
  assert raised.value.status_code == 400
  assert raised.value.body['param'] == 'top_p'
  assert 'top_p=1.5' in raised.value.body['message']
  with pytest.raises(openai.NotFoundError):
    client.completions.create(model='gpt-9', prompt='x')


@pytest.fixture(scope='module')
def long_workdir(tmp_path_factory):
  """`tiny` with max_len 2048, every task text within it."""
  return api_server.train_workdir(tmp_path_factory.mktemp('long'),
                                  max_len=2048, steps=2)


def _scores(model: str, model_args: str) -> tuple[dict, dict]:
  """({task: each document's responses}, {task: its metrics})."""
  results = lm_eval.simple_evaluate(
      model=model, model_args=model_args, tasks=TASKS,
      task_manager=TaskManager(include_path=str(TASKS_DIR),
                               include_defaults=False),
      log_samples=True, bootstrap_iters=0)
  responses = {task: [s['filtered_resps'] for s in results['samples'][task]]
               for task in TASKS}
  return responses, results['results']


@pytest.mark.slowest
def test_lm_evals_local_completions_scores_as_the_gqa_lab_model(
    long_workdir):
  ours, our_metrics = _scores('gqa-lab', f'workdir={long_workdir},'
                              'batch_size=4')
  with api_server.running(long_workdir, kv_memory='8MiB') as (server, url):
    # A byte-level model has no BOS or EOS: an empty context starts from
    # a line break (10), as the gqa-lab model's does.
    served, served_metrics = _scores(
        'local-completions', f'model={server.model},base_url={url}/v1/'
        'completions,tokenizer_backend=remote,custom_prefix_token_id=10,'
        'batch_size=4,max_retries=1')
    assert server.engine.stats.steps > 0
  for task in ('gqa_lab_choice', 'gqa_lab_rolling'):
    flat = lambda rows: [r if isinstance(r, tuple) else (r, None)
                         for doc in rows for r in doc]
    mine, theirs = flat(ours[task]), flat(served[task])
    assert len(mine) == len(theirs) > 1
    np.testing.assert_allclose([r[0] for r in theirs], [r[0] for r in mine],
                               atol=1e-4, rtol=0)
    assert [r[1] for r in theirs] == [r[1] for r in mine]
  assert served['gqa_lab_generate'] == ours['gqa_lab_generate']
  assert any(doc[0] for doc in ours['gqa_lab_generate'])  # Not all empty.
  for task in TASKS:  # Perplexities: exponentials of the sums above.
    for name, value in our_metrics[task].items():
      if isinstance(value, float):
        assert served_metrics[task][name] == pytest.approx(
            value, rel=1e-5, abs=1e-4), (task, name)
