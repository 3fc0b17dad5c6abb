"""Writes a random-weight Hugging Face checkpoint, with a trained tokenizer.

  python -m scripts.make_hf_model --out=DIR [--family=llama] [--d_model=384]
      [--num_layers=4] [--num_heads=8] [--num_kv_heads=8] [--vocab_size=4096]

A stand-in for a downloaded model (nothing is fetched): `transformers` builds
the architecture from a config with random weights and saves it as
safetensors; a byte-level BPE tokenizer is trained on the embedded corpus's
documentation text. The defaults give a ~10M-parameter Llama-style MHA
model, the README's workflow example. Needs the `[test]` extra (torch,
transformers, tokenizers).
"""

from __future__ import annotations

import pathlib
import sys

from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       positive_int)
from infra.errors import UserError, pip_install
from lm import tokenizer as tokenizer_lib

FAMILIES = ('llama', 'mistral', 'ministral', 'qwen2', 'qwen3', 'gemma',
            'gemma2', 'gemma3_text')


def make(out: str, *, family: str = 'llama', d_model: int = 384,
         num_layers: int = 4, num_heads: int = 8, num_kv_heads: int = 8,
         head_dim: int | None = None, mlp_dim: int = 1024,
         vocab_size: int = 4096, max_len: int = 2048, dtype: str = 'float32',
         rope_scaling: dict | None = None, sliding_window: int | None = None,
         layer_types: list[str] | None = None,
         tie_embeddings: bool | None = None, init_std: float = 0.02,
         seed: int = 0, tokenizer: bool = True, **config_fields):
  """Saves the model (and tokenizer.json) to OUT; returns the torch model.
  sliding_window (and layer_types, where the family reads them) make layers
  local; rope_scaling goes to the global layers; config_fields are set on the
  family's config as they are (e.g. Gemma 2's attn_logit_softcapping)."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise UserError(f'{e.name} is not installed; make_hf_model needs the '
                    f'test extra: {pip_install("test")}') from None
  fields = dict(
      vocab_size=vocab_size, hidden_size=d_model, intermediate_size=mlp_dim,
      num_hidden_layers=num_layers, num_attention_heads=num_heads,
      num_key_value_heads=num_kv_heads, head_dim=head_dim or d_model // num_heads,
      max_position_embeddings=max_len, bos_token_id=0, eos_token_id=1,
      pad_token_id=None, rms_norm_eps=1e-5 if family == 'llama' else 1e-6,
      initializer_range=init_std)
  if tie_embeddings is not None:
    fields['tie_word_embeddings'] = tie_embeddings
  rope = {'rope_type': 'default', 'rope_theta': 500_000.0 if family in (
      'llama', 'qwen2', 'qwen3') else 10_000.0}
  rope.update(rope_scaling or {})
  fields['rope_parameters'] = rope
  if family == 'gemma3_text':  # 10k for the local layers, 1M global.
    fields['rope_parameters'] = {
        'sliding_attention': {'rope_type': 'default', 'rope_theta': 10_000.0},
        'full_attention': {**rope, 'rope_theta': 1_000_000.0}}
  if sliding_window is not None or family in ('mistral', 'ministral', 'qwen2',
                                              'qwen3'):  # Gemma keeps 4096.
    fields['sliding_window'] = sliding_window
  if family in ('qwen2', 'qwen3'):
    fields['use_sliding_window'] = sliding_window is not None
    fields['max_window_layers'] = 0
  if layer_types is not None:
    fields['layer_types'] = layer_types
  fields.update(config_fields)
  torch.manual_seed(seed)
  config = transformers.AutoConfig.for_model(family, **fields)
  model = transformers.AutoModelForCausalLM.from_config(
      config, dtype=getattr(torch, dtype))
  with torch.no_grad():  # Norm weights random too, so that a mix-up shows.
    for name, p in model.named_parameters():
      if 'norm' in name:
        p.copy_(p + 0.1 * torch.randn_like(p))
  model.eval()
  out_dir = pathlib.Path(out)
  model.save_pretrained(out_dir)
  if tokenizer:
    tokenizer_lib.train_bpe(vocab_size, out_dir / tokenizer_lib.FILE)
  return model


def _check(args):
  """A model transformers would build but not run (or that is not GQA)."""
  if args.num_heads % args.num_kv_heads:
    raise UserError(f'--num_heads={args.num_heads} is not divisible by '
                    f'--num_kv_heads={args.num_kv_heads}; use a divisor of '
                    f'{args.num_heads}')
  head_dim = args.d_model // args.num_heads
  if args.d_model % args.num_heads or head_dim % 2:
    raise UserError(f'--d_model={args.d_model} / --num_heads={args.num_heads}'
                    ' must be a whole, even head size (RoPE rotates pairs)')
  if args.vocab_size < 258:  # Byte-level BPE: 256 bytes and <s>, </s>.
    raise UserError(f'--vocab_size={args.vocab_size} must be >= 258 (the '
                    'tokenizer\'s 256 bytes and <s>, </s>)')


def main(argv=None):
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--out', required=True)
  parser.add_argument('--family', choices=FAMILIES, default='llama')
  parser.add_argument('--d_model', type=positive_int, default=384)
  parser.add_argument('--num_layers', type=positive_int, default=4)
  parser.add_argument('--num_heads', type=positive_int, default=8)
  parser.add_argument('--num_kv_heads', type=positive_int, default=8)
  parser.add_argument('--mlp_dim', type=positive_int, default=1024)
  parser.add_argument('--vocab_size', type=positive_int, default=4096)
  parser.add_argument('--max_len', type=positive_int, default=2048)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'),
                      default='float32')
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(argv)
  check_output_dir(args.out, new=True)
  _check(args)
  model = make(**vars(args))
  count = sum(p.numel() for p in model.parameters())
  print(f'wrote {args.out}: random {args.family}, {count:,} parameters, '
        f'tokenizer of {args.vocab_size} tokens')


if __name__ == '__main__':
  exit_on_user_error(lambda: main(sys.argv[1:]))
