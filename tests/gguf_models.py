"""Workdirs and tokenizers that tests/test_gguf.py and test_llama_cpp.py
export: random tiny models with Llama's conventions, and byte-level BPE
tokenizers with each pre-tokenizer llama.cpp names (train.convert.gguf_vocab)."""

import json
import pathlib

from etils import epath
import flax.linen as nn
import jax

from configs import tiny
from lm import config_lib
from lm.model import Transformer
from train import loop
from train.convert import gguf_vocab, workdirs

# A SwiGLU model with Gemma's other conventions (RMSNorm by 1 + w,
# embeddings times √D): what train.convert.to_gguf folds into the weights.
SILU = dict(mlp_activation='silu')
# Llama's conventions throughout.
LLAMA = dict(mlp_activation='silu', norm_scale_offset=0.0, embed_scale=False,
             tied_logits_scale=False)


def tiny_config(**model):
  """`tiny` with `model`'s fields changed (a section's, such as
  rope_scaling or a layout's settings, as a dict)."""
  config = tiny.get_config()
  for name, value in model.items():  # A dict: a section's fields.
    if isinstance(value, dict):
      config.model[name].update(value)
    else:
      config.model[name] = value
  config.data.seq_len = min(config.data.seq_len, config.model.max_len)
  return config


def model_config(**model):
  return config_lib.model_config(tiny_config(**model))


def random_workdir(path: pathlib.Path, seed: int = 0, tokenizer=None,
                   **model):
  """A step-0 workdir of a random `tiny_config(**model)` model;
  tokenizer: a tokenizer.json to copy in. Returns its ModelConfig."""
  config = tiny_config(**model)
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=seed))
  path.mkdir(parents=True)
  if tokenizer is not None:
    (path / 'tokenizer.json').write_bytes(pathlib.Path(tokenizer).read_bytes())
  workdirs._write_step0(epath.Path(path), jax.device_get(params), config, {})  # pylint: disable=protected-access
  return mc


# Name -> the Split regex before ByteLevel (None: ByteLevel's own, GPT-2's)
# and the ignore_merges llama.cpp reads it with.
PRE_TOKENIZERS = {'gpt-2': (None, False)} | {
    name: (pattern, ignore) for pattern, (name, ignore)
    in gguf_vocab.PRE_TOKENIZERS.items()}


def bpe_tokenizer(path: pathlib.Path, pre: str, vocab_size: int = 400):
  """Writes a byte-level BPE tokenizer.json trained on Python's pydoc
  topics with the pre-tokenizer `pre` (a key of PRE_TOKENIZERS); <s> (id
  0, put before every text) and </s> (1) special. Returns PATH."""
  import pydoc_data.topics  # pylint: disable=import-outside-toplevel
  from tokenizers import (Regex, Tokenizer, decoders, models,  # pylint: disable=import-outside-toplevel
                          pre_tokenizers, processors, trainers)
  pattern, ignore_merges = PRE_TOKENIZERS[pre]
  tokenizer = Tokenizer(models.BPE(ignore_merges=ignore_merges))
  if pattern is None:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior='isolated'),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(
      sorted(pydoc_data.topics.topics.values()), trainers.BpeTrainer(
          vocab_size=vocab_size, special_tokens=['<s>', '</s>'],
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
          show_progress=False))
  tokenizer.post_processor = processors.TemplateProcessing(
      single='<s> $A', special_tokens=[('<s>', 0)])
  tokenizer.save(str(path))
  assert json.loads(path.read_text())['model']['type'] == 'BPE'
  return path
