"""Converting MHA/GQA parameters into grouped-tied attention (GTA).

`train.convert --to_gta` first pools the source's K/V heads to K as its
--method says (`train.convert.convert_params`); this module then ties each
layer's pooled heads (`attention.tied`), every head's H features put in
one order: those outside the Y / 2 chosen RoPE pairs (I = H - Y), then
those at the pairs (Y, as a Y-wide RoPE turns them):

  kv        the value kernel [D, K, H] in that order: each KV head's tied
            state starts as its value, and out [N, H, D], its rows put in
            the same order, maps the values as the pooled model's did;
  rope_key  the key kernel's features at the pairs, averaged over the K
            heads [D, Y]: one key for every head (the source's own when
            K = 1);
  query     in that order: its last Y features, which RoPE turns at the
            source's frequencies (`rope_pairs`), meet the shared key.

The pairs are chosen as `train.convert.to_mla` chooses them (MHA2MLA's
partial RoPE): the `to_mla.calibration_scores` of the pooled model on
training tokens, summed over the KV heads, since one key serves them all; the
Y / 2 best, in frequency order. What no choice keeps: the query's I features
without RoPE now meet the value's features outside the pairs where they met
the key's (turned by RoPE); that term of every logit starts unrelated to the
source's, and uptraining must learn it. Tying is lossy in general; a source
whose keys already equal its values converts exactly when it has no RoPE,
or with one KV head and queries that give the pairs left out no weight
(the identity controls of tests/test_tied.py). The scale stays
head_dim ** -0.5 (query_pre_attn_scalar kept); every other parameter is
copied.

Letters: D model width, N query heads, K KV heads, H head dim, Y the shared
RoPE key's width (qk_rope_head_dim), I = H - Y.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from attention.tied import GTA
from infra.errors import UserError
from lm import model as model_lib
from train.convert import to_mla


def check_source(mc, qk_rope_head_dim: int) -> None:
  """UserError, in one line, for a source or a target we cannot convert."""
  if mc.layout.name != 'gqa':
    raise UserError(f'--source is model.attention={mc.layout.name!r} '
                    f'({mc.layout_description()}); --to_gta converts MHA/GQA '
                    'models: convert the model it came from')
  for name in ('qk_norm', 'qkv_bias', 'fused_qkv'):
    if getattr(mc, name):
      raise UserError(f'--to_gta: the source has model.{name}=True, which '
                      'GTA cannot take; convert a model without it')
  H, Y = mc.head_dim, qk_rope_head_dim
  if not mc.use_rope and Y:
    raise UserError(f'--qk_rope_head_dim={Y}: the source has no RoPE '
                    '(model.use_rope=False); give 0')
  if mc.use_rope and not (0 < Y < H and Y % 2 == 0):
    given = f'--qk_rope_head_dim={Y}' if Y else 'no --qk_rope_head_dim'
    raise UserError(
        f'{given}: the source uses RoPE, so --qk_rope_head_dim, the '
        f'shared RoPE key\'s width, must be even, from 2 to head_dim - 2 = '
        f'{H - 2} '
        f'(GTA\'s default is head_dim / 2 = {H // 2})')


def select_pairs(scores_KP: np.ndarray, qk_rope_head_dim: int) -> np.ndarray:
  """[Y / 2]: the frequency pairs of the largest score summed over the KV
  heads (`to_mla.select_pairs` of one head), in frequency order."""
  return to_mla.select_pairs(scores_KP.sum(0, keepdims=True),
                             qk_rope_head_dim)[0]


def target_config(mc, qk_rope_head_dim: int,
                  pairs: np.ndarray | None = None):
  """(the tied model's ModelConfig, the model.* fields it changes, as
  config.json holds them) of the pooled model `mc`."""
  gta = dict(qk_rope_head_dim=qk_rope_head_dim,
             rope_pairs=None if pairs is None else [int(p) for p in pairs])
  layout = GTA(qk_rope_head_dim=qk_rope_head_dim,
               rope_pairs=None if pairs is None else tuple(gta['rope_pairs']))
  return (dataclasses.replace(mc, layout=layout),
          dict(num_kv_heads=mc.num_kv_heads, attention='gta', gta=gta))


def feature_order(H: int, pairs: np.ndarray | None) -> np.ndarray:
  """[H]: the source features of a head in GTA's order, the I outside the
  pairs (in order), then the Y at them as a Y-wide RoPE turns them: slots
  I + j and I + j + Y / 2 hold pair pairs[j]'s two features (j and
  j + H / 2 of the source's half-split RoPE)."""
  if pairs is None:
    return np.arange(H)
  turned = np.concatenate([pairs, pairs + H // 2])
  return np.concatenate([np.delete(np.arange(H), turned), turned])


def convert_params(params, mc, qk_rope_head_dim: int = 0,
                   pair_scores_KP: np.ndarray | None = None
                   ) -> tuple[dict, object]:
  """(the GTA parameters, their ModelConfig) of the MHA/GQA model `mc`
  (already pooled to its K). A RoPE source needs pair_scores_KP [K, H/2]
  (`to_mla.calibration_scores`): the shared key keeps the
  qk_rope_head_dim / 2 best pairs."""
  check_source(mc, qk_rope_head_dim)
  pairs = (select_pairs(pair_scores_KP, qk_rope_head_dim) if mc.use_rope
           else None)
  new_mc, _ = target_config(mc, qk_rope_head_dim, pairs)
  order_H = feature_order(mc.head_dim, pairs)
  I = mc.head_dim - qk_rope_head_dim
  layers = []
  for i, tree in enumerate(model_lib.layer_subtrees(mc, params)):
    tree = dict(tree)
    attention = {k: np.asarray(v) for k, v in tree['attention'].items()}
    attention['query'] = attention['query'][..., order_H]  # [D, N, H].
    # A sharer reads its owner's tied states, in this order too.
    attention['out'] = attention['out'][:, order_H]  # [N, H, D].
    if not mc.shares_kv(i):
      key = attention.pop('key')
      attention['kv'] = attention.pop('value')[..., order_H]  # [D, K, H].
      if pairs is not None:
        attention['rope_key'] = key[..., order_H[I:]].mean(1).astype(
            key.dtype)  # [D, Y].
    tree['attention'] = attention
    layers.append(tree)
  return model_lib.with_layer_subtrees(params, new_mc, layers), new_mc
