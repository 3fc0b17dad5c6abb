"""One completion in flight (`CompletionRun`): its prompts submitted to the
device loop (`serve.service.EngineThread`), their tokens gathered as the
engine makes them and answered as OpenAI's completions API does, in one
response or as server-sent events; a client that leaves aborts what has not
finished, so its pages come back at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from lm.sampling_params import cut
from serve import engine as engine_lib
from serve import protocol


class CompletionRun:
  """One completion in flight: its requests submitted to the device loop,
  their Deltas gathered as they come (from the device thread, through the
  event loop). `server` is the `serve.api.Server` it came through (its loop,
  device thread, tokenizer, model name and the completions in flight)."""

  def __init__(self, server, completion: protocol.Completion):
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
            'finish_reason': finish_reason(output, done.reason)
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
          choice['finish_reason'] = finish_reason(delta.output, done.reason)
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


def finish_reason(output: engine_lib.Output, cut_reason: str) -> str:
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
