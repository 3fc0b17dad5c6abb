"""The server's metrics, in Prometheus's text format (`GET /metrics`).

Per request, as it finishes (histograms, seconds): time to first token
(from arrival, queueing included), time per output token after the first,
queue time (arrival to first admission), end-to-end latency. Counted
(counters): prompt and generated tokens, requests finished by reason
('length', 'eos', 'stop', 'abort'), refused, preemptions, prefix-cache
lookups and hits in tokens (the hit rate is hits / lookups; also a gauge).
Now (gauges, after every step): requests running and waiting, KV pages in
use, usable and cached. Names follow vLLM's (`vllm:time_to_first_token_
seconds` ...) with the prefix `gqa_lab_`, so a dashboard built for one
reads the other with a rename.

Each server has its own registry (two servers in one process, as tests
start them, count apart). Counters of the engine's `Stats` are mirrored by
increments since the last step, so /metrics agrees with the Stats a
benchmark reads.
"""

from __future__ import annotations

import prometheus_client as prom

from serve import engine as engine_lib

# Seconds: 1 ms to 5 min, denser where a CPU-served request lands.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5,
                   10, 20, 60, 120, 300)

# Engine Stats field -> (metric name, help).
_COUNTED = {
    'prefill_tokens': ('prefill_tokens', 'prompt tokens computed (prefill, '
                       'recomputation included; cached ones are not)'),
    'decode_tokens': ('decode_tokens', 'tokens fed as decode rows'),
    'preemptions': ('preemptions', 'sequences preempted (pages freed, '
                    'recomputed later)'),
    'lookup_tokens': ('prefix_cache_queries', 'context tokens looked up in '
                      'the prefix cache at admission'),
    'cached_tokens': ('prefix_cache_hits', 'context tokens found in the '
                      'prefix cache (their prefill skipped)'),
    'refused': ('requests_refused', 'requests the engine refused'),
}


class Metrics:
  """The server's metrics; `observe` each finished Output, `after_step`
  after every step (on the device thread: prometheus_client is
  thread-safe)."""

  def __init__(self, prefix: str = 'gqa_lab_'):
    self.registry = prom.CollectorRegistry()
    r, p = self.registry, prefix
    histogram = lambda name, doc: prom.Histogram(
        p + name, doc, registry=r, buckets=LATENCY_BUCKETS)
    self.ttft = histogram('time_to_first_token_seconds',
                          'arrival to first token, queueing included')
    self.tpot = histogram('time_per_output_token_seconds',
                          'mean time between a request\'s later tokens')
    self.queue = histogram('request_queue_time_seconds',
                           'arrival to first admission')
    self.e2e = histogram('e2e_request_latency_seconds',
                         'arrival to finish')
    self.prompt_tokens = prom.Counter(p + 'prompt_tokens', 'prompt tokens of '
                                      'finished requests', registry=r)
    self.generation_tokens = prom.Counter(p + 'generation_tokens', 'tokens '
                                          'generated', registry=r)
    self.finished = prom.Counter(p + 'requests_finished', 'requests finished',
                                 ['finish_reason'], registry=r)
    self.counted = {field: prom.Counter(p + name, doc, registry=r)
                    for field, (name, doc) in _COUNTED.items()}
    self.running = prom.Gauge(p + 'num_requests_running', 'requests holding '
                              'pages', registry=r)
    self.waiting = prom.Gauge(p + 'num_requests_waiting', 'requests waiting '
                              'for pages', registry=r)
    self.pages_in_use = prom.Gauge(p + 'kv_pages_in_use', 'KV pages held by '
                                   'requests', registry=r)
    self.pages_usable = prom.Gauge(p + 'kv_pages_usable', 'KV pages in the '
                                   'pool', registry=r)
    self.pages_cached = prom.Gauge(p + 'kv_pages_cached', 'KV pages keyed in '
                                   'the prefix cache (held or free)',
                                   registry=r)
    self.hit_rate = prom.Gauge(p + 'prefix_cache_hit_rate', 'of the tokens '
                               'looked up, those found cached', registry=r)
    self._seen = {field: 0 for field in _COUNTED}
    self._stats = None

  def observe(self, output: engine_lib.Output):
    """A finished request."""
    self.finished.labels(output.finish_reason).inc()
    self.prompt_tokens.inc(output.prompt_tokens)
    self.generation_tokens.inc(len(output.tokens))
    for histogram, value in ((self.e2e, output.latency_s),
                             (self.ttft, output.time_to_first_token_s),
                             (self.tpot, output.per_token_s),
                             (self.queue, output.queue_s)):
      if value is not None:
        histogram.observe(value)

  def after_step(self, engine: engine_lib.Engine, deltas=()):
    """The engine's state after a step, and the requests that finished in
    it (their Deltas with an Output)."""
    for delta in deltas:
      if delta.output is not None:
        self.observe(delta.output)
    stats, scheduler = engine.stats, engine.scheduler
    if stats is not self._stats:  # reset_stats: count from its zero.
      self._stats, self._seen = stats, {field: 0 for field in _COUNTED}
    for field, counter in self.counted.items():
      value = getattr(stats, field)
      counter.inc(value - self._seen[field])
      self._seen[field] = value
    self.running.set(len(scheduler.running))
    self.waiting.set(scheduler.num_waiting)
    self.pages_in_use.set(engine.pages.in_use)
    self.pages_usable.set(engine.pages.usable)
    self.pages_cached.set(engine.pages.cached)
    self.hit_rate.set(stats.prefix_hit_rate)

  def text(self) -> bytes:
    return prom.generate_latest(self.registry)
