"""The model's forward pass over a paged KV cache (the device side).

The pool is P pages per layer that owns K/V (not those sharing another's,
kv_share), each page `page_size` (p) consecutive positions of one sequence,
laid out as `attention.kv_cache.paged_spec` says (JAX's TPU paged-attention
kernel's layout: grouped-query keys and values [K, P, p, H]; an MLA layer's
latents [G, P, p, F] (G latent groups) and RoPE key [1, P, p, Y]; int8 pages' float32 scales [E, P, p]).
Page j of every layer belongs to the same sequence. A sequence's page table
[M] lists its pages in position order (M = max pages per sequence,
ceil(max_len / p)). Page 0 is never handed out: unused page-table entries,
idle rows and padding tokens point at it, so their writes land there and
nothing reads them.

The network is `lm.model.Transformer` itself, called with `paging`: each
attention layer runs `attention.layer.apply`, the one attention step, with a
`PagedCache` (its pool from the 'cache' collection), so nothing of a layer
is written twice. Each row of the batch has its own position (`lengths`),
so sequences at different points share one step, and a row may carry fewer
real tokens than the step's T (`num_new`; the rest are padding).

Letters: B rows, T new tokens, M pages per sequence, p page size, P pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from attention import kv_cache
from lm import model as model_lib


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

