"""Progress of a long operation on stderr, in the style of the training bar.

  with Progress('importing', total=nbytes, unit='MB', scale=1e6) as bar:
    for chunk in chunks:
      ...
      bar.advance(len(chunk))

On a terminal one line is redrawn in place: a bar, done / total, the rate,
the elapsed time and the ETA. Elsewhere (a log file, CI) a plain line is
printed at most every `every` seconds, and one when the operation ends, so
short operations say only that they finished. stdout stays for results.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
  """done / total of a unit (bytes shown as MB with scale=1e6, or runs)."""

  def __init__(self, label: str, total: float, *, unit: str = '',
               scale: float = 1.0, every: float = 30.0,
               stream: TextIO | None = None):
    self.label, self.total, self.unit, self.scale = label, total, unit, scale
    self.every = every
    self.stream = stream or sys.stderr
    self.interactive = self.stream.isatty()
    self.done = 0.0
    self._start = self._last_line = time.perf_counter()

  def __enter__(self) -> Progress:
    self._draw(time.perf_counter())
    return self

  def __exit__(self, kind, *_):
    if kind is None:  # A failure says so itself, in one line.
      self.finish()
    elif self.interactive:
      self.stream.write('\r\033[K')

  def advance(self, amount: float = 1.0):
    self.done += amount
    now = time.perf_counter()
    if self.interactive or now - self._last_line >= self.every:
      self._draw(now)

  def finish(self):
    self.done = max(self.done, self.total)
    self._draw(time.perf_counter(), final=True)

  def line(self, now: float) -> str:
    elapsed = now - self._start
    amount = lambda x: (f'{x / self.scale:,.1f}' if self.scale != 1
                        else f'{x:,.0f}')
    parts = [self.label, f'{amount(self.done)}/{amount(self.total)}'
             + (f' {self.unit}' if self.unit else '')]
    if self.done and elapsed > 0:
      rate = self.done / elapsed
      if self.scale != 1:
        parts.append(f'{rate / self.scale:,.1f} {self.unit}/s')
      parts.append(f'elapsed {duration(elapsed)}')
      parts.append(f'ETA {duration((self.total - self.done) / rate)}')
    else:
      parts.append(f'elapsed {duration(elapsed)}')
    return '  '.join(parts)

  def _draw(self, now: float, final: bool = False):
    self._last_line = now
    text = self.line(now)
    if self.interactive:
      width = 20
      filled = int(width * min(1.0, self.done / self.total)) if (
          self.total) else width
      self.stream.write(f'\r\033[K[{"#" * filled}{"." * (width - filled)}] '
                        f'{text}' + ('\n' if final else ''))
    elif final or self.done:
      self.stream.write(text + '\n')
    self.stream.flush()


def duration(seconds: float) -> str:
  """m:ss, or h:mm:ss from an hour; '?' if unknown."""
  if not seconds < float('inf') or seconds != seconds:
    return '?'
  minutes, seconds = divmod(int(seconds), 60)
  hours, minutes = divmod(minutes, 60)
  return (f'{hours}:{minutes:02d}:{seconds:02d}' if hours else
          f'{minutes}:{seconds:02d}')


def runs(items: list, describe, stream: TextIO | None = None, *,
         cost=lambda item: 1.0, reused=lambda item: False):
  """Yields `items` (the runs of a study), announcing each on stdout:
  '=== run i of n: DESCRIPTION (elapsed m:ss, ETA m:ss)', the ETA from the
  runs trained so far, weighted by `cost(item)` (e.g. its steps). An item
  that `reused` says is done already (a finished run that a rerun reuses)
  is announced as '=== run i of n: DESCRIPTION: reused' and left out of
  the ETA, which it would otherwise make look fast."""
  start = time.perf_counter()
  again = [bool(reused(item)) for item in items]
  costs = [0.0 if r else cost(item) for item, r in zip(items, again)]
  for i, item in enumerate(items):
    head = f'=== run {i + 1} of {len(items)}: {describe(item)}'
    if again[i]:
      print(f'{head}: reused (finished before)', file=stream or sys.stdout,
            flush=True)
      yield item
      continue
    elapsed = time.perf_counter() - start
    done = sum(costs[:i])
    eta = elapsed / done * sum(costs[i:]) if done else float('inf')
    print(f'{head} (elapsed {duration(elapsed)}, ETA {duration(eta)})',
          file=stream or sys.stdout, flush=True)
    yield item
