"""Defaults shared by every named config; each config file changes what it needs."""

import typing

from ml_collections import config_dict

# Importing the attention package registers its layouts (attention.layer).
from attention import layout as layout_lib


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()
  c.seed = 0
  c.model = model()
  c.data = data()
  c.train = train()
  # Device mesh: -1 = all remaining devices.
  c.mesh = config_dict.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  return c


def layout_sections() -> dict[str, config_dict.ConfigDict]:
  """{name: its settings' defaults} of every registered layout that has
  settings, as config fields: a None default is a placeholder of the
  field's type (a tuple's: list, as JSON writes it)."""
  sections = {}
  for name in layout_lib.names():
    cls = layout_lib.get(name)
    hints = typing.get_type_hints(cls)
    fields = {}
    for field_name, field in layout_lib.fields(cls).items():
      if field.default is None:
        kind = next(t for t in typing.get_args(hints[field_name])
                    if t is not type(None))
        kind = list if typing.get_origin(kind) is tuple else kind
        fields[field_name] = config_dict.placeholder(kind)
      else:
        fields[field_name] = field.default
    if fields:
      sections[name] = config_dict.ConfigDict(fields)
  return sections


def model() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      vocab_size=256,
      num_layers=4,
      d_model=256,
      num_heads=8,
      num_kv_heads=2,  # The knob: num_heads = MHA, 1 = MQA, a divisor = GQA.
      head_dim=32,
      mlp_dim=768,
      max_len=256,  # Longest sequence the model accepts (and its KV cache).
      tie_embeddings=False,
      scan_layers=True,  # One compiled layer, looped (compile time flat in depth).
      # Layers per scan iteration: 4 unrolls these 4-layer models, which on
      # CPU trains 10% faster (XLA schedules across layers); parameters and
      # initialisation are the scan's either way. Compile time grows with it.
      scan_unroll=4,
      remat=False,
      rope_base=10_000.0,
      use_rope=True,  # Rotary positions in every attention layer.
      # A learned [max_len, D] position embedding added to the tokens' (GPT-2,
      # Zoology's recall models); with or without RoPE.
      learned_positions=False,
      local_window=config_dict.placeholder(int),  # Keys of an 'L' layer.
      # Layer kinds, cycled over the layers: 'G' global, 'L' local
      # (local_window keys, and a decode cache of that many): 'LG' is
      # Gemma 2's, 'LLLLLG' Gemma 3's, 'L' every layer local (Mistral).
      attention_pattern='G',
      kv_share=1,  # Consecutive layers sharing one K/V (2: CLA2).
      # How decoding caches K and V: None (dtype), 'bfloat16' or 'int8' (a
      # scale per token and KV head). Training is unaffected.
      kv_cache_dtype=config_dict.placeholder(str),
      # How attention caches K/V (attention.layout; docs/kv_memory.md):
      # 'gqa' (num_kv_heads K/V heads: MHA, GQA, MQA), 'mla' (multi-head
      # latent attention, DeepSeek-V2/V3; GLA with model.mla.latent_groups),
      # 'gta' (grouped-tied, Zadouri et al. 2025), or any registered
      # layout. Its settings are model.<name> (below, one section per
      # layout that has settings, with the layout class's defaults).
      attention='gqa',
      **layout_sections(),
      logits_soft_cap=config_dict.placeholder(float),  # Attention's (Gemma 2).
      final_logits_soft_cap=config_dict.placeholder(float),  # Output's.
      # Attention logits are q·k x query_pre_attn_scalar ** -0.5 (None:
      # head_dim); Gemma 2/3 checkpoints set it.
      query_pre_attn_scalar=config_dict.placeholder(float),
      post_norms=False,  # Norms after attention and MLP too (Gemma 2/3).
      fused_qkv=False,
      dtype='float32',  # Compute dtype: 'bfloat16' on GPU/TPU.
      param_dtype='float32',  # Of the parameters (imported bf16 may stay).
      # Conventions, Gemma's by default; `train.convert --from_hf` sets
      # Llama's, Mistral's or Qwen's.
      mlp_activation='gelu_tanh',  # Or 'silu'.
      norm_eps=1e-6,
      norm_scale_offset=1.0,  # RMSNorm multiplies by offset + scale (Llama 0).
      embed_scale=True,  # Embeddings times √D.
      tied_logits_scale=True,  # Tied output divides the logits by √D.
      qkv_bias=False,  # Biases on the Q/K/V projections (Qwen2).
      qk_norm=False,  # RMSNorm of each query and key head (Qwen3).
      # The L layers' RoPE base, unscaled (Gemma 3: 10k); None: rope_base
      # and rope_scaling, as the G layers.
      local_rope_base=config_dict.placeholder(float),
      # RoPE frequency scaling: kind '' (none), 'linear', 'llama3' or 'yarn'.
      rope_scaling=config_dict.ConfigDict(dict(
          kind='', factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0,
          original_max_len=8192,
          # 'yarn' (DeepSeek): its ramp's bounds and mscales (0: absent).
          beta_fast=32.0, beta_slow=1.0, mscale=0.0, mscale_all_dim=0.0)),
  ))


def data() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      task='lm',  # 'lm': data.path; 'recall': the synthetic recall probe.
      path='',  # '' = the embedded stdlib corpus; else text, a folder, .bin.
      recall_pairs=0,  # task='recall': key-value pairs per row; 0 = all fit.
      recall_gap=0,  # task='recall': filler tokens between pairs and queries.
      seq_len=256,
      val_fraction=0.05,  # Held-out tail of a single text or .bin file.
      cache_dir='',  # '' = $XDG_CACHE_HOME/gqa-lab.
      # '' = bytes (vocabulary 256), or a Hugging Face tokenizer.json; a
      # workdir remembers its tokenizer (WORKDIR/tokenizer.json).
      tokenizer='',
  ))


def train() -> config_dict.ConfigDict:
  return config_dict.ConfigDict(dict(
      steps=360,
      batch_size=16,
      grad_accum_steps=1,
      learning_rate=3e-3,
      warmup_steps=30,
      min_learning_rate_ratio=0.1,  # Cosine decay ends at this x peak.
      weight_decay=0.1,
      b1=0.9,
      b2=0.95,
      grad_clip=1.0,
      log_every=10,
      eval_every=60,
      eval_batches=8,
      checkpoint_every=120,
      keep_checkpoints=3,
  ))
