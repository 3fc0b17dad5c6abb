"""The device side of serving: the pool of KV pages, the model's forward
pass over it, and the jitted step that runs a plan's rows.

The pool is P pages per layer that owns K/V (not those sharing another's,
kv_share), each page `page_size` (p) consecutive positions of one sequence,
laid out as `attention.kv_cache.paged_spec` says (JAX's TPU paged-attention
kernel's layout: grouped-query keys and values [K, P, p, H]; an MLA layer's
latents [G, P, p, F] (G latent groups) and RoPE key [1, P, p, Y]; int8
pages' float32 scales [E, P, p]). Page j of every layer belongs to the same
sequence. A sequence's page table [M] lists its pages in position order
(M = max pages per sequence, ceil(max_len / p)). Page 0 is never handed
out (`serve.pages.SCRATCH_PAGE`): unused page-table entries, idle rows and
padding tokens point at it, so their writes land there and nothing reads
them.

The network is `lm.model.Transformer` itself, called with `paging`: each
attention layer runs `attention.layer.apply`, the one attention step, with a
`PagedCache` (its pool from the 'cache' collection), so nothing of a layer
is written twice. Each row of the batch has its own position (`lengths`),
so sequences at different points share one step, and a row may carry fewer
real tokens than the step's T (`num_new`; the rest are padding).

`ModelRunner.run(rows)` takes a plan's rows (`serve.scheduler.Row`), each
carrying the page ids it reads and writes (the plan is the only message
from the scheduler: the runner never reads the page manager). For rows of
sequences that ask for log-probabilities (`Sequence.logprobs`), it also
returns, at each position fed, the log-probability of the token that
follows there (the next context token, or the one sampled) and the k
likeliest tokens' (OpenAI's `logprobs`): the model's own distribution,
log-softmax of the logits before temperature or truncation (vLLM's
default).

Letters: B rows, T new tokens, M pages per sequence, p page size, P pages,
V vocabulary, k top log-probabilities.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from attention import kv_cache
from serve import pages as pages_lib
from serve.scheduler import Row
from lm import model as model_lib
from lm import inference
from lm import sampling


def page_bytes(config: model_lib.ModelConfig, page_size: int) -> int:
  """Bytes of one page across all layers: the model's KV-cache bytes
  (`lm.model.kv_cache_bytes`, the one count) for one sequence of
  page_size tokens, every layer keeping all of them."""
  every_global = dataclasses.replace(config, attention_pattern='G',
                                     local_window=None)
  return model_lib.kv_cache_bytes(every_global, 1, page_size)


def empty_pool(config: model_lib.ModelConfig, num_pages: int,
               page_size: int) -> dict:
  """{layer name: {'attention': its zeroed pool arrays}} for the layers
  that own K/V (`attention.kv_cache.paged_spec`)."""
  dtype = config.kv_cache_dtype or config.dtype
  pool = {}
  for i in range(config.num_layers):
    if config.shares_kv(i):
      continue
    spec = kv_cache.paged_spec(config.attention(i), num_pages, page_size,
                               dtype)
    pool[f'layers_{i}'] = {'attention': {
        name: jnp.zeros(s.shape, s.dtype) for name, s in spec.items()}}
  return pool


def forward(model: model_lib.Transformer, params, pool: dict, tokens_BT,
            page_table_BM, lengths_B, num_new_B=None):
  """(logits [B, T, V] float32, the pool with the tokens written).

  tokens_BT: each row's next T tokens, at positions lengths_B + 0..T-1, of
  which the first num_new_B are real (None: all); page_table_BM: each row's
  pages. The model must be unrolled (`serving_model`).
  """
  paging = kv_cache.Paging(page_table_BM, lengths_B, num_new_B)
  logits_BTV, mutated = model.apply({'params': params, 'cache': pool},
                                    tokens_BT, paging=paging,
                                    mutable=['cache'])
  return logits_BTV, mutated['cache']


def serving_model(config: model_lib.ModelConfig, params, kv_cache_dtype=None
                  ) -> tuple[model_lib.Transformer, dict]:
  """(the model as `forward` runs it, its parameters): layers unrolled, no
  rematerialisation, kv_cache_dtype if given."""
  config = dataclasses.replace(
      config, remat=False,
      kv_cache_dtype=kv_cache_dtype or config.kv_cache_dtype)
  return model_lib.unroll_layers(model_lib.Transformer(config), params)


# Sizes per octave of the batch, length and table-width buckets: 4 pads by
# less than a quarter (exact up to 8), at 4 compiled sizes per doubling.
BUCKETS_PER_OCTAVE = 4
# Page-table widths, two per doubling (exact up to 4, then 6, 8, 12, 16, ...):
# a sequence crosses every width as it grows, each a compile (about 1 s for
# gqa_small on 2 cores), while a wider table costs a step little more.
WIDTHS_PER_OCTAVE = 2


def bucket(n: int, per_octave: int = BUCKETS_PER_OCTAVE) -> int:
  """The least size >= n (n >= 1) among n itself up to 2·per_octave, then
  per_octave evenly spaced sizes per doubling (per_octave a power of two;
  1: the next power of two): at most per_octave·(log2(limit) + 1) sizes up
  to a limit."""
  unit = 1 << max(0, (n - 1).bit_length() - per_octave.bit_length())
  return -(-n // unit) * unit


# The most top log-probabilities a position returns (OpenAI's limit for
# completions).
MAX_LOGPROBS = 5


@dataclasses.dataclass
class Logprobs:
  """A row's log-probabilities at its n positions start..start+n-1: of the
  token that follows each (`chosen` [n]), and the k likeliest tokens'
  (`top_ids`, `top` [n, k], likeliest first)."""
  start: int
  chosen: np.ndarray
  top_ids: np.ndarray
  top: np.ndarray


def _run_rows(model, params, pool, tokens_BT, table_BM, lengths_B, num_new_B,
              settings: sampling.Rows, index_B, targets_BT=None,
              needs: sampling.Needs | None = None, top_k: int | None = None):
  """Each row's tokens written at positions lengths_B.. of its pages (the
  first num_new_B real; None: all T), and one token sampled from the logits
  of each row's last real token, the index_B-th of its request's
  generation: (tokens [B], the pool, log-probabilities or None). needs
  (static): what the rows' sampling uses. top_k (static; None: no
  log-probabilities): the log-probabilities of targets_BT (the token after
  each position; -1: the one sampled) [B, T] and the top_k likeliest
  tokens' ([B, T, top_k] ids and values)."""
  logits_BTV, pool = forward(model, params, pool, tokens_BT, table_BM,
                             lengths_B, num_new_B)
  B, T, _ = logits_BTV.shape
  num_new_B = jnp.full((B,), T) if num_new_B is None else num_new_B
  last_BV = jnp.take_along_axis(
      logits_BTV, jnp.maximum(num_new_B - 1, 0)[:, None, None], axis=1)[:, 0]
  tokens_B = sampling.sample(last_BV, settings, index_B, needs)
  if top_k is None:
    return tokens_B, pool, None
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
  targets_BT = jnp.where(targets_BT < 0, tokens_B[:, None], targets_BT)
  chosen_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1)[..., 0]
  top_BTk, ids_BTk = jax.lax.top_k(logp_BTV, max(top_k, 1))
  return tokens_B, pool, (chosen_BT, ids_BTk[..., :top_k], top_BTk[..., :top_k])


class ModelRunner:
  """The device side: the pool, the model and its jitted step.

  `run(rows)` feeds a plan's rows as the first rows of a batch of the
  next bucket size (at least 2: a one-row write becomes an update XLA does
  on a copy of the whole pool), padded to the bucket of the longest row's
  tokens, with page tables as wide as the bucket of the pages the rows
  reach: a few compiled shapes however lengths mix, and short sequences do
  not read max_len positions. Decode rows (one token each) and prefill
  chunks are separate calls, so a decode row is never padded to a chunk.
  """

  def __init__(self, config: model_lib.ModelConfig, params, *,
               num_pages: int, page_size: int):
    self.model, self.params = serving_model(config, params)
    self.config = self.model.config
    self.page_size = page_size
    self.max_pages = pages_lib.pages_for(self.config.max_len, page_size)
    self.pool = empty_pool(self.config, num_pages, page_size)
    # Programs specialised to what the rows' sampling needs (a greedy batch
    # compiles in about half the time of one that samples).
    self._step = jax.jit(functools.partial(_run_rows, self.model),
                         donate_argnums=1, static_argnames=('needs', 'top_k'),
                         compiler_options=inference.compiler_options())

  def run(self, rows: list[Row]) -> tuple[dict[str, int],
                                          dict[str, Logprobs]]:
    """({sequence id: its sampled token} for the rows that sample, {id: its
    row's Logprobs} for rows of sequences that ask for them); every row's
    tokens written into its pages (`Row.pages`, the plan's)."""
    if not rows:
      return {}, {}
    B = max(2, bucket(len(rows)))
    T = bucket(max(len(row.tokens) for row in rows))
    M = min(self.max_pages, bucket(max(
        pages_lib.pages_for(row.end, self.page_size) for row in rows),
        WIDTHS_PER_OCTAVE))
    tokens_BT = np.zeros((B, T), np.int32)
    table_BM = np.zeros((B, M), np.int32)  # Idle rows: the scratch page.
    lengths_B = np.zeros(B, np.int32)
    num_new_B = np.zeros(B, np.int32)
    index_B = np.zeros(B, np.int32)  # Of the token a row samples.
    params = [sampling.SamplingParams()] * B
    for b, row in enumerate(rows):
      tokens_BT[b, :len(row.tokens)] = row.tokens
      owned = row.pages[:M]
      table_BM[b, :len(owned)] = owned
      lengths_B[b], num_new_B[b] = row.start, len(row.tokens)
      index_B[b] = len(row.seq.generated)
      params[b] = row.seq.sampling
    wanted = [row.seq.logprobs for row in rows
              if row.seq.logprobs is not None]
    top_k = max(wanted) if wanted else None
    targets_BT = None if top_k is None else _targets(rows, B, T)
    # One token per row (decoding): no padding to mask, none passed.
    padded = None if T == 1 else num_new_B
    tokens_B, self.pool, logprobs = self._step(
        self.params, self.pool, tokens_BT, table_BM, lengths_B, padded,
        sampling.rows(params), index_B, targets_BT,
        needs=sampling.needs(params), top_k=top_k)
    tokens_B = np.asarray(tokens_B)
    sampled = {row.seq.id: int(tokens_B[b]) for b, row in enumerate(rows)
               if row.sample}
    if logprobs is None:
      return sampled, {}
    chosen_BT, ids_BTk, top_BTk = map(np.asarray, logprobs)
    return sampled, {
        row.seq.id: Logprobs(row.start, chosen_BT[b, :len(row.tokens)],
                             ids_BTk[b, :len(row.tokens), :row.seq.logprobs],
                             top_BTk[b, :len(row.tokens), :row.seq.logprobs])
        for b, row in enumerate(rows) if row.seq.logprobs is not None}


def _targets(rows: list[Row], B: int, T: int) -> np.ndarray:
  """[B, T]: the token after each row's positions in its context, -1 where
  it is the one the row samples (and in padding)."""
  targets_BT = np.full((B, T), -1, np.int32)
  for b, row in enumerate(rows):
    after = row.seq.context[row.start + 1:row.end + 1]
    targets_BT[b, :len(after)] = after
  return targets_BT
