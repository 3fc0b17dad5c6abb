"""Text <-> token ids: bytes by default, or a Hugging Face tokenizer.json.

A workdir remembers its tokenizer as WORKDIR/tokenizer.json (written by
`train.convert --from_hf`, or by `train.main` from `data.tokenizer`);
without one, a model reads UTF-8 bytes (vocabulary 256).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from typing import Iterator

from etils import epath
import numpy as np

from infra.errors import UserError

FILE = 'tokenizer.json'


class Bytes:
  """UTF-8 bytes as tokens."""
  vocab_size = 256
  name = 'bytes'
  fingerprint = 'bytes'
  eos_ids: tuple[int, ...] = ()

  def encode(self, text: str, *, special: bool = True) -> np.ndarray:
    del special
    return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

  def decode(self, ids, *, skip_special: bool = False) -> str:
    del skip_special
    return bytes(np.asarray(ids, np.uint8)).decode('utf-8', 'replace')


class HuggingFace:
  """A `tokenizers` tokenizer.json (BPE, Unigram, WordPiece, ...)."""

  def __init__(self, path: epath.Path, eos_ids: tuple[int, ...] = ()):
    try:
      from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
    except ImportError:
      raise UserError(f'{path} needs the tokenizers package; pip install '
                      'tokenizers') from None
    content = path.read_bytes()
    try:
      self._tokenizer = Tokenizer.from_str(content.decode())
    except Exception as e:  # pylint: disable=broad-except
      raise UserError(f'{path} is not a Hugging Face tokenizer.json ({e}); '
                      'give the tokenizer.json of a Hugging Face model') from None
    # Ids may leave gaps (a vocabulary edited by hand, added tokens placed
    # high): the model needs a row for every id up to the largest.
    self.vocab_size = max(
        self._tokenizer.get_vocab_size(with_added_tokens=True),
        1 + max(self._tokenizer.get_vocab(with_added_tokens=True).values(),
                default=-1))
    self.name = str(path)
    self.fingerprint = hashlib.sha256(content).hexdigest()[:12]
    self.eos_ids = eos_ids

  def encode(self, text: str, *, special: bool = True) -> np.ndarray:
    """special: add the tokenizer's special tokens (a BOS, for most)."""
    return np.asarray(self._tokenizer.encode(
        text, add_special_tokens=special).ids, np.int32)

  def encode_many(self, texts: list[str]) -> list[list[int]]:
    """Without special tokens, in parallel."""
    return [e.ids for e in self._tokenizer.encode_batch(
        texts, add_special_tokens=False)]

  def encode_pieces(self, texts: list[str], continued: list[bool]
                    ) -> list[list[int]]:
    """`pieces` of texts, without special tokens, in parallel; continued[i]:
    texts[i] is not its text's first piece. A tokenizer that puts a space
    before every text (Llama 2's "▁" prefix) gets such a piece without the
    space it was cut before, which it puts back."""
    return self.encode_many([
        text[1:] if again and self._prefixes_space and text.startswith(' ')
        else text for text, again in zip(texts, continued)])

  @functools.cached_property
  def _prefixes_space(self) -> bool:
    ids = lambda text: self.encode(text, special=False).tolist()
    return ids('a b') != ids('a') + ids(' b') and (
        ids('a b') == ids('a') + ids('b'))

  def encode_documents(self, texts: list[str]) -> list[list[int]]:
    """With the special tokens the post-processor adds (a BOS, for most),
    in parallel."""
    return [e.ids for e in self._tokenizer.encode_batch(
        texts, add_special_tokens=True)]

  def special_ends(self) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a text's own
    (([BOS], []) for most): what `encode_documents` adds to `encode_many`."""
    full = [int(i) for i in self.encode('a')]
    plain = [int(i) for i in self.encode('a', special=False)]
    for i in range(len(full) - len(plain) + 1):
      if full[i:i + len(plain)] == plain:
        return full[:i], full[i + len(plain):]
    raise UserError(f'{self.name}: its post-processor changes the text\'s own '
                    'tokens, not only adding special ones around them; give '
                    'a tokenizer.json with a template post-processor')

  def id_of(self, token: str) -> int | None:
    return self._tokenizer.token_to_id(token)

  def decode(self, ids, *, skip_special: bool = False) -> str:
    return self._tokenizer.decode([int(i) for i in ids],
                                  skip_special_tokens=skip_special)


def load(path: str | os.PathLike | None, eos_ids: tuple[int, ...] = ()):
  """The tokenizer at PATH, or bytes for '' / None."""
  if not path:
    return Bytes()
  path = epath.Path(path).expanduser()  # A workdir's may be in a bucket.
  if not path.is_file():
    raise UserError(f'tokenizer {str(path)!r} does not exist; give a '
                    "tokenizer.json, or '' for bytes")
  return HuggingFace(path, eos_ids)


# A long text is encoded in pieces of PIECE_CHARS to 2 * PIECE_CHARS
# characters: `tokenizers` holds ~200 bytes per character while it encodes
# (ids, offsets, token strings), so one 60 MB line needed 12 GB at once. With
# 2**16, a 20 MB line peaked at 354 MB of RSS (2**15: 333, 2**18: 424), about
# that of a corpus of short documents plus three copies of the text.
PIECE_CHARS = 1 << 16
PIECE_RULE = ('a text over 2 * piece_chars characters is encoded in pieces '
              'of piece_chars to 2 * piece_chars, each cut just before a '
              'space that follows a character other than whitespace (at '
              '2 * piece_chars where there is none), its special tokens '
              'added once; a tokenizer that puts a space before every text '
              'gets a piece after the first without that space')
_CUT = re.compile(r'(?<=\S) ')  # A space after anything but whitespace.


def pieces(text: str, chars: int) -> Iterator[str]:
  """`text` in pieces, by PIECE_RULE (piece_chars: `chars`); a text of up
  to 2 * chars is one.

  Encoded one by one (`HuggingFace.encode_pieces`), the pieces give the
  whole text's tokens where the tokenizer's words start at such a space:
  splitting at whitespace (WordLevel, Metaspace), by GPT-2's, Llama 3's or
  Qwen's byte-level pattern, or SentencePiece's BPE whose "▁" a normalizer
  puts before every text (Llama 2's). Elsewhere, and at a hard cut (2 * chars
  without such a space), the tokens near a cut may differ.
  """
  start = 0
  while len(text) - start > 2 * chars:
    cut = _CUT.search(text, start + chars, start + 2 * chars)
    end = cut.start() if cut else start + 2 * chars
    yield text[start:end]
    start = end
  yield text[start:]


# End-of-sequence tokens by name, for a tokenizer.json that comes without its
# model's config (Llama 2/Mistral, GPT-2/Qwen, Gemma, Llama 3).
EOS_NAMES = ('</s>', '<|endoftext|>', '<eos>', '<|end_of_text|>')


def of_workdir(workdir: str | os.PathLike):
  """WORKDIR's tokenizer (bytes if it has none), with the end-of-sequence
  ids of the Hugging Face model it came from, or else its named one."""
  workdir = epath.Path(workdir)
  if not (workdir / FILE).exists():
    return Bytes()
  eos = set()
  for name in ('generation_config.json', 'config.json'):
    path = workdir / 'hf' / name
    if path.exists():
      value = json.loads(path.read_text()).get('eos_token_id')
      eos.update(value if isinstance(value, list) else
                 [] if value is None else [value])
  tokenizer = load(workdir / FILE, tuple(sorted(eos)))
  if not eos:
    tokenizer.eos_ids = named_eos(tokenizer,
                                  workdir / 'hf' / 'tokenizer_config.json')
  return tokenizer


def for_text(workdir, mc, config):
  """WORKDIR's tokenizer for reading and writing text (`of_workdir`);
  UserError for a model of token ids whose workdir keeps no tokenizer."""
  tokenizer = of_workdir(workdir)
  if tokenizer.name == 'bytes' and (mc.vocab_size != 256 or
                                    config.data.path.endswith('.bin')):
    raise UserError('this model reads token ids (data.path='
                    f'{config.data.path!r}) and its workdir has no '
                    f'{FILE}; text needs a byte-level model or a tokenizer '
                    f'(copy the one it was trained with to {FILE} there)')
  return tokenizer


def bos_id(tokenizer, workdir: str | os.PathLike) -> int | None:
  """The beginning-of-sequence id, as `transformers` names it: the
  bos_token of the Hugging Face model's tokenizer_config.json, else its
  config.json's bos_token_id, else the special token the tokenizer puts
  before any text; None if none (bytes)."""
  if tokenizer.name == 'bytes':
    return None
  hf = epath.Path(workdir) / 'hf'
  if (hf / 'tokenizer_config.json').exists():
    bos = json.loads((hf / 'tokenizer_config.json').read_text()).get(
        'bos_token')
    bos = bos.get('content') if isinstance(bos, dict) else bos
    if bos and tokenizer.id_of(bos) is not None:
      return tokenizer.id_of(bos)
  if (hf / 'config.json').exists():
    bos = json.loads((hf / 'config.json').read_text()).get('bos_token_id')
    if isinstance(bos, int):
      return bos
  prefix = tokenizer.encode('', special=True)
  return int(prefix[0]) if len(prefix) == 1 else None


def named_eos(tokenizer: HuggingFace, config: epath.Path
              ) -> tuple[int, ...]:
  """(id,) of the EOS token that `config` (a tokenizer_config.json) names,
  or else of the first of EOS_NAMES in the vocabulary; () if none."""
  names = list(EOS_NAMES)
  if config.exists():
    eos = json.loads(config.read_text()).get('eos_token')
    names.insert(0, eos.get('content') if isinstance(eos, dict) else eos)
  for name in names:
    if name and tokenizer.id_of(name) is not None:
      return (tokenizer.id_of(name),)
  return ()


def train_bpe(vocab_size: int, path: str | os.PathLike):
  """Writes PATH: a byte-level BPE tokenizer.json of `vocab_size` tokens
  (<s> = 0, </s> = 1) trained on Python's pydoc topics (nothing is
  downloaded); <s> is prepended to each encoded text. The tokenizer of a
  random-weight Hugging Face checkpoint (`scripts.make_hf_model`), and the
  README's BPE."""
  import pydoc_data.topics  # pylint: disable=import-outside-toplevel
  from tokenizers import (  # pylint: disable=import-outside-toplevel
      Tokenizer, decoders, models, pre_tokenizers, processors, trainers)
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=['<s>', '</s>'],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  tokenizer.train_from_iterator(
      sorted(pydoc_data.topics.topics.values()), trainer)
  tokenizer.post_processor = processors.TemplateProcessing(
      single='<s> $A', special_tokens=[('<s>', 0)])
  tokenizer.save(str(path))
