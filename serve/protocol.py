"""OpenAI's completions API (`POST /v1/completions`), checked and shaped.

`parse` turns a request body into `Completion`: one engine `Request` per
prompt, or an `ApiError` (an HTTP status and one line, OpenAI's error
body) naming the first thing wrong: an unknown parameter, a value out of
range, a prompt too long for the model. `response`, `chunk` and `usage`
shape what goes back: a `text_completion` object, or its streamed chunks.
Pure functions of the body, the model's limits and the tokenizer: the HTTP
server (`serve.api`) is a thin shell around them.

Parameters (OpenAI's, with their defaults): prompt (a string, a list of
strings, a list of token ids, or a list of lists of ids; several prompts
make several choices), max_tokens (16; 0 with echo scores the prompt
alone), temperature (1), top_p (1), top_k (vLLM's; 0 or -1: all), seed, stop
(a string or a list), n (1 only), stream, stream_options.include_usage,
echo, logprobs (0..5: the chosen token's log-probability and the k
likeliest tokens'), model (this server's, or none). Accepted at their
neutral values only: best_of (1), presence_penalty and frequency_penalty
(0), logit_bias (empty), suffix (none); user is ignored.

Seeds: a request's `seed` is every prompt's; a request without one gives
prompt i the seed `sampling.request_seed(server seed, "<request id>-<i>")`,
as `serve.generate` derives the seed of a line whose id is "<request id>-
<i>" from its --seed. The request id is the header X-Request-Id where the
client sends one (else a random one), so a client can reproduce a text that
it did not seed.

Text: a choice's text is `sampling.cut` of its tokens (an end-of-sequence
token ends it; the first stop string cuts it, not included), as
serve.generate writes it; with echo the prompt's text comes first.
"""

from __future__ import annotations

import dataclasses
import math
import time

from serve import engine as engine_lib
from serve.runner import MAX_LOGPROBS
from lm.sampling_params import SamplingParams, is_int, length_refusal
from lm.sampling_params import request_seed

# name -> the values a request may give it without changing anything.
NEUTRAL = {'best_of': (None, 1), 'presence_penalty': (None, 0),
           'frequency_penalty': (None, 0), 'logit_bias': (None, {}),
           'suffix': (None, ''), 'n': (None, 1)}
KNOWN = frozenset({'model', 'prompt', 'max_tokens', 'temperature', 'top_p',
                   'top_k', 'seed', 'stop', 'stream', 'stream_options', 'echo',
                   'logprobs', 'user', *NEUTRAL})
DEFAULT_MAX_TOKENS = 16  # OpenAI's.


class ApiError(Exception):
  """A request refused: its HTTP status, one line, OpenAI's error type and
  the parameter at fault."""

  def __init__(self, status: int, message: str, param: str | None = None,
               kind: str = 'invalid_request_error'):
    super().__init__(message)
    self.status, self.message, self.param, self.kind = (status, message, param,
                                                        kind)

  def body(self) -> dict:
    return {'error': {'message': self.message, 'type': self.kind,
                      'param': self.param, 'code': self.status}}


@dataclasses.dataclass
class Completion:
  """A checked request: its engine requests (one per prompt, ids
  "<id>-<i>"), each prompt's token ids, and how to answer."""
  id: str
  requests: list[engine_lib.Request]
  prompts: list[list[int]]
  max_tokens: int
  stop: tuple[str, ...]
  stream: bool = False
  include_usage: bool = False
  echo: bool = False
  logprobs: int | None = None
  created: int = 0


def _check_envelope(body, model: str):
  """What a body must be before its parameters are read: a JSON object of
  known parameters, those this server cannot honour left at their neutral
  values, and this server's model (or none named)."""
  if not isinstance(body, dict):
    raise ApiError(400, 'the body must be a JSON object of the request\'s '
                   'parameters')
  unknown = sorted(set(body) - KNOWN)
  if unknown:
    raise ApiError(400, f'unknown parameter(s) {", ".join(unknown)}; this '
                   f'server takes {", ".join(sorted(KNOWN))}', unknown[0])
  for name, neutral in NEUTRAL.items():
    if name in body and body[name] not in neutral:
      raise ApiError(400, f'{name}={body[name]!r} is not supported; leave it '
                     f'out (this server takes only {neutral[1]!r})', name)
  if body.get('model') not in (None, model):
    raise ApiError(404, f'the model {body["model"]!r} does not exist; this '
                   f'server serves {model!r} (GET /v1/models)', 'model',
                   'not_found_error')


def _sampling(body: dict, vocab_size: int) -> tuple[SamplingParams, int]:
  """(the request's sampling settings, checked; its seed, or None)."""
  stop = body.get('stop')
  stop = (() if stop is None else (stop,) if isinstance(stop, str) else stop)
  if not (isinstance(stop, (list, tuple)) and
          all(isinstance(s, str) and s for s in stop)):
    raise ApiError(400, f'stop={body.get("stop")!r} must be a non-empty '
                   'string or a list of them', 'stop')
  settings = SamplingParams(
      temperature=_number(body, 'temperature', 1.0),
      top_k=_top_k(body), top_p=_number(body, 'top_p', 1.0),
      stop=tuple(stop))
  seed = body.get('seed')
  if seed is not None and not (is_int(seed) and 0 <= seed < 1 << 32):
    raise ApiError(400, f'seed={seed!r} must be an integer in 0..2**32 - 1',
                   'seed')
  return _checked(settings, vocab_size), seed


def _include_usage(body: dict, stream: bool) -> bool:
  """stream_options' include_usage: for a streamed request only."""
  options = body.get('stream_options')
  if options is not None and not stream:  # As OpenAI and vLLM answer.
    raise ApiError(400, 'stream_options is for a streamed request only; give '
                   'stream=true or leave stream_options out', 'stream_options')
  options = options or {}
  if not isinstance(options, dict) or set(options) - {'include_usage'}:
    raise ApiError(400, 'stream_options takes only include_usage',
                   'stream_options')
  return bool(options.get('include_usage'))


def parse(body, *, request_id: str, model: str, max_len: int,
          vocab_size: int, encode, server_seed: int) -> Completion:
  """The body of a completions request, checked: a Completion, or an
  ApiError (400, or 404 for another model). encode(text) -> token ids."""
  _check_envelope(body, model)
  prompts = _prompts(body.get('prompt'), vocab_size, encode)
  # A prompt holds at least one token: max_len - 1 new ones at most.
  max_tokens = _int(body, 'max_tokens', DEFAULT_MAX_TOKENS, 0, max_len - 1)
  echo = _bool(body, 'echo')
  logprobs = body.get('logprobs')
  if logprobs is not None and not (is_int(logprobs) and
                                   0 <= logprobs <= MAX_LOGPROBS):
    raise ApiError(400, f'logprobs={logprobs!r} must be an integer in '
                   f'0..{MAX_LOGPROBS}, or null', 'logprobs')
  settings, seed = _sampling(body, vocab_size)
  stream = _bool(body, 'stream')
  completion = Completion(
      request_id, [], prompts, max_tokens, settings.stop,
      stream=stream, include_usage=_include_usage(body, stream), echo=echo,
      logprobs=logprobs, created=int(time.time()))
  for i, tokens in enumerate(prompts):
    key = f'{request_id}-{i}'
    new = max(max_tokens, 1)  # max_tokens=0 generates one, not returned.
    why = length_refusal(len(tokens), new, max_len)
    if why:
      raise ApiError(400, f'prompt {i}: {why}'.replace(
          'max_new_tokens', 'max_tokens'), 'prompt')
    completion.requests.append(engine_lib.Request(
        key, tokens, new, dataclasses.replace(
            settings, seed=request_seed(server_seed, key) if seed is None
            else seed),
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo and logprobs is not None else None))
  return completion


def _prompts(prompt, vocab_size: int, encode) -> list[list[int]]:
  """Token ids of each prompt (text through `encode`, ids checked)."""
  if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and
                                 all(is_int(t) or t is None for t in prompt)
                                 and any(is_int(t) for t in prompt)):
    prompt = [prompt]  # One prompt of ids (a null among them: _ids says).
  if not (isinstance(prompt, list) and prompt):
    raise ApiError(400, 'prompt must be a string, a list of strings, a list '
                   'of token ids or a list of lists of them', 'prompt')
  out = []
  for i, p in enumerate(prompt):
    if isinstance(p, str):
      try:
        out.append([int(t) for t in encode(p)])
      except UnicodeEncodeError:
        raise ApiError(400, f'prompt {i} is not valid UTF-8 text (a lone '
                       'surrogate); fix its escapes', 'prompt') from None
    elif isinstance(p, list):
      out.append(_ids(i, p, vocab_size))
    else:
      raise ApiError(400, f'prompt {i} must be a string or a list of token '
                     'ids', 'prompt')
  return out


def _ids(i: int, prompt: list, vocab_size: int) -> list[int]:
  """Prompt i's token ids, each checked: an integer in the vocabulary."""
  for j, t in enumerate(prompt):
    if t is None:  # lm_eval's context for a model with no BOS nor EOS.
      raise ApiError(400, f'prompt {i} holds null at position {j}, not a '
                     'token id (lm_eval\'s local-completions sends that for '
                     'a model without a prefix token: give it '
                     'custom_prefix_token_id=<id> in --model_args, 10 for a '
                     'byte-level model)', 'prompt')
    if not is_int(t):
      raise ApiError(400, f'prompt {i} holds {t!r} at position {j}; a prompt '
                     'of token ids holds integers only', 'prompt')
    if not 0 <= t < vocab_size:
      raise ApiError(400, f'prompt {i} holds token id {t}, outside the '
                     f'vocabulary 0..{vocab_size - 1}', 'prompt')
  return list(prompt)


def _int(body, name, default, low, high) -> int:
  value = body.get(name, default)
  if value is None:
    value = default
  if not (is_int(value) and low <= value <= high):
    raise ApiError(400, f'{name}={value!r} must be an integer in '
                   f'{low}..{high}', name)
  return int(value)


def _number(body, name, default) -> float:
  value = body.get(name, default)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (
      not math.isfinite(value)):
    raise ApiError(400, f'{name}={value!r} must be a number', name)
  return float(value)


def _bool(body, name) -> bool:
  value = body.get(name, False)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise ApiError(400, f'{name}={value!r} must be true or false', name)
  return value


def _top_k(body) -> int:
  value = body.get('top_k', 0)
  if value is None or value == -1:  # vLLM's "all".
    return 0
  if not is_int(value):
    raise ApiError(400, f'top_k={value!r} must be an integer (0 or -1: all)',
                   'top_k')
  return int(value)


def _checked(settings: SamplingParams, vocab_size: int) -> SamplingParams:
  """settings in range (`SamplingParams.check`'s rule), or the ApiError
  naming the parameter."""
  try:
    return settings.check(vocab_size, prefix='')
  except Exception as e:  # UserError: its message names the parameter.
    name = str(e).split('=', 1)[0]
    raise ApiError(400, str(e), name) from None


# Responses.


def logprobs_block(entries, decode, text_start: int = 0) -> dict:
  """OpenAI's logprobs object for tokens in order (None for a prompt's
  first token, which has none: entries of (token, TokenLogprob or None)).
  top_logprobs holds the chosen token and the k likeliest (their values
  winning where two tokens read the same)."""
  tokens, chosen, top, offsets = [], [], [], []
  offset = text_start
  for token, entry in entries:
    text = decode([token])
    tokens.append(text)
    offsets.append(offset)
    offset += len(text)
    if entry is None:
      chosen.append(None)
      top.append(None)
      continue
    chosen.append(entry.logprob)
    likeliest = {text: entry.logprob}
    likeliest.update((decode([i]), v) for i, v in entry.top)
    top.append(likeliest)
  return {'tokens': tokens, 'token_logprobs': chosen, 'top_logprobs': top,
          'text_offset': offsets}


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
  return {'prompt_tokens': prompt_tokens,
          'completion_tokens': completion_tokens,
          'total_tokens': prompt_tokens + completion_tokens,
          'prompt_tokens_details': {'cached_tokens': cached}}


def response(completion: Completion, model: str, choices: list[dict],
             use: dict, fingerprint: str) -> dict:
  return {'id': completion.id, 'object': 'text_completion',
          'created': completion.created, 'model': model,
          'system_fingerprint': fingerprint, 'choices': choices,
          'usage': use}


def chunk(completion: Completion, model: str, choices: list[dict],
          fingerprint: str, use: dict | None = None) -> dict:
  out = {'id': completion.id, 'object': 'text_completion',
         'created': completion.created, 'model': model,
         'system_fingerprint': fingerprint, 'choices': choices}
  if use is not None:
    out['usage'] = use
  return out


class TextStream:
  """A choice's text as its tokens come: `add` returns the text that can
  be sent now, `finish` the rest, so that what is sent adds up to
  `sampling.cut`'s text. Held back: an incomplete character (a trailing
  U+FFFD) and the last len(longest stop) - 1 characters, where a stop string
  could still begin."""

  def __init__(self, decode, stop: tuple[str, ...]):
    self.decode, self.stop = decode, stop
    self.hold = max(map(len, stop), default=1) - 1
    self.tokens: list[int] = []
    self.sent = 0

  def add(self, tokens: list[int]) -> str:
    self.tokens += tokens
    text = self.decode(self.tokens).rstrip('\ufffd')
    safe = max(self.sent, len(text) - self.hold)
    out, self.sent = text[self.sent:safe], safe
    return out

  def finish(self, final: str) -> str:
    """The rest of `final` (the choice's whole text) after what was sent."""
    out, self.sent = final[self.sent:], len(final)
    return out
