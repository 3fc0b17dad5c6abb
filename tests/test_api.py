"""Specification of the OpenAI-compatible server (`python -m serve.api`,
`serve/api.py`, `serve/protocol.py`), started on a free localhost port:

a completion's text is serve.generate's and train.sample's for the same
prompt, settings and seed (a request without a seed derives it as
serve.generate derives a line's); streamed chunks add up to that text, stop
strings held back until they cannot begin; echo with max_tokens=0 scores a
prompt as the model's full pass does; requests from many connections share
one batch; the routes beside completions answer. Bad input and faults:
tests/test_api_faults.py; real clients: tests/test_api_clients.py.
"""

import concurrent.futures
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import api_server
from tests.api_server import complete, post, stream
from lm import checkpoint, inference, sampling
from lm.model import Transformer

pytestmark = pytest.mark.slow  # Each waits for the engine's steps.


def _train_sample(workdir, prompt: str, new: int, settings) -> str:
  """train.sample's text (its library half, `inference.generate`)."""
  mc, params, tokenizer = inference.load_language_model(str(workdir))
  tokens = inference.generate(
      params, jnp.asarray(tokenizer.encode(prompt))[None],
      sampling.rows([settings]), model=Transformer(mc, decode=True),
      max_new_tokens=new)
  return sampling.cut(np.asarray(tokens[0]), eos_ids=tokenizer.eos_ids,
                      decode=tokenizer.decode, stop=settings.stop).text


def test_a_completion_is_serve_generates_and_train_samples_text(
    served, trained, tmp_path):
  _, url = served
  hot = dict(temperature=0.9, top_k=40, top_p=0.95)
  seeded = complete(url, prompt='def main', max_tokens=12, seed=5, **hot)
  _, unseeded = post(url + '/v1/completions', dict(
      prompt='def main', max_tokens=12, **hot), headers={
          'X-Request-Id': 'req-7'})
  greedy = complete(url, prompt='import o', max_tokens=12, temperature=0,
                     stop=['\n'])
  files = api_server.generate_texts(trained, tmp_path / 'a', [
      {'id': 'seeded', 'prompt': 'def main', 'seed': 5},
      {'id': 'req-7-0', 'prompt': 'def main'}], 12, seed=11, **hot)
  assert seeded['choices'][0]['text'] == files['seeded']
  # No seed: request_seed(the server's --seed, "<X-Request-Id>-0"), as
  # serve.generate derives line "req-7-0"'s from its --seed.
  assert unseeded['choices'][0]['text'] == files['req-7-0']
  assert files['seeded'] == _train_sample(
      trained, 'def main', 12, sampling.SamplingParams(seed=5, **hot))
  assert greedy['choices'][0]['text'] == _train_sample(
      trained, 'import o', 12, sampling.SamplingParams(stop=('\n',)))
  assert seeded['usage']['prompt_tokens'] == 8
  assert seeded['model'] == trained.name and seeded['object'] == (
      'text_completion')
  _, params, _ = inference.load_language_model(str(trained))
  assert seeded['system_fingerprint'] == checkpoint.fingerprint(params)


def test_streamed_chunks_add_up_to_the_text_with_stop_strings_held_back(
    served):
  _, url = served
  for stop in ([], ['e '], ['xyz', 'in']):
    body = dict(prompt='def main(', max_tokens=16, temperature=0.8, seed=3,
                stop=stop)
    whole = complete(url, **body)['choices'][0]
    conn, events = stream(url, {**body, 'stream': True,
                                'stream_options': {'include_usage': True}})
    chunks = list(events)
    conn.close()
    assert chunks[-1] == '[DONE]' and chunks[-2]['usage'][
        'completion_tokens'] > 0
    texts = [c['choices'][0]['text'] for c in chunks[:-2]]
    assert ''.join(texts) == whole['text']
    assert all(not any(s in t for s in stop) for t in texts)
    assert chunks[-3]['choices'][0]['finish_reason'] == whole['finish_reason']
    assert len(texts) > 1


def test_echo_with_no_new_tokens_scores_the_prompt_as_the_full_pass(
    served, trained):
  _, url = served
  text = 'def main(): return 1'
  answer = complete(url, prompt=[text, 'import os'], max_tokens=0, echo=True,
                     logprobs=1, temperature=0)
  mc, params, tokenizer = inference.load_language_model(str(trained))
  for choice, prompt in zip(answer['choices'], [text, 'import os']):
    tokens = tokenizer.encode(prompt)
    logits = Transformer(mc).apply({'params': params}, tokens[None])[0]
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    lp = choice['logprobs']
    assert choice['text'] == prompt and lp['token_logprobs'][0] is None
    np.testing.assert_allclose(
        lp['token_logprobs'][1:],
        [logp[i - 1, tokens[i]] for i in range(1, len(tokens))], atol=1e-5)
    greedy = [max(top.values()) == chosen for top, chosen in zip(
        lp['top_logprobs'][1:], lp['token_logprobs'][1:])]
    assert greedy == [logp[i - 1].argmax() == tokens[i]
                      for i in range(1, len(tokens))]
    assert ''.join(lp['tokens']) == prompt
  assert answer['usage']['completion_tokens'] == 0


def test_requests_from_many_connections_share_one_batch(served, trained,
                                                        tmp_path):
  server, url = served
  stats = server.engine.stats
  steps, rows = stats.steps, stats.in_flight
  prompts = [f'line {i}: ' for i in range(6)]
  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    answers = list(pool.map(lambda p: complete(
        url, prompt=p, max_tokens=10, temperature=0), prompts))
  assert (stats.in_flight - rows) / (stats.steps - steps) > 1.5
  files = api_server.generate_texts(trained, tmp_path, [
      {'id': i, 'prompt': p} for i, p in enumerate(prompts)], 10)
  assert [a['choices'][0]['text'] for a in answers] == [
      files[i] for i in range(6)]


def test_the_routes_beside_completions(served):
  server, url = served
  status, models = api_server.get(url + '/v1/models')
  assert status == 200 and json.loads(models)['data'][0]['max_model_len'] == 32
  status, metrics = api_server.get(url + '/metrics')
  for name in ('time_to_first_token_seconds', 'time_per_output_token_seconds',
               'request_queue_time_seconds', 'num_requests_running',
               'num_requests_waiting', 'kv_pages_in_use',
               'prefix_cache_hit_rate', 'preemptions_total'):
    assert f'gqa_lab_{name}' in metrics, name
  assert re.search(r'gqa_lab_time_to_first_token_seconds_count [1-9]',
                   metrics)
  status, tokens = post(url + '/tokenize', {'prompt': 'hé'})
  assert status == 200 and tokens['tokens'] == [104, 195, 169]
  assert post(url + '/detokenize', {'tokens': [104, 195, 169]})[1] == {
      'prompt': 'hé'}
  status, info = api_server.get(url + '/tokenizer_info')
  assert json.loads(info)['model_max_length'] == 32


