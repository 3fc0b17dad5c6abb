"""DeepSeek-V2/V3 checkpoints with dense MLPs, in and out (`train.convert.hf`'s
multi-head latent attention family; `attention.latent` computes it).

  HF (torch Linear, [out, in])                here
  q_proj [N·(I+Y), D]                     ->  query [D, N, I+Y]
  q_a_proj [Q, D], q_a_layernorm [Q]      ->  query_down [D, Q], query_down_norm
  q_b_proj [N·(I+Y), Q]                   ->  query_up [Q, N, I+Y]
  kv_a_proj_with_mqa [A+Y, D]             ->  kv_down [D, A+Y]
  kv_a_layernorm [A]                      ->  kv_norm [A]
  kv_b_proj [N·(I+U), A]                  ->  kv_up [A, N, I+U]
  o_proj [D, N·U]                         ->  out [N, U, D]

and the MLP, norms and embeddings as Llama's. DeepSeek turns its RoPE dims in
interleaved pairs (x0, x1), (x2, x3), ... (V2 always, V3 unless
rope_interleave is false); `attention.rope` turns (i, i + Y/2): the RoPE rows
of the query and of the RoPE key are permuted on the way in (evens, then
odds), which changes no logit as query and key move alike, and back out.
YaRN's RoPE scaling (DeepSeek-V3's) is read with its attention factor and
its softmax mscale (`attention.rope.RopeScaling`). Mixture-of-experts layers
(first_k_dense_replace < num_hidden_layers) are refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from infra.errors import UserError

FAMILIES = {'deepseek_v2': 'DeepseekV2ForCausalLM',
            'deepseek_v3': 'DeepseekV3ForCausalLM'}
# What transformers' config classes assume for a key config.json leaves out.
DEFAULTS = {
    'deepseek_v2': dict(q_lora_rank=1536, first_k_dense_replace=0,
                        n_routed_experts=None, rope_interleave=True),
    'deepseek_v3': dict(q_lora_rank=1536, first_k_dense_replace=3,
                        n_routed_experts=256, rope_interleave=True),
}
LATENT_COUNTS = ('kv_lora_rank', 'qk_rope_head_dim', 'qk_nope_head_dim',
                 'v_head_dim')


def model_fields(hf: dict, rope) -> dict[str, Any]:
  """config.model fields for a DeepSeek config.json (with transformers'
  defaults filled in); rope(hf, problems): train.convert.hf's RoPE reader."""
  family = hf['model_type']
  hf = {**DEFAULTS[family], **{k: v for k, v in hf.items() if v is not None},
        'q_lora_rank': hf.get('q_lora_rank', DEFAULTS[family]['q_lora_rank'])}
  for key in LATENT_COUNTS:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise UserError(f'config.json: {key}={value!r} must be an integer >= 1; '
                      f'a {family} config needs {", ".join(LATENT_COUNTS)}')
  L = hf['num_hidden_layers']
  problems = []
  if hf.get('n_routed_experts') and hf['first_k_dense_replace'] < L:
    problems.append(
        f'mixture-of-experts layers (first_k_dense_replace='
        f"{hf['first_k_dense_replace']} < num_hidden_layers={L}); only "
        'checkpoints whose every layer is dense are supported')
  if hf.get('attention_bias'):
    problems.append('attention_bias=true')
  if hf.get('hidden_act', 'silu') != 'silu':
    problems.append(f"hidden_act={hf['hidden_act']!r} (supported: silu)")
  base, scaling, _ = rope(hf, family, problems)
  if problems:
    raise UserError(f'this {family} checkpoint uses {"; ".join(problems)}, '
                    'which lm.model cannot express; nothing was written')
  N = hf['num_attention_heads']
  dtype = str(hf.get('dtype') or hf.get('torch_dtype', 'float32'))
  return dict(
      vocab_size=hf['vocab_size'], num_layers=L, d_model=hf['hidden_size'],
      num_heads=N, num_kv_heads=N, head_dim=hf['qk_nope_head_dim'],
      mlp_dim=hf['intermediate_size'],
      max_len=hf.get('max_position_embeddings', 4096),
      tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
      rope_base=float(base), local_window=None, local_rope_base=None,
      logits_soft_cap=None, final_logits_soft_cap=None,
      query_pre_attn_scalar=None, post_norms=False, attention_pattern='G',
      kv_share=1, fused_qkv=False,
      param_dtype=dtype if dtype in ('float32', 'bfloat16', 'float16')
      else 'float32', mlp_activation='silu',
      norm_eps=float(hf.get('rms_norm_eps', 1e-6)), norm_scale_offset=0.0,
      embed_scale=False, tied_logits_scale=False, qkv_bias=False,
      qk_norm=False, rope_scaling=scaling, use_rope=True,
      learned_positions=False, scan_layers=True, scan_unroll=1,
      attention='mla', mla=dict(
          kv_lora_rank=hf['kv_lora_rank'], q_lora_rank=hf['q_lora_rank'],
          qk_rope_head_dim=hf['qk_rope_head_dim'],
          qk_nope_head_dim=hf['qk_nope_head_dim'],
          v_head_dim=hf['v_head_dim'], latent_norm=True))


def interleaved(hf: dict) -> bool:
  """Whether the checkpoint's RoPE dims are stored in interleaved pairs."""
  family = hf.get('model_type')
  if family == 'deepseek_v2':
    return True
  value = hf.get('rope_interleave')
  return DEFAULTS[family]['rope_interleave'] if value is None else bool(value)


def family_problems(mc) -> list[str]:
  """What of an MLA model no DeepSeek checkpoint computes."""
  mla = mc.attention(0).layout
  wrong = {f'mla.latent_groups={mla.latent_groups} (grouped latents: '
           "DeepSeek's format has one)": mla.latent_groups > 1,
           'use_rope=False': not mc.use_rope,
           'mla.latent_norm=False (DeepSeek normalises the latent)':
           not mla.latent_norm,
           f'local_window={mc.local_window}': mc.local_window,
           f'kv_share={mc.kv_share}': mc.kv_share > 1,
           'post_norms': mc.post_norms,
           'logits_soft_cap': mc.logits_soft_cap,
           'final_logits_soft_cap': mc.final_logits_soft_cap,
           'query_pre_attn_scalar': mc.query_pre_attn_scalar,
           'learned_positions': mc.learned_positions,
           'mla.rope_pairs (a converted RoPE key)':
           mla.rope_pairs is not None,
           f'mlp_activation={mc.mlp_activation!r}, norm_scale_offset='
           f'{mc.norm_scale_offset}, embed_scale={mc.embed_scale} (Gemma\'s '
           "conventions; DeepSeek's are Llama's: silu, 0, False)": not (
               mc.mlp_activation == 'silu' and mc.norm_scale_offset == 0.0
               and not mc.embed_scale),
           'tied_logits_scale': mc.tie_embeddings and mc.tied_logits_scale}
  return [f'model.{name} in an MLA (deepseek) model'
          for name, bad in wrong.items() if bad]


def hf_config(mc, family: str) -> dict:
  """The DeepSeek fields of config.json (every layer dense)."""
  o = mc.attention(0).layout
  return dict(
      num_key_value_heads=mc.num_heads, kv_lora_rank=o.kv_lora_rank,
      q_lora_rank=o.q_lora_rank, qk_rope_head_dim=o.qk_rope_head_dim,
      qk_nope_head_dim=o.qk_nope_head_dim, v_head_dim=o.v_head_dim,
      head_dim=o.qk_rope_head_dim, first_k_dense_replace=mc.num_layers,
      rope_interleave=True, attention_bias=False, hidden_act='silu')


def _permutation(lead: int, Y: int, is_interleaved: bool) -> np.ndarray:
  """Our feature j is HF's feature perm[j]: `lead` features kept, then the
  Y RoPE dims de-interleaved (HF's evens, then its odds)."""
  rope = np.arange(Y)
  if is_interleaved:
    rope = np.concatenate([rope[0::2], rope[1::2]])
  return np.concatenate([np.arange(lead), lead + rope])


def layer_weights(mc, is_interleaved: bool) -> dict:
  """HF name within layer i -> (our path, to ours, to HF) for the attention
  of an MLA model (converters as train.convert.hf's, their H argument
  unused)."""
  o = mc.attention(0).layout
  N, A = mc.num_heads, o.kv_lora_rank
  I, Y, U = o.qk_nope_head_dim, o.qk_rope_head_dim, o.v_head_dim
  q_perm = _permutation(I, Y, is_interleaved)
  kv_perm = _permutation(A, Y, is_interleaved)
  q_back, kv_back = np.argsort(q_perm), np.argsort(kv_perm)

  def heads(width, perm, back):  # [N·W, C] <-> [C, N, W]
    to_ours = lambda w, H: w.T.reshape(w.shape[1], N, width)[..., perm]
    to_hf = lambda w, H: w[..., back].reshape(w.shape[0], -1).T
    return to_ours, to_hf

  same = lambda w, H: w
  transpose = lambda w, H: w.T
  no_perm = np.arange(I + U)
  table = {
      'q_proj': ('query', *heads(I + Y, q_perm, q_back)),
      'q_a_proj': ('query_down', transpose, transpose),
      'q_a_layernorm': ('query_down_norm', same, same),
      'q_b_proj': ('query_up', *heads(I + Y, q_perm, q_back)),
      'kv_a_proj_with_mqa': ('kv_down', lambda w, H: w.T[..., kv_perm],
                             lambda w, H: w[..., kv_back].T),
      'kv_a_layernorm': ('kv_norm', same, same),
      'kv_b_proj': ('kv_up', *heads(I + U, no_perm, no_perm)),
      'o_proj': ('out', lambda w, H: w.T.reshape(N, U, w.shape[0]),
                 lambda w, H: w.reshape(-1, w.shape[-1]).T),
  }
  return {f'self_attn.{name}.weight': (('attention', ours), to_ours, to_hf)
          for name, (ours, to_ours, to_hf) in table.items()}
