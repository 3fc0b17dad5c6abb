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
engine requests (`serve.protocol.parse`) and hand them, as a
`serve.completion.CompletionRun`, to the device loop
(`serve.service.EngineThread`), which steps one engine on its own thread, so
requests from every connection share its continuous batch and the event
loop never waits for the device. Each request's tokens come back as the
engine makes them; a client that disconnects (streaming or not) has its
request aborted and its pages returned at once.

Faults: malformed JSON, an unknown or out-of-range parameter and a prompt
too long for the model are a 400 with OpenAI's error body, naming what is
wrong; a body over --max_body a 413; anything unforeseen a 500 with one
line (the traceback goes to the server's log, never to a client). A full
pool queues requests, never drops them. SIGTERM (or Ctrl-C) drains
(`serve.listener`): new requests get 503, those in flight finish, and any
still running after --drain_timeout seconds end with finish_reason "abort"
(what they had generated is returned); then the process exits 0. A second
signal exits at once. It listens on 127.0.0.1 unless --host says otherwise.

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
import sys
import pathlib
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from attention import layer
from infra.cli import run_app
from infra.errors import UserError
from lm import checkpoint
from lm import inference
from lm import tokenizer as tokenizer_lib
from lm.sampling_params import is_int
from serve import engine as engine_lib
from serve import metrics as metrics_lib
from serve import pages
from serve import protocol
from serve import service as service_lib
from serve.completion import CompletionRun
# The process around the app (a socket, uvicorn, the drain), which
# tests/api_server.py and `main` use.
from serve.listener import listen, serve  # pylint: disable=unused-import

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
    run = CompletionRun(self, completion)
    if completion.stream:
      return StreamingResponse(run.events(), media_type='text/event-stream',
                               headers={'Cache-Control': 'no-cache'})
    return await run.whole(request)


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
