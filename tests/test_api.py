"""Specification of the OpenAI-compatible server (`python -m serve.api`,
`serve/api.py`, `serve/protocol.py`), started on a free localhost port:

a completion's text is serve.generate's and train.sample's for the same
prompt, settings and seed (a request without a seed derives it as
serve.generate derives a line's); streamed chunks add up to that text, stop
strings held back until they cannot begin; echo with max_tokens=0 scores a
prompt as the model's full pass does; requests from many connections share
one batch; a full pool queues; a client that leaves has its request aborted
and its pages returned; every bad input is an OpenAI error body (400, 404,
413) and the server goes on; no traceback reaches a client; SIGTERM drains.
"""

import concurrent.futures
import http.client
import json
import re
import signal
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve import api, generate, protocol
from tests import api_server
from tests.api_server import post, stream
from lm import checkpoint, inference, sampling
from lm.model import Transformer

pytestmark = pytest.mark.slow  # Each starts a server and compiles its steps.


@pytest.fixture(scope='module')
def served(trained):
  with api_server.running(trained, seed=11) as (server, url):
    yield server, url


def _complete(url, **body):
  status, answer = post(url + '/v1/completions', body)
  assert status == 200, answer
  return answer


def _generate_file(workdir, tmp_path, lines, max_new_tokens, **settings):
  """serve.generate's {id: text} for JSON lines."""
  tmp_path.mkdir(parents=True, exist_ok=True)
  prompts, out = tmp_path / 'prompts.jsonl', tmp_path / 'out.jsonl'
  prompts.write_text(''.join(json.dumps(line) + '\n' for line in lines))
  generate.generate_file(str(workdir), str(prompts), str(out),
                         kv_memory='1MiB', max_new_tokens=max_new_tokens,
                         settings=sampling.SamplingParams(**settings))
  return {r['id']: r['text'] for r in map(json.loads,
                                         out.read_text().splitlines())}


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
  seeded = _complete(url, prompt='def main', max_tokens=12, seed=5, **hot)
  _, unseeded = post(url + '/v1/completions', dict(
      prompt='def main', max_tokens=12, **hot), headers={
          'X-Request-Id': 'req-7'})
  greedy = _complete(url, prompt='import o', max_tokens=12, temperature=0,
                     stop=['\n'])
  files = _generate_file(trained, tmp_path / 'a', [
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
    whole = _complete(url, **body)['choices'][0]
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
  answer = _complete(url, prompt=[text, 'import os'], max_tokens=0, echo=True,
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
    answers = list(pool.map(lambda p: _complete(
        url, prompt=p, max_tokens=10, temperature=0), prompts))
  assert (stats.in_flight - rows) / (stats.steps - steps) > 1.5
  files = _generate_file(trained, tmp_path, [
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


BAD = [  # (body, status, the parameter named)
    (b'{"prompt": "x"', 400, None),  # Not JSON.
    (b'[1, 2]', 400, None),  # Not an object.
    ({'prompt': 'x', 'bogus': 1}, 400, 'bogus'),
    ({'prompt': 'x', 'temperature': -1}, 400, 'temperature'),
    ({'prompt': 'x', 'top_p': 1.5}, 400, 'top_p'),
    ({'prompt': 'x', 'top_k': 100000}, 400, 'top_k'),
    ({'prompt': 'x', 'max_tokens': -1}, 400, 'max_tokens'),
    ({'prompt': 'x', 'seed': -2}, 400, 'seed'),
    ({'prompt': 'x', 'logprobs': 9}, 400, 'logprobs'),
    ({'prompt': 'x', 'n': 2}, 400, 'n'),
    ({'prompt': 'x', 'presence_penalty': 0.5}, 400, 'presence_penalty'),
    ({'prompt': 'x', 'stream': 'yes'}, 400, 'stream'),
    ({'prompt': 'x', 'stop': [3]}, 400, 'stop'),
    ({'prompt': 7}, 400, 'prompt'),
    ({'prompt': [[1, 999]]}, 400, 'prompt'),  # Past the vocabulary.
    ({'prompt': ''}, 400, 'prompt'),  # Empty.
    ({'prompt': 'x' * 30, 'max_tokens': 5}, 400, 'prompt'),  # Past max_len.
    ({'prompt': 'x' * 40, 'max_tokens': 0, 'echo': True}, 400, 'prompt'),
    ({'prompt': 'x', 'model': 'gpt-9'}, 404, 'model'),
]


@pytest.mark.parametrize('body,status,param', BAD)
def test_bad_input_is_an_openai_error_and_the_server_goes_on(served, body,
                                                             status, param):
  _, url = served
  got, answer = post(url + '/v1/completions', body)
  assert got == status, answer
  error = answer['error']
  assert error['param'] == param and error['code'] == status
  assert '\n' not in error['message'] and error['type']
  assert _complete(url, prompt='ok', max_tokens=2)['choices'][0]['text']


def test_a_body_over_the_limit_is_413_by_length_or_as_it_arrives(trained):
  with api_server.running(trained, max_body='1KiB') as (_, url):
    status, answer = post(url + '/v1/completions', {'prompt': 'x' * 2000})
    assert status == 413 and 'max_body' in answer['error']['message']
    host, port = url.split('//')[1].split(':')
    conn = http.client.HTTPConnection(host, int(port))  # Chunked: no length.
    conn.request('POST', '/v1/completions', iter([b'{"prompt": "', b'x' * 2000,
                                                  b'"}']),
                 {'Content-Type': 'application/json'}, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())['error']
    assert _complete(url, prompt='ok', max_tokens=2)


def test_no_traceback_reaches_a_client(served, monkeypatch):
  _, url = served

  def broken(*args, **kwargs):
    raise RuntimeError('boom at /secret/path')
  monkeypatch.setattr(protocol, 'parse', broken)
  status, text = post(url + '/v1/completions', {'prompt': 'x'}, raw=True)
  assert status == 500
  error = json.loads(text)['error']
  assert error['type'] == 'internal_error' and 'RuntimeError' in error[
      'message']
  assert 'Traceback' not in text and 'secret' not in text
  status, text = post(url + '/nowhere', {}, raw=True)
  assert status == 404 and json.loads(text)['error']['type']
  monkeypatch.undo()
  assert _complete(url, prompt='ok', max_tokens=2)


def _slowed(server, seconds: float):
  """Each engine step takes `seconds` longer (a request stays in flight)."""
  step = server.engine.step_deltas

  def slow():
    time.sleep(seconds)
    return step()
  server.engine.step_deltas = slow


def _wait(condition, timeout=60):
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, 'timed out'
    time.sleep(0.05)


def test_a_client_that_leaves_has_its_request_aborted_and_pages_freed(
    trained):
  with api_server.running(trained) as (server, url):
    _slowed(server, 0.2)
    conn, events = stream(url, {'prompt': 'def ', 'max_tokens': 24,
                                'temperature': 0, 'stream': True})
    next(events)
    assert server.engine.pages.in_use > 0
    conn.close()  # Mid-stream.
    _wait(lambda: server.engine.stats.aborted == 1)
    assert server.engine.pages.in_use == 0
    assert not server.engine.has_unfinished() and not server.in_flight
    # Not streaming: the client sends, then leaves before the answer.
    host, port = url.split('//')[1].split(':')
    raw = socket.create_connection((host, int(port)))
    body = json.dumps({'prompt': 'def ', 'max_tokens': 24}).encode()
    raw.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: '
                b'application/json\r\nContent-Length: %d\r\n\r\n%s' % (
                    len(body), body))
    _wait(lambda: server.engine.pages.in_use > 0)
    raw.close()
    _wait(lambda: server.engine.stats.aborted == 2)
    assert server.engine.pages.in_use == 0
    _, metrics = api_server.get(url + '/metrics')
    assert 'gqa_lab_requests_finished_total{finish_reason="abort"} 2.0' in (
        metrics)


def test_a_full_pool_queues_requests_and_drops_none(trained, tmp_path):
  """A pool of 2 pages of 16 holds one request at a time."""
  mc, _, _ = inference.load_language_model(str(trained))
  from serve import runner  # pylint: disable=import-outside-toplevel
  with api_server.running(trained, kv_memory=str(
      3 * runner.page_bytes(mc, 16))) as (server, url):
    assert server.engine.pages.usable == 2
    prompts = [f'{i} + {i} = ' for i in range(5)]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
      answers = list(pool.map(lambda p: _complete(
          url, prompt=p, max_tokens=16, temperature=0), prompts))
  files = _generate_file(trained, tmp_path, [
      {'id': i, 'prompt': p} for i, p in enumerate(prompts)], 16)
  assert [a['choices'][0]['text'] for a in answers] == [
      files[i] for i in range(5)]


@pytest.mark.slowest
def test_sigterm_drains_refuses_newcomers_and_exits_0(tmp_path):
  """In-flight requests finish, or are cut at --drain_timeout and say so;
  a request during the drain gets 503; loopback is the default address."""
  workdir = api_server.train_workdir(tmp_path / 'long', max_len=2048,
                                     steps=2)
  with api_server.process(workdir, '--drain_timeout=4') as (proc, url):
    assert url.startswith('http://127.0.0.1:')
    _complete(url, prompt='warm up', max_tokens=4)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      short = pool.submit(_complete, url, prompt='a', max_tokens=8,
                          temperature=0)
      long = pool.submit(_complete, url, prompt='b', max_tokens=2000,
                         temperature=0)
      time.sleep(0.5)
      proc.send_signal(signal.SIGTERM)
      time.sleep(0.5)
      status, answer = post(url + '/v1/completions', {'prompt': 'late'})
      assert status == 503 and 'shutting down' in answer['error']['message']
      assert short.result()['choices'][0]['finish_reason'] == 'length'
      cut = long.result()['choices'][0]
    assert cut['finish_reason'] == 'abort' and cut['text']
    assert proc.wait(60) == 0
    assert 'end with finish_reason "abort"' in proc.stderr.read()
