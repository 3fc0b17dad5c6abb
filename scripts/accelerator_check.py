"""The one command to run when a GPU or TPU machine is at hand.

  pip install -e '.[cuda,test,bench]'   # or '.[tpu,test]' on a TPU VM
  python -m scripts.accelerator_check --out=out/accelerator

In under 10 minutes on one GPU or TPU:
  1. the accelerator and attention tests, on the device (pytest);
  2. the attention benchmark in bfloat16: causal, B=4, N=16, H=128,
     T = 2048 and 8192, K = 16, 4, 1; ours (whatever `implementation=None`
     picks there: splash on TPU, cuDNN on GPU) against jax.nn's XLA and cuDNN
     paths and PyTorch's SDPA where installed; forward and forward+backward,
     ms and TFLOP/s;
  3. gqa_base trained for --steps steps: median tokens/s and MFU against the
     chip's datasheet peak;
  4. decode of gqa_base-shaped models (K = 12, 4, 1) against the HBM
     bandwidth roofline measured in the same run.
Writes OUT/accelerator.md (a section for BENCHMARKS.md) and accelerator.json.
--quick shrinks every part to seconds (the test suite runs it on CPU).
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from attention import core, dot_product_attention
from studies import report, timing
from lm import config_lib, flops
from train import loop
from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       positive_int)
from train.metrics import read_metrics

REPO = pathlib.Path(__file__).parent.parent
TESTS = ['tests/test_accelerators.py', 'tests/test_core.py',
         'tests/test_blockwise.py', 'tests/test_module.py']


def run_tests(quick: bool, timeout: float | None = None,
              log: pathlib.Path | None = None) -> dict:
  """pytest on the device; {'summary': its closing line, 'returncode'}.

  timeout: seconds after which pytest is stopped (the summary says so and
  the return code is 124), so a lease of minutes still reaches the
  benchmarks. log: where pytest's whole output goes (the failures' names
  and reasons, -rfE).

  The tests live in the repository, not in the installed package: from an
  install without them this part is skipped, and the summary says so."""
  if not all((REPO / t).exists() for t in TESTS):
    return {'summary': f'skipped: no tests in {REPO} (an installed package; '
                       'run from a clone of the repository to include them)',
            'returncode': 0}
  # -o addopts= drops the project's two-worker default (one process, or four
  # sharing a GPU); the slow tests too (on CPU they are slow for compiling many programs), but
  # not the one that runs this command itself.
  args = [sys.executable, '-m', 'pytest', '-q', '-rfE', '-o', 'addopts=',
          '-k',
          'not prepared_device_command', *TESTS]
  if jax.default_backend() == 'gpu':  # Workers share the card (and its
    args[3:3] = ['-n', '4']           # 16 host cores compile in parallel).
  if quick:  # One test, to check the plumbing.
    args = args[:-len(TESTS) - 2] + ['-k', 'naming_them_rank',
                                     'tests/test_core.py']
  # This process holds JAX's usual 75% of the card: the workers take what
  # they use of the rest. (Turning preallocation off here instead left the
  # gqa_base step unable to get its 39 GiB of temporaries on an H200 after
  # the attention benchmark, 2026-12-04.)
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE='false')
  try:
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True,
                            timeout=timeout, env=env)
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ''
    if log:
      log.write_text(out)
    return {'summary': f'stopped after {timeout:.0f} s (--tests_timeout); '
                       f'its last output: {out.strip()[-300:]!r}',
            'returncode': 124}
  if log:
    log.write_text(result.stdout + result.stderr)
  lines = result.stdout.strip().splitlines()
  return {'summary': lines[-1] if lines else result.stderr[-500:],
          'returncode': result.returncode}


def bench_attention_bf16(lengths, kv_heads, repeats, B=4, N=16, H=128):
  on_gpu = jax.default_backend() == 'gpu'
  torch_sdpa = _torch_cuda_sdpa() if on_gpu else None
  rows = []
  for T in lengths:
    for K in kv_heads:
      keys = jax.random.split(jax.random.key(T + K), 3)
      q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
      k = jax.random.normal(keys[1], (B, T, K, H), jnp.bfloat16)
      v = jax.random.normal(keys[2], (B, T, K, H), jnp.bfloat16)
      peers = {'ours': lambda q, k, v: dot_product_attention(
          q, k, v, is_causal=True),
               'jax.nn xla': lambda q, k, v: jax.nn.dot_product_attention(
                   q, k, v, is_causal=True, implementation='xla')}
      if on_gpu and core.cudnn_available():
        peers['jax.nn cudnn'] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation='cudnn')
      for backward in (False, True):
        contestants = {}
        for name, fn in peers.items():
          run = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(
              jnp.float32).sum(), argnums=(0, 1, 2)) if backward else fn)
          try:
            jax.block_until_ready(run(q, k, v))
          except Exception as e:  # pylint: disable=broad-except
            if name == 'ours':
              raise  # Our own contestant must run; a peer may refuse.
            print(f'  {name} T={T} K={K}: {type(e).__name__}: {e}'[:200])
            continue
          contestants[name] = lambda run=run: run(q, k, v)
        if torch_sdpa:
          contestants['torch sdpa'] = torch_sdpa(q, k, v, backward)
        times = timing.median_times(contestants, repeats)
        work = flops.attention_flops(B, T, N, H, backward)
        row = {'T': T, 'K': K, 'pass': 'fwd+bwd' if backward else 'fwd',
               'ms': {n: t * 1e3 for n, t in times.items()},
               'tflops': {n: work / t / 1e12 for n, t in times.items()}}
        rows.append(row)
        print(f'T={T} K={K} {row["pass"]}: ' + '  '.join(
            f'{n} {t:.2f} ms' for n, t in row['ms'].items()), flush=True)
  return rows


def _torch_cuda_sdpa():
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None

  def make(q, k, v, backward):
    tq, tk, tv = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(
        'cuda', torch.bfloat16).transpose(1, 2).contiguous().requires_grad_(
            backward) for x in (q, k, v))

    def run():
      out = torch.nn.functional.scaled_dot_product_attention(
          tq, tk, tv, is_causal=True, enable_gqa=True)
      if backward:
        out.backward(torch.ones_like(out))
      torch.cuda.synchronize()
    return run
  return make


def train_base(out: pathlib.Path, steps: int, quick: bool) -> dict:
  config = config_lib.load('tiny' if quick else 'gqa_base')
  config.train.update(steps=steps, warmup_steps=max(1, steps // 10),
                      log_every=max(1, steps // 20), eval_every=steps,
                      checkpoint_every=steps)
  workdir = out / 'train_gqa_base'
  start = time.perf_counter()
  record = loop.train_and_evaluate(config, str(workdir))
  metrics = read_metrics(workdir)[1:]  # The first window has warm-up steps.
  tokens = [m['tokens_per_sec'] for m in metrics] or [record['tokens_per_sec']]
  mfu = [m['mfu'] for m in metrics] or [record['mfu']]
  peak, source = flops.peak_flops()
  return {'config': 'tiny' if quick else 'gqa_base', 'steps': steps,
          'tokens_per_sec': float(np.median(tokens)),
          'mfu': float(np.median(mfu)), 'peak_flops': peak,
          'peak_source': source, 'eval_loss': record.get('eval_loss'),
          'seconds': time.perf_counter() - start}


def decode_roofline(quick: bool, repeats: int) -> dict:
  config = config_lib.load('tiny' if quick else 'gqa_base')
  heads = config.model.num_heads
  batch, context = (2, 16) if quick else (64, 1024)
  bandwidth = timing.read_bandwidth(repeats)
  peak = flops.peak_flops()[0]
  rows = []
  for K in sorted({heads, max(1, heads // 4), 1}, reverse=True):
    config.model.num_kv_heads = K
    mc = config_lib.model_config(config)
    seconds = timing.decode_step_seconds(mc, batch, context, repeats)
    roofline = flops.decode_roofline_tokens_per_sec(
        mc, batch, context, bandwidth, peak)['roofline']
    rows.append({'K': K, 'batch': batch, 'context': context,
                 'tokens_per_sec': batch / seconds,
                 'roofline_tokens_per_sec': roofline})
    print(f'decode K={K}: {batch / seconds:,.0f} tokens/s, roofline '
          f'{roofline:,.0f}', flush=True)
  return {'bandwidth': bandwidth, 'rows': rows}


def markdown(env, tests=None, attention=None, train=None, decode=None
             ) -> str:
  """BENCHMARKS.md's section; a part not (yet) measured is said so."""
  device = f'{env["device_kind"]} ({env["platform"]})'
  lines = [f'## On {device}', '',
           f'`python -m scripts.accelerator_check` on {env["date"]}: '
           f'{env["devices"]} device(s), jax {env["jax"]}, cuDNN at trace '
           f'time: {env["cudnn"]}; `implementation=None` chose '
           f'{env["chosen"]} for causal bf16 training shapes.', '']
  missing = '(not measured: the run stopped before this part)'
  lines += [f'Tests on the device: {tests["summary"] if tests else missing}.',
            '']
  if attention:
    names = list(dict.fromkeys(n for r in attention for n in r['ms']))
    # A peer that refused a row (out of memory): '-'.
    lines += report.table(
        ['T', 'K', 'pass', *(f'{n} ms (TFLOP/s)' for n in names)],
        ([r['T'], r['K'], r['pass'], *(
            f'{r["ms"][n]:.2f} ({r["tflops"][n]:.1f})' if n in r['ms']
            else '-' for n in names)] for r in attention))
  else:
    lines.append(f'Attention benchmark: {missing}.')
  if train:
    lines += ['', f'Training {train["config"]} for {train["steps"]} steps: '
              f'{train["tokens_per_sec"]:,.0f} tokens/s, MFU '
              f'{100 * train["mfu"]:.1f}% of '
              f'{train["peak_flops"] / 1e12:,.1f} TFLOP/s '
              f'({train["peak_source"]}).']
  else:
    lines += ['', f'Training: {missing}.']
  if decode:
    share = lambda r: r['tokens_per_sec'] / r['roofline_tokens_per_sec']
    lines += ['', f'Decode (read bandwidth measured '
              f'{decode["bandwidth"] / 1e9:.0f} GB/s):', '', *report.table(
                  ['K', 'batch', 'context', 'tokens/s', 'roofline', 'share'],
                  ([r['K'], r['batch'], r['context'],
                    f'{r["tokens_per_sec"]:,.0f}',
                    f'{r["roofline_tokens_per_sec"]:,.0f}',
                    f'{100 * share(r):.0f}%']
                   for r in decode['rows']))]
  else:
    lines += ['', f'Decode: {missing}.']
  return '\n'.join(lines) + '\n'


def main():
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--out', required=True)
  parser.add_argument('--steps', type=positive_int, default=300)
  parser.add_argument('--repeats', type=positive_int, default=5)
  parser.add_argument('--tests_timeout', type=positive_int, default=None,
                      help='seconds the device tests may take (default: no '
                      'limit); then the benchmarks run regardless')
  parser.add_argument('--quick', action='store_true',
                      help='tiny sizes: checks the command itself, on CPU too')
  args = parser.parse_args()
  check_output_dir(args.out, new=True)  # Its training run would resume.
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  device = jax.devices()[0]
  probe = jnp.zeros((1, 2048, 16, 128), jnp.bfloat16)
  call = core._Call(probe, probe, probe, None, True, 1.0, None, None)  # pylint: disable=protected-access
  env = {'date': time.strftime('%Y-%m-%d'), 'platform': device.platform,
         'device_kind': device.device_kind, 'devices': jax.device_count(),
         'jax': jax.__version__, 'host': platform.node(),
         'cudnn': core.cudnn_available(),
         'chosen': core.choose({'gpu': 'cuda'}.get(device.platform,
                                                  device.platform), call)}
  print(json.dumps(env), flush=True)
  parts = {'env': env}

  def save(name, value):
    """Each part is written as soon as it is measured: a run cut short (a
    lease ending) keeps what it had."""
    parts[name] = value
    (out / 'accelerator.json').write_text(json.dumps(parts, indent=1))
    (out / 'accelerator.md').write_text(markdown(**parts))

  tests = run_tests(args.quick, args.tests_timeout, out / 'tests.log')
  save('tests', tests)
  print(f'tests: {tests["summary"]}', flush=True)
  save('attention', bench_attention_bf16(
      [256] if args.quick else [2048, 8192],
      [2, 1] if args.quick else [16, 4, 1],
      1 if args.quick else args.repeats,
      **(dict(B=1, N=2, H=16) if args.quick else {})))
  save('train', train_base(out, 4 if args.quick else args.steps, args.quick))
  save('decode', decode_roofline(args.quick,
                                 1 if args.quick else args.repeats))
  print(f'wrote {out}/accelerator.md and accelerator.json')
  if tests['returncode'] != 0:
    sys.exit(1)


if __name__ == '__main__':
  exit_on_user_error(main)
