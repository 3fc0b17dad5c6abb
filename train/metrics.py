"""What a run tells its user: a progress bar or log lines, metrics.jsonl, TensorBoard.

In a bucket workdir both files are written locally and uploaded whole
(`storage.Staged`): every 30 s, and completely before each checkpoint, so a
resumed run's metrics.jsonl holds every step up to its checkpoint."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

from etils import epath

from infra import storage
from infra.errors import UserError
from infra.progress import duration


class MetricsWriter:
  """Writes WORKDIR/metrics.jsonl and TensorBoard events; shows progress.

  On a terminal, progress is one line redrawn in place on stderr; otherwise
  (a log file, CI) each logged step is a plain line on stdout.
  """

  def __init__(self, workdir: str | epath.Path, total_steps: int, *,
               enabled: bool = True,
               resume_step: int = 0):
    self.enabled = enabled
    self.total_steps = total_steps
    self.interactive = sys.stderr.isatty()
    self._first_log = None  # (time, step): the ETA counts from here, after
    # compilation, which would otherwise dominate a short (resumed) run.
    if not enabled:
      return
    self._staged = storage.Staged(storage.path(workdir),
                                  seed=('metrics.jsonl',))
    path = self._staged.folder / 'metrics.jsonl'
    _truncate_after(path, resume_step)  # Steps past the checkpoint rerun.
    self._jsonl = path.open('a')
    self._tb = _summary_writer(self._staged.folder / 'tensorboard')

  def log(self, step: int, metrics: dict, *, durable: bool = False):
    """Appends a record; durable: in the workdir before this returns (a
    bucket's copy is otherwise at most 30 s behind)."""
    if not self.enabled:
      return
    record = {'step': step, **{k: _plain(v) for k, v in metrics.items()}}
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    for name, value in record.items():
      if name != 'step' and isinstance(value, (int, float)):
        self._tb.add_scalar(name, value, step)
    self._tb.flush()
    self._staged.upload(unless_recent=not durable)
    self._show(step, record)

  def sync(self):
    """metrics.jsonl and the events, complete in the workdir."""
    if self.enabled:
      self._jsonl.flush()
      self._tb.flush()
      self._staged.upload()

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
      self._staged.close()

  def _show(self, step, record):
    now = time.perf_counter()
    if self._first_log is None:
      self._first_log = (now, step)
      seconds_per_step = record['step_time']
    else:
      seconds_per_step = (now - self._first_log[0]) / (step - self._first_log[1])
    eta = seconds_per_step * (self.total_steps - step)
    parts = [f'step {step}/{self.total_steps}', f'loss {record["loss"]:.4f}']
    if 'eval_loss' in record:
      parts.append(f'eval {record["eval_loss"]:.4f}')
      if 'eval_bpb' in record:
        parts.append(f'({record["eval_bpb"]:.3f} bits/byte)')
    parts += [f'{record["tokens_per_sec"]:,.0f} tok/s',
              f'mfu {100 * record["mfu"]:.1f}%', f'ETA {duration(eta)}']
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


def read_metrics(workdir: str | epath.Path) -> list[dict]:
  return _records(storage.path(workdir) / 'metrics.jsonl')


def _records(path: epath.Path | pathlib.Path) -> list[dict]:
  """The records of a metrics.jsonl; a partial last line (a kill mid-write)
  is dropped, an unreadable line elsewhere is an error."""
  lines = path.read_text().splitlines()
  records = []
  for number, line in enumerate(lines, 1):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      if number < len(lines):
        raise UserError(f'{path} line {number} is not JSON ({line[:40]!r}); '
                        'remove or repair that line and rerun') from None
  return records


def left_range_at(records: list[dict], step: int | None = None,
                  tolerance: float = 0.25, floor: float = 0.1) -> int | None:
  """The first logged step whose training loss left its running range, or
  `step` (a non-finite one) if none did before it.

  Out of range: not finite, or above the lowest loss logged before it by
  more than max(tolerance x that loss, floor) nats; the noise of a healthy
  run stays well inside that, a diverging one leaves it at once.
  """
  lowest = math.inf
  for record in records:
    loss = record.get('loss')
    if step is not None and record['step'] >= step:
      break
    if loss is None:
      continue
    if not math.isfinite(loss) or loss > lowest + max(tolerance * lowest,
                                                      floor):
      return record['step']
    lowest = min(lowest, loss)
  return step


def _summary_writer(folder):
  """tensorboardX's SummaryWriter, imported without PyTorch. tensorboardX
  imports torch, when installed, only to accept its tensors (these scalars
  are floats), and that import took 1-2 s of every run's start: a third of
  a test's tiny run."""
  if 'torch' in sys.modules:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  else:
    sys.modules['torch'] = None  # `import torch` raises ImportError.
    try:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    finally:
      del sys.modules['torch']
  return SummaryWriter(str(folder))


def _truncate_after(path: pathlib.Path, step: int):
  """Drops the records past `step` (the resumed checkpoint): they rerun."""
  if path.exists():
    kept = [r for r in _records(path) if r.get('step', math.inf) <= step]
    tmp = path.with_name(f'.{path.name}.tmp')
    tmp.write_text(''.join(json.dumps(r) + '\n' for r in kept))
    tmp.replace(path)


def _plain(value):
  value = float(value) if hasattr(value, 'dtype') else value
  return value
