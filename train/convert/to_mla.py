"""Converting MHA/GQA parameters into multi-head latent attention (MLA).

As TransMLA and MHA2MLA (Meng et al. 2025, Ji et al. 2025) do, each layer's
key and value projections are factorised jointly: W = [W_K | W_V]
[D, 2·K·H] = U Σ Vᵀ (SVD, float64), kept to the kv_lora_rank A largest
singular values, so that kv_down = U_A Σ_A [D, A] makes the cached latent and
Vᵀ_A [A, 2·K·H] splits into key_up and value_up (kv_up [A, N, 2H]), whose KV head k serves the
query heads of its group [k·G, (k+1)·G) (each query head gets its group's
columns). `energy` is Σ_A² / Σ², the share of the projections' squared
Frobenius norm kept; at full rank A = 2·K·H (or D, when smaller) the product
is W itself. The latent has no RMSNorm (latent_norm=False: a norm is not
linear, and would change the function).

A model with RoPE keeps it on part of its frequencies, as MHA2MLA's partial
RoPE: per KV head, the r = Y / (2K) frequency pairs with the largest 2-norm
score (mean ‖q_i‖ · mean ‖k_i‖ over calibration tokens, summed over the
group's query heads: the attention mass a pair can carry), pooled over the
layers (one `rope_pairs` for the model, so the layers still scan). Their key
features become the shared RoPE key (Y = 2·r·K slots, KV head k's in block
k, turned at their source frequencies, `rope_pairs`); each query head fills
its KV head's block and is zero in the others', so a kept pair's logit term
is the source's exactly. The other 2·(H/2 - r) features of each key lose
RoPE and join the latent's factorisation (I = H - 2r per head). The scale
stays the source's (query_pre_attn_scalar). Queries, outputs and every other
parameter are copied. At full rank, a model without RoPE, or one keeping
every pair (Y = K·H), converts exactly (the identity controls).

Into grouped latent attention (GLA, `latent_groups` > 1, a divisor of K),
each latent group is factorised by itself: group j's latent (A /
latent_groups features) is the SVD of the [W_K | W_V] columns of source KV
heads [j·K/latent_groups, (j+1)·K/latent_groups), whose query heads are
exactly those the group serves; its energy is pooled with the other groups'.
At a group's full rank, 2·K·H/latent_groups less its share of the RoPE dims
(or D, when smaller), it too converts exactly. latent_groups = 1 is the MLA
conversion above.

Letters: D model width, N query heads, K KV heads, G = N // K, H head dim,
A kv_lora_rank.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import numpy as np

from attention.latent import MLA
from infra.errors import UserError
from lm import model as model_lib


# A conversion's arguments as a study plans one and saves the plan: flat
# among the plan's own fields, named as `workdirs.convert_to_mla` takes them.
ARGUMENTS = ('kv_lora_rank', 'qk_rope_head_dim', 'latent_groups')


def arguments(record: Mapping) -> dict:
  """The keyword arguments of an MLA conversion (`convert_to_mla`) that
  RECORD holds among its own fields: kv_lora_rank, qk_rope_head_dim and
  latent_groups (1, MLA's, where it holds none)."""
  return {'latent_groups': 1, **{k: record[k] for k in ARGUMENTS
                                 if k in record}}


class Latent(NamedTuple):
  """What an MLA conversion caches per token and layer, in a study's
  words: a latent `width` wide (A, in `groups`: GLA's G) and a RoPE key of
  `rope` (Y) beside it, A + Y numbers."""
  width: int
  rope: int
  groups: int = 1


def latent(record: Mapping) -> Latent:
  """The Latent of the conversion whose arguments RECORD holds
  (`arguments`: a saved plan, as studies wrote it before and write it
  now)."""
  a = arguments(record)
  return Latent(a['kv_lora_rank'], a['qk_rope_head_dim'],
                a['latent_groups'])


def check_source(mc, kv_lora_rank: int, qk_rope_head_dim: int,
                 latent_groups: int = 1) -> None:
  """UserError, in one line, for a source or target we cannot convert."""
  if mc.layout.name != 'gqa':
    raise UserError(f'--source is model.attention={mc.layout.name!r} '
                    f'({mc.layout_description()}); --to_mla converts MHA/GQA '
                    'models: convert the model it came from')
  for name in ('qk_norm', 'qkv_bias', 'fused_qkv'):
    if getattr(mc, name):
      raise UserError(f'--to_mla: the source has model.{name}=True, which '
                      'MLA cannot take; convert a model without it')
  K, H, Y = mc.num_kv_heads, mc.head_dim, qk_rope_head_dim
  groups = latent_groups
  if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or (
      K % groups):
    raise UserError(
        f'--latent_groups={groups}: give a divisor of the source\'s K={K} KV '
        f'heads ({", ".join(str(g) for g in range(1, K + 1) if K % g == 0)}): '
        'latent group j factorises KV heads [j·K/G, (j+1)·K/G)')
  if not mc.use_rope and Y:
    raise UserError(f'--qk_rope_head_dim={Y}: the source has no RoPE '
                    '(model.use_rope=False); give 0')
  if mc.use_rope and not (Y > 0 and Y % (2 * K) == 0 and Y <= K * H):
    given = f'--qk_rope_head_dim={Y}' if Y else 'no --qk_rope_head_dim'
    raise UserError(
        f'{given}: the source uses RoPE, so --qk_rope_head_dim, the RoPE '
        f'dims kept, must be 2·r·K for r pairs per KV head (K={K}): a multiple of '
        f'{2 * K} from {2 * K} to K·H = {K * H}')
  # The latent holds the keys' dims without RoPE and all the values':
  # K·(H - Y/K) + K·H = 2·K·H - Y features (Y = 0 without RoPE).
  features = 2 * K * H - (Y if mc.use_rope else 0)
  if groups == 1:
    full = min(mc.d_model, features)
    if not 1 <= kv_lora_rank <= full:
      raise UserError(f'--kv_lora_rank={kv_lora_rank}: give 1 to {full}, the '
                      f'full rank: min(d_model = {mc.d_model}, 2·K·H - '
                      f'--qk_rope_head_dim = {2 * K * H} - '
                      f'{Y if mc.use_rope else 0}), the key and value '
                      'features left to the latent')
    return
  full = min(mc.d_model, features // groups)  # A group's.
  if kv_lora_rank % groups or not 1 <= kv_lora_rank // groups <= full:
    raise UserError(
        f'--kv_lora_rank={kv_lora_rank} with --latent_groups={groups}: give '
        f'a multiple of {groups} from {groups} to {groups * full}, '
        f'{groups} times a group\'s full rank: min(d_model = {mc.d_model}, '
        f'(2·K·H - --qk_rope_head_dim) / {groups} = {features // groups})')


def select_pairs(scores_KP: np.ndarray, qk_rope_head_dim: int) -> np.ndarray:
  """[K, r]: per KV head, the r = Y / (2K) frequency pairs of the largest
  score (MHA2MLA's 2-norm criterion: the attention mass a pair can carry),
  in frequency order."""
  K = scores_KP.shape[0]
  r = qk_rope_head_dim // (2 * K)
  return np.sort(np.argsort(-scores_KP, axis=1, kind='stable')[:, :r], axis=1)


def pair_scores(q_XNH: np.ndarray, k_XKH: np.ndarray) -> np.ndarray:
  """[K, H/2]: each KV head's frequency pairs scored over calibration
  tokens, mean ‖q_i‖ · mean ‖k_i‖ summed over the group's query heads (pair
  i: features i and i + H/2; RoPE turns a pair, keeping its norm)."""
  X, N, H = q_XNH.shape
  K = k_XKH.shape[1]
  norm = lambda x: np.sqrt(x[..., :H // 2] ** 2 + x[..., H // 2:] ** 2
                           ).mean(0)  # [E, H/2]
  q_NP, k_KP = norm(q_XNH), norm(k_XKH)
  return (q_NP.reshape(K, N // K, H // 2) * k_KP[:, None]).sum(1)


def target_config(mc, kv_lora_rank: int, qk_rope_head_dim: int,
                  pairs_Kr: np.ndarray | None = None,
                  latent_groups: int = 1):
  """(the converted model's ModelConfig, the model.* fields it changes, as
  config.json holds them). With RoPE, each KV head's r kept pairs leave its
  key I = H - 2r features without position, and the scale stays the
  source's."""
  H = mc.head_dim
  mla = dict(kv_lora_rank=kv_lora_rank, latent_groups=latent_groups,
             q_lora_rank=None, qk_rope_head_dim=qk_rope_head_dim,
             qk_nope_head_dim=H, v_head_dim=H, latent_norm=False,
             rope_pairs=None)
  fields = dict(num_kv_heads=mc.num_heads, attention='mla')
  if pairs_Kr is not None:
    mla.update(qk_nope_head_dim=H - 2 * pairs_Kr.shape[1],
               rope_pairs=[int(p) for p in pairs_Kr.reshape(-1)])
    fields['query_pre_attn_scalar'] = float(mc.query_pre_attn_scalar or H)
  pairs = mla['rope_pairs']
  layout = MLA(**{**mla, 'rope_pairs': None if pairs is None
                  else tuple(pairs)})
  new_fields = {k: v for k, v in fields.items() if k != 'attention'}
  return (dataclasses.replace(mc, **new_fields, layout=layout),
          {**fields, 'mla': mla})


def _rope_split(kernel_DEH: np.ndarray, pairs_Kr: np.ndarray, kv_head
                ) -> tuple[np.ndarray, np.ndarray]:
  """(features without RoPE [D, E, H - 2r], each head's RoPE features laid
  out in the shared key's Y slots [D, E, Y]) of a query or key kernel
  [D, E, H]; kv_head(e): the KV head whose pairs head e keeps. Slot
  j = k·r + m (and j + Y/2) holds pair pairs_Kr[k, m] of KV head k; a head
  is zero in the other heads' slots."""
  D, E, H = kernel_DEH.shape
  K, r = pairs_Kr.shape
  half, Y = H // 2, 2 * K * r
  nope = np.empty((D, E, H - 2 * r), kernel_DEH.dtype)
  rope = np.zeros((D, E, Y), kernel_DEH.dtype)
  for e in range(E):
    k = kv_head(e)
    turned = np.concatenate([pairs_Kr[k], pairs_Kr[k] + half])
    nope[:, e] = np.delete(kernel_DEH[:, e], turned, axis=-1)
    rope[:, e, k * r:(k + 1) * r] = kernel_DEH[:, e, pairs_Kr[k]]
    rope[:, e, Y // 2 + k * r:Y // 2 + (k + 1) * r] = kernel_DEH[
        :, e, pairs_Kr[k] + half]
  return nope, rope


def factorise(key_DKI: np.ndarray, value_DKH: np.ndarray, rank: int,
              group: int, latent_groups: int = 1
              ) -> tuple[dict[str, np.ndarray], float]:
  """({kv_down [D, A], kv_up [A / latent_groups, N, I + H]: key_up then
  value_up}, energy kept) of one layer's key (without RoPE) [D, K, I] and
  value [D, K, H] kernels; group: G. Each latent group factorises its own
  K / latent_groups KV heads to rank A / latent_groups (its kv_down columns
  and its query heads' kv_up, in group order)."""
  D, K, I = key_DKI.shape
  H = value_DKH.shape[-1]
  k, a = K // latent_groups, rank // latent_groups  # A group's KV heads, rank.
  per_query = lambda x_AKW: np.repeat(x_AKW, group, axis=1)  # [a, k·G, W]
  downs, ups, kept, total = [], [], 0.0, 0.0
  for j in range(latent_groups):
    heads = slice(j * k, (j + 1) * k)
    W = np.concatenate([key_DKI[:, heads].reshape(D, k * I),
                        value_DKH[:, heads].reshape(D, k * H)],
                       axis=1).astype(np.float64)
    u, s, vt = np.linalg.svd(W, full_matrices=False)
    kept, total = kept + np.sum(s[:a] ** 2), total + np.sum(s ** 2)
    up_K = vt[:a, :k * I].reshape(a, k, I)
    up_V = vt[:a, k * I:].reshape(a, k, H)
    downs.append(u[:, :a] * s[:a])
    ups.append(np.concatenate([per_query(up_K), per_query(up_V)], -1))
  dtype = value_DKH.dtype
  return {'kv_down': np.concatenate(downs, axis=1).astype(dtype),
          'kv_up': np.concatenate(ups, axis=1).astype(dtype)}, float(
              kept / max(total, 1e-300))


def convert_params(params, mc, kv_lora_rank: int, qk_rope_head_dim: int = 0,
                   pair_scores_KP: np.ndarray | None = None,
                   latent_groups: int = 1
                   ) -> tuple[dict, object, list[float | None]]:
  """(the MLA (GLA with latent_groups > 1) parameters, their ModelConfig,
  the energy kept per layer: None for a layer reading another's K/V,
  kv_share). A RoPE source needs pair_scores_KP [K, H/2] (`pair_scores`,
  pooled over the layers): the RoPE key keeps each KV head's best
  qk_rope_head_dim / (2K) pairs."""
  check_source(mc, kv_lora_rank, qk_rope_head_dim, latent_groups)
  pairs_Kr = (select_pairs(pair_scores_KP, qk_rope_head_dim)
              if mc.use_rope else None)
  new_mc, _ = target_config(mc, kv_lora_rank, qk_rope_head_dim, pairs_Kr,
                            latent_groups)
  G = mc.num_heads // mc.num_kv_heads
  layers, energies, owner = [], [], None
  for i, tree in enumerate(model_lib.layer_subtrees(mc, params)):
    tree = {name: (dict(sub) if isinstance(sub, dict) else sub)
            for name, sub in tree.items()}
    attention = {k: np.asarray(v) for k, v in tree['attention'].items()}
    key = value = None
    if not mc.shares_kv(i):
      key, value = attention.pop('key'), attention.pop('value')
    if pairs_Kr is not None:
      q_nope, q_rope = _rope_split(attention['query'], pairs_Kr,
                                   lambda n: n // G)
      attention['query'] = np.concatenate([q_nope, q_rope], axis=-1)
      if key is not None:
        key, k_rope = _rope_split(key, pairs_Kr, lambda k: k)
        k_rope = k_rope.sum(1)  # [D, Y]: each slot from its own KV head.
    if key is not None:
      owner, energy = factorise(key, value, kv_lora_rank, G, latent_groups)
      attention['kv_down'] = owner['kv_down'] if pairs_Kr is None else (
          np.concatenate([owner['kv_down'], k_rope], axis=-1))
      energies.append(energy)
    else:
      energies.append(None)
    attention['kv_up'] = owner['kv_up']
    tree['attention'] = attention
    layers.append(tree)
  return model_lib.with_layer_subtrees(params, new_mc, layers), new_mc, (
      energies)


def calibration_scores(mc, params, tokens_BT) -> np.ndarray:
  """[K, H/2]: `pair_scores` of each layer owning K/V on the calibration
  tokens [B, T] (its queries and keys from the layer's actual inputs),
  each layer's normalised to sum 1, summed over the layers."""
  from lm.model import RMSNorm, Transformer, unroll_layers  # pylint: disable=import-outside-toplevel
  model, unrolled = unroll_layers(Transformer(mc), params)
  _, state = model.apply(
      {'params': unrolled}, tokens_BT, mutable=['intermediates'],
      capture_intermediates=lambda m, _: (isinstance(m, RMSNorm)
                                          and m.name == 'attention_norm'))
  total = 0.0
  for i, tree in enumerate(model_lib.layer_subtrees(mc, params)):
    if mc.shares_kv(i):
      continue
    x_BTD = np.asarray(state['intermediates'][f'layers_{i}'][
        'attention_norm']['__call__'][0], np.float32)
    x_XD = x_BTD.reshape(-1, x_BTD.shape[-1])
    attention = tree['attention']
    project = lambda w: np.einsum('XD,DEH->XEH', x_XD,
                                  np.asarray(w, np.float32))
    scores = pair_scores(project(attention['query']),
                         project(attention['key']))
    total = total + scores / scores.sum()
  return total
