"""Fixtures shared by test files, and the cpu_only marker."""

import jax
import pytest

from configs import tiny
from train import loop


def pytest_collection_modifyitems(config, items):
  """On a GPU or TPU, skips tests marked cpu_only (XLA:CPU kernels, layouts,
  simulated host devices); everything else runs there as here."""
  del config
  if jax.default_backend() == 'cpu':
    return
  skip = pytest.mark.skip(reason='asserts behaviour of the CPU backend')
  for item in items:
    if 'cpu_only' in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope='session')
def trained(tmp_path_factory):
  """A workdir holding a `tiny` model trained for its 20 steps."""
  workdir = tmp_path_factory.mktemp('trained')
  loop.train_and_evaluate(tiny.get_config(), str(workdir))
  return workdir
