"""Specification of `serve.protocol.parse`'s refusals, without a model or a
server (the server's answers to them: tests/test_api_faults.py): each says
what is wrong in terms that are true, and names the parameter."""

import pytest

from serve import protocol

MAX_LEN, VOCAB = 256, 256


def _parse(**body):
  return protocol.parse(body, request_id='r', model='m', max_len=MAX_LEN,
                        vocab_size=VOCAB, encode=lambda text: list(
                            text.encode()), server_seed=0)


def _refusal(**body) -> protocol.ApiError:
  with pytest.raises(protocol.ApiError) as caught:
    _parse(**body)
  assert caught.value.status == 400
  return caught.value


@pytest.mark.parametrize('prompt', [[[None, 104, 105]], [None, 104, 105]])
def test_a_null_token_says_where_and_that_lm_eval_needs_a_prefix_token(
    prompt):
  """lm_eval's local-completions puts its prefix token, None for a model
  without BOS or EOS, before a rolling window's tokens."""
  error = _refusal(prompt=prompt, max_tokens=0, echo=True)
  assert error.param == 'prompt'
  assert 'prompt 0 holds null at position 0' in error.message
  assert 'custom_prefix_token_id=' in error.message


def test_a_token_that_is_not_an_integer_is_named_with_its_position():
  error = _refusal(prompt=[[104, 'i']])
  assert error.param == 'prompt' and "'i' at position 1" in error.message
  assert _refusal(prompt=[[104, 999]]).message.startswith(
      'prompt 0 holds token id 999, outside the vocabulary 0..255')


def test_max_tokens_range_is_the_one_a_prompt_leaves():
  """A prompt holds a token at least, so max_len - 1 is the most."""
  for value in (100000, MAX_LEN):
    error = _refusal(prompt='h', max_tokens=value)
    assert error.param == 'max_tokens'
    assert f'must be an integer in 0..{MAX_LEN - 1}' in error.message
  assert _parse(prompt='h', max_tokens=MAX_LEN - 1).max_tokens == MAX_LEN - 1


@pytest.mark.parametrize('stream', [False, None, 'absent'])
def test_stream_options_without_stream_is_refused(stream):
  body = {} if stream == 'absent' else {'stream': stream}
  error = _refusal(prompt='h', stream_options={'include_usage': True},
                   **body)
  assert error.param == 'stream_options' and 'stream=true' in error.message
  assert _parse(prompt='h', stream=True, stream_options={
      'include_usage': True}).include_usage
  assert not _parse(prompt='h', stream_options=None).stream
