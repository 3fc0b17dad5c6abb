"""SIGTERM and SIGINT (Ctrl-C) as requests that a run stops at its next step.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread
happens to be, and JAX runs Python in every garbage collection (its
`_xla_gc_callback`): an exception raised there is printed as "Exception
ignored in ..." and dropped, so a study's first Ctrl-C was lost and it ran
on. A signal recorded instead, and acted on by the training loop between
steps (`train.loop`'s `should_stop`), cannot be lost, and the run saves a
checkpoint before it stops.
"""

from __future__ import annotations

import contextlib
import signal
import threading

from infra.errors import UserError

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def recorded():
  """Within, SIGTERM and SIGINT are recorded, not acted on: yields the list
  of those received, in order; the handlers before are restored on the way
  out. Outside the main thread, where Python cannot set handlers, the list
  stays empty (whoever owns the main thread handles signals)."""
  received: list[int] = []
  if threading.current_thread() is not threading.main_thread():
    yield received
    return
  before = {sig: signal.signal(sig, lambda signum, _: received.append(signum))
            for sig in SIGNALS}
  try:
    yield received
  finally:
    for sig, handler in before.items():
      signal.signal(sig, handler)


class Interrupted(UserError):
  """A run stopped by a signal, its checkpoint saved: one line, and exit
  status 128 + the signal (130 for Ctrl-C, 143 for SIGTERM), as a shell
  gives a process that the signal ended."""

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.exit_status = 128 + signum


def name(signum: int) -> str:
  """'SIGINT (Ctrl-C)', 'SIGTERM'."""
  text = signal.Signals(signum).name
  return f'{text} (Ctrl-C)' if signum == signal.SIGINT else text
