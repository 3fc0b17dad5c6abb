"""A workdir's tokenizer as a GGUF vocabulary, for `train.convert.to_gguf`.

llama.cpp tokenizes by the vocabulary a GGUF file carries; both of ours are
written as its byte-level BPE (tokenizer.ggml.model "gpt2"):

  bytes (a workdir without tokenizer.json): token i is byte i, spelled in
    GPT-2's byte-to-unicode alphabet, with no merge that can ever apply, so
    llama.cpp reads each byte of a text as its own token, as we do. It has no
    BOS and no end-of-sequence token; llama.cpp insists on one, so byte 0
    (NUL, which text does not hold) stands for it.
  a tokenizer.json holding a byte-level BPE whose pre-tokenizer llama.cpp
    knows by name (GPT-2's, Llama 3's, Qwen2's: `PRE_TOKENIZERS`): its
    tokens, merges and special tokens as they are, with the BOS and EOS ids
    the workdir's Hugging Face files name (`lm.tokenizer`).

Ids past the tokenizer's, up to the model's vocab_size (an embedding padded
beyond the tokenizer), are unused tokens '[PAD<id>]', as llama.cpp's own
converter writes them. Anything else (SentencePiece, WordPiece, another
pre-tokenizer) is refused in one line: llama.cpp would tokenize it
differently from the model's training.
"""

from __future__ import annotations

import dataclasses
import json
import os

from etils import epath

from infra.errors import UserError
from lm import tokenizer as tokenizer_lib

# gguf.TokenType's values (its package is imported only to write).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# tokenizer.json's split pattern -> (llama.cpp's pre-tokenizer name, whether
# llama.cpp takes a word that is a token whole, before any merge: the
# tokenizer.json's model.ignore_merges must say the same).
PRE_TOKENIZERS = {
    # Llama 3.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
    r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": ('llama-bpe', True),
    # Qwen2 (single digits).
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
    r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": ('qwen2', False),
}
GPT2 = ('gpt-2', False)  # ByteLevel's own regex (use_regex=true).
# llama.cpp needs tokenizer.ggml.merges, and the gguf writer refuses an empty
# array: the byte vocabulary gets this one, which can never apply (its left
# side is two bytes, which no merge makes).
NO_MERGE = '\u0100\u0100 \u0100'


@dataclasses.dataclass(frozen=True)
class Vocab:
  """What GGUF's tokenizer.ggml.* keys say; token types are gguf.TokenType's
  values; bos/eos None: not written."""
  pre: str
  tokens: list[str]
  types: list[int]
  merges: list[str]
  bos: int | None
  eos: int | None
  add_bos: bool
  add_eos: bool


def byte_alphabet() -> list[str]:
  """GPT-2's byte -> unicode character, [256]: printable Latin-1 bytes as
  themselves, the others as U+0100 onwards in byte order."""
  kept = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1),
          *range(ord('®'), ord('ÿ') + 1)]
  moved = iter(range(256, 512))
  return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def of_workdir(workdir: os.PathLike, vocab_size: int) -> Vocab:
  """The vocabulary of WORKDIR's tokenizer, padded to `vocab_size` ids."""
  tokenizer = tokenizer_lib.of_workdir(workdir)
  if tokenizer.name == 'bytes':
    tokens = byte_alphabet()[:vocab_size]
    return _padded(Vocab('gpt-2', tokens, [NORMAL] * len(tokens), [NO_MERGE],
                         bos=0, eos=0, add_bos=False, add_eos=False),
                   vocab_size)
  spec = json.loads((epath.Path(workdir) / tokenizer_lib.FILE).read_text())
  pre = _check_bpe(spec, tokenizer.name)
  size = tokenizer.vocab_size
  if size > vocab_size:
    raise UserError(f'{tokenizer.name} has {size} tokens, more than the '
                    f"model's vocab_size={vocab_size}; give the workdir the "
                    'tokenizer it was trained with')
  tokens, types = [None] * size, [NORMAL] * size
  for text, i in spec['model']['vocab'].items():
    tokens[i] = text
  for added in spec.get('added_tokens', []):
    tokens[added['id']] = added['content']
    types[added['id']] = CONTROL if added.get('special') else USER_DEFINED
  for i, text in enumerate(tokens):
    if text is None:  # A gap in the ids.
      tokens[i], types[i] = f'[PAD{i}]', UNUSED
  merges = [m if isinstance(m, str) else ' '.join(m)
            for m in spec['model'].get('merges', [])]
  before, after = tokenizer.special_ends()
  if len(before) > 1 or len(after) > 1:
    raise UserError(f'{tokenizer.name}: its post-processor adds {before} '
                    f'before a text and {after} after it; llama.cpp adds at '
                    'most one BOS and one EOS, so it cannot be exported')
  bos = tokenizer_lib.bos_id(tokenizer, workdir)
  bos = before[0] if before else bos
  eos = after[0] if after else (tokenizer.eos_ids or (None,))[0]
  return _padded(Vocab(pre, tokens, types, merges or [NO_MERGE], bos, eos,
                       add_bos=bool(before), add_eos=bool(after)), vocab_size)


def _padded(vocab: Vocab, size: int) -> Vocab:
  extra = range(len(vocab.tokens), size)
  return dataclasses.replace(
      vocab, tokens=vocab.tokens + [f'[PAD{i}]' for i in extra],
      types=vocab.types + [UNUSED] * len(extra))


def _check_bpe(spec: dict, name: str) -> str:
  """llama.cpp's pre-tokenizer name for a tokenizer.json it can read as it
  was trained; UserError naming what it cannot."""
  model = spec.get('model') or {}
  pre = spec.get('pre_tokenizer') or {}
  decoder = spec.get('decoder') or {}
  normalizer = spec.get('normalizer') or {}
  problem = None
  if model.get('type') != 'BPE' or model.get('byte_fallback'):
    problem = (f'its model is {model.get("type")!r}'
               + (' with byte_fallback' if model.get('byte_fallback') else '')
               + ' (SentencePiece-style)')
  elif decoder.get('type') != 'ByteLevel':
    problem = f'its decoder is {decoder.get("type")!r}, not ByteLevel'
  elif normalizer and normalizer.get('type') != 'NFC':  # Qwen2's NFC: not
    # applied by llama.cpp, so text already in NFC (most) reads the same.
    problem = f'its normalizer is {normalizer.get("type")!r}'
  found = _pre_tokenizer(pre)
  if problem is None and found is None:
    problem = (f'its pre-tokenizer ({json.dumps(pre)[:120]}) is not one '
               'llama.cpp names')
  if problem is None and bool(model.get('ignore_merges')) != found[1]:
    problem = (f'model.ignore_merges={bool(model.get("ignore_merges"))} with '
               f"the {found[0]} pre-tokenizer, whose llama.cpp reading takes "
               f'ignore_merges={found[1]}')
  if problem:
    raise UserError(f'{name}: {problem}; GGUF export writes byte-level BPE '
                    'tokenizers with a GPT-2, Llama 3 or Qwen2 pre-tokenizer, '
                    'which llama.cpp tokenizes as tokenizers does')
  return found[0]


def _pre_tokenizer(pre: dict) -> tuple[str, bool] | None:
  """(name, ignore_merges) of a ByteLevel pre-tokenizer, alone (GPT-2's
  regex) or after a Split by a pattern of PRE_TOKENIZERS; None otherwise."""
  def byte_level(step, regex):
    return (step.get('type') == 'ByteLevel' and not step.get(
        'add_prefix_space') and step.get('use_regex', True) == regex)
  if byte_level(pre, True):
    return GPT2
  steps = pre.get('pretokenizers') if pre.get('type') == 'Sequence' else None
  if not steps or len(steps) != 2 or not byte_level(steps[1], False):
    return None
  split = steps[0]
  if (split.get('type') != 'Split' or split.get('behavior') != 'Isolated'
      or split.get('invert')):
    return None
  return PRE_TOKENIZERS.get((split.get('pattern') or {}).get('Regex'))


def write(writer, vocab: Vocab):
  """The tokenizer.ggml.* keys, through a gguf.GGUFWriter."""
  writer.add_tokenizer_model('gpt2')
  writer.add_tokenizer_pre(vocab.pre)
  writer.add_token_list(vocab.tokens)
  writer.add_token_types(vocab.types)
  writer.add_token_merges(vocab.merges)
  if vocab.bos is not None:
    writer.add_bos_token_id(vocab.bos)
  if vocab.eos is not None:
    writer.add_eos_token_id(vocab.eos)
  writer.add_add_bos_token(vocab.add_bos)
  writer.add_add_eos_token(vocab.add_eos)
