"""Training-step benchmark: `train.main` against the same model in PyTorch.

  python -m scripts.bench_train [--configs=gqa_small,mha_small,mqa_small]
      [--rounds=3] [--steps=25] [--warmup=5] [--no_compile] [--in_process]
      [--json=out.json] [--markdown=BENCHMARKS.md]
      (pip install -e '.[bench]' for torch)

Contestants, per config:
  ours           `python -m train.main --config=NAME` as users run it, every
                 step logged (log_every=1): its step_time from metrics.jsonl,
                 which counts everything between two steps' results (the
                 data feed, the loop's host work, the metrics fetch)
  torch eager    `TorchTransformer`, the same network built from the same
                 config (parameter count asserted equal, logits checked equal
                 on our parameters by tests/test_scripts.py): SDPA with
                 enable_gqa, AdamW(fused=True) with the same hyperparameters
                 and decay mask, global-norm clipping; a loop that makes
                 each batch from the same data and fetches each loss
  torch compile  the same, forward and backward under torch.compile

Each contestant runs --steps steps in a process of its own (no two
frameworks' thread pools in one process), taking turns round after round so
that all see the same machine load (a shared 2-core VM drifts up to 1.5x); a
round's time is the median step after --warmup steps (compilation). Prints a
table of median tokens/s and ours/peer ratios, with the spread over rounds;
--json and --markdown write them.

--in_process times the compiled step alone instead (`loop.setup`'s
(state, batch) -> state, and the two torch steps), all in this process, each
round --steps steps after a warm-up: the step without the loop around it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from studies import report, timing
from lm import config_lib, flops, sharding
from train import loop
from train import metrics as metrics_lib
from lm import model as model_lib
from infra.errors import UserError
from infra.cli import ArgumentParser, exit_on_user_error
from infra.cli import positive_int

try:
  import torch
  from torch import nn as tnn
  from torch.nn import functional as F
except ImportError:  # Only the torch contestants need it.
  torch = None


class TorchTransformer(tnn.Module if torch else object):
  """`lm.model.Transformer` in PyTorch, for the default conventions.

  Gemma's: embeddings times √D, RMSNorm by 1 + scale, tanh-GELU gated MLP,
  half-split RoPE, untied or tied output. Weights are kept in our layouts
  ([D, N·H] projections, x @ W) so that `load_params` copies them directly.
  """

  def __init__(self, mc):
    super().__init__()
    refusal = self.refusal(mc)
    if refusal:
      raise UserError(refusal)
    self.mc = mc
    D, N, K, H, Fd = (mc.d_model, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                      mc.mlp_dim)
    zeros = lambda *shape: tnn.Parameter(torch.zeros(*shape))
    self.embed = zeros(mc.vocab_size, D)
    self.layers = tnn.ModuleList()
    for _ in range(mc.num_layers):
      layer = tnn.Module()
      layer.attention_norm, layer.mlp_norm = zeros(D), zeros(D)
      layer.query, layer.key, layer.value = (
          zeros(D, N * H), zeros(D, K * H), zeros(D, K * H))
      layer.out = zeros(N * H, D)
      layer.gate, layer.up, layer.down = zeros(D, Fd), zeros(D, Fd), zeros(Fd, D)
      self.layers.append(layer)
    self.final_norm = zeros(D)
    self.unembed = None if mc.tie_embeddings else zeros(D, mc.vocab_size)
    inv_freq = 1.0 / mc.rope_base ** (torch.arange(0, H, 2).float() / H)
    angle = torch.arange(mc.max_len).float()[:, None] * inv_freq  # [T, H/2]
    self.register_buffer('cos', angle.cos(), persistent=False)
    self.register_buffer('sin', angle.sin(), persistent=False)
    with torch.no_grad():  # Our initialisers, for a realistic first loss.
      tnn.init.normal_(self.embed, std=1.0)
      for layer in self.layers:
        for name in ('query', 'key', 'value', 'out', 'gate', 'up', 'down'):
          w = getattr(layer, name)
          tnn.init.trunc_normal_(w, std=w.shape[0] ** -0.5)
      if self.unembed is not None:
        tnn.init.normal_(self.unembed, std=0.02)

  @staticmethod
  def refusal(mc) -> str | None:
    """Why this peer cannot build `mc` (a ModelConfig), or None."""
    unsupported = [name for name, on in (
        ('local_window', mc.local_window), ('logits_soft_cap', mc.logits_soft_cap),
        ('fused_qkv', mc.fused_qkv), ('qkv_bias', mc.qkv_bias),
        ('qk_norm', mc.qk_norm), ('rope_scaling', mc.rope_scaling),
        ('mlp_activation=silu', mc.mlp_activation != 'gelu_tanh'),
        ('norm_scale_offset!=1', mc.norm_scale_offset != 1.0),
        ('embed_scale=False', not mc.embed_scale),
        ('use_rope=False', not mc.use_rope),
        ('learned_positions', mc.learned_positions),
        ('tied_logits_scale', mc.tie_embeddings and mc.tied_logits_scale),
        ('kv_share', mc.kv_share != 1), ('post_norms', mc.post_norms),
        ('final_logits_soft_cap', mc.final_logits_soft_cap),
        ('query_pre_attn_scalar', mc.query_pre_attn_scalar not in (
            None, mc.head_dim)),
        ('dtype', np.dtype(mc.dtype) != np.float32)) if on]
    if unsupported:
      return (f'the PyTorch peer does not build {", ".join(unsupported)}; '
              'benchmark a config with the default conventions')
    return None

  def _norm(self, x, scale):
    eps = self.mc.norm_eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + scale)

  def _rope(self, x):  # [B, heads, T, H]
    T = x.shape[2]
    cos, sin = self.cos[:T], self.sin[:T]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

  def forward(self, tokens_BT):
    mc = self.mc
    B, T = tokens_BT.shape
    N, K, H = mc.num_heads, mc.num_kv_heads, mc.head_dim
    x = self.embed[tokens_BT] * torch.tensor(mc.d_model ** 0.5)
    for layer in self.layers:
      h = self._norm(x, layer.attention_norm)
      heads = lambda w, n: (h @ w).view(B, T, n, H).transpose(1, 2)
      q = self._rope(heads(layer.query, N))
      k = self._rope(heads(layer.key, K))
      v = heads(layer.value, K)
      o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=K != N)
      x = x + o.transpose(1, 2).reshape(B, T, N * H) @ layer.out
      h = self._norm(x, layer.mlp_norm)
      x = x + (F.gelu(h @ layer.gate, approximate='tanh') * (h @ layer.up)
               ) @ layer.down
    x = self._norm(x, self.final_norm)
    return x @ (self.embed.T if self.unembed is None else self.unembed)

  def load_params(self, params):
    """Copies our (unboxed, scanned) parameters in."""
    mc = self.mc
    as_t = lambda a: torch.from_numpy(np.array(a, np.float32))
    with torch.no_grad():
      self.embed.copy_(as_t(params['embed']['embedding']))
      self.final_norm.copy_(as_t(params['final_norm']['scale']))
      if self.unembed is not None:
        self.unembed.copy_(as_t(params['unembed']['kernel']))
      for i, layer in enumerate(self.layers):
        p = (jax.tree.map(lambda x, i=i: x[i], params['layers'])
             if mc.scan_layers else params[f'layers_{i}'])
        a = p['attention']
        layer.attention_norm.copy_(as_t(p['attention_norm']['scale']))
        layer.mlp_norm.copy_(as_t(p['mlp_norm']['scale']))
        for name in ('query', 'key', 'value'):
          getattr(layer, name).copy_(as_t(a[name]).reshape(mc.d_model, -1))
        layer.out.copy_(as_t(a['out']).reshape(-1, mc.d_model))
        for name in ('gate', 'up', 'down'):
          getattr(layer, name).copy_(as_t(p['mlp'][name]))


def torch_step(model, tc, compile_: bool):
  """(tokens [B, T+1] numpy) -> loss: one AdamW step as `train.loop` takes it."""
  decay = [p for n, p in model.named_parameters() if not n.endswith('norm')]
  no_decay = [p for n, p in model.named_parameters() if n.endswith('norm')]
  opt = torch.optim.AdamW(
      [{'params': decay, 'weight_decay': tc.weight_decay},
       {'params': no_decay, 'weight_decay': 0.0}],
      lr=tc.learning_rate, betas=(tc.b1, tc.b2), fused=True)

  def loss_and_grad(inputs, targets):
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return loss

  if compile_:
    loss_and_grad = torch.compile(loss_and_grad)

  def step(tokens):
    tokens = torch.from_numpy(np.array(tokens, np.int64))
    opt.zero_grad(set_to_none=True)
    loss = loss_and_grad(tokens[:, :-1], tokens[:, 1:])
    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip,
                                   foreach=True)
    opt.step()
    return loss
  return step


class Ours:
  """`train.main`'s compiled step and batches for `config`, in a temp workdir."""

  def __init__(self, config):
    self._tmp = tempfile.TemporaryDirectory()
    mesh = sharding.make_mesh(config.mesh)
    self.run = loop.setup(config, pathlib.Path(self._tmp.name), mesh,
                           is_chief=False)
    self.state, self.step = self.run.state, 0

  def __call__(self):
    self.state, metrics = self.run.step_fn(self.state,
                                           self.run.get_batch(self.step))
    self.step += 1
    return metrics

  def sync(self, metrics):
    jax.block_until_ready(metrics)

  def close(self):
    self.run.checkpointer.close()
    self._tmp.cleanup()


def run_overrides(config, steps: int) -> dict[str, int]:
  """train.main's settings for a timed run of `steps` steps, every one
  logged (a warm-up shortened to fit: the schedule does not change speed)."""
  return {'train.steps': steps, 'train.log_every': 1,
          'train.eval_every': steps, 'train.checkpoint_every': steps,
          'train.warmup_steps': min(config.train.warmup_steps, steps - 1)}


def ours_in_a_process(name: str, config, steps: int) -> list[float]:
  """The step_time of each step of `train.main --config=NAME`, run as a user
  runs it (its own process, a fresh workdir, every step logged)."""
  with tempfile.TemporaryDirectory() as workdir:
    result = subprocess.run(
        [sys.executable, '-m', 'train.main', f'--config={name}',
         f'--workdir={workdir}'] + [
             f'--config.{k}={v}'
             for k, v in run_overrides(config, steps).items()],
        capture_output=True, text=True, check=False)
    if result.returncode:  # Our own contestant failing: shown whole.
      raise RuntimeError(f'train.main --config={name} failed:\n'
                         f'{result.stderr[-3000:]}')
    return [r['step_time'] for r in metrics_lib.read_metrics(workdir)]


def torch_in_a_process(name: str, peer: str, steps: int) -> list[float]:
  """The wall time of each step of `peer` on config NAME, in a process of
  its own (`--worker`)."""
  result = subprocess.run(
      [sys.executable, '-m', 'scripts.bench_train', f'--worker={peer}',
       f'--configs={name}', f'--steps={steps}'],
      capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f'{peer} on {name} failed:\n{result.stderr[-3000:]}')
  return json.loads(result.stdout.strip().splitlines()[-1])['step_times']


def torch_worker(name: str, peer: str, steps: int):
  """Prints {"step_times": [...]}: `peer`'s training loop on config NAME,
  each step from making its batch to fetching its loss."""
  config = config_lib.load(name)
  mc, tc, dc = config_lib.model_config(config), config.train, config.data
  with tempfile.TemporaryDirectory() as workdir:  # Ours' data, as numpy.
    dataset = loop.training_data(config, workdir)
  torch.manual_seed(config.seed)
  step = torch_step(TorchTransformer(mc), tc, compile_=peer == 'torch compile')
  times = []
  for i in range(steps):
    start = time.perf_counter()
    batch = dataset.batch('train', batch_size=tc.batch_size,
                          seq_len=dc.seq_len, shard=0, num_shards=1,
                          seed=config.seed, step=i)
    step(np.asarray(batch)).item()
    times.append(time.perf_counter() - start)
  print(json.dumps({'step_times': times}))


def bench_processes(name, config, args) -> dict:
  """`train.main` and the torch loops, each in its own process, in turns."""
  peers = ['ours'] + ([] if torch is None else ['torch eager'] + (
      [] if args.no_compile else ['torch compile']))
  times = {peer: [] for peer in peers}
  for _ in range(args.rounds):
    for peer in peers:
      steps = (ours_in_a_process(name, config, args.steps)
               if peer == 'ours' else
               torch_in_a_process(name, peer, args.steps))
      times[peer].append(statistics.median(steps[args.warmup:]))
  return _row(name, config, times)


def bench_config(name, config, args) -> dict:
  """The compiled steps alone, taking turns in this process."""
  mc, tc = config_lib.model_config(config), config.train
  ours = Ours(config)
  contestants = {'ours': (ours, ours.sync)}
  if torch is not None:
    torch.manual_seed(config.seed)
    for peer, compile_ in (('torch eager', False), ('torch compile', True)):
      if compile_ and args.no_compile:
        continue
      model = TorchTransformer(mc)
      n_torch = sum(p.numel() for p in model.parameters())
      n_ours = sum(x.size for x in jax.tree.leaves(ours.state.params))
      if n_torch != n_ours:
        raise AssertionError(f'{peer}: {n_torch:,} parameters, ours {n_ours:,}')
      step = torch_step(model, tc, compile_)
      batches = ours.run.get_batch  # The same data, as numpy.
      counter = itertools.count()  # This peer's step number.
      contestants[peer] = (
          lambda step=step, batches=batches, counter=counter: step(
              np.asarray(batches(next(counter)))),
          lambda loss: loss.item())
  times = {peer: [] for peer in contestants}
  for peer, (fn, sync) in contestants.items():  # Warm-up: compile, caches.
    for _ in range(3):
      sync(fn())
  for _ in range(args.rounds):
    for peer, (fn, sync) in contestants.items():
      start = time.perf_counter()
      for _ in range(args.steps):
        out = fn()
      sync(out)
      times[peer].append((time.perf_counter() - start) / args.steps)
  ours.close()
  return _row(name, config, times)


def _row(name, config, times: dict[str, list[float]]) -> dict:
  """Tokens/s and ratios from each contestant's step time per round."""
  mc = config_lib.model_config(config)
  tokens_per_step = config.train.batch_size * config.data.seq_len
  row = {'config': name, 'tokens_per_step': tokens_per_step,
         'params': model_lib.num_params(mc),
         'model_flops_per_token': flops.training_flops_per_token(
             mc, config.data.seq_len)}
  for peer, t in times.items():
    row[peer] = {'step_s_median': statistics.median(t),
                 'tokens_per_s': tokens_per_step / statistics.median(t),
                 'rounds_s': t}
  for peer in times:
    if peer != 'ours':
      ratios = [b / a for a, b in zip(times['ours'], times[peer])]
      row[f'ours/{peer}'] = {
          'median': row['ours']['tokens_per_s'] / row[peer]['tokens_per_s'],
          'min': min(ratios), 'max': max(ratios)}
  return row


def format_rows(rows, env) -> str:
  peers = [p for p in ('torch eager', 'torch compile') if p in rows[0]]
  head = ['config', 'params', 'ours tokens/s',
          *(f'{p} tokens/s' for p in peers),
          *(f'ours / {p} (min-max over rounds)' for p in peers),
          'ours model TFLOP/s', 'ours MFU']
  cells = []
  for r in rows:
    model_flops = r['ours']['tokens_per_s'] * r['model_flops_per_token']
    cells.append(
        [r['config'], f'{r["params"]:,}', f'{r["ours"]["tokens_per_s"]:,.0f}',
         *(f'{r[p]["tokens_per_s"]:,.0f}' for p in peers),
         *(f'{r[f"ours/{p}"]["median"]:.2f} ({r[f"ours/{p}"]["min"]:.2f}-'
           f'{r[f"ours/{p}"]["max"]:.2f})' for p in peers),
         f'{model_flops / 1e12:.3f}',
         f'{100 * model_flops / env["peak_flops"]:.0f}%'])
  return '\n'.join(report.table(head, cells))


def main():
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--configs', default='gqa_small,mha_small,mqa_small')
  parser.add_argument('--rounds', type=positive_int, default=3)
  parser.add_argument('--steps', type=positive_int,
                      help='steps per contestant per round (25; '
                      '--in_process: 10)')
  parser.add_argument('--warmup', type=positive_int, default=5,
                      help='first steps of each process left out')
  parser.add_argument('--no_compile', action='store_true',
                      help='skip the torch.compile contestant')
  parser.add_argument('--in_process', action='store_true',
                      help='time the compiled steps alone, in this process')
  parser.add_argument('--worker', choices=('torch eager', 'torch compile'),
                      help=argparse.SUPPRESS)  # One torch contestant's run.
  parser.add_argument('--json', help='also write the results here')
  parser.add_argument('--markdown', help=f'write the table as the section '
                      f'"{SECTION}" (--in_process: "{STEP_SECTION}") of '
                      'this file (BENCHMARKS.md)')
  args = parser.parse_args()
  args.steps = args.steps or (10 if args.in_process else 25)
  if args.worker:
    return torch_worker(args.configs, args.worker, args.steps)
  if not args.in_process and args.steps <= args.warmup:
    raise UserError(f'--steps={args.steps} must exceed --warmup='
                    f'{args.warmup}: the warm-up steps are left out')
  env = environment(args)
  print(json.dumps(env), flush=True)
  configs = checked_configs(args)
  rows = []
  for name, config in configs.items():
    rows.append((bench_config if args.in_process else bench_processes)(
        name, config, args))
    print(format_rows(rows[-1:], env), flush=True)
  table = format_rows(rows, env)
  print(table)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'env': env, 'rows': rows}, f, indent=1)
  if args.markdown:
    timing.replace_section(
        args.markdown, STEP_SECTION if args.in_process else SECTION,
        markdown_section(env, table, args))


def environment(args) -> dict:
  """What every figure is measured on: the machine, the versions, the
  peak FLOP/s the MFU is against, the settings."""
  peak, peak_source = flops.peak_flops()
  return {'machine': f'{platform.processor() or platform.machine()}, '
                     f'{jax.devices()[0].device_kind}',
          'jax': jax.__version__,
          'torch': torch.__version__ if torch else None,
          'torch_threads': torch.get_num_threads() if torch else None,
          'peak_flops': peak, 'peak_source': peak_source,
          'date': time.strftime('%Y-%m-%d'), 'rounds': args.rounds,
          'steps': args.steps, 'in_process': args.in_process}


def checked_configs(args) -> dict:
  """Each of --configs as train.main reads it, checked (and as the timed
  runs will read it, and for the torch peer) before anything is
  measured."""
  configs = {}
  for name in args.configs.split(','):
    configs[name] = config_lib.load(name)
    config_lib.validate(configs[name], batch_shards=1)
    if not args.in_process:
      timed = config_lib.load(name)
      timed.update_from_flattened_dict(run_overrides(timed, args.steps))
      config_lib.validate(timed, batch_shards=1)
    refusal = torch and TorchTransformer.refusal(
        config_lib.model_config(configs[name]))
    if refusal:
      raise UserError(f'{name}: {refusal}')
  return configs


def markdown_section(env: dict, table: str, args) -> str:
  """BENCHMARKS.md's section: the command, the machine, how it was timed,
  then the table."""
  return (
      f'Written by `python -m scripts.bench_train {" ".join(sys.argv[1:])}` '
      f'on {env["date"]}: {env["machine"]}, jax {env["jax"]}, torch '
      f'{env["torch"]} ({env["torch_threads"]} threads), float32. '
      + (f'The compiled steps alone, in one process: each round times '
         f'{args.steps} steps of each contestant in turn' if args.in_process
         else f'As users run them, each contestant in its own process '
         f'({args.steps} steps, every loss fetched), taking turns; a '
         f'round\'s time is the median step after the first '
         f'{args.warmup}')
      + f'; medians over {args.rounds} rounds, the ratio\'s range over the '
      f'rounds in brackets. MFU against {env["peak_source"]} = '
      f'{env["peak_flops"] / 1e9:,.0f} GFLOP/s.\n\n{table}\n')


SECTION = 'Training step: train.main against PyTorch'
STEP_SECTION = 'Training step alone (one process): ours against PyTorch'


if __name__ == '__main__':
  exit_on_user_error(main)
