"""A workdir as one GGUF file, for llama.cpp (llama-cli, llama-server,
llama-cpp-python, Ollama, LM Studio).

  python -m train.convert --source=WORKDIR --to_gguf=OUT.gguf \
      [--dtype=f32|f16|bf16]

llama.cpp's `llama` and `qwen2` graphs (src/models/llama.cpp, qwen2.cpp)
compute our block with Llama's conventions: x + attention(RMSNorm(x)), then
x + MLP(RMSNorm(x)) with MLP = down(silu(x @ gate) * (x @ up)), RoPE over the
whole head, softmax scale 1/√H, a final RMSNorm and an output matrix (or the
embedding, tied). A model with biases on Q/K/V and N·H = D is written as
qwen2 (Qwen2's), any other as llama. Conventions that differ in form, not in
value, are folded into the weights written:

  norm_scale_offset    RMSNorm by offset + w (Gemma's 1 + w): w + offset
  embed_scale          embeddings times √D: the token embedding times √D
  tied_logits_scale    tied logits over √D: an output matrix, embedding / √D
  tie_embeddings       tied, with either scale: the output written apart
  fused_qkv            separate Q, K and V (`train.convert.hf.unfused`)

and the options llama.cpp cannot compute are refused in one line naming them
(`problems`): layouts other than GQA's (MLA, GLA, GTA), sliding windows that
bind, soft caps, post-norms, QK-norm, learned positions, K/V shared across
layers, another query scale, GELU MLPs, YaRN.

RoPE. Ours rotates feature pairs (i, i + H/2) of each head (the half-split
form, Hugging Face's). llama's graph rotates adjacent pairs (2i, 2i + 1)
(LLAMA_ROPE_TYPE_NORM), so each query and key head's rows (weights and
biases) are written interleaved: row 2i + s is our feature s·H/2 + i
(`interleave_rope`). Every pair is then rotated by the same angle as ours,
and q·k sums the same products. qwen2's graph rotates (i, i + H/2)
(LLAMA_ROPE_TYPE_NEOX): its rows are written as they are. Llama 3.1's
scaling is the rope_freqs tensor (per pair, the divisor of its frequency:
ours unscaled over scaled, `attention.rope.inverse_frequencies`); linear
scaling is rope.scaling.factor.

Tensors: `train.convert.hf.hf_tensors` gives them in Hugging Face's layout
([out, in], which is GGUF's: the writer reverses shapes into ggml's order),
and the gguf package's name map gives llama.cpp's names. Matrices are
written in --dtype (default: the checkpoint's param_dtype), and norms,
biases and rope_freqs in float32, as llama.cpp's converter writes them. The
vocabulary: `train.convert.gguf_vocab`. Everything is checked before
anything is written; the file is written beside OUT and renamed onto it at
the end, so a failure leaves nothing.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile

import ml_dtypes
import numpy as np

from attention.rope import RopeScaling, inverse_frequencies
from infra import storage
from infra.errors import UserError, pip_install
from lm import checkpoint
from train.convert import gguf_vocab, hf

# --dtype -> (numpy dtype, gguf's GGMLQuantizationType and LlamaFileType
# names).
DTYPES = {'f32': (np.float32, 'F32', 'ALL_F32'),
          'f16': (np.float16, 'F16', 'MOSTLY_F16'),
          'bf16': (ml_dtypes.bfloat16, 'BF16', 'MOSTLY_BF16')}
# A checkpoint's param_dtype -> the --dtype that keeps its weights as they are.
DEFAULT_DTYPE = {'float32': 'f32', 'float16': 'f16', 'bfloat16': 'bf16'}


def _gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise UserError(f'--to_gguf needs the gguf package: {pip_install("gguf")}'
                    ) from None
  return gguf


def problems(mc) -> list[str]:
  """The settings of `mc` that llama.cpp's llama and qwen2 graphs do not
  compute, each naming its option ([] if none)."""
  found = []
  if mc.layout.name != 'gqa':  # MLA, GLA, GTA: llama.cpp caches K and V.
    found.append(f'model.attention={mc.layout.name!r} '
                 f'({mc.layout_description()})')
  if 'L' in mc.attention_pattern and (mc.local_window or 0) < mc.max_len:
    found.append(f'model.local_window={mc.local_window} (sliding-window '
                 f'layers, pattern {mc.attention_pattern!r})')
  if mc.mlp_activation != 'silu':
    found.append(f'model.mlp_activation={mc.mlp_activation!r} (their MLP '
                 "is SwiGLU, model.mlp_activation='silu')")
  settings = {
      'model.logits_soft_cap': mc.logits_soft_cap,
      'model.final_logits_soft_cap': mc.final_logits_soft_cap,
      'model.post_norms': mc.post_norms, 'model.qk_norm': mc.qk_norm,
      'model.learned_positions': mc.learned_positions,
      'model.use_rope=False': not mc.use_rope,
      f'model.kv_share={mc.kv_share}': mc.kv_share > 1,
      f'model.query_pre_attn_scalar={mc.query_pre_attn_scalar}':
          mc.query_pre_attn_scalar not in (None, mc.head_dim),
      f'model.rope_scaling.kind={getattr(mc.rope_scaling, "kind", "")!r}':
          mc.rope_scaling is not None and mc.rope_scaling.kind == 'yarn',
  }
  return found + [name for name, given in settings.items() if given]


def architecture(mc) -> str:
  """'qwen2' for Q/K/V biases where its graph's shapes fit (N·H = D), else
  'llama' (which reads such biases too)."""
  fits = mc.num_heads * mc.head_dim == mc.d_model
  return 'qwen2' if mc.qkv_bias and fits else 'llama'


def interleave_rope(w, heads: int):
  """[E·H, ...] rows of E heads, pairs (i, i + H/2) -> pairs (2i, 2i + 1):
  row 2i + s of each head is row s·H/2 + i."""
  return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def rope_factors(mc) -> np.ndarray | None:
  """[H/2] float32 divisors of each pair's frequency (llama.cpp's
  rope_freqs) for Llama 3.1's scaling; None for any other."""
  s = mc.rope_scaling
  if s is None or s.kind != 'llama3':
    return None
  return (inverse_frequencies(mc.head_dim, mc.rope_base)
          / inverse_frequencies(mc.head_dim, mc.rope_base, s)
          ).astype(np.float32)


def fold(name: str, w, mc, arch: str):
  """A tensor in Hugging Face's layout (`train.convert.hf.hf_tensors`' name) as
  llama.cpp computes with it, float32: norms as offset + w, the embedding
  times √D where ours scales it, q/k rows interleaved for llama."""
  w = np.asarray(w, np.float32)
  if name.endswith('layernorm.weight') or name == 'model.norm.weight':
    w = w + np.float32(mc.norm_scale_offset)
  if name == 'model.embed_tokens.weight' and mc.embed_scale:
    w = w * np.float32(mc.d_model ** 0.5)
  heads = {'q_proj': mc.num_heads, 'k_proj': mc.num_kv_heads}
  kind = name.split('.')[-2]
  if arch == 'llama' and kind in heads:
    w = interleave_rope(w, heads[kind])
  return w


def output_matrix(params, mc) -> np.ndarray | None:
  """[V, D] float32: the output written apart from a tied embedding whose
  logits ours scales (tied_logits_scale), or whose embedding it does
  (embed_scale, folded into the token embedding); None where llama.cpp's
  tied output is ours."""
  if not mc.tie_embeddings or not (mc.tied_logits_scale or mc.embed_scale):
    return None
  embedding = np.asarray(params['embed']['embedding'], np.float32)
  if mc.tied_logits_scale:
    return embedding / np.float32(mc.d_model ** 0.5)
  return embedding


def tensors(params, mc, arch: str, dtype: str):
  """{GGUF name: (numpy dtype, shape)}, and a generator of the arrays in
  that order: `params` in llama.cpp's names, layout and dtypes (matrices
  in `dtype`, vectors float32)."""
  gguf = _gguf()
  names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()],
                                   mc.num_layers)
  shapes, hf_arrays = hf.hf_tensors(hf.unfused(params, mc), mc)
  cast = lambda w: w.astype(DTYPES[dtype][0]) if w.ndim == 2 else w
  output = output_matrix(params, mc)  # Made before the writing; one [V, D].
  factors = rope_factors(mc)
  infos = {}
  for name, (_, shape) in shapes.items():
    found = names.get_name(name, try_suffixes=('.weight', '.bias'))
    if found is None:  # A tensor the plan has and llama.cpp would not read.
      raise ValueError(f'{name} has no GGUF name for {arch}')
    infos[found] = (np.dtype(DTYPES[dtype][0] if len(shape) == 2
                             else np.float32), shape)
  extra = {'output.weight': output, 'rope_freqs.weight': factors}
  extra = {name: cast(w) for name, w in extra.items() if w is not None}
  infos |= {name: (w.dtype, w.shape) for name, w in extra.items()}

  def arrays():
    for name, w in hf_arrays:
      yield cast(fold(name, w, mc, arch))
    yield from extra.values()
  return infos, arrays()


def write_metadata(writer, mc, arch: str, dtype: str, name: str):
  """general.* and ARCH.* keys: the shapes, heads, RoPE and norm epsilon."""
  gguf = _gguf()
  writer.add_name(name)
  writer.add_file_type(gguf.LlamaFileType[DTYPES[dtype][2]])
  writer.add_context_length(mc.max_len)
  writer.add_embedding_length(mc.d_model)
  writer.add_block_count(mc.num_layers)
  writer.add_feed_forward_length(mc.mlp_dim)
  writer.add_head_count(mc.num_heads)
  writer.add_head_count_kv(mc.num_kv_heads)
  writer.add_key_length(mc.head_dim)
  writer.add_value_length(mc.head_dim)
  writer.add_rope_dimension_count(mc.head_dim)
  writer.add_rope_freq_base(mc.rope_base)
  writer.add_layer_norm_rms_eps(mc.norm_eps)
  writer.add_vocab_size(mc.vocab_size)
  if isinstance(mc.rope_scaling, RopeScaling) and (
      mc.rope_scaling.kind == 'linear'):
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(mc.rope_scaling.factor)


def export(source: str, out: str, dtype: str | None = None) -> dict:
  """Writes SOURCE's latest parameters and tokenizer as the GGUF file OUT;
  returns {'arch', 'dtype', 'bytes'}."""
  gguf = _gguf()
  if dtype is not None and dtype not in DTYPES:
    raise UserError(f'--dtype={dtype!r}; use one of {", ".join(DTYPES)}')
  target = _check_target(out)
  mc, params, _ = checkpoint.load_workdir(source, '--source')
  found = problems(mc)
  if found:
    raise UserError(f"llama.cpp's llama and qwen2 architectures cannot "
                    f'compute {"; ".join(found)}; only a model without '
                    f'{"it" if len(found) == 1 else "them"} exports as GGUF')
  arch = architecture(mc)
  dtype = dtype or DEFAULT_DTYPE.get(np.dtype(mc.param_dtype).name, 'f32')
  vocab = gguf_vocab.of_workdir(storage.path(source, '--source'),
                                mc.vocab_size)
  infos, arrays = tensors(params, mc, arch, dtype)
  try:
    with _replaced_at_the_end(target) as partial:
      writer = gguf.GGUFWriter(partial, arch)
      try:
        write_metadata(writer, mc, arch, dtype, pathlib.Path(source).name)
        gguf_vocab.write(writer, vocab)
        _write_tensors(gguf, writer, dtype, infos, arrays)
      finally:
        writer.close()
  except OSError as e:  # A full disk, a file size limit, a failing mount.
    raise UserError(f'--to_gguf={out}: writing {target} failed '
                    f'({e.strerror or e}); nothing was left there: free space '
                    'or choose another disk, and rerun') from None
  return {'arch': arch, 'dtype': dtype, 'bytes': target.stat().st_size}


def _write_tensors(gguf, writer, dtype: str, infos, arrays):
  """The header, the keys added so far, and the tensors (`tensors`)."""
  for name, (np_dtype, shape) in infos.items():
    raw = gguf.GGMLQuantizationType[DTYPES[dtype][1]] if (
        np_dtype == np.dtype(ml_dtypes.bfloat16)) else None
    writer.add_tensor_info(name, shape, np_dtype, int(
        np.prod(shape)) * np_dtype.itemsize, raw_dtype=raw)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_ti_data_to_file()
  for array in arrays:
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
      array = array.view(np.uint16)  # Raw BF16: its bits.
    writer.write_tensor_data(array)


def _check_target(out: str) -> pathlib.Path:
  """OUT as a path to create, refused in one line unless it is new and
  its folder writable."""
  storage.refuse_url(out, '--to_gguf')
  target = pathlib.Path(out).expanduser().absolute()
  if target.exists():
    raise UserError(f'--to_gguf={out} exists; give a new file name (or '
                    'remove it)')
  if not target.parent.is_dir() or not os.access(target.parent, os.W_OK):
    raise UserError(f'--to_gguf={out}: cannot write into {target.parent}; '
                    'give a file in a folder you can write to')
  return target


@contextlib.contextmanager
def _replaced_at_the_end(target: pathlib.Path):
  """A temporary file beside TARGET, renamed onto it when the block ends
  well and removed when it does not."""
  try:  # As root os.access passes on /sys and /proc: creating says no.
    fd, partial = tempfile.mkstemp(dir=target.parent,
                                   prefix=f'.{target.name}.', suffix='.partial')
  except OSError as e:
    raise UserError(f'--to_gguf={target}: cannot create a file in '
                    f'{target.parent} ({e.strerror or e}); give a file in a '
                    'folder you can write to') from None
  os.close(fd)
  umask = os.umask(0)
  os.umask(umask)
  try:
    os.chmod(partial, 0o666 & ~umask)  # A new file's mode, not mkstemp's 0600.
    yield partial
    os.replace(partial, target)
  except BaseException:
    os.unlink(partial)
    raise
