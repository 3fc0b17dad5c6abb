"""The JSON-lines command end to end against one request at a time.

  python -m scripts.bench_generate [--config=gqa_small] [--requests=512]
      [--max_new_tokens=176] [--prompt_len=8,64] [--kv_memory=256MiB]
      [--slots=128] [--prefill_chunk=64] [--repeats=2] [--seed=0]
      [--out=out/generate]

A step-0 workdir of --config (random weights: speed does not depend on
them; byte-level, so no end-of-sequence token cuts a request short) and
--requests prompts of printable bytes, lengths uniform in --prompt_len
(seeded). Contestants, taking turns --repeats times:
  serve.generate  `python -m serve.generate` in a process of its own, timed
                  from its start to its exit: loading, compiling and writing
                  OUT included (nothing excluded)
  one at a time   the same requests one after another through
                  `lm.inference.generate` in this process, each shape
                  compiled before its clock starts (compiling excluded)
Both generate every request's --max_new_tokens tokens. The ratio is the
peer's wall time over the command's, per turn (median and range). Writes
generate.json and report.md under --out, with the CPU and its flags.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import numpy as np

from infra import provenance
from studies import timing
from lm import checkpoint, config_lib
from train import loop
from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       int_list, positive_int)
from infra.errors import UserError
from lm.model import Transformer


def command_runner(workdir, prompts_file, out_dir, args):
  """A function running serve.generate once into a fresh OUT, timed from
  the process's start to its exit."""
  runs = iter(range(1 << 30))

  def run() -> dict:
    out = pathlib.Path(out_dir, f'out{next(runs)}.jsonl')
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, '-m', 'serve.generate', f'--workdir={workdir}',
         f'--prompts={prompts_file}', f'--out={out}',
         f'--kv_memory={args.kv_memory}',
         f'--max_new_tokens={args.max_new_tokens}', f'--slots={args.slots}',
         f'--prefill_chunk={args.prefill_chunk}'],
        capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if result.returncode:
      raise RuntimeError(f'serve.generate failed:\n{result.stderr[-3000:]}')
    tokens = sum(len(json.loads(line)['tokens'])
                 for line in out.read_text().splitlines())
    return {'command_seconds': seconds, 'command_tokens': tokens,
            'command_tokens_per_sec': tokens / seconds,
            'command_summary': result.stderr.strip().splitlines()[-2]}
  return run


def alone_runner(mc, params, prompts, new: int):
  """The requests one after another through lm.inference.generate
  (`studies.timing.alone_runner`)."""
  return timing.alone_runner(mc, params, [
      (np.frombuffer(p.encode(), np.uint8).astype(np.int32), new)
      for p in prompts])


def main():
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='gqa_small')
  parser.add_argument('--requests', type=positive_int, default=512)
  parser.add_argument('--max_new_tokens', type=positive_int, default=176)
  parser.add_argument('--prompt_len', type=int_list, default=[8, 64])
  parser.add_argument('--kv_memory', default='256MiB')
  parser.add_argument('--slots', type=positive_int, default=128)
  parser.add_argument('--prefill_chunk', type=positive_int, default=64)
  parser.add_argument('--repeats', type=positive_int, default=2)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default='out/generate')
  args = parser.parse_args()
  check_output_dir(args.out)
  config = config_lib.load(args.config)
  if len(args.prompt_len) != 2:
    raise UserError('--prompt_len must be LOW,HIGH')
  if args.prompt_len[1] + args.max_new_tokens > config.model.max_len:
    raise UserError(f'--prompt_len and --max_new_tokens reach '
                    f'{args.prompt_len[1] + args.max_new_tokens} tokens, past '
                    f'model.max_len ({config.model.max_len}); lower them')
  runs = measure(config, args)
  ratios = [r['speedup'] for r in runs]
  results = {
      'command': 'python -m scripts.bench_generate ' + ' '.join(sys.argv[1:]),
      'commit': provenance.commit(), 'date': time.strftime('%Y-%m-%d'),
      'machine': timing.machine(), 'args': vars(args), 'runs': runs,
      'speedup': float(np.median(ratios)),
      'speedup_range': [min(ratios), max(ratios)]}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'generate.json').write_text(json.dumps(results, indent=1))
  (out / 'report.md').write_text(report_text(results, args))
  print(f'serve.generate is {results["speedup"]:.2f}x one request at a time '
        f'(median of {len(runs)} turns); wrote {out}/generate.json and '
        'report.md')


def measure(config, args) -> list[dict]:
  """The command and the one-at-a-time peer over the same prompts on a
  random model of CONFIG (a step-0 workdir), taking turns --repeats times:
  each turn's numbers and the command's speedup."""
  prompts = timing.ascii_prompts(args)
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=0))
  with tempfile.TemporaryDirectory() as tmp:
    workdir = pathlib.Path(tmp, 'workdir')
    checkpoint.save_params(workdir, params)  # A step-0 workdir.
    (workdir / 'config.json').write_text(config.to_json(indent=2))
    prompts_file = pathlib.Path(tmp, 'prompts.jsonl')
    prompts_file.write_text(''.join(
        json.dumps({'id': i, 'prompt': p}) + '\n'
        for i, p in enumerate(prompts)))
    contestants = [command_runner(workdir, prompts_file, tmp, args),
                   alone_runner(mc, params, prompts, args.max_new_tokens)]
    runs = []
    for turn in range(args.repeats):
      run = {}
      for contestant in contestants:
        run |= contestant()
      run['speedup'] = run['alone_seconds'] / run['command_seconds']
      print(f'turn {turn + 1}: serve.generate {run["command_seconds"]:.1f} s '
            f'({run["command_tokens_per_sec"]:,.0f} tokens/s, everything '
            f'included), one at a time {run["alone_seconds"]:.1f} s: '
            f'{run["speedup"]:.2f}x', flush=True)
      runs.append(run)
  return runs


def report_text(results: dict, args) -> str:
  """report.md: the command, the machine and its load, the speedup."""
  m, runs = results['machine'], results['runs']
  low, high = results['speedup_range']
  return (
      f'# serve.generate against one request at a time\n\n'
      f'`{results["command"]}` at commit {results["commit"]} on '
      f'{results["date"]}; CPU {m["cpu"]} (avx2: {m["avx2"]}, avx512f: '
      f'{m["avx512f"]}), {m["cores"]} cores, load average '
      f'{", ".join(f"{x:.2f}" for x in m["load_average"])} at the end.\n\n'
      f'{args.requests} requests x {args.max_new_tokens} new tokens, '
      f'--kv_memory={args.kv_memory}, --slots={args.slots}: the command '
      f'(everything included) is {results["speedup"]:.2f}x one request at a '
      f'time in wall time (range {low:.2f} to {high:.2f} over '
      f'{len(runs)} turns; the command '
      f'{np.median([r["command_seconds"] for r in runs]):.1f} s, one at a '
      f'time {np.median([r["alone_seconds"] for r in runs]):.1f} s, '
      'medians).\n')


if __name__ == '__main__':
  exit_on_user_error(main)
