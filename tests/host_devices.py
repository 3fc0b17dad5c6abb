"""The environment of a subprocess with simulated host devices."""

import os


def env(count: int, **extra) -> dict[str, str]:
  """os.environ and `extra`, with `count` CPU devices added to the XLA_FLAGS
  the test run set (tests/conftest.py)."""
  flags = os.environ.get('XLA_FLAGS', '')
  return {**os.environ, **extra, 'XLA_FLAGS': (
      f'{flags} --xla_force_host_platform_device_count={count}'.strip())}
