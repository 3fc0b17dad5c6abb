"""Hugging Face checkpoints in and out: Llama 2/3/3.1+, Mistral, Ministral,
Qwen2, Qwen3, Gemma 1, 2 and 3 (text).

One network (`lm.model.Transformer`) holds them all; what differs between
them is a handful of conventions (`ModelConfig`: activation, norm eps and
weight offset, embedding and tied-logit scale, q/k/v bias, QK-norm, RoPE
base and scaling per layer kind, which layers slide a window
(`attention_pattern`, from `layer_types`), Gemma 2/3's post-norms, query
scale and soft caps), and the layout of the weights:

  HF (torch Linear, [out, in])             here
  q_proj [N·H, D], k/v_proj [K·H, D]   ->  query [D, N, H], key/value [D, K, H]
  o_proj [D, N·H]                      ->  out [N, H, D]
  q/k/v_proj.bias [E·H]                ->  query/key/value_bias [E, H]
  q_norm, k_norm [H]                   ->  query_norm, key_norm [H]
  gate/up_proj [F, D], down_proj [D, F] -> gate/up [D, F], down [F, D]
  *_layernorm, norm [D]                ->  *_norm/scale [D] (same numbers:
                                           Gemma stores w of 1 + w, as we do)
    (Gemma 2/3: input_, post_attention_, pre_feedforward_ and
    post_feedforward_layernorm -> attention_, post_attention_, mlp_ and
    post_mlp_norm; elsewhere post_attention_layernorm is mlp_norm)
  embed_tokens [V, D], lm_head [V, D]  ->  embedding [V, D], unembed [D, V]

Layers are stacked ([L, ...], `nn.scan`). Import streams tensor by tensor
from the safetensors shards into the stacked arrays, pooling K/V heads on the
way when asked (`train.convert`), so the peak memory is about one copy of the
parameters. Export writes tensor by tensor likewise.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Iterator

import numpy as np

from train.convert import hf_deepseek
from lm import model as model_lib
from train.convert import safetensors_io
from infra.errors import UserError
from infra.progress import Progress

FAMILIES = {  # model_type -> architecture class.
    'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
    'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM',
    'ministral': 'MinistralForCausalLM', 'gemma': 'GemmaForCausalLM',
    'gemma2': 'Gemma2ForCausalLM', 'gemma3_text': 'Gemma3ForCausalLM',
    **hf_deepseek.FAMILIES}  # Multi-head latent attention, dense MLPs.
GEMMAS = ('gemma', 'gemma2', 'gemma3_text')
SANDWICHED = ('gemma2', 'gemma3_text')  # Post-norms, query scale, soft caps.
# What transformers' config classes assume for a key config.json leaves out
# (an explicit null stays null: no soft cap).
CONFIG_DEFAULTS = {
    'gemma2': dict(query_pre_attn_scalar=256, sliding_window=4096,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    'gemma3_text': dict(query_pre_attn_scalar=256, sliding_window=4096,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
}
ACTIVATIONS = {'silu': 'silu', 'gelu_pytorch_tanh': 'gelu_tanh',
               'gelu': 'gelu_tanh'}  # Gemma's legacy name for the tanh form.
PARAM_DTYPES = ('float32', 'bfloat16', 'float16')  # torch_dtype kept as is.
# Files of the source that travel with the workdir (WORKDIR/hf/) and back out.
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json',
                   'special_tokens_map.json', 'tokenizer.model',
                   'generation_config.json', 'chat_template.jinja')


# --- Configs ---------------------------------------------------------------

def model_fields(hf: dict) -> dict[str, Any]:
  """config.model fields for a Hugging Face config.json; UserError names
  every setting this network cannot express."""
  family = hf.get('model_type')
  if family == 'gemma3':
    raise UserError("model_type 'gemma3' is Gemma 3 with vision (Gemma3For"
                    'ConditionalGeneration), which is not supported; convert '
                    "a text-only Gemma 3 checkpoint (model_type 'gemma3_text',"
                    ' e.g. google/gemma-3-1b-pt) instead')
  if family not in FAMILIES:
    raise UserError(f'model_type {family!r} is not supported; supported: '
                    f'{", ".join(FAMILIES)}')
  hf = {**CONFIG_DEFAULTS.get(family, {}), **hf}
  _check_types(hf)
  if family in hf_deepseek.FAMILIES:
    return hf_deepseek.model_fields(hf, _rope)
  get = lambda key, default=None: (hf[key] if hf.get(key) is not None
                                   else default)
  problems = _unsupported(get, family)
  activation = get('hidden_activation') or get('hidden_act', 'silu')
  window, pattern = _layer_kinds(hf, family, problems)
  base, scaling, local_base = _rope(hf, family, problems)
  if problems:
    raise UserError(f'this {family} checkpoint uses {"; ".join(problems)}, '
                    'which lm.model cannot express; nothing was written')
  D, N, L = hf['hidden_size'], hf['num_attention_heads'], hf['num_hidden_layers']
  gemma, sandwiched = family in GEMMAS, family in SANDWICHED
  number = lambda key: float(get(key)) if sandwiched and get(key) else None
  dtype = str(get('dtype') or get('torch_dtype', 'float32'))
  return dict(
      vocab_size=hf['vocab_size'], num_layers=L,
      d_model=D, num_heads=N, num_kv_heads=get('num_key_value_heads', N),
      head_dim=get('head_dim', D // N), mlp_dim=hf['intermediate_size'],
      max_len=get('max_position_embeddings', 2048),
      tie_embeddings=bool(get('tie_word_embeddings', gemma)),
      rope_base=float(base), local_window=window,
      local_rope_base=local_base if 'L' in pattern else None,
      logits_soft_cap=number('attn_logit_softcapping'),
      final_logits_soft_cap=number('final_logit_softcapping'),
      query_pre_attn_scalar=number('query_pre_attn_scalar'),
      post_norms=sandwiched, attention_pattern=pattern, kv_share=1,
      fused_qkv=False, param_dtype=dtype if dtype in PARAM_DTYPES else 'float32',
      mlp_activation=ACTIVATIONS.get(activation, 'silu'),
      norm_eps=float(get('rms_norm_eps', 1e-6)),
      norm_scale_offset=1.0 if gemma else 0.0, embed_scale=gemma,
      tied_logits_scale=False, qkv_bias=family == 'qwen2',
      qk_norm=family in ('qwen3', 'gemma3_text'), rope_scaling=scaling,
      use_rope=True, learned_positions=False,
      # Scanned in groups of the pattern's period where it divides the
      # layers (Gemma 3's 6 does not divide 26 or 34: unrolled).
      scan_layers=L % len(pattern) == 0,
      scan_unroll=1)  # Deep models: one layer compiled, not four.


def _unsupported(get, family: str) -> list[str]:
  """The settings of a config.json (`get(key, default)`) that lm.model
  cannot express, each as a phrase."""
  problems = []
  if get('mlp_bias', False):
    problems.append('mlp_bias=true')
  if get('attention_bias', False) and family != 'qwen2':
    problems.append('attention_bias=true (a bias on o_proj)')
  if get('use_bidirectional_attention', False):
    problems.append('use_bidirectional_attention=true')
  if family == 'gemma3_text' and get('attn_logit_softcapping'):
    problems.append("attn_logit_softcapping, which transformers' Gemma 3 "
                    'does not apply (so its logits would not be ours)')
  activation = get('hidden_activation') or get('hidden_act', 'silu')
  if activation not in ACTIVATIONS:
    problems.append(f'hidden_act={activation!r} (supported: '
                    f'{", ".join(ACTIVATIONS)})')
  return problems


# config.json fields read as counts: required, or optional (None allowed).
REQUIRED_COUNTS = ('vocab_size', 'hidden_size', 'intermediate_size',
                   'num_hidden_layers', 'num_attention_heads')
OPTIONAL_COUNTS = ('num_key_value_heads', 'head_dim', 'max_position_embeddings',
                   'sliding_window')
OPTIONAL_NUMBERS = ('rms_norm_eps', 'rope_theta', 'rope_local_base_freq',
                    'query_pre_attn_scalar', 'attn_logit_softcapping',
                    'final_logit_softcapping')


def _check_types(hf: dict):
  """UserError for a missing or mistyped field, before any is used."""
  def bad(key, what):
    return UserError(f'config.json: {key}={hf.get(key)!r} must be {what}; '
                     'fix config.json (it is not a valid checkpoint config)')
  is_count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0
  for key in REQUIRED_COUNTS:
    if key not in hf:
      raise UserError(f'config.json has no {key}; a {hf["model_type"]} config '
                      f'needs {", ".join(REQUIRED_COUNTS)}')
    if not is_count(hf[key]):
      raise bad(key, 'an integer >= 1')
  for key in OPTIONAL_COUNTS:
    if hf.get(key) is not None and not is_count(hf[key]):
      raise bad(key, 'an integer >= 1 (or absent)')
  for key in OPTIONAL_NUMBERS:
    value = hf.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(
        value, (int, float)) or not value > 0):
      raise bad(key, 'a number > 0 (or absent)')


def _rope(hf: dict, family: str, problems: list[str]):
  """(rope_theta, rope_scaling fields, the sliding layers' unscaled base or
  None) from transformers 5's rope_parameters (one, or one per layer type as
  Gemma 3's) or 4's rope_theta + rope_scaling (+ rope_local_base_freq)."""
  params = dict(hf.get('rope_parameters') or {})
  local_base = hf.get('rope_local_base_freq') if family == 'gemma3_text' else (
      None)
  if params and all(isinstance(v, dict) for v in params.values()):
    if set(params) - {'full_attention', 'sliding_attention'}:
      problems.append(f'RoPE parameters for layer types {sorted(params)}')
    local = params.get('sliding_attention') or {}
    if local.get('rope_type', 'default') != 'default':
      problems.append(f"rope_type {local['rope_type']!r} in the sliding-"
                      'window layers (supported there: default)')
    local_base = local.get('rope_theta', local_base)
    params = params.get('full_attention') or {}
  base, scaling = _one_rope(params, hf, problems)
  return base, scaling, None if local_base is None else float(local_base)


def _one_rope(params: dict, hf: dict, problems: list[str]):
  """(rope_theta, rope_scaling fields) of one layer type."""
  base = params.get('rope_theta', hf.get('rope_theta', 10_000.0))
  scaling = params if params.get('rope_type', 'default') != 'default' else (
      hf.get('rope_scaling') or {})
  kind = scaling.get('rope_type') or scaling.get('type') or 'default'
  if (params.get('partial_rotary_factor') or
      hf.get('partial_rotary_factor') or 1.0) != 1.0:
    problems.append('partial_rotary_factor < 1')
  if kind == 'default':
    return base, {'kind': ''}
  if kind not in ('linear', 'llama3', 'yarn'):
    problems.append(f'rope scaling {kind!r} (supported: linear, llama3, '
                    'yarn)')
    return base, {'kind': ''}
  fields = {'kind': kind, 'factor': float(scaling['factor'])}
  if kind == 'yarn':
    if scaling.get('attention_factor') is not None or not scaling.get(
        'truncate', True):
      problems.append('yarn with attention_factor or truncate=false')
    fields.update(
        original_max_len=int(scaling.get(
            'original_max_position_embeddings',
            hf.get('max_position_embeddings', 8192))),
        **{ours: float(scaling.get(theirs) or default) for ours, theirs,
           default in (('beta_fast', 'beta_fast', 32.0),
                       ('beta_slow', 'beta_slow', 1.0),
                       ('mscale', 'mscale', 0.0),
                       ('mscale_all_dim', 'mscale_all_dim', 0.0))})
  if kind == 'llama3':
    fields.update(
        low_freq_factor=float(scaling['low_freq_factor']),
        high_freq_factor=float(scaling['high_freq_factor']),
        original_max_len=int(scaling.get(
            'original_max_position_embeddings',
            hf.get('max_position_embeddings', 8192))))
  return base, fields


def _layer_kinds(hf: dict, family: str, problems: list[str]
                 ) -> tuple[int | None, str]:
  """(the sliding window or None, attention_pattern): which layers slide a
  window, as transformers reads the config; the pattern is the shortest
  period of the layers' kinds (the whole list where none is shorter)."""
  L, window = hf['num_hidden_layers'], hf.get('sliding_window')
  kinds = hf.get('layer_types')
  if family == 'mistral':
    if kinds and len(set(kinds)) > 1:
      problems.append("layer_types mixing sliding and full attention, which "
                      "transformers' Mistral ignores (model_type 'ministral' "
                      'reads them)')
    return window, 'L' if window else 'G'
  if family in ('llama', 'gemma'):
    return None, 'G'
  if family in ('qwen2', 'qwen3') and not hf.get('use_sliding_window'):
    window = None  # transformers drops the window, whatever layer_types say.
  kinds = kinds or [_default_kind(hf, family, i) for i in range(L)]
  if len(kinds) != L or set(kinds) - {'sliding_attention', 'full_attention'}:
    problems.append(f'layer_types {kinds!r} (one of sliding_attention, '
                    f'full_attention per layer, {L} layers)')
    return None, 'G'
  letters = ''.join('L' if kind == 'sliding_attention' and window else 'G'
                    for kind in kinds)
  period = next(p for p in range(1, L + 1) if letters == (letters[:p] * L)[:L])
  pattern = letters[:period]
  return (window if 'L' in pattern else None), pattern


def _default_kind(hf: dict, family: str, i: int) -> str:
  """Layer i's type where config.json lists none, as transformers fills it."""
  L = hf['num_hidden_layers']
  sliding = {
      'qwen2': i >= hf.get('max_window_layers', L),
      'qwen3': i >= hf.get('max_window_layers', L),
      'ministral': True,
      'gemma2': (i + 1) % 2 != 0,
      'gemma3_text': (i + 1) % hf.get('sliding_window_pattern', 6) != 0}[family]
  return 'sliding_attention' if sliding else 'full_attention'


def family_of(mc, remembered: str | None = None) -> str:
  """The Hugging Face model_type that computes what `mc` computes."""
  if mc.layout.name not in ('gqa', 'mla'):
    raise UserError(f'no Hugging Face architecture computes model.attention='
                    f'{mc.layout.name!r} ({mc.layout_description()}); keep '
                    'the workdir, or export the MHA/GQA model it was '
                    'converted from')
  if mc.layout.name == 'mla':
    return _deepseek_family(mc, remembered)
  problems = []
  if not mc.use_rope:
    problems.append('model.use_rope=False')
  if mc.learned_positions:
    problems.append('model.learned_positions (a learned position embedding)')
  if mc.kv_share > 1:
    problems.append(f'model.kv_share={mc.kv_share} (K/V shared across '
                    'layers)')
  if mc.tie_embeddings and mc.tied_logits_scale:
    problems.append('model.tied_logits_scale=True (tied logits divided by '
                    '√D)')
  gemma = (mc.mlp_activation == 'gelu_tanh' and mc.norm_scale_offset == 1.0
           and mc.embed_scale)
  llama = (mc.mlp_activation == 'silu' and mc.norm_scale_offset == 0.0
           and not mc.embed_scale)
  mixed = mc.attention_pattern not in ('G', 'L')
  if gemma and mc.post_norms:
    family = 'gemma3_text' if mc.qk_norm else 'gemma2'
    given = {'qkv_bias': mc.qkv_bias,
             'local_rope_base': family == 'gemma2' and mc.local_rope_base,
             # transformers' Gemma 3 does not apply it.
             'logits_soft_cap': family == 'gemma3_text' and mc.logits_soft_cap}
  elif gemma or llama:
    family = ('gemma' if gemma else 'qwen3' if mc.qk_norm else
              'qwen2' if mc.qkv_bias else
              'ministral' if mixed or remembered == 'ministral' else
              'mistral' if mc.local_window or remembered == 'mistral' else
              'llama')
    given = {
        'post_norms': mc.post_norms, 'logits_soft_cap': mc.logits_soft_cap,
        'final_logits_soft_cap': mc.final_logits_soft_cap,
        'query_pre_attn_scalar': mc.query_pre_attn_scalar not in (
            None, mc.head_dim),
        'local_rope_base': mc.local_rope_base,
        'qk_norm': gemma and mc.qk_norm, 'qkv_bias': gemma and mc.qkv_bias,
        'local_window': gemma and mc.local_window,
        'qk_norm with model.qkv_bias': mc.qk_norm and mc.qkv_bias}
  else:
    family, given = None, {}
    problems.append(
        f'model.mlp_activation={mc.mlp_activation!r}, norm_scale_offset='
        f'{mc.norm_scale_offset}, embed_scale={mc.embed_scale} (neither '
        "Gemma's gelu_tanh/1/True nor Llama's silu/0/False)")
  problems += [f'model.{field} in a {family} model'
               for field, value in given.items() if value]
  if problems:
    raise UserError(f'no Hugging Face architecture computes {"; ".join(problems)}'
                    f'; export supports {", ".join(FAMILIES)}')
  return family


def _deepseek_family(mc, remembered: str | None) -> str:
  """An MLA model's model_type: DeepSeek's (the one remembered, else V3)."""
  problems = hf_deepseek.family_problems(mc)
  if problems:
    raise UserError(f'no Hugging Face architecture computes '
                    f'{"; ".join(problems)}; MLA exports as deepseek_v3: keep '
                    'the workdir, or train the model with DeepSeek\'s '
                    'settings')
  return remembered if remembered in hf_deepseek.FAMILIES else 'deepseek_v3'


def hf_config(mc, family: str, base: dict | None = None) -> dict:
  """config.json for `mc` as `family`; `base` (the imported source's config)
  keeps what we do not set, such as the special token ids."""
  config = {k: v for k, v in (base or {}).items()
            if k not in ('rope_scaling', 'rope_parameters', 'torch_dtype',
                         'layer_types', 'transformers_version',
                         'hidden_act', 'hidden_activation')}
  dtype = {np.dtype('float32'): 'float32', np.dtype('float16'): 'float16'
           }.get(np.dtype(mc.param_dtype), 'bfloat16')
  rope = _rope_parameters(mc)
  L = mc.num_layers
  kinds = [('sliding_attention' if letter == 'L' else 'full_attention')
           for letter in (mc.attention_pattern * L)[:L]]
  config.update(
      model_type=family, architectures=[FAMILIES[family]],
      vocab_size=mc.vocab_size, hidden_size=mc.d_model,
      intermediate_size=mc.mlp_dim, num_hidden_layers=L,
      num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
      head_dim=mc.head_dim, max_position_embeddings=mc.max_len,
      rms_norm_eps=mc.norm_eps, tie_word_embeddings=mc.tie_embeddings,
      rope_parameters=rope, rope_theta=mc.rope_base, dtype=dtype)
  config['hidden_activation' if family in SANDWICHED else 'hidden_act'] = (
      'gelu_pytorch_tanh' if family in GEMMAS else 'silu')
  if mc.rope_scaling is not None:  # For transformers 4 readers.
    config['rope_scaling'] = {k: v for k, v in rope.items()
                              if k != 'rope_theta'}
  if family in ('llama', 'qwen3', *GEMMAS):
    config['attention_bias'] = False
  if family == 'llama':
    config['mlp_bias'] = False
  if family in ('mistral', 'ministral', *SANDWICHED):
    config['sliding_window'] = mc.local_window
  if family in ('ministral', 'qwen2', 'qwen3', *SANDWICHED):
    config['layer_types'] = kinds
  if family in ('qwen2', 'qwen3'):
    sliding = mc.local_window is not None
    config.update(use_sliding_window=sliding, sliding_window=mc.local_window,
                  max_window_layers=0 if sliding else L)
  if family in hf_deepseek.FAMILIES:
    config.update(hf_deepseek.hf_config(mc, family))
  if family in SANDWICHED:
    scalar = mc.query_pre_attn_scalar or mc.head_dim
    config.update(
        query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,
        attn_logit_softcapping=mc.logits_soft_cap,
        final_logit_softcapping=mc.final_logits_soft_cap)
  if family == 'gemma3_text':
    local = ({'rope_type': 'default', 'rope_theta': mc.local_rope_base}
             if mc.local_rope_base is not None else rope)
    config.update(rope_parameters={'full_attention': rope,
                                   'sliding_attention': local},
                  rope_local_base_freq=local['rope_theta'])
  return config


def _rope_parameters(mc) -> dict:
  """One layer type's rope_parameters: the global layers'."""
  rope = {'rope_type': 'default', 'rope_theta': mc.rope_base}
  if mc.rope_scaling is not None:
    s = mc.rope_scaling
    rope = {'rope_type': s.kind, 'rope_theta': mc.rope_base,
            'factor': s.factor}
    if s.kind == 'llama3':
      rope.update(low_freq_factor=s.low_freq_factor,
                  high_freq_factor=s.high_freq_factor,
                  original_max_position_embeddings=s.original_max_len)
    if s.kind == 'yarn':
      rope.update(original_max_position_embeddings=s.original_max_len,
                  beta_fast=s.beta_fast, beta_slow=s.beta_slow)
      rope.update({k: v for k, v in (('mscale', s.mscale),
                                     ('mscale_all_dim', s.mscale_all_dim))
                   if v})
  return rope


# --- Weights ---------------------------------------------------------------

def _to_heads(w, H):  # [E·H, D] -> [D, E, H]
  return w.T.reshape(w.shape[1], -1, H)


def _from_heads(w, H):  # [D, E, H] -> [E·H, D]
  return w.reshape(w.shape[0], -1).T


def _to_out(w, H):  # [D, N·H] -> [N, H, D]
  return w.T.reshape(-1, H, w.shape[0])


def _from_out(w, H):  # [N, H, D] -> [D, N·H]
  return w.reshape(-1, w.shape[-1]).T


def _to_bias(w, H):  # [E·H] -> [E, H]
  return w.reshape(-1, H)


def _from_bias(w, H):
  return w.reshape(-1)


def _same(w, H):
  return w


def _transpose(w, H):
  return w.T


# HF name within layer i -> (our path within the stacked layers, to ours,
# to HF).
LAYER_WEIGHTS = {
    'self_attn.q_proj.weight': (('attention', 'query'), _to_heads, _from_heads),
    'self_attn.k_proj.weight': (('attention', 'key'), _to_heads, _from_heads),
    'self_attn.v_proj.weight': (('attention', 'value'), _to_heads, _from_heads),
    'self_attn.o_proj.weight': (('attention', 'out'), _to_out, _from_out),
    'self_attn.q_proj.bias': (('attention', 'query_bias'), _to_bias, _from_bias),
    'self_attn.k_proj.bias': (('attention', 'key_bias'), _to_bias, _from_bias),
    'self_attn.v_proj.bias': (('attention', 'value_bias'), _to_bias, _from_bias),
    'self_attn.q_norm.weight': (('attention', 'query_norm'), _same, _same),
    'self_attn.k_norm.weight': (('attention', 'key_norm'), _same, _same),
    'mlp.gate_proj.weight': (('mlp', 'gate'), _transpose, _transpose),
    'mlp.up_proj.weight': (('mlp', 'up'), _transpose, _transpose),
    'mlp.down_proj.weight': (('mlp', 'down'), _transpose, _transpose),
    'input_layernorm.weight': (('attention_norm', 'scale'), _same, _same),
    'post_attention_layernorm.weight': (('mlp_norm', 'scale'), _same, _same),
}
# Gemma 2/3's four norms per layer: post_attention_layernorm is the
# attention output's, the MLP's input norm is pre_feedforward_layernorm.
POST_NORM_WEIGHTS = {
    'post_attention_layernorm.weight': (('post_attention_norm', 'scale'),
                                        _same, _same),
    'pre_feedforward_layernorm.weight': (('mlp_norm', 'scale'), _same, _same),
    'post_feedforward_layernorm.weight': (('post_mlp_norm', 'scale'), _same,
                                          _same),
}
GLOBAL_WEIGHTS = {
    'model.embed_tokens.weight': (('embed', 'embedding'), _same, _same),
    'model.norm.weight': (('final_norm', 'scale'), _same, _same),
    'lm_head.weight': (('unembed', 'kernel'), _transpose, _transpose),
}
KV_NAMES = ('key', 'value', 'key_bias', 'value_bias')


def weight_plan(params_shapes: dict, mc, interleaved: bool = True
                ) -> dict[str, tuple[tuple, int | None, Callable, Callable]]:
  """HF name -> (our path, index on its stacked layer axis or None, to ours,
  to HF), for the parameters the model has (biases and norms only where
  configured); interleaved: a DeepSeek checkpoint's RoPE layout."""
  plan = {}
  for name, (path, to_ours, to_hf) in GLOBAL_WEIGHTS.items():
    if _has(params_shapes, path):
      plan[name] = (path, None, to_ours, to_hf)
  names = LAYER_WEIGHTS | (POST_NORM_WEIGHTS if mc.post_norms else {})
  if mc.layout.name == 'mla':  # DeepSeek's attention in place of Llama's.
    names = {name: value for name, value in names.items()
             if not name.startswith('self_attn.')}
    names |= hf_deepseek.layer_weights(mc, interleaved)
  for i in range(mc.num_layers):
    prefix, index = model_lib.layer_slot(mc, i)
    for name, (path, to_ours, to_hf) in names.items():
      if _has(params_shapes, (*prefix, *path)):
        plan[f'model.layers.{i}.{name}'] = ((*prefix, *path), index, to_ours,
                                            to_hf)
  return plan


def _has(tree, path) -> bool:
  for key in path:
    if not isinstance(tree, dict) or key not in tree:
      return False
    tree = tree[key]
  return True


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def read_weights(files: list[safetensors_io.File], shapes: dict, mc,
                 convert_kv: Callable[[np.ndarray, str], np.ndarray] | None
                 = None, interleaved: bool = True) -> dict:
  """The parameters (stacked layers) filled from the safetensors `files`.

  shapes: the target parameters' ShapeDtypeStructs; convert_kv(array, name)
  turns a source key/value weight [D, K_source, H] or bias [K_source, H] into
  the target's K heads. Checks every name and shape before reading any.
  """
  plan = weight_plan(shapes, mc, interleaved)
  where = {}
  ignored = ('rotary_emb.inv_freq',)
  unexpected = []
  for f in files:
    for name in f.entries:
      if name.endswith(ignored) or (name == 'lm_head.weight' and
                                    mc.tie_embeddings):
        continue
      if name not in plan:
        unexpected.append(name)
      where[name] = f
  missing = [n for n in plan if n not in where]
  if unexpected or missing:
    raise UserError(
        'the safetensors do not match config.json: '
        + (f'missing {_some(missing)}' if missing else '')
        + ('; ' if missing and unexpected else '')
        + (f'unexpected {_some(unexpected)}' if unexpected else '')
        + '; nothing was written')
  H = mc.head_dim
  for name, (path, layer, to_ours, _) in plan.items():
    target = _get(shapes, path)
    slot_shape = target.shape[1:] if layer is not None else target.shape
    _, shape = where[name].entries[name]
    source_shape = _source_shape(to_ours, shape, H)
    is_kv = path[-1] in KV_NAMES and convert_kv is not None
    if source_shape is None or (not is_kv and source_shape != slot_shape):
      expected = _source_shape(plan[name][3], slot_shape, H)  # HF layout.
      raise UserError(f'{name} is {list(shape)} in the safetensors, but '
                      f'config.json implies {list(expected)}; nothing was '
                      'written')
  params = _empty_like(shapes)  # Allocated once everything is checked.
  total = sum(f.nbytes(name) for f in files for name in f.entries
              if name in plan)
  with Progress('reading weights', total, unit='MB', scale=1e6) as bar:
    for f in files:
      for name in f.entries:
        if name in plan:
          _read_into(params, f, name, plan[name], H, convert_kv)
          bar.advance(f.nbytes(name))
  return params


def _read_into(params, f: safetensors_io.File, name: str, planned, H: int,
               convert_kv):
  """Reads one tensor into its slot of `params`."""
  path, layer, to_ours, _ = planned
  value = to_ours(f.read(name), H)
  if path[-1] in KV_NAMES and convert_kv is not None:
    try:
      value = convert_kv(value, name)
    except ValueError:
      raise UserError(f'{name} is {list(f.entries[name][1])} in the '
                      'safetensors, which does not fit the KV heads of '
                      'config.json; nothing was written') from None
  target = _get(params, path)
  if layer is None:
    target[...] = value
  else:
    target[layer] = value


def _source_shape(to_ours, shape, H):
  try:
    return to_ours(np.empty(shape, np.uint8), H).shape
  except ValueError:
    return None


def _some(names: list[str]) -> str:
  return ', '.join(names[:4]) + (f' and {len(names) - 4} more'
                                 if len(names) > 4 else '')


def _empty_like(shapes):
  if isinstance(shapes, dict):
    return {k: _empty_like(v) for k, v in shapes.items()}
  return np.empty(shapes.shape, shapes.dtype)


def unfused(params, mc):
  """Separate query/key/value (and biases) from a fused_qkv model's qkv, in
  every attention layer."""
  if not mc.fused_qkv:
    return params
  N, K = mc.num_heads, mc.num_kv_heads

  def unfuse(tree):
    if not isinstance(tree, dict):
      return tree
    tree = {name: unfuse(sub) for name, sub in tree.items()}
    for suffix in ('', '_bias'):
      if f'qkv{suffix}' in tree:
        q, k, v = np.split(np.asarray(tree.pop(f'qkv{suffix}')),
                           [N, N + K], axis=-2)
        tree.update({f'query{suffix}': q, f'key{suffix}': k,
                     f'value{suffix}': v})
    return tree
  return unfuse(params)


def hf_tensors(params, mc) -> tuple[dict, Iterator[tuple[str, np.ndarray]]]:
  """(name -> (dtype, shape), the tensors one by one) in Hugging Face layout."""
  plan = weight_plan(params, mc)
  H = mc.head_dim

  def convert(name):
    path, layer, _, to_hf = plan[name]
    value = np.asarray(_get(params, path))
    return to_hf(value[layer] if layer is not None else value, H)

  shapes = {}
  for name, (path, layer, _, to_hf) in plan.items():
    leaf = _get(params, path)
    shape = leaf.shape[1:] if layer is not None else leaf.shape
    shapes[name] = (np.dtype(leaf.dtype),
                    to_hf(np.empty(shape, np.uint8), H).shape)
  return shapes, ((name, convert(name)) for name in shapes)


def read_config(directory: pathlib.Path) -> dict:
  path = directory / 'config.json'
  if not directory.is_dir():
    raise UserError(f'--from_hf={directory} is not a directory; give the '
                    'folder of a Hugging Face checkpoint')
  if not path.exists():
    raise UserError(f'{path} not found; --from_hf must be a Hugging Face '
                    'checkpoint folder (config.json + *.safetensors)')
  try:
    config = json.loads(path.read_text())
  except ValueError as e:
    raise UserError(f'{path} is not valid JSON ({e})') from None
  if not isinstance(config, dict):
    raise UserError(f'{path} holds a JSON {type(config).__name__}, not an '
                    'object; give the config.json of a Hugging Face model')
  return config
