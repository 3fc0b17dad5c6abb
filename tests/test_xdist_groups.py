"""The suite's scheduling: tests marked xdist_group run on one worker
(tests/xdist_groups.py), so that what they share is built once."""

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).parent.parent
PROBE = '''
import pytest


@pytest.mark.xdist_group('shared')
@pytest.mark.parametrize('i', range(6))
def test_grouped(i):
  pass


@pytest.mark.parametrize('i', range(6))
def test_free(i):
  pass
'''


def test_grouped_tests_run_on_one_worker_under_loadgroup(tmp_path):
  """As the suite runs (-n 2 --dist loadgroup, setup.cfg), in a folder of
  its own; without the plugin (pytest 9.2, xdist 3.8) the grouped tests
  went to both workers."""
  (tmp_path / 'pytest.ini').write_text('[pytest]\n')
  (tmp_path / 'test_probe.py').write_text(PROBE)
  result = subprocess.run(
      [sys.executable, '-m', 'pytest', '-v', '-p', 'no:cacheprovider',
       '-p', 'tests.xdist_groups', '-n', '2', '--dist', 'loadgroup',
       str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
      timeout=120, env={**os.environ, 'PYTHONPATH': str(REPO)})
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr
  ran = re.findall(r'\[(gw\d)\] .* PASSED \S+::test_(\w+)\[', result.stdout)
  assert len(ran) == 12, result.stdout[-3000:]
  assert len({worker for worker, name in ran if name == 'grouped'}) == 1, (
      result.stdout[-3000:])
