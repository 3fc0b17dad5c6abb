"""`python -m serve.api` in a process of its own, on a free localhost port:
the server as its clients see it, for benchmarks and load tests.

  with process.ServerProcess('runs/tiny', '--kv_memory=64MiB') as server:
    ... clients against server.url ...
    before = server.counters()  # {'gqa_lab_prefill_tokens_total': ...}
    status = server.stop()      # SIGTERM: a drain; its exit status

Its stderr is read on a thread for as long as it runs (a pipe nobody reads
fills and stops the server at its next line): the lines up to the one that
says it listens are kept (`started`), and the last lines after (`said`).
Leaving the `with` kills a server still running.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from infra.errors import UserError


class ServerProcess:
  """python -m serve.api --workdir=WORKDIR --port=0 FLAGS...; `url` once it
  listens."""

  def __init__(self, workdir: str, *flags: str):
    self.process = subprocess.Popen(
        [sys.executable, '-m', 'serve.api', f'--workdir={workdir}',
         '--port=0', *flags], stderr=subprocess.PIPE, text=True,
        env={**os.environ, 'PYTHONUNBUFFERED': '1'})
    self.started, self.said = [], collections.deque(maxlen=20)
    for line in self.process.stderr:
      self.started.append(line)
      found = re.search(r'listening on (http://\S+)', line)
      if found:
        self.url = found.group(1)
        break
    else:
      self.process.wait(30)
      raise UserError('serve.api never listened: '
                      + ''.join(self.started[-3:]).strip())
    self.said.extend(self.started)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def __enter__(self) -> ServerProcess:
    return self

  def __exit__(self, *exc):
    if self.process.poll() is None:
      self.process.kill()
    self.wait(30)

  def _read(self):
    for line in self.process.stderr:
      self.said.append(line)

  def wait(self, timeout: float) -> int:
    """Its exit status once it has exited and its last lines are read."""
    status = self.process.wait(timeout)
    self._reader.join(timeout)
    return status

  def model(self) -> dict:
    """GET /v1/models' model card: its `id` and `max_model_len`."""
    with urllib.request.urlopen(self.url + '/v1/models', timeout=60) as r:
      return json.load(r)['data'][0]

  def counters(self) -> dict[str, float]:
    """GET /metrics: each sample's value by its name, summed over labels
    (`gqa_lab_prefill_tokens_total`, `gqa_lab_kv_pages_in_use`, ...)."""
    with urllib.request.urlopen(self.url + '/metrics', timeout=60) as r:
      text = r.read().decode()
    totals = collections.Counter()
    for family in text_string_to_metric_families(text):
      for sample in family.samples:
        totals[sample.name] += sample.value
    return dict(totals)

  def stop(self) -> int:
    """SIGTERM (a drain); its exit status."""
    self.process.send_signal(signal.SIGTERM)
    try:
      return self.process.wait(120)
    finally:
      if self.process.poll() is None:
        self.process.kill()
        self.process.wait(30)
