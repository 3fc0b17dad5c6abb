"""How long `serve.generate` takes to its first result, and how much memory it
holds, as the prompt file grows.

  python -m scripts.bench_admission [--config=tiny] [--sizes=1000,10000,100000]
      [--max_new_tokens=4] [--prompt_len=8,24] [--kv_memory=64MiB]
      [--slots=128] [--seed=0] [--out=out/admission]

A step-0 workdir of --config (random weights: the time to a first result
and the memory do not depend on them) and, for each of --sizes, a file of
that many prompts of printable bytes (lengths uniform in --prompt_len,
seeded). Each file is served by `python -m serve.generate` in a process of
its own, to the end, into a fresh OUT. Measured per size: the seconds from
the process's start to the first result line in OUT (loading and compiling
included), the seconds from its stderr's line naming the checkpoint loaded
(every check done, reading begins) to that first result, the whole run, and
the process's peak resident memory (wait4's ru_maxrss). Issue 62's targets:
a first result in under 5 s at every size, and peak memory growing less
than 2x from the smallest size to the largest (requests are read as the
engine has room, never all queued first). Writes admission.json and
report.md under --out, with the CPU, its flags and the load average.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import flax.linen as nn

from train import loop
from lm import checkpoint
from lm import config_lib
from infra import provenance
from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       int_list, int_range, positive_int)
from infra.errors import UserError
from lm.model import Transformer
from studies import timing
from studies.report import table

LOADED = 'generate: '  # serve.generate's first stderr line: the checkpoint.


def serve(workdir, prompts_file, out: pathlib.Path, args) -> dict:
  """One run of serve.generate over PROMPTS_FILE into OUT, watched: its
  first result, its end, its peak memory."""
  stderr_path = out.with_suffix('.stderr')
  with stderr_path.open('w') as stderr:
    start = time.perf_counter()
    process = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, '-m', 'serve.generate', f'--workdir={workdir}',
         f'--prompts={prompts_file}', f'--out={out}',
         f'--kv_memory={args.kv_memory}',
         f'--max_new_tokens={args.max_new_tokens}', f'--slots={args.slots}',
         '--page_size=8'], stdout=subprocess.DEVNULL, stderr=stderr)
    loaded = first = None
    while first is None and process.poll() is None:
      if loaded is None and LOADED in stderr_path.read_text():
        loaded = time.perf_counter() - start
      if out.exists() and out.stat().st_size:
        first = time.perf_counter() - start
      time.sleep(0.005)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
  if os.waitstatus_to_exitcode(status):
    raise RuntimeError('serve.generate failed:\n'
                       + stderr_path.read_text()[-3000:])
  lines = out.read_text().count('\n')
  return {'first_result_s': first, 'loaded_s': loaded,
          'first_after_loaded_s': None if None in (first, loaded)
          else first - loaded, 'seconds': seconds, 'results': lines,
          'peak_rss_mib': usage.ru_maxrss / 1024}  # Linux: KiB.


def main():
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='tiny')
  parser.add_argument('--sizes', type=int_list, default=[1000, 10000, 100000])
  parser.add_argument('--max_new_tokens', type=positive_int, default=4)
  parser.add_argument('--prompt_len', type=int_range, default=[8, 24])
  parser.add_argument('--kv_memory', default='64MiB')
  parser.add_argument('--slots', type=positive_int, default=128)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--out', default='out/admission')
  args = parser.parse_args()
  check_output_dir(args.out)
  config = config_lib.load(args.config)
  if args.prompt_len[1] + args.max_new_tokens > config.model.max_len:
    raise UserError(f'--prompt_len and --max_new_tokens reach '
                    f'{args.prompt_len[1] + args.max_new_tokens} tokens, past '
                    f'model.max_len ({config.model.max_len}); lower them')
  mc = config_lib.model_config(config)
  params = nn.unbox(loop.init_params(Transformer(mc), seed=0))
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    workdir = pathlib.Path(tmp, 'workdir')
    checkpoint.save_params(workdir, params)  # A step-0 workdir.
    (workdir / 'config.json').write_text(config.to_json(indent=2))
    for size in args.sizes:
      prompts_file = pathlib.Path(tmp, f'prompts{size}.jsonl')
      prompts = timing.ascii_prompts(_with(args, requests=size))
      prompts_file.write_text(''.join(
          json.dumps({'id': i, 'prompt': p}) + '\n'
          for i, p in enumerate(prompts)))
      del prompts
      row = {'prompts': size, **serve(workdir, prompts_file,
                                      pathlib.Path(tmp, f'out{size}.jsonl'),
                                      args)}
      print(f'{size:,} prompts: first result {_s(row["first_result_s"])} s '
            f'from the start ({_s(row["first_after_loaded_s"])} s after '
            f'loading), all in {row["seconds"]:.1f} s, peak RSS '
            f'{row["peak_rss_mib"]:,.0f} MiB', flush=True)
      rows.append(row)
  results = {
      'command': 'python -m scripts.bench_admission ' + ' '.join(sys.argv[1:]),
      'commit': provenance.commit(), 'date': time.strftime('%Y-%m-%d'),
      'machine': timing.machine(), 'args': vars(args), 'rows': rows,
      'rss_growth': rows[-1]['peak_rss_mib'] / rows[0]['peak_rss_mib']}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'admission.json').write_text(json.dumps(results, indent=1))
  (out / 'report.md').write_text(report(results))
  print(f'peak RSS grows {results["rss_growth"]:.2f}x from '
        f'{rows[0]["prompts"]:,} to {rows[-1]["prompts"]:,} prompts; wrote '
        f'{out}/admission.json and report.md')


def _s(seconds: float | None) -> str:
  return '-' if seconds is None else f'{seconds:.2f}'


def _with(args, **changes):
  return type(args)(**{**vars(args), **changes})


def report(results: dict) -> str:
  m, args = results['machine'], results['args']
  lines = [
      '# serve.generate: time to the first result and peak memory by the '
      'number of prompts', '',
      f'`{results["command"]}` at commit {results["commit"]} on '
      f'{results["date"]}; CPU {m["cpu"]} (avx2: {m["avx2"]}, avx512f: '
      f'{m["avx512f"]}), {m["cores"]} cores, load average '
      f'{", ".join(f"{x:.2f}" for x in m["load_average"])} at the end. '
      f'--config={args["config"]}, {args["max_new_tokens"]} new tokens a '
      f'prompt, --slots={args["slots"]}, --kv_memory={args["kv_memory"]}.',
      '', *table(
          ('prompts', 'first result (s, from start)',
           'first result (s, after loading)', 'whole run (s)',
           'peak RSS (MiB)'),
          [(f'{r["prompts"]:,}', _s(r['first_result_s']),
            _s(r['first_after_loaded_s']), f'{r["seconds"]:.1f}',
            f'{r["peak_rss_mib"]:,.0f}') for r in results['rows']])]
  lines += ['', f'Peak RSS grows {results["rss_growth"]:.2f}x from the '
            'smallest file to the largest.', '']
  return '\n'.join(lines)


if __name__ == '__main__':
  exit_on_user_error(main)
