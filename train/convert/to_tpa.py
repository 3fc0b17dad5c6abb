"""Converting MHA/GQA parameters into tensor product attention (TPA), exactly.

The paper's Section 4 (Zhang et al. 2025): MHA, MQA and GQA are
non-contextual TPA. A grouped-query layer with K KV heads is TPA of rank K
for the keys and for the values whose head factors are constants: KV head
r's key W^K_r x is the token factor b_r, and its head factor a_r is K times
the one-hot of the query heads it serves, [n // G == r], so that

  K_t[n] = (1/K) Σ_r a_r[n] b_r = W^K_{n // G} x_t,

the source's key of query head n (RoPE turns b_r as it turned that key);
the values likewise. `train.convert --to_tpa` first pools the source's K/V
heads to K as its --method says (`train.convert.workdirs.convert_params`;
-1 keeps them), then writes each layer as:

  key_token_factors    the key kernel [D, K, H] (rank r = KV head r)
  value_token_factors  the value kernel [D, K, H]
  *_head_factors       zeros [D, K, N]: no head factor depends on the
                       token yet
  *_head_factors_bias  K·one-hot [K, N] (tpa.head_bias=True): the constant
                       head factors
  query, out           copied: per-head queries (tpa.q_rank=0, the
                       paper's TPA-KV-only), the source's out

The converted model computes the pooled one's logits (a test holds them to
1e-5). Uptraining then makes the head factors contextual (the W_a x beside
the constant). Its cache holds 2·K·(N + H) numbers per token and layer, the
factors, where the source held 2·K·H: N / H more, the price of keeping the
head factors in the cache. The scale stays head_dim ** -0.5
(query_pre_attn_scalar kept); every other parameter is copied.

Letters: D model width, N query heads, K KV heads (the ranks), H head dim,
G = N / K.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from attention.tensor_product import TPA
from infra.errors import UserError
from lm import model as model_lib


def check_source(mc) -> None:
  """UserError, in one line, for a source we cannot convert."""
  if mc.layout.name != 'gqa':
    raise UserError(f'--source is model.attention={mc.layout.name!r} '
                    f'({mc.layout_description()}); --to_tpa converts MHA/GQA '
                    'models: convert the model it came from')
  for name in ('qk_norm', 'qkv_bias', 'fused_qkv'):
    if getattr(mc, name):
      raise UserError(f'--to_tpa: the source has model.{name}=True, which '
                      'TPA\'s factors cannot take; convert a model without '
                      'it')


def target_config(mc):
  """(the TPA model's ModelConfig, the model.* fields it changes, as
  config.json holds them) of the pooled MHA/GQA model `mc`: ranks K, per-head
  queries, head-factor biases, num_kv_heads = num_heads."""
  K, N = mc.num_kv_heads, mc.num_heads
  tpa = dict(q_rank=0, k_rank=K, v_rank=K, head_bias=True)
  return (dataclasses.replace(mc, num_kv_heads=N, layout=TPA(**tpa)),
          dict(num_kv_heads=N, attention='tpa', tpa=tpa))


def one_hot_heads(N: int, K: int) -> np.ndarray:
  """[K, N]: K·[n // (N / K) == r], the constant head factor of rank r (KV
  head r serves query heads n // G == r; the 1/K of TPA's sum undone)."""
  G = N // K
  return K * (np.arange(N)[None] // G == np.arange(K)[:, None]).astype(
      np.float32)


def convert_params(params, mc) -> tuple[dict, object]:
  """(the TPA parameters, their ModelConfig) of the MHA/GQA model `mc`
  (already pooled to its K): the module docstring's table."""
  check_source(mc)
  new_mc, _ = target_config(mc)
  K, N = mc.num_kv_heads, mc.num_heads
  layers = []
  for i, tree in enumerate(model_lib.layer_subtrees(mc, params)):
    tree = dict(tree)
    attention = {k: np.asarray(v) for k, v in tree['attention'].items()}
    if not mc.shares_kv(i):  # A sharer reads its owner's factors.
      for kind in ('key', 'value'):
        kernel_DKH = attention.pop(kind)
        D = kernel_DKH.shape[0]
        attention[f'{kind}_token_factors'] = kernel_DKH
        attention[f'{kind}_head_factors'] = np.zeros((D, K, N),
                                                     kernel_DKH.dtype)
        attention[f'{kind}_head_factors_bias'] = one_hot_heads(N, K).astype(
            kernel_DKH.dtype)
    tree['attention'] = attention
    layers.append(tree)
  return model_lib.with_layer_subtrees(params, new_mc, layers), new_mc
