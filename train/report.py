"""What a run tells its user: a progress bar or log lines, metrics.jsonl, TensorBoard."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time


class Reporter:
  """Writes WORKDIR/metrics.jsonl and TensorBoard events; shows progress.

  On a terminal, progress is one line redrawn in place on stderr; otherwise
  (a log file, CI) each logged step is a plain line on stdout.
  """

  def __init__(self, workdir: str, total_steps: int, *, enabled: bool = True,
               resume_step: int = 0):
    self.enabled = enabled
    self.total_steps = total_steps
    self.interactive = sys.stderr.isatty()
    self._start = time.perf_counter()
    self._start_step = resume_step
    if not enabled:
      return
    path = pathlib.Path(workdir) / 'metrics.jsonl'
    _truncate_after(path, resume_step)  # Steps past the checkpoint rerun.
    self._jsonl = path.open('a')
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self._tb = SummaryWriter(str(pathlib.Path(workdir) / 'tensorboard'))

  def log(self, step: int, metrics: dict):
    if not self.enabled:
      return
    record = {'step': step, **{k: _plain(v) for k, v in metrics.items()}}
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    for name, value in record.items():
      if name != 'step' and isinstance(value, (int, float)):
        self._tb.add_scalar(name, value, step)
    self._tb.flush()
    self._show(step, record)

  def message(self, text: str):
    if self.enabled:
      if self.interactive:
        sys.stderr.write('\r\033[K')
      print(text, flush=True)

  def close(self):
    if self.enabled:
      if self.interactive:
        sys.stderr.write('\n')
      self._jsonl.close()
      self._tb.close()

  def _show(self, step, record):
    elapsed = time.perf_counter() - self._start
    done = step - self._start_step
    eta = elapsed / done * (self.total_steps - step) if done else math.nan
    parts = [f'step {step}/{self.total_steps}', f'loss {record["loss"]:.4f}']
    if 'eval_loss' in record:
      parts.append(f'eval {record["eval_loss"]:.4f}')
      if 'eval_bpb' in record:
        parts.append(f'({record["eval_bpb"]:.3f} bits/byte)')
    parts += [f'{record["tokens_per_sec"]:,.0f} tok/s',
              f'mfu {100 * record["mfu"]:.1f}%', f'ETA {_duration(eta)}']
    line = '  '.join(parts)
    if self.interactive:
      bar_width = 20
      filled = int(bar_width * step / self.total_steps)
      sys.stderr.write(f'\r\033[K[{"#" * filled}{"." * (bar_width - filled)}] '
                       f'{line}')
      sys.stderr.flush()
      if 'eval_loss' in record:
        sys.stderr.write('\n')
    else:
      print(line, flush=True)


def read_metrics(workdir: str) -> list[dict]:
  path = pathlib.Path(workdir) / 'metrics.jsonl'
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def _truncate_after(path: pathlib.Path, step: int):
  if path.exists():
    kept = [line for line in path.read_text().splitlines()
            if line and json.loads(line)['step'] <= step]
    path.write_text(''.join(line + '\n' for line in kept))


def _plain(value):
  value = float(value) if hasattr(value, 'dtype') else value
  return value


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return '?'
  minutes, seconds = divmod(int(seconds), 60)
  return f'{minutes}:{seconds:02d}'
