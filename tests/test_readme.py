"""The README's example runs and prints what the README says it prints."""

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).parent.parent / 'README.md'


@pytest.mark.slow
def test_readme_example_prints_what_it_claims():
  text = README.read_text()
  blocks = re.findall(r'```python\n(.*?)```', text, re.S)
  expected = re.search(r'prints\n\n```\n(.*?)```', text, re.S).group(1)
  out = io.StringIO()
  namespace = {}
  with contextlib.redirect_stdout(out):
    for block in blocks:
      exec(block, namespace)  # pylint: disable=exec-used
  assert out.getvalue() == expected


def test_ci_runs_the_readme_test_command():
  ci = (README.parent / '.ci' / 'run').read_text()
  commands = re.findall(r'```bash\n(.*?)\n```', README.read_text(), re.S)
  test_command = next(c for c in commands if 'pytest' in c)
  assert test_command in ci
