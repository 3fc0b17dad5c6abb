"""Fixtures shared by test files."""

import pytest

from configs import tiny
from train import loop


@pytest.fixture(scope='session')
def trained(tmp_path_factory):
  """A workdir holding a `tiny` model trained for its 20 steps."""
  workdir = tmp_path_factory.mktemp('trained')
  loop.train_and_evaluate(tiny.get_config(), str(workdir))
  return workdir
