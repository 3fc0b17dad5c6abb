"""Checkpoints in and out, and to fewer K/V heads (Ainslie et al. 2023).

  python -m train.convert --source=WORKDIR --workdir=NEWDIR --num_kv_heads=K \
      [--method=mean|first|random] [--optimizer=fresh|pooled]
                                            # our checkpoint -> fewer KV heads
  python -m train.convert --from_hf=HF_DIR --workdir=NEWDIR \
      [--num_kv_heads=K --method=mean] [--param_dtype=float32]   # import
  python -m train.convert --source=WORKDIR --to_hf=HF_DIR          # export
  python -m train.convert --source=WORKDIR --to_gguf=OUT.gguf \
      [--dtype=f32|f16|bf16]     # for llama.cpp (train.convert.to_gguf)
  python -m train.convert --source=WORKDIR --workdir=NEWDIR --to_mla \
      --kv_lora_rank=A --qk_rope_head_dim=Y [--latent_groups=G]
                                            # into latent attention (GLA)
  python -m train.convert --source=WORKDIR --workdir=NEWDIR --to_gta \
      [--num_kv_heads=K --method=mean] --qk_rope_head_dim=Y   # tied K/V
  python -m train.convert --source=WORKDIR --workdir=NEWDIR --to_tpa \
      [--num_kv_heads=K --method=mean]      # tensor product attention

`mean` averages the key and value projection heads of each group (the
paper's method), `first` keeps the first of them, `random` re-initialises the
projections. KV head j of the result serves query heads [j·N/K, (j+1)·N/K),
which in the source were served by its KV heads [j·r, (j+1)·r),
r = K_source / K (the `jnp.repeat` head order of
`attention.dot_product_attention`). K = -1 (the default) keeps every head.

NEWDIR gets config.json and a step-0 checkpoint of the parameters (the
optimizer starts fresh), or with --optimizer=pooled of the parameters and the
source's Adam moments, their K/V heads pooled as the weights are (its
schedule restarts); an imported one also gets the tokenizer
(tokenizer.json) and the source's other small files (hf/), which export
copies back out. Uptrain with the workdir's own config, e.g.

  python -m train.main --config=NEWDIR --workdir=NEWDIR \
      --config.train.steps=36 --config.train.learning_rate=1e-4

--to_mla factorises each layer's K/V projections into multi-head latent
attention (`train.convert.to_mla`: partial RoPE on the best qk_rope_head_dim /
(2K) frequency pairs per KV head, a joint SVD of the rest of [W_K | W_V], the
energy kept per layer and the held-out loss before any uptraining in
NEWDIR/convert.json and on stdout; MLA caches A numbers per token and layer
instead of 2·K·H). --latent_groups=G (a divisor of the source's K) converts
into grouped latent attention: each of G latents factorised from its own K/G
KV heads.

--to_gta pools the K/V heads to K as above, then ties them into grouped-tied
attention (`train.convert.to_gta`: each KV head's value becomes its tied
state, the keys' best qk_rope_head_dim / 2 RoPE pairs, averaged over the
heads, the shared RoPE key; K·H + Y numbers per token and layer instead of
2·K·H). It is lossy: convert.json and stdout give the held-out loss before
uptraining. No Hugging Face architecture computes GTA, so --to_hf refuses such
a model.

--to_tpa pools the K/V heads to K as above, then writes them as tensor
product attention of rank K (`train.convert.to_tpa`, the paper's Section 4:
GQA is TPA whose head factors are constant one-hots, held by head-factor
biases beside zero contextual weights; per-head queries, TPA-KV-only). It
is exact: the converted model computes the pooled one's logits, and
uptraining makes the head factors contextual. Its cache holds 2·K·(N + H)
numbers per token and layer for the source's 2·K·H. No Hugging Face
architecture computes TPA, so --to_hf refuses such a model.

Hugging Face import supports Llama 2/3/3.1+, Mistral, Qwen2, Qwen3, Gemma
and DeepSeek-V2/V3 with dense MLPs (`train.convert.hf`,
`train.convert.hf_deepseek`); it streams the safetensors tensor by tensor, so
the peak memory is about one copy of the parameters.
"""

import pathlib
import sys

from infra.cli import run_app
from infra.errors import UserError
from lm import tokenizer as tokenizer_lib
from train.convert import to_gguf
from train.convert.workdirs import (METHODS, convert_to_gta, convert_to_mla,
                                    convert_to_tpa, convert_workdir,
                                    export_hf, import_hf)


def main(argv):
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  del argv
  logging.set_verbosity(logging.WARNING)
  f = flags.FLAGS
  _check_ends(f)
  _check_targets(f)
  if f.to_gguf or f.to_hf or f.from_hf:
    _interop(f)
  else:
    _convert(f)


def _check_ends(f):
  """One source and one destination, and --to_gguf's flags: UserError."""
  if bool(f.source) == bool(f.from_hf):
    raise UserError('give one of --source (a workdir) or --from_hf (a '
                    'Hugging Face folder)')
  given = [f'--{name}' for name in ('workdir', 'to_hf', 'to_gguf')
           if f[name].value]
  if len(given) > 1:
    raise UserError(f'give only one of --workdir, --to_hf, --to_gguf (not '
                    f'{" and ".join(given)})')
  if not given:
    raise UserError('give --workdir (to write a workdir) or, with --source, '
                    '--to_hf (to write a Hugging Face folder) or --to_gguf (a '
                    'GGUF file for llama.cpp)')
  if f.from_hf and (f.to_hf or f.to_gguf):
    raise UserError(f'--from_hf imports into a --workdir, not {given[0]}; '
                    f'import first, then export that workdir with --source')
  ignored = [f'--{name}' for name in (
      'num_kv_heads', 'method', 'seed', 'optimizer', 'param_dtype',
      'kv_lora_rank', 'qk_rope_head_dim', 'latent_groups')
             if f.to_gguf and f[name].present]
  if ignored:
    raise UserError(f'--to_gguf writes the workdir as it is and takes no '
                    f'{", ".join(ignored)}; convert it first (--workdir), '
                    'then export that')
  if f['dtype'].present and not f.to_gguf:
    raise UserError('--dtype is the weights\' dtype in a GGUF file; give it '
                    'with --to_gguf, or leave it out')


def _check_targets(f):
  """One conversion into another layout at most, from a workdir into a
  workdir, with only the flags it uses: UserError."""
  chosen = [f'--{name}' for name in TARGETS if f[name].value]
  if len(chosen) > 1:
    raise UserError(f'give one of {", ".join(chosen)}')
  for name in TARGETS:
    if f[name].value and not (f.source and f.workdir):
      raise UserError(f'--{name} converts --source=WORKDIR into a new '
                      '--workdir')
  ignored = [f'--{name}' for name in ('kv_lora_rank', 'optimizer',
                                      'param_dtype')
             if f.to_gta and f[name].present]
  if ignored:
    raise UserError(f'--to_gta takes no {", ".join(ignored)} (an MLA '
                    'conversion\'s, a GQA conversion\'s or an import\'s); '
                    'leave them out')
  ignored = [f'--{name}' for name in ('kv_lora_rank', 'qk_rope_head_dim',
                                      'latent_groups', 'optimizer',
                                      'param_dtype')
             if f.to_tpa and f[name].present]
  if ignored:
    raise UserError(f'--to_tpa takes no {", ".join(ignored)} (an MLA or GTA '
                    'conversion\'s, a GQA conversion\'s or an import\'s); '
                    'leave them out')
  if f['latent_groups'].present and not f.to_mla:
    raise UserError('--latent_groups splits the latent of --to_mla; give it '
                    'with --to_mla (and --kv_lora_rank), or leave it out')
  ignored = [f'--{name}' for name in ('num_kv_heads', 'method', 'seed',
                                      'optimizer', 'param_dtype')
             if f.to_mla and f[name].present]
  if ignored:  # Those of a GQA conversion or an import: not used here.
    raise UserError(f'--to_mla takes no {", ".join(ignored)} (a GQA '
                    'conversion\'s or an import\'s); leave them out')
  _check_readers(f)
  if f.to_mla and f.kv_lora_rank is None:
    raise UserError('--to_mla needs --kv_lora_rank=A, the latent\'s width '
                    '(at most min(d_model, 2·K·H - --qk_rope_head_dim) for K '
                    'KV heads of H dims: the full rank, every K/V direction '
                    'kept)')


# The flags that only some commands read, and those commands (a K/V-head
# conversion is --source with --workdir and no --to_mla/--to_gta/--to_tpa):
# any other command refuses them rather than ignore them.
_HEADS = 'a K/V-head conversion (--source with --workdir)'
READERS = {
    'num_kv_heads': ('--from_hf', '--to_gta', '--to_tpa', _HEADS),
    'method': ('--from_hf', '--to_gta', '--to_tpa', _HEADS),
    'seed': ('--from_hf', '--to_gta', '--to_tpa', _HEADS),
    'optimizer': (_HEADS,),
    'param_dtype': ('--from_hf',),
    'kv_lora_rank': ('--to_mla',),
    'qk_rope_head_dim': ('--to_mla', '--to_gta'),
    'latent_groups': ('--to_mla',),
    'dtype': ('--to_gguf',),
}


def _command(f) -> str:
  """The command the flags give, named as in READERS."""
  for name in ('to_gguf', 'to_hf', 'from_hf', *TARGETS):
    if f[name].value:
      return f'--{name}'
  return _HEADS


def _check_readers(f):
  """Every flag given is read by the command given: UserError if not."""
  command = _command(f)
  for name, readers in READERS.items():
    if f[name].present and command not in readers:
      with_ = readers[0] if len(readers) == 1 else 'one of those'
      raise UserError(f'--{name} is read only by {" or ".join(readers)}, not '
                      f'by {command}; give it with {with_}, or leave it out')


def _interop(f):
  """--to_gguf, --to_hf or --from_hf: a GGUF or Hugging Face file out, or a
  Hugging Face folder in."""
  if f.to_gguf:
    info = to_gguf.export(f.source, f.to_gguf, f.dtype)
    print(f'wrote {f.to_gguf}: {info["arch"]} ({info["dtype"]}, '
          f'{info["bytes"] / 2**20:,.1f} MiB) for llama.cpp')
    return
  if f.to_hf:
    family = export_hf(f.source, f.to_hf)
    print(f'wrote {f.to_hf}: a {family} checkpoint (Hugging Face format)')
    return
  if f.from_hf:
    family, k_source, k = import_hf(f.from_hf, f.workdir, f.num_kv_heads,
                                    f.method, f.seed, f.param_dtype)
    print(f'wrote {f.workdir}: {family}, {_heads(k_source, k, f.method)}')
    if not (pathlib.Path(f.from_hf) / tokenizer_lib.FILE).exists():
      print(f'warning: {f.from_hf} has no {tokenizer_lib.FILE}, so '
            f'{f.workdir} can train only on token ids (.bin files); to train '
            f'on text, copy the model\'s {tokenizer_lib.FILE} into both',
            file=sys.stderr)


def _convert(f):
  """--source into --workdir: into another layout (TARGETS), or to
  --num_kv_heads."""
  if f.to_gta:
    info = convert_to_gta(f.source, f.workdir, f.num_kv_heads,
                          f.qk_rope_head_dim, f.method, f.seed)
    print(f'wrote {f.workdir}: GTA, '
          f"{_heads(info['source_num_kv_heads'], info['num_kv_heads'], f.method)}"
          f', tied with a RoPE key of {f.qk_rope_head_dim}, '
          f"{info['source_kv_bytes_per_token']:g} -> "
          f"{info['kv_bytes_per_token']:g} KV bytes/token; held-out loss "
          f'{info["source_eval_loss"]:.4f} -> '
          f'{info["eval_loss_before_uptraining"]:.4f} before uptraining')
    return
  if f.to_tpa:
    info = convert_to_tpa(f.source, f.workdir, f.num_kv_heads, f.method,
                          f.seed)
    print(f'wrote {f.workdir}: TPA, '
          f"{_heads(info['source_num_kv_heads'], info['k_rank'], f.method)}"
          f" as factors of rank {info['k_rank']} (one-hot head factors, "
          'per-head queries), '
          f"{info['source_kv_bytes_per_token']:g} -> "
          f"{info['kv_bytes_per_token']:g} KV bytes/token; held-out loss "
          f'{info["source_eval_loss"]:.4f} -> '
          f'{info["eval_loss_before_uptraining"]:.4f} before uptraining')
    return
  if f.to_mla:
    info = convert_to_mla(f.source, f.workdir, f.kv_lora_rank,
                          f.qk_rope_head_dim, f.latent_groups)
    energy = [round(e, 4) for e in info['energy_kept'] if e is not None]
    kind = (f'GLA, latent_groups={f.latent_groups}' if f.latent_groups > 1
            else 'MLA')
    print(f'wrote {f.workdir}: {kind}, kv_lora_rank={f.kv_lora_rank}, '
          f"{info['source_kv_bytes_per_token']:g} -> "
          f"{info['kv_bytes_per_token']:g} KV bytes/token; energy kept per "
          f'layer {energy}; held-out loss {info["source_eval_loss"]:.4f} -> '
          f'{info["eval_loss_before_uptraining"]:.4f} before uptraining')
    return
  k_source, k = convert_workdir(f.source, f.workdir, f.num_kv_heads, f.method,
                                f.seed, f.optimizer)
  print(f'wrote {f.workdir}: {_heads(k_source, k, f.method)}')


# The conversions into another layout, one at a time.
TARGETS = ('to_mla', 'to_gta', 'to_tpa')


def _heads(k_source: int, k: int, method: str) -> str:
  if k == k_source and method != 'random':
    return f'{k} KV heads, copied unchanged'
  return f'{k_source} -> {k} KV heads by {method}'


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('source', None, 'a train.main workdir to read')
  flags.DEFINE_string('from_hf', None, 'a Hugging Face checkpoint folder')
  flags.DEFINE_string('workdir', None, 'new workdir to write')
  flags.DEFINE_string('to_hf', None, 'new Hugging Face folder to write')
  flags.DEFINE_string('to_gguf', None, 'new GGUF file to write (llama.cpp; '
                      'train.convert.to_gguf)')
  flags.DEFINE_enum('dtype', None, list(to_gguf.DTYPES), '--to_gguf: the '
                    "weights' dtype; default the checkpoint's param_dtype")
  flags.DEFINE_integer('num_kv_heads', -1, 'K; -1 keeps all')
  flags.DEFINE_enum('method', 'mean', METHODS, 'how grouped heads become one')
  flags.DEFINE_integer('seed', 0, 'seed of --method=random')
  flags.DEFINE_enum('optimizer', 'fresh', ['fresh', 'pooled'],
                    "a converted workdir's optimizer: fresh, or the source's "
                    'Adam moments pooled like the weights')


  flags.DEFINE_bool('to_mla', False, 'convert --source into multi-head '
                    'latent attention (train.convert.to_mla)')
  flags.DEFINE_integer('kv_lora_rank', None, '--to_mla: the latent\'s width')
  flags.DEFINE_bool('to_gta', False, 'convert --source into grouped-tied '
                    'attention (train.convert.to_gta), its K/V heads pooled to '
                    '--num_kv_heads first')
  flags.DEFINE_bool('to_tpa', False, 'convert --source into tensor product '
                    'attention (train.convert.to_tpa), exactly: its K/V '
                    'heads pooled to --num_kv_heads first, then factors of '
                    'that rank with one-hot head factors')
  flags.DEFINE_integer('qk_rope_head_dim', 0, '--to_mla: RoPE dims kept, 2·r·K (r pairs per KV head); --to_gta: the shared RoPE key\'s width, even, below head_dim; 0 without RoPE')
  flags.DEFINE_integer('latent_groups', 1, '--to_mla: latents of '
                       '--kv_lora_rank / G features, each from K/G source KV '
                       'heads (grouped latent attention); 1: MLA')
  flags.DEFINE_string('param_dtype', '', "imported parameters' dtype; '': "
                      "float32 master weights (the uptraining recipe)")
  run_app(main)


if __name__ == '__main__':
  run()
