"""train.prepare_data's speed and memory, against the tokenizer alone.

  python -m scripts.bench_prepare [--sizes_mb=2,20] [--rounds=3] [--out=DIR]

For each input size (JSON Lines of the standard library's .py files, repeated
to the size), takes turns, `--rounds` times, between:
  - prepare: `train.prepare_data.prepare` on the file, reading, splitting,
    encoding and writing the shards;
  - encoder: the `tokenizers` batch encoder alone on the same documents,
    already in memory, in batches of the same size (the limit prepare can
    reach);
each in its own process, which reports its own peak resident memory (VmHWM).
Prints MB/s (input bytes per second of the work, imports excluded), the ratio
prepare / encoder, and peak RSS, which should not grow with the input; writes
OUT/bench_prepare.json.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

from lm import tokenizer as tokenizer_lib
from train import prepare_data
from infra.errors import UserError
from infra.cli import (ArgumentParser, check_output_dir, exit_on_user_error,
                       float_list, positive_int)

BATCH_MB = prepare_data.BATCH_MB  # Both contestants' batch.


def make_input(path: pathlib.Path, megabytes: float):
  """JSON Lines of stdlib files, cycled to `megabytes` of text."""
  from lm import data  # pylint: disable=import-outside-toplevel
  files = data.stdlib_files(pathlib.Path(sysconfig.get_paths()['stdlib']))
  written, target = 0, int(megabytes * 1e6)
  with open(path, 'w') as out:
    while written < target:
      for f in files:
        text = f.read_text(errors='replace')
        out.write(json.dumps({'text': text}) + '\n')
        written += len(text.encode())
        if written >= target:
          break


def child(kind: str, source: str, tokenizer: str, out: str):
  """Runs in the measured process: prints the seconds of the work."""
  if kind == 'prepare':
    start = time.perf_counter()
    prepare_data.prepare([source], tokenizer, out, batch_mb=BATCH_MB,
                         val_fraction=0.1, say=lambda _: None)
  else:
    from lm import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
    encoder = tokenizer_lib.load(tokenizer)
    texts = [json.loads(line)['text'] for line in open(source)]
    start = time.perf_counter()
    batch, size = [], 0
    for text in texts + [None]:
      if text is None or size >= BATCH_MB * 1e6:
        encoder.encode_documents(batch)
        batch, size = [], 0
      if text is not None:
        batch.append(text)
        size += len(text)
  print(time.perf_counter() - start, peak_rss_mb())


def peak_rss_mb() -> float:
  """This process's own peak resident memory: VmHWM of its address space
  (ru_maxrss would include the parent's, inherited across fork and exec)."""
  for line in pathlib.Path('/proc/self/status').read_text().splitlines():
    if line.startswith('VmHWM:'):
      return int(line.split()[1]) / 1024
  raise UserError('no VmHWM in /proc/self/status; run on Linux')


def measure(kind, source, tokenizer, scratch) -> tuple[float, float]:
  """(seconds of the work, peak RSS in MB) of one run in a fresh process."""
  out = scratch / f'out-{time.monotonic_ns()}'
  result = subprocess.run(
      [sys.executable, '-m', 'scripts.bench_prepare', '--child', kind,
       str(source), str(tokenizer), str(out)], capture_output=True, text=True,
      check=False)
  if result.returncode != 0:
    raise UserError(f'{kind} failed: {result.stderr.strip()[-300:]}')
  seconds, rss = result.stdout.split()[-2:]
  return float(seconds), float(rss)


def main():
  if len(sys.argv) > 1 and sys.argv[1] == '--child':
    child(*sys.argv[2:6])
    return
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--sizes_mb', type=float_list, default=[2.0, 20.0])
  parser.add_argument('--rounds', type=positive_int, default=3)
  parser.add_argument('--out', default='out/bench_prepare')
  args = parser.parse_args()
  check_output_dir(args.out)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    scratch = pathlib.Path(tmp)
    tokenizer = scratch / 'tokenizer.json'
    tokenizer_lib.train_bpe(4096, tokenizer)  # The README's BPE.
    for megabytes in args.sizes_mb:
      source = scratch / f'input-{megabytes:g}.jsonl'
      make_input(source, megabytes)
      nbytes = sum(len(json.loads(line)['text'].encode())
                   for line in open(source))
      runs = {'prepare': [], 'encoder': []}
      for _ in range(args.rounds):  # Taking turns.
        for kind in runs:
          runs[kind].append(measure(kind, source, tokenizer, scratch))
      row = {'megabytes': nbytes / 1e6, 'rounds': args.rounds}
      for kind, results in runs.items():
        row[f'{kind}_mb_per_s'] = float(np.median(
            [nbytes / 1e6 / seconds for seconds, _ in results]))
        row[f'{kind}_peak_rss_mb'] = max(rss for _, rss in results)
      row['ratio'] = row['prepare_mb_per_s'] / row['encoder_mb_per_s']
      rows.append(row)
      print(f'{row["megabytes"]:.1f} MB: prepare {row["prepare_mb_per_s"]:.2f}'
            f' MB/s, encoder alone {row["encoder_mb_per_s"]:.2f} MB/s, ratio '
            f'{row["ratio"]:.2f}; peak RSS prepare '
            f'{row["prepare_peak_rss_mb"]:,.0f} MB, encoder '
            f'{row["encoder_peak_rss_mb"]:,.0f} MB', flush=True)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'bench_prepare.json').write_text(json.dumps(rows, indent=1))
  print(f'wrote {out}/bench_prepare.json')


if __name__ == '__main__':
  exit_on_user_error(main)
