"""A pytest plugin that makes `--dist loadgroup` group again under pytest 9.2.

pytest-xdist 3.8 tells its scheduler a test's xdist_group by appending
'@NAME' to the test's node ID, which it writes to `item._nodeid`. pytest 9.2
reads node IDs from a structured `item._id`, so the suffix no longer
reaches the scheduler and every grouped test is scheduled on its own
(pytest-dev/pytest-xdist#1386): the fixtures a group was there to build once
(tests/test_hf.py's model per family, tests/test_evaluate.py's llama, the
mesh runs) were built on both workers. This writes the same suffix where
pytest 9.2 reads it; it does nothing where xdist's own suffix arrived.
tests/conftest.py registers it; tests/test_scripts.py checks that it groups.
"""

import pytest


@pytest.hookimpl(trylast=True)  # After xdist's own (its worker plugin).
def pytest_collection_modifyitems(config, items):
  if not getattr(config.option, 'loadgroup', False):  # xdist's workers.
    return
  try:
    from _pytest.nodeid import NodeId  # pylint: disable=import-outside-toplevel
  except ImportError:  # pytest before 9.2: xdist's suffix works.
    return
  for item in items:
    names = sorted({str(m.args[0] if m.args else m.kwargs.get('name',
                                                              'default'))
                    for m in item.iter_markers('xdist_group')})
    nodeid = item.nodeid
    if names and nodeid.rfind('@') <= nodeid.rfind(']'):  # No suffix yet.
      item._id = NodeId.parse(f'{nodeid}@{"_".join(names)}')  # pylint: disable=protected-access
