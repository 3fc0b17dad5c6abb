"""Specification of `python -m serve.api`'s command line (serve/api.py's
main, serve/listener.py's listen): --help's usage names every flag; a start
prints its two lines, not the libraries' INFO log; an address that cannot
be listened on is one line that blames the host or the port, whichever is
wrong."""

import pathlib
import re
import socket
import subprocess
import sys

import pytest

from infra.errors import UserError
from serve.listener import listen
from serve import process

REPO = pathlib.Path(__file__).parent.parent


@pytest.mark.parametrize('host', ['256.1.1.1', 'no-such-host.invalid',
                                  '192.0.2.1'])  # The last: not this one's.
def test_a_host_that_cannot_be_listened_on_is_blamed(host):
  with pytest.raises(UserError) as caught:
    listen(host, 0)
  message = str(caught.value)
  assert message.startswith(f'--host={host}: cannot listen there (')
  assert 'address of this machine' in message and 'port' not in message


def test_a_port_in_use_is_blamed():
  taken = listen('127.0.0.1', 0)
  port = taken.getsockname()[1]
  try:
    with pytest.raises(UserError, match=f'--port={port}: .* pick another '
                       'port, or --port=0'):
      listen('127.0.0.1', port)
  finally:
    taken.close()
  free = listen('127.0.0.1', 0)  # A control: the same call can succeed.
  assert free.family == socket.AF_INET
  free.close()


@pytest.mark.slow
def test_help_usage_names_every_flag_on_its_own_lines():
  result = subprocess.run([sys.executable, '-m', 'serve.api', '--help'],
                          cwd=REPO, capture_output=True, text=True,
                          timeout=180)
  usage, flags = result.stdout.split('\nflags:', 1)
  own = flags.split('serve/api.py:\n', 1)[1].split('\n\n')[0]  # Its own.
  defined = set(re.findall(r'^  --(?:\[no\])?(\w+):', own, re.M))
  assert {'workdir', 'page_size', 'served_model_name'} <= defined, flags
  named = set(re.findall(r'--(?:no)?(\w+)', usage.split('\n\n')[1]))
  assert defined <= named, defined - named
  # The docstring's line continuations are kept, one row per line.
  assert re.search(r'^  python -m serve\.api --workdir=DIR .* \\$', usage,
                   re.M), usage


@pytest.mark.slow
def test_the_server_starts_without_the_libraries_info_log(trained):
  with process.ServerProcess(str(trained)) as server:
    lines = server.started
  assert lines[-1].startswith('serve.api: listening on'), lines
  noise = [l for l in lines if re.match(r'I\d{4} |INFO', l)]
  assert not noise, ''.join(lines)
