"""An OpenAI-compatible completions server over the engine.

  python -m serve.api --workdir=DIR [--host=127.0.0.1] [--port=8000] \
      [--kv_memory=256MiB] [--slots=32] [--seed=0] [--noprefix_caching] \
      [--max_body=1MiB] [--drain_timeout=30]

Routes: POST /v1/completions (`serve.protocol`: OpenAI's parameters, SSE
streaming), GET /v1/models, GET /health, GET /metrics (Prometheus text,
`serve.metrics`), and vLLM's tokenizer routes (GET /tokenizer_info, POST
/tokenize, POST /detokenize), which lm_eval's `local-completions` uses to
count a context's tokens without a tokenizer of its own.

A thin shell: Starlette routes on uvicorn's event loop turn a body into
engine requests (`serve.protocol.parse`) and hand them to the device loop
(`serve.service.EngineThread`), which steps one engine on its own thread, so
requests from every connection share its continuous batch and the event
loop never waits for the device. Each request's tokens come back as the
engine makes them; a client that disconnects (streaming or not) has its
request aborted and its pages returned at once.

Faults: malformed JSON, an unknown or out-of-range parameter and a prompt
too long for the model are a 400 with OpenAI's error body, naming what is
wrong; a body over --max_body a 413; anything unforeseen a 500 with one
line (the traceback goes to the server's log, never to a client). A full
pool queues requests, never drops them. SIGTERM (or Ctrl-C) drains: new
requests get 503, those in flight finish, and any still running after
--drain_timeout seconds end with finish_reason "abort" (what they had
generated is returned); then the process exits 0. A second signal exits at
once. It listens on 127.0.0.1 unless --host says otherwise.

Starlette and uvicorn, not FastAPI: the API's parameters are checked by
`serve.protocol`, whose errors must be OpenAI's 400 bodies naming the
parameter (FastAPI's pydantic models answer 422 in their own shape), and
Starlette is the small, well-kept core FastAPI itself is built on (as is
vLLM's server), with uvicorn the server both run on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import time
import pathlib
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
import uvicorn

from attention import layer
from infra.cli import run_app
from infra.errors import UserError
from lm import checkpoint
from lm import inference
from lm import tokenizer as tokenizer_lib
from lm.sampling_params import cut, is_int
from serve import engine as engine_lib
from serve import metrics as metrics_lib
from serve import pages
from serve import protocol
from serve import service as service_lib

log = logging.getLogger('serve.api')


def error(status: int, message: str, param=None,
          kind='invalid_request_error') -> JSONResponse:
  e = protocol.ApiError(status, message, param, kind)
  return JSONResponse(e.body(), status_code=status)


class Server:
  """The app's state: the device loop, the tokenizer, what /v1/models and
  the responses name, and whether it is draining."""

  def __init__(self, engine: engine_lib.Engine, tokenizer, *, model: str,
               fingerprint: str, seed: int = 0, max_body: int = 2**20,
               bos_id: int | None = None):
    self.engine, self.tokenizer = engine, tokenizer
    self.model, self.fingerprint, self.seed = model, fingerprint, seed
    self.max_body, self.bos_id = max_body, bos_id
    self.metrics = metrics_lib.Metrics()
    self.thread = service_lib.EngineThread(engine, self.metrics.after_step)
    self.draining = False
    self.in_flight: dict[str, list[str]] = {}  # Completion id -> its keys.
    self.loop: asyncio.AbstractEventLoop | None = None

  def app(self) -> Starlette:
    routes = [Route('/v1/completions', self.completions, methods=['POST']),
              Route('/v1/models', self.models),
              Route('/health', self.health),
              Route('/metrics', self.metrics_text),
              Route('/tokenizer_info', self.tokenizer_info),
              Route('/tokenize', self.tokenize, methods=['POST']),
              Route('/detokenize', self.detokenize, methods=['POST'])]
    return Starlette(routes=routes, lifespan=self._lifespan,
                     exception_handlers={Exception: self._internal,
                                         404: self._not_found,
                                         405: self._not_allowed})

  @contextlib.asynccontextmanager
  async def _lifespan(self, app):
    del app
    self.loop = asyncio.get_running_loop()
    self.thread.start()
    yield
    self.thread.stop(timeout=60)

  # Errors.

  async def _internal(self, request, exc):
    del request
    log.error('unexpected error', exc_info=exc)
    return error(500, f'internal error ({type(exc).__name__}); the server '
                 'log has the details', kind='internal_error')

  async def _not_found(self, request, exc):
    del exc
    return error(404, f'no route {request.url.path}; see GET /v1/models, POST '
                 '/v1/completions', kind='not_found_error')

  async def _not_allowed(self, request, exc):
    del exc
    return error(405, f'{request.method} is not allowed on {request.url.path}')

  # Small routes.

  async def health(self, request):
    del request
    if self.thread.failed:
      return error(503, self.thread.failed, kind='service_unavailable')
    if self.draining:
      return error(503, 'the server is shutting down',
                   kind='service_unavailable')
    return JSONResponse({'status': 'ok'})

  async def models(self, request):
    del request
    return JSONResponse({'object': 'list', 'data': [{
        'id': self.model, 'object': 'model', 'created': 0,
        'owned_by': 'gqa-lab', 'max_model_len': self.engine.config.max_len}]})

  async def metrics_text(self, request):
    del request
    return Response(self.metrics.text(),
                    media_type='text/plain; version=0.0.4; charset=utf-8')

  async def tokenizer_info(self, request):
    del request
    text = lambda i: None if i is None else self.tokenizer.decode([i])
    eos = self.tokenizer.eos_ids
    return JSONResponse({
        'tokenizer_class': type(self.tokenizer).__name__,
        'name': self.tokenizer.name, 'bos_token': text(self.bos_id),
        'eos_token': text(eos[0]) if eos else None, 'pad_token': None,
        'model_max_length': self.engine.config.max_len})

  async def tokenize(self, request):
    body = await self._body(request)
    if isinstance(body, Response):
      return body
    if not isinstance(body, dict) or not isinstance(body.get('prompt'), str):
      return error(400, 'give {"prompt": "text"}', 'prompt')
    tokens = self.tokenizer.encode(
        body['prompt'], special=bool(body.get('add_special_tokens', True)))
    return JSONResponse({'tokens': [int(t) for t in tokens],
                         'count': len(tokens),
                         'max_model_len': self.engine.config.max_len})

  async def detokenize(self, request):
    body = await self._body(request)
    if isinstance(body, Response):
      return body
    tokens = body.get('tokens') if isinstance(body, dict) else None
    vocab = self.engine.config.vocab_size
    if not (isinstance(tokens, list) and all(
        isinstance(t, int) and 0 <= t < vocab for t in tokens)):
      return error(400, f'give {{"tokens": [ids in 0..{vocab - 1}]}}',
                   'tokens')
    return JSONResponse({'prompt': self.tokenizer.decode(tokens)})

  async def _body(self, request: HttpRequest):
    """The body as JSON, or the error Response: 413 past max_body (by its
    Content-Length, or as it arrives), 400 if it is not JSON."""
    limit = self.max_body
    too_big = error(413, f'the body is over {limit:,} bytes (the server\'s '
                    '--max_body); send less', kind='request_too_large')
    declared = request.headers.get('content-length', '')
    if declared.isdigit() and int(declared) > limit:
      return too_big
    data = bytearray()
    async for part in request.stream():
      data += part
      if len(data) > limit:
        return too_big
    try:
      return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return error(400, f'the body is not JSON ({e}); send a JSON object')

  # Completions.

  async def completions(self, request: HttpRequest):
    if self.draining or self.thread.failed:
      return error(503, self.thread.failed or 'the server is shutting down; '
                   'send the request elsewhere or later',
                   kind='service_unavailable')
    body = await self._body(request)
    if isinstance(body, Response):
      return body
    request_id = request.headers.get('x-request-id') or (
        f'cmpl-{uuid.uuid4().hex}')
    if request_id in self.in_flight:  # Its engine ids would collide.
      return error(400, f'X-Request-Id {request_id!r} is in flight already; '
                   'give each request its own id')
    config = self.engine.config
    try:
      completion = protocol.parse(
          body, request_id=request_id, model=self.model,
          max_len=config.max_len, vocab_size=config.vocab_size,
          encode=self.tokenizer.encode, server_seed=self.seed)
    except protocol.ApiError as e:
      return JSONResponse(e.body(), status_code=e.status)
    run = _Run(self, completion)
    if completion.stream:
      return StreamingResponse(run.events(), media_type='text/event-stream',
                               headers={'Cache-Control': 'no-cache'})
    return await run.whole(request)


class _Run:
  """One completion in flight: its requests submitted to the device loop,
  their Deltas gathered as they come (from the device thread, through the
  event loop)."""

  def __init__(self, server: Server, completion: protocol.Completion):
    self.server, self.completion = server, completion
    self.keys = [r.id for r in completion.requests]
    self.queue: asyncio.Queue = asyncio.Queue()
    self.outputs: dict[int, engine_lib.Output] = {}
    # Prompts the engine does not hold (refused: the id may be another
    # request's; or the engine failed): never to abort.
    self.unheld: set[int] = set()
    self.arrival = time.perf_counter()

  def _submit(self):
    server, loop = self.server, self.server.loop

    def sink(i):
      def put(item):
        with contextlib.suppress(RuntimeError):  # The loop closed: shutdown.
          loop.call_soon_threadsafe(self.queue.put_nowait, (i, item))
      return put
    server.in_flight[self.completion.id] = self.keys
    for i, request in enumerate(self.completion.requests):
      request.arrival = self.arrival
      server.thread.submit(request, sink(i))

  def _abort(self):
    """Aborts what has not finished (no-op for the rest)."""
    for i, key in enumerate(self.keys):
      if i not in self.outputs and i not in self.unheld:
        self.server.thread.abort(key)

  def _done(self):
    self.server.in_flight.pop(self.completion.id, None)

  async def deltas(self):
    """(prompt index, Delta) as they come, until every prompt's Output;
    an ApiError if the engine refused one (the others aborted)."""
    while len(self.outputs) < len(self.keys):
      i, item = await self.queue.get()
      if isinstance(item, engine_lib.RequestRefused):
        # Refused as a duplicate, its id is another request's: not aborted.
        self.unheld.add(i)
        self._abort()
        raise protocol.ApiError(400, f'prompt {i}: {item.reason}', 'prompt')
      if isinstance(item, Exception):  # The engine failed (service.py).
        self.unheld.update(range(len(self.keys)))
        raise protocol.ApiError(500, str(item), kind='internal_error')
      if item.output is not None:
        self.outputs[i] = item.output
      yield i, item

  async def whole(self, request: HttpRequest) -> Response:
    """The completion as one response; aborted if the client leaves."""
    self._submit()
    gather = asyncio.ensure_future(self._gather())
    left = asyncio.ensure_future(_disconnected(request))
    try:
      await asyncio.wait({gather, left}, return_when=asyncio.FIRST_COMPLETED)
      if not gather.done():  # The client left: nothing to answer.
        self._abort()
        gather.cancel()
        return Response(status_code=499)
      return gather.result()
    except protocol.ApiError as e:
      return JSONResponse(e.body(), status_code=e.status)
    finally:
      left.cancel()
      self._done()

  async def _gather(self) -> Response:
    async for _ in self.deltas():
      pass
    c, server = self.completion, self.server
    choices, generated = [], 0
    for i in range(len(self.keys)):
      choice, n = self._choice(i, self.outputs[i])
      choices.append(choice)
      generated += n
    use = protocol.usage(sum(map(len, c.prompts)), generated, sum(
        o.cached_tokens for o in self.outputs.values()))
    return JSONResponse(protocol.response(c, server.model, choices, use,
                                          server.fingerprint))

  def _choice(self, i: int, output: engine_lib.Output) -> tuple[dict, int]:
    """Prompt i's choice and how many tokens it generated."""
    c, decode = self.completion, self.server.tokenizer.decode
    tokens = output.tokens if c.max_tokens else []
    done = cut(tokens, eos_ids=(), decode=decode, stop=c.stop)
    prompt_text = decode(c.prompts[i]) if c.echo else ''
    logprobs = None
    if c.logprobs is not None and output.logprobs is not None:  # Not cut.
      entries = []
      if c.echo:
        entries = list(zip(c.prompts[i], [None] + output.prompt_logprobs))
      entries += list(zip(tokens, output.logprobs[:len(tokens)]))
      logprobs = protocol.logprobs_block(entries, decode)
    return {'index': i, 'text': prompt_text + done.text, 'logprobs': logprobs,
            'finish_reason': _finish_reason(output, done.reason)
            }, len(tokens)

  async def events(self):
    """Server-sent events: OpenAI's chunks, then `data: [DONE]`. Closed
    early (the client left), it aborts what has not finished."""
    c, server = self.completion, self.server
    decode = server.tokenizer.decode
    streams = [protocol.TextStream(decode, c.stop) for _ in self.keys]
    echoed, generated = set(), 0
    self._submit()
    try:
      async for i, delta in self.deltas():
        choices = []
        if c.echo and i not in echoed:
          echoed.add(i)
          choices.append(self._echo(i, delta))
        tokens = delta.tokens if c.max_tokens else []
        generated += len(tokens)
        text = streams[i].add(tokens)
        choice = {'index': i, 'text': text, 'logprobs': None,
                  'finish_reason': None}
        if c.logprobs is not None and tokens:
          choice['logprobs'] = protocol.logprobs_block(
              zip(tokens, delta.logprobs), decode)
        if delta.output is not None:
          done = cut(delta.output.tokens if c.max_tokens else [], eos_ids=(),
                     decode=decode, stop=c.stop)
          choice['text'] += streams[i].finish(done.text)
          choice['finish_reason'] = _finish_reason(delta.output, done.reason)
        if choice['text'] or choice['logprobs'] or choice['finish_reason']:
          choices.append(choice)
        if choices:
          yield _event(protocol.chunk(c, server.model, choices,
                                      server.fingerprint))
      if c.include_usage:
        yield _event(protocol.chunk(c, server.model, [], server.fingerprint,
                                    protocol.usage(
                                        sum(map(len, c.prompts)), generated,
                                        sum(o.cached_tokens for o in
                                            self.outputs.values()))))
    except protocol.ApiError as e:  # Headers are sent: the error as an event.
      yield _event(e.body())
    finally:  # Also when the client leaves (the stream is cancelled).
      self._abort()
      self._done()
    yield 'data: [DONE]\n\n'

  def _echo(self, i: int, delta: engine_lib.Delta) -> dict:
    """The chunk of prompt i's echoed text (and its log-probabilities)."""
    c, decode = self.completion, self.server.tokenizer.decode
    logprobs = None
    if c.logprobs is not None and delta.prompt_logprobs is not None:
      logprobs = protocol.logprobs_block(
          zip(c.prompts[i], [None] + delta.prompt_logprobs), decode)
    return {'index': i, 'text': decode(c.prompts[i]), 'logprobs': logprobs,
            'finish_reason': None}


def _finish_reason(output: engine_lib.Output, cut_reason: str) -> str:
  """OpenAI's: 'stop' (an end-of-sequence token or a stop string), 'length',
  or 'abort' (cut by a disconnect or the drain deadline)."""
  if output.finish_reason == 'abort':
    return 'abort'
  if output.finish_reason in ('eos', 'stop') or cut_reason == 'stop':
    return 'stop'
  return 'length'


def _event(payload: dict) -> str:
  return f'data: {json.dumps(payload)}\n\n'


async def _disconnected(request: HttpRequest):
  """Returns when the client disconnects (its body already read)."""
  while (await request.receive())['type'] != 'http.disconnect':
    pass


class _Uvicorn(uvicorn.Server):
  """uvicorn, its first SIGTERM or SIGINT a drain (see the module
  docstring) and exit status 0; a second exits at once."""

  def __init__(self, config: uvicorn.Config, server: Server,
               drain_timeout: float):
    super().__init__(config)
    self.server, self.drain_timeout = server, drain_timeout
    self._signalled = False

  def handle_exit(self, sig, frame):
    del frame
    if self._signalled or self.server.loop is None:
      self.should_exit = self.force_exit = True
      return
    self._signalled = True
    print(f'serve.api: {signal.Signals(sig).name}: draining (new requests get '
          f'503; in-flight ones have {self.drain_timeout:g}s)',
          file=sys.stderr, flush=True)
    self.server.loop.call_soon_threadsafe(
        lambda: asyncio.ensure_future(self.drain()))

  async def drain(self):
    server = self.server
    server.draining = True
    deadline = time.monotonic() + self.drain_timeout
    while server.in_flight and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    if server.in_flight:
      print(f'serve.api: {len(server.in_flight)} request(s) still running at '
            'the deadline end with finish_reason "abort"', file=sys.stderr,
            flush=True)
      for keys in list(server.in_flight.values()):
        for key in keys:
          server.thread.abort(key)
      while server.in_flight and time.monotonic() < deadline + 10:
        await asyncio.sleep(0.05)
    self.should_exit = True


def listen(host: str, port: int) -> socket.socket:
  """A listening socket on host:port (0: a free port), IPv4 or IPv6."""
  family = socket.AF_INET6 if ':' in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise UserError(f'--host={host} --port={port}: cannot listen there '
                    f'({e.strerror}); pick another port, or --port=0 for a '
                    'free one') from None
  sock.listen(2048)
  sock.set_inheritable(True)
  return sock


def build(workdir: str, *, kv_memory: str = '256MiB', page_size: int = 16,
          slots: int = 32, prefill_chunk: int = 64, admission='reserve',
          kv_cache_dtype=None, prefix_caching: bool = True, seed: int = 0,
          max_body: str = '1MiB', model: str | None = None
          ) -> tuple[Server, str]:
  """(the Server of a workdir's model, the line saying what was loaded)."""
  mc, params, tokenizer, step = inference.load_language_model(
      workdir, with_step=True)
  if kv_cache_dtype not in (None, *layer.KV_CACHE_DTYPES):
    raise UserError(f'--kv_cache_dtype={kv_cache_dtype!r}; use one of '
                    f'{", ".join(layer.KV_CACHE_DTYPES)}')
  if not is_int(seed) or not 0 <= seed < 1 << 32:
    raise UserError(f'--seed={seed} must be an integer in 0..2**32 - 1')
  try:
    engine = engine_lib.Engine(
        mc, params, kv_memory=pages.parse_bytes(kv_memory),
        page_size=page_size, slots=slots, prefill_chunk=prefill_chunk,
        eos_ids=tokenizer.eos_ids, kv_cache_dtype=kv_cache_dtype,
        detokenize=tokenizer.decode, admission=admission,
        prefix_caching=prefix_caching)
  except engine_lib.PoolSizeError as e:
    raise UserError(f'--kv_memory={kv_memory}: {e}') from None
  fingerprint = checkpoint.fingerprint(params)
  name = model or pathlib.Path(str(workdir).rstrip('/')).name
  server = Server(engine, tokenizer, model=name, fingerprint=fingerprint,
                  seed=seed, max_body=pages.parse_bytes(max_body, '--max_body'),
                  bos_id=tokenizer_lib.bos_id(tokenizer, workdir))
  return server, (f'{workdir} at step {step} (parameters {fingerprint}) as '
                  f'{name!r}, {engine.pages.usable} pages of {page_size} '
                  f'tokens, prefix caching {"on" if prefix_caching else "off"}')


def serve(server: Server, sock: socket.socket, drain_timeout: float = 30.0,
          log_level: str = 'warning'):
  """Serves on sock until a signal drains it (main thread) or
  `should_exit` (a thread, in tests: uvicorn then installs no handlers)."""
  config = uvicorn.Config(server.app(), log_level=log_level,
                          access_log=False, lifespan='on')
  runner = _Uvicorn(config, server, drain_timeout)
  server.uvicorn = runner
  runner.run(sockets=[sock])


def main(argv):
  from absl import flags  # pylint: disable=import-outside-toplevel
  del argv
  logging.basicConfig(level=logging.WARNING)
  f = flags.FLAGS
  if f.drain_timeout < 0:
    raise UserError(f'--drain_timeout={f.drain_timeout} must be >= 0')
  server, loaded = build(
      f.workdir, kv_memory=f.kv_memory, page_size=f.page_size, slots=f.slots,
      prefill_chunk=f.prefill_chunk, admission=f.admission,
      kv_cache_dtype=f.kv_cache_dtype, prefix_caching=f.prefix_caching,
      seed=f.seed, max_body=f.max_body, model=f.served_model_name)
  sock = listen(f.host, f.port)
  host, port = sock.getsockname()[:2]
  print(f'serve.api: {loaded}', file=sys.stderr)
  print(f'serve.api: listening on http://{host}:{port}', file=sys.stderr,
        flush=True)
  serve(server, sock, f.drain_timeout)
  print('serve.api: drained, exiting', file=sys.stderr, flush=True)


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('workdir', None, 'a train.main workdir')
  flags.DEFINE_string('host', '127.0.0.1', 'address to listen on (loopback '
                      'only by default; 0.0.0.0 listens on every interface)')
  flags.DEFINE_integer('port', 8000, 'port to listen on (0: a free one, '
                       'printed)', lower_bound=0, upper_bound=65535)
  flags.DEFINE_string('served_model_name', None, 'the model\'s name in the '
                      'API (default: the workdir\'s folder name)')
  flags.DEFINE_string('kv_memory', '256MiB', "the paged cache's bytes")
  flags.DEFINE_integer('slots', 32, 'sequences in flight at most',
                       lower_bound=1)
  flags.DEFINE_integer('page_size', 16, 'tokens per page', lower_bound=1)
  flags.DEFINE_integer('prefill_chunk', 64, 'prompt tokens a sequence feeds '
                       'per step', lower_bound=1)
  flags.DEFINE_enum('admission', 'reserve', ['reserve', 'optimistic'],
                    'as serve.generate\'s --admission')
  flags.DEFINE_string('kv_cache_dtype', None, 'float32, bfloat16 or int8 '
                      '(default: the model\'s)')
  flags.DEFINE_boolean('prefix_caching', True, 'reuse the KV pages of '
                       'prompts that start the same (--noprefix_caching: '
                       'off)')
  flags.DEFINE_integer('seed', 0, 'the seed a request without one derives '
                       'its own from (with its id)')
  flags.DEFINE_string('max_body', '1MiB', 'the largest request body '
                      'accepted (413 past it)')
  flags.DEFINE_float('drain_timeout', 30.0, 'seconds in-flight requests '
                     'have to finish after SIGTERM')
  run_app(main, required=['workdir'])


if __name__ == '__main__':
  run()
