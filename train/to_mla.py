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

Queries, outputs and every other parameter are copied. Models with RoPE are
not converted yet (MHA2MLA's partial RoPE, which keeps RoPE on the frequency
pairs that carry the most attention mass, needs a RoPE key of chosen
frequencies that `attention.rope` does not turn); a model without RoPE
converts exactly at full rank (the identity control).

Letters: D model width, N query heads, K KV heads, G = N // K, H head dim,
A kv_lora_rank.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from train import model as model_lib
from train.errors import UserError


def check_source(mc, kv_lora_rank: int, qk_rope_head_dim: int) -> None:
  """UserError, in one line, for a source or target we cannot convert."""
  if mc.kv_lora_rank:
    raise UserError(f'--source already is MLA (model.kv_lora_rank='
                    f'{mc.kv_lora_rank}); --to_mla converts MHA/GQA models')
  if mc.use_rope or qk_rope_head_dim:
    raise UserError(
        '--to_mla converts models without RoPE (model.use_rope=False, '
        '--qk_rope_head_dim=0) only: partial RoPE (MHA2MLA) is not '
        'implemented yet; train the source with model.use_rope=False')
  for name in ('qk_norm', 'qkv_bias', 'fused_qkv'):
    if getattr(mc, name):
      raise UserError(f'--to_mla: the source has model.{name}=True, which '
                      'MLA cannot take; convert a model without it')
  full = min(mc.d_model, 2 * mc.num_kv_heads * mc.head_dim)
  if not 1 <= kv_lora_rank <= full:
    raise UserError(f'--kv_lora_rank={kv_lora_rank}: give 1 to {full} '
                    f'(min(d_model, 2·K·H = {2 * mc.num_kv_heads * mc.head_dim})'
                    ', the full rank)')


def target_config(mc, kv_lora_rank: int, qk_rope_head_dim: int):
  """The converted model's ModelConfig; as dotted config fields too."""
  fields = dict(num_kv_heads=mc.num_heads, kv_lora_rank=kv_lora_rank,
                q_lora_rank=None, qk_rope_head_dim=qk_rope_head_dim,
                qk_nope_head_dim=mc.head_dim, v_head_dim=mc.head_dim,
                latent_norm=False)
  return dataclasses.replace(mc, **fields), fields


def factorise(key_DKH: np.ndarray, value_DKH: np.ndarray, rank: int,
              group: int) -> tuple[dict[str, np.ndarray], float]:
  """({kv_down [D, A], kv_up [A, N, 2H]: key_up then value_up}, energy kept)
  of one layer's key and value kernels [D, K, H]; group: G."""
  D, K, H = key_DKH.shape
  W = np.concatenate([key_DKH.reshape(D, K * H), value_DKH.reshape(D, K * H)],
                     axis=1).astype(np.float64)
  u, s, vt = np.linalg.svd(W, full_matrices=False)
  energy = float(np.sum(s[:rank] ** 2) / max(np.sum(s ** 2), 1e-300))
  up_AKH = vt[:rank].reshape(rank, 2, K, H)
  per_query = lambda x_AKH: np.repeat(x_AKH, group, axis=1)  # [A, N, H]
  dtype = key_DKH.dtype
  return {'kv_down': (u[:, :rank] * s[:rank]).astype(dtype),
          'kv_up': np.concatenate([per_query(up_AKH[:, 0]),
                                   per_query(up_AKH[:, 1])], -1).astype(dtype)
          }, energy


def convert_params(params, mc, kv_lora_rank: int, qk_rope_head_dim: int = 0
                   ) -> tuple[dict, object, list[float | None]]:
  """(the MLA parameters, their ModelConfig, the energy kept per layer:
  None for a layer reading another's K/V, kv_share)."""
  check_source(mc, kv_lora_rank, qk_rope_head_dim)
  new_mc, _ = target_config(mc, kv_lora_rank, qk_rope_head_dim)
  G = mc.num_heads // mc.num_kv_heads
  layers, energies, owner = [], [], None
  for i, tree in enumerate(model_lib.layer_subtrees(mc, params)):
    tree = {name: (dict(sub) if isinstance(sub, dict) else sub)
            for name, sub in tree.items()}
    attention = {k: np.asarray(v) for k, v in tree['attention'].items()}
    if not mc.shares_kv(i):
      owner, energy = factorise(attention.pop('key'), attention.pop('value'),
                                kv_lora_rank, G)
      attention['kv_down'] = owner['kv_down']
      energies.append(energy)
    else:
      energies.append(None)
    attention['kv_up'] = owner['kv_up']
    tree['attention'] = attention
    layers.append(tree)
  return _with_layers(params, new_mc, layers), new_mc, energies


def _with_layers(params, mc, layers: list) -> dict:
  """params with its layers replaced by `layers` (one subtree per layer),
  stacked as `mc` stores them (model.layer_slot)."""
  import jax  # pylint: disable=import-outside-toplevel
  out = {k: v for k, v in params.items()
         if k != 'layers' and not k.startswith('layers_')}
  slots: dict[tuple, list] = {}
  for i, tree in enumerate(layers):
    path, index = model_lib.layer_slot(mc, i)
    if index is None:
      out[path[0]] = tree
    else:
      slots.setdefault(path, []).append(tree)
  for path, trees in slots.items():
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *trees)
    target = out
    for key in path[:-1]:
      target = target.setdefault(key, {})
    target[path[-1]] = stacked
  return out
