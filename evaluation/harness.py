"""A workdir as an lm-evaluation-harness model: `gqa-lab`.

  from evaluation import harness  # Registers 'gqa-lab' with lm_eval.
  lm_eval.simple_evaluate(model='gqa-lab',
                          model_args='workdir=W,batch_size=8', tasks=[...])

or from a shell, lm_eval's own command line with the model registered:
`gqa-lab-lm-eval --model gqa-lab --model_args workdir=W --batch_size 8
--tasks ...` (lm_eval 0.4.13 reads no plugins: a plain `lm_eval` does not
import this module; docs/evaluation.md). There the batch size is lm_eval's
--batch_size, which it passes beside --model_args (in both: given twice).

The three request types follow lm_eval's `hf` model (lm_eval/models/
huggingface.py) step for step, so that a workdir and its `--to_hf` export
score the same:
- loglikelihood: text encoded as `hf` encodes it (the tokenizer's special
  tokens, a BOS for most; the continuation split from the context at the
  token boundary by lm_eval's TemplateLM), context + continuation
  left-truncated to max_len + 1 tokens, then one batched full pass
  (`Transformer`) gives each continuation token's log-probability and
  whether it is the argmax;
- loglikelihood_rolling: each document in disjoint windows of max_len
  tokens (lm_eval.utils.get_rolling_token_windows), each scored as above;
- generate_until: the context left-truncated to max_len - max_gen_toks,
  then `lm.inference.generate` (prefill, then the KV cache one token per
  step: local layers' ring buffers, shared K/V, int8 caches as the model
  decodes), sampled by `lm.sampling` (temperature, top_k, top_p and seed
  per request: gen_kwargs' `seed`, else one derived from model_args' seed
  and the request (`sampling.request_seed` of its task, document, index and
  repeat), so that a task's repeats sample independently; the same seed
  gives the text `train.sample --seed` and `serve.generate` give), cut by
  `sampling.cut`
  at the first end-of-sequence token and at the first stop sequence. It
  decodes max_gen_toks tokens and cuts after, where `hf` stops
  as soon as every row has stopped: the same text, more work.

Letters: B batch, T length, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models import utils as model_utils

from attention import layer
from lm import checkpoint
from lm import inference
from lm import sampling
from lm import tokenizer as tokenizer_lib
from infra.errors import UserError
from lm.model import Transformer

NAME = 'gqa-lab'
log = logging.getLogger(__name__)


@functools.partial(jax.jit, static_argnames='model')
def token_logprobs(params, inputs_BT, targets_BT, *, model: Transformer):
  """(log p(target) [B, T], whether the target is the argmax [B, T]): one
  full pass; float32 log-softmax, as `hf` computes it."""
  logits_BTV = model.apply({'params': params}, inputs_BT)
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  picked_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1)[..., 0]
  return picked_BT, jnp.argmax(logits_BTV, axis=-1) == targets_BT


def _bucket(length: int, limit: int) -> int:
  """Padded length: the next power of two from 128, at most `limit` (a few
  programs to compile rather than one per length)."""
  return min(limit, max(128, 1 << (length - 1).bit_length()))


@register_model(NAME)
class WorkdirLM(TemplateLM):
  """A train.main workdir's latest checkpoint, for lm_eval.

  model_args: workdir (required; local or gs://), batch_size (rows per
  pass, default 8), max_gen_toks (default 256, as `hf`), kv_cache_dtype
  (generation's cache, default the model's), seed (sampling at
  temperature > 0: the seed each request's own is derived from, where its
  gen_kwargs give none). flag: what named the workdir, for error messages
  (`evaluation.evaluate` passes its --workdir).
  """

  def __init__(self, workdir: str, batch_size: int | str = 8,
               max_gen_toks: int = 256, kv_cache_dtype: str | None = None,
               seed: int = 0, device=None, max_batch_size=None,
               flag: str = 'model_args workdir', **unused):
    del device, max_batch_size  # lm_eval's; JAX places the model itself.
    super().__init__()
    if unused:
      log.warning('%s ignores model_args %s', NAME, sorted(unused))
    if batch_size is None or str(batch_size).startswith('auto'):
      batch_size = 8  # lm_eval's 'auto' probes memory; a fixed shape here.
    if not str(batch_size).isdigit() or int(batch_size) < 1:
      raise UserError(f'batch_size={batch_size} must be an integer >= 1')
    batch_size = int(batch_size)
    if kv_cache_dtype not in (None, *layer.KV_CACHE_DTYPES):
      raise UserError(f'kv_cache_dtype={kv_cache_dtype!r}; use one of '
                      f'{", ".join(layer.KV_CACHE_DTYPES)}')
    mc, self.params, config, step = checkpoint.load_workdir_step(workdir,
                                                                 flag)
    # What was scored, by content: results.json records it.
    self.checkpoint = {'step': step,
                       'parameters': checkpoint.fingerprint(self.params)}
    if config.data.get('task', 'lm') != 'lm':
      raise UserError(f'{workdir} was trained on data.task='
                      f'{config.data.task!r}, not text; evaluate a language '
                      'model')
    self.tokenizer = tokenizer_lib.for_text(workdir, mc, config)
    self.workdir, self.mc = str(workdir), mc
    self.batch_size_per_gpu = batch_size
    self._max_gen_toks = int(max_gen_toks)
    self._kv_cache_dtype = kv_cache_dtype or mc.kv_cache_dtype
    self._seed = int(seed)
    self._bos = tokenizer_lib.bos_id(self.tokenizer, workdir)
    self._eos = tuple(self.tokenizer.eos_ids)
    self._truncated = set()  # The request types already said truncated.

  @classmethod
  def create_from_arg_obj(cls, arg_dict, additional_config=None):
    """model_args win over the command line's --batch_size and --device,
    which lm_eval passes too (else batch_size in both would collide)."""
    extra = {k: v for k, v in (additional_config or {}).items()
             if v is not None and k not in arg_dict}
    return cls(**arg_dict, **extra)

  @classmethod
  def create_from_arg_string(cls, arg_string, additional_config=None):
    return cls.create_from_arg_obj(
        lm_utils.simple_parse_args_string(arg_string), additional_config)

  # What `hf` reads from its tokenizer and config.

  @property
  def eot_token_id(self) -> int:
    return self._eos[0] if self._eos else self.prefix_token_id

  @property
  def prefix_token_id(self) -> int:
    """What an empty context is: BOS, else EOS (as `hf`); a line break for
    a byte-level model, which has neither (as train.sample starts)."""
    if self._bos is not None:
      return self._bos
    if self._eos:
      return self._eos[0]
    return int(self.tokenizer.encode('\n')[0])

  @property
  def max_length(self) -> int:
    return self.mc.max_len

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def batch_size(self) -> int:
    return self.batch_size_per_gpu

  @property
  def tokenizer_name(self) -> str:
    return self.tokenizer.name.replace('/', '__')

  def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                 left_truncate_len: int | None = None, **kwargs) -> list[int]:
    """`hf`'s: the tokenizer's special tokens unless told, or unless the
    text starts with the BOS text already."""
    del kwargs
    special = True if add_special_tokens is None else add_special_tokens
    if add_special_tokens is None and string.startswith(
        self.tok_decode([self.prefix_token_id], skip_special_tokens=False)):
      special = False
    ids = self.tokenizer.encode(string, special=special).tolist()
    return ids[-left_truncate_len:] if left_truncate_len else ids

  def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
    return self.tokenizer.decode(tokens, skip_special=skip_special_tokens)

  def _say_truncated(self, kind: str, count: int, total: int):
    """Once per request type: how many requests lost their left end."""
    if count and kind not in self._truncated:
      self._truncated.add(kind)
      log.warning('%d of %d %s requests are longer than max_len %d and were '
                  'truncated from the left, as lm_eval\'s hf model does',
                  count, total, kind, self.max_length)

  # loglikelihood and loglikelihood_rolling.

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                            kind: str = 'loglikelihood'):
    """[(key, context ids, continuation ids)] -> [(log p(continuation),
    whether every continuation token is the argmax)]."""
    del disable_tqdm
    L, B = self.max_length, self.batch_size
    rows, truncated = [], 0
    for _, context, continuation in requests:
      if not context or not continuation:
        raise ValueError('empty context or continuation')  # lm_eval's bug.
      whole = (list(context) + list(continuation))
      truncated += len(whole) > L + 1
      whole = whole[-(L + 1):]
      rows.append((whole[:-1], whole[1:], min(len(continuation), L)))
    self._say_truncated(kind, truncated, len(rows))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    results = [None] * len(rows)
    model = Transformer(self.mc)
    for start in range(0, len(order), B):
      chunk = order[start:start + B]
      T = _bucket(len(rows[chunk[0]][0]), L)
      inputs_BT = np.zeros((B, T), np.int32)
      targets_BT = np.zeros((B, T), np.int32)
      for b, i in enumerate(chunk):
        inputs, targets, _ = rows[i]
        inputs_BT[b, :len(inputs)] = inputs  # Right-padded: causal.
        targets_BT[b, :len(targets)] = targets
      logp_BT, greedy_BT = jax.device_get(token_logprobs(
          self.params, inputs_BT, targets_BT, model=model))
      for b, i in enumerate(chunk):
        end, n = len(rows[i][0]), rows[i][2]
        results[i] = (float(logp_BT[b, end - n:end].astype(np.float64).sum()),
                      bool(greedy_BT[b, end - n:end].all()))
    for (key, _, _), result in zip(requests, results):
      if key is not None:
        self.cache_hook.add_partial('loglikelihood', key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    """Each document's log-likelihood, in disjoint windows of max_len."""
    del disable_tqdm
    windows, counts = [], []
    for (text,) in [r.args for r in requests]:
      mine = [(None, *lm_utils.make_disjoint_window(w))
              for w in lm_utils.get_rolling_token_windows(
                  token_list=self.tok_encode(text),
                  prefix_token=self.prefix_token_id,
                  max_seq_len=self.max_length, context_len=1)]
      windows += mine
      counts.append(len(mine))
    scores = self._loglikelihood_tokens(windows, kind='loglikelihood_rolling')
    out, start = [], 0
    for request, n in zip(requests, counts):
      out.append(sum(s for s, _ in scores[start:start + n]))
      start += n
      self.cache_hook.add_partial('loglikelihood_rolling', request.args,
                                  out[-1])
    return out

  # generate_until.

  def generate_until(self, requests, disable_tqdm: bool = False):
    """Each context's continuation up to a stop sequence (or EOS, or
    max_gen_toks tokens). Rows of one prompt length and one set of
    generation settings decode together."""
    del disable_tqdm
    groups, truncated, repeats = {}, 0, {}
    for i, request in enumerate(requests):
      context, gen_kwargs = request.args
      # lm_eval passes a request with repeats (pass@k) that many times,
      # the same object: each its own seed.
      repeat = repeats[id(request)] = repeats.get(id(request), -1) + 1
      kwargs = model_utils.normalize_gen_kwargs(dict(gen_kwargs),
                                                self.max_gen_toks)
      until = model_utils.handle_stop_sequences(kwargs.pop('until', None),
                                                eos=None)
      new = int(kwargs.pop('max_gen_toks'))
      if new >= self.max_length:
        raise UserError(f'max_gen_toks={new} must be below the model\'s '
                        f'max_len ({self.max_length}), to leave room for the '
                        'context')
      temperature = float(kwargs.pop('temperature', 0.0) or 0.0)
      if not kwargs.pop('do_sample', False):
        temperature = 0.0
      seed = kwargs.pop('seed', None)
      if seed is None:
        seed = sampling.request_seed(self._seed, [
            request.task_name, request.doc_id, request.idx, repeat])
      settings = sampling.SamplingParams(
          temperature=temperature, top_k=int(kwargs.pop('top_k', 0) or 0),
          top_p=float(kwargs.pop('top_p', 1.0) or 1.0), seed=seed,
          stop=tuple(until)).check(self.mc.vocab_size, prefix='gen_kwargs ')
      if kwargs:
        log.warning('%s ignores generation settings %s', NAME, sorted(kwargs))
      prompt = self.tok_encode(context)
      truncated += len(prompt) > self.max_length - new
      prompt = prompt[-(self.max_length - new):]
      groups.setdefault((len(prompt), new), []).append((i, prompt, settings))
    self._say_truncated('generate_until', truncated, len(requests))
    out = [None] * len(requests)
    # The model as trained; `inference.generate` sizes the cache by T + new.
    model = Transformer(dataclasses.replace(
        self.mc, kv_cache_dtype=self._kv_cache_dtype), decode=True)
    for (T, new), rows in groups.items():
      for start in range(0, len(rows), self.batch_size):
        chunk = rows[start:start + self.batch_size]
        chunk += [chunk[0]] * (self.batch_size - len(chunk))  # Fixed shape.
        prompts_BT = np.array([p for _, p, _ in chunk], np.int32)
        tokens_BN = np.asarray(inference.generate(
            self.params, prompts_BT, sampling.rows([s for *_, s in chunk]),
            model=model, max_new_tokens=new))
        for (i, _, settings), tokens in zip(chunk, tokens_BN):
          if out[i] is not None:
            continue  # A padding row.
          out[i] = sampling.cut(tokens, eos_ids=self._eos,
                                decode=self.tok_decode,
                                stop=settings.stop).text
          self.cache_hook.add_partial('generate_until', requests[i].args,
                                      out[i])
    return out

  def get_model_info(self) -> dict:
    return {'model_workdir': self.workdir,
            'model_num_kv_heads': self.mc.num_kv_heads,
            'model_step': self.checkpoint['step'],
            'model_parameters': self.checkpoint['parameters']}
