"""The server's process: a listening socket, uvicorn on it, and the drain a
signal starts (`serve.api`'s docstring: new requests get 503, those in flight
finish or are cut off at the deadline, then the process exits 0; a second
signal exits at once)."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import signal

import uvicorn

from infra.errors import UserError


class _Uvicorn(uvicorn.Server):
  """uvicorn, its first SIGTERM or SIGINT a drain (see the module
  docstring) and exit status 0; a second exits at once."""

  def __init__(self, config: uvicorn.Config, server,
               drain_timeout: float):
    super().__init__(config)
    self.server, self.drain_timeout = server, drain_timeout
    self._signalled = False

  def handle_exit(self, sig, frame):
    del frame
    if self._signalled or self.server.loop is None:
      self.should_exit = self.force_exit = True
      return
    self._signalled = True
    print(f'serve.api: {signal.Signals(sig).name}: draining (new requests get '
          f'503; in-flight ones have {self.drain_timeout:g}s)',
          file=sys.stderr, flush=True)
    self.server.loop.call_soon_threadsafe(
        lambda: asyncio.ensure_future(self.drain()))

  async def drain(self):
    server = self.server
    server.draining = True
    deadline = time.monotonic() + self.drain_timeout
    while server.in_flight and time.monotonic() < deadline:
      await asyncio.sleep(0.05)
    if server.in_flight:
      print(f'serve.api: {len(server.in_flight)} request(s) still running at '
            'the deadline end with finish_reason "abort"', file=sys.stderr,
            flush=True)
      for keys in list(server.in_flight.values()):
        for key in keys:
          server.thread.abort(key)
      while server.in_flight and time.monotonic() < deadline + 10:
        await asyncio.sleep(0.05)
    self.should_exit = True


def listen(host: str, port: int) -> socket.socket:
  """A listening socket on host:port (0: a free port), IPv4 or IPv6."""
  family = socket.AF_INET6 if ':' in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise UserError(f'--host={host} --port={port}: cannot listen there '
                    f'({e.strerror}); pick another port, or --port=0 for a '
                    'free one') from None
  sock.listen(2048)
  sock.set_inheritable(True)
  return sock


def serve(server, sock: socket.socket, drain_timeout: float = 30.0,
          log_level: str = 'warning'):
  """Serves `server` (a `serve.api.Server`) on sock until a signal drains
  it (main thread) or `should_exit` (a thread, in tests: uvicorn then
  installs no handlers)."""
  config = uvicorn.Config(server.app(), log_level=log_level,
                          access_log=False, lifespan='on')
  runner = _Uvicorn(config, server, drain_timeout)
  server.uvicorn = runner
  runner.run(sockets=[sock])
