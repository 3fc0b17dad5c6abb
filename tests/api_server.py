"""The completions server for tests: started on a free localhost port in a
thread (`running`; in a process: `serve.process.ServerProcess`), and small HTTP helpers on the
standard library (so that what is tested is the server, not a client's
conveniences)."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import urllib.error
import urllib.request

from configs import tiny
from lm import sampling
from serve import api
from serve import generate
from train import loop


@contextlib.contextmanager
def running(workdir, **build):
  """(the Server, its base URL) of a workdir served in a thread on a free
  port; stopped (uvicorn's exit, the engine thread joined) after."""
  server, _ = api.build(str(workdir), **{'kv_memory': '1MiB', **build})
  sock = api.listen('127.0.0.1', 0)
  url = f'http://127.0.0.1:{sock.getsockname()[1]}'
  thread = threading.Thread(target=api.serve, args=(server, sock),
                            daemon=True)
  thread.start()
  wait_healthy(url)
  try:
    yield server, url
  finally:
    server.uvicorn.should_exit = True
    thread.join(60)
    assert not thread.is_alive() and not server.thread.alive


def wait_healthy(url: str, timeout: float = 120):
  deadline = time.monotonic() + timeout
  while True:
    try:
      if get(url + '/health')[0] == 200:
        return
    except OSError:
      pass
    if time.monotonic() > deadline:
      raise TimeoutError(f'{url} not healthy after {timeout}s')
    time.sleep(0.1)


def get(url: str) -> tuple[int, str]:
  try:
    with urllib.request.urlopen(url, timeout=120) as response:
      return response.status, response.read().decode()
  except urllib.error.HTTPError as e:
    return e.code, e.read().decode()


def post(url: str, body, raw: bool = False, headers=None
         ) -> tuple[int, dict | str]:
  """(status, the JSON answer, or its text if raw)."""
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  request = urllib.request.Request(url, data=data, headers={
      'Content-Type': 'application/json', **(headers or {})})
  try:
    with urllib.request.urlopen(request, timeout=300) as response:
      status, text = response.status, response.read().decode()
  except urllib.error.HTTPError as e:
    status, text = e.code, e.read().decode()
  return status, text if raw else json.loads(text)


def complete(url: str, **body) -> dict:
  """The answer of a completion that must succeed."""
  status, answer = post(url + '/v1/completions', body)
  assert status == 200, answer
  return answer


def stream(url: str, body: dict, headers=None):
  """(the open connection, an iterator of each SSE event's data)."""
  host, port = url.split('//')[1].split(':')
  conn = http.client.HTTPConnection(host, int(port), timeout=300)
  conn.request('POST', '/v1/completions', json.dumps(body),
               {'Content-Type': 'application/json', **(headers or {})})
  response = conn.getresponse()
  assert response.status == 200, response.read()

  def events():
    for line in response:
      line = line.decode().strip()
      if line.startswith('data: '):
        data = line[len('data: '):]
        yield data if data == '[DONE]' else json.loads(data)
  return conn, events()


def train_workdir(workdir, max_len: int = 32, steps: int = 20):
  """`tiny` trained for `steps`, its max_len raised (positions past its
  seq_len of 32 untrained: a model for lengths, not quality)."""
  config = tiny.get_config()
  config.model.max_len = max_len
  config.train.update(steps=steps, eval_every=steps, checkpoint_every=steps,
                      log_every=steps, warmup_steps=min(2, steps - 1))
  loop.train_and_evaluate(config, str(workdir))
  return workdir


def generate_texts(workdir, tmp_path, lines, max_new_tokens, **settings):
  """serve.generate's {id: text} for JSON lines."""
  tmp_path.mkdir(parents=True, exist_ok=True)
  prompts, out = tmp_path / 'prompts.jsonl', tmp_path / 'out.jsonl'
  prompts.write_text(''.join(json.dumps(line) + '\n' for line in lines))
  generate.generate_file(str(workdir), str(prompts), str(out),
                         kv_memory='1MiB', max_new_tokens=max_new_tokens,
                         settings=sampling.SamplingParams(**settings))
  return {r['id']: r['text'] for r in map(json.loads,
                                         out.read_text().splitlines())}
