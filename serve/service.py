"""The engine on a thread of its own, fed by any number of callers.

`Engine` is single-threaded (one caller steps it); an HTTP server takes
requests on an event loop that must never wait for the device. So the
engine runs here on its own thread, the device loop:

  1. take what callers queued (requests to add, ids to abort), all of it,
     blocking only while the engine holds nothing to step;
  2. step once (`Engine.step_deltas`): every request that got a token or
     finished hands its Delta to the sink it was submitted with;
  3. report the step to `on_step` (the metrics).

Requests from every caller join the same continuous batch, because they all
go into the one engine; a full pool makes them wait in the scheduler's
queue, never dropped. Sinks run on the device thread: a caller on an event
loop passes one that only hands the item over
(`loop.call_soon_threadsafe`). A request the engine refuses gets its
`RequestRefused` in its sink; an abort of a request still running gets its
last Delta (finish_reason 'abort'). If a step raises (a bug, the device out
of memory), every request in flight gets the error, the loop ends, and
`failed` says why: an engine that stopped half-way through a step cannot
be trusted with another.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Callable

from serve import engine as engine_lib

log = logging.getLogger(__name__)

Sink = Callable[[object], None]  # Gets Deltas, or an exception; never raises.


class EngineThread:
  """`submit` and `abort` from any thread; the engine steps on this one."""

  def __init__(self, engine: engine_lib.Engine,
               on_step: Callable[[engine_lib.Engine, list], None] = None):
    self.engine = engine
    self.on_step = on_step or (lambda engine, deltas: None)
    self.failed: str | None = None
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._sinks: dict[str, Sink] = {}  # By the id as JSON (the engine's key).
    self._thread = threading.Thread(target=self._run, name='engine',
                                    daemon=True)

  def start(self) -> 'EngineThread':
    self._thread.start()
    return self

  def submit(self, request: engine_lib.Request, sink: Sink):
    """Queues the request; its Deltas (or a RequestRefused) go to sink."""
    self._inbox.put(('add', request, sink))

  def abort(self, request_id):
    """Ends the request if it is still waiting or running (its pages back
    at once); its sink gets a last Delta with finish_reason 'abort'."""
    self._inbox.put(('abort', request_id, None))

  def stop(self, timeout: float | None = None):
    """Ends the loop after its current step (requests in flight are left
    unfinished: abort them first) and waits for it."""
    self._inbox.put(('stop', None, None))
    self._thread.join(timeout)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def _run(self):
    try:
      while True:
        if not self._take(block=not self.engine.has_unfinished()):
          return
        if self.engine.has_unfinished():
          deltas = self.engine.step_deltas()
          for delta in deltas:
            key = json.dumps(delta.id)
            sink = (self._sinks.pop(key) if delta.output else
                    self._sinks[key])
            sink(delta)
          self.on_step(self.engine, deltas)
    except Exception as e:  # pylint: disable=broad-except
      log.exception('the engine failed; requests in flight end with an error')
      # The client is told the kind, the log has the rest (paths, shapes).
      self.failed = (f'the engine failed ({type(e).__name__}); the server '
                     'log has the details; restart the server')
      for sink in self._sinks.values():
        sink(RuntimeError(self.failed))
      self._sinks.clear()

  def _take(self, block: bool) -> bool:
    """Handles every queued command (waiting for one if block); False once
    asked to stop."""
    while True:
      try:
        kind, item, sink = self._inbox.get(block=block)
      except queue.Empty:
        return True
      block = False
      if kind == 'stop':
        return False
      if kind == 'add':
        try:
          self.engine.add_request(item)
        except engine_lib.RequestRefused as e:
          sink(e)
          continue
        self._sinks[json.dumps(item.id)] = sink
      else:
        output = self.engine.abort_request(item)
        if output is not None:
          self._sinks.pop(json.dumps(item))(
              engine_lib.Delta(item, [], output=output))
          self.on_step(self.engine, [engine_lib.Delta(item, [],
                                                      output=output)])
