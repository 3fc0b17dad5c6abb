"""Specification of the lm_eval commands the docs give (README.md,
docs/*.md): each, parsed by lm_eval 0.4.13's own command line, builds its
model as lm_eval builds it (`--model_args` beside the flags lm_eval always
passes: `--batch_size`, given twice a TypeError), with the batch size it
asks for; `local-completions` against this server's byte-level model is
given a prefix token (without one lm_eval sends null as a rolling window's
first token, which the server refuses)."""

import pathlib
import re
import shlex
import sys

import pytest

lm_eval_registry = pytest.importorskip('lm_eval.api.registry')
from lm_eval.__main__ import cli_evaluate  # pylint: disable=wrong-import-position
from lm_eval.api.model import LM  # pylint: disable=wrong-import-position

REPO = pathlib.Path(__file__).parent.parent
COMMAND = re.compile(r'^((?:gqa-lab-)?lm[-_]eval (?:.*\\\n)*.*)$', re.M)


def _commands() -> list[tuple[str, str]]:
  """(file, command) of each lm_eval command line in the docs."""
  found = []
  for path in [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]:
    for command in COMMAND.findall(path.read_text()):
      if '--model ' in command:
        found.append((path.name, command.replace('\\\n', ' ')))
  return found


class _Built(Exception):
  """Raised by the stand-in model with the arguments lm_eval gave it."""


class _StandIn:
  """A model that records its arguments, built by lm_eval's own code."""
  create_from_arg_string = classmethod(LM.create_from_arg_string.__func__)
  create_from_arg_obj = classmethod(LM.create_from_arg_obj.__func__)

  def __init__(self, **kwargs):
    raise _Built(kwargs)


def test_the_docs_give_lm_eval_commands():
  names = [command.split()[2] for _, command in _commands()]
  assert {'gqa-lab', 'local-completions'} <= set(names), names


@pytest.mark.slow  # lm_eval's command line loads the tasks.
@pytest.mark.parametrize('where,command', _commands())
def test_a_docs_lm_eval_command_builds_its_model(where, command, monkeypatch,
                                                 tmp_path):
  argv = shlex.split(command)
  monkeypatch.chdir(REPO)  # The docs' relative paths (--include_path).
  monkeypatch.setattr(sys, 'argv', ['lm_eval', *[
      str(tmp_path / 'out') if a.startswith('runs/') and argv[i - 1] == (
          '--output_path') else a for i, a in enumerate(argv)][1:]])
  monkeypatch.setattr(lm_eval_registry, 'get_model', lambda name: _StandIn)
  with pytest.raises(_Built) as built:
    cli_evaluate()
  kwargs = built.value.args[0]
  asked = re.search(r'--batch_size[ =](\S+)', command)
  assert str(kwargs['batch_size']) == (asked.group(1) if asked else '1'), (
      where, kwargs)
  if '--model local-completions' in command:
    assert 'custom_prefix_token_id' in kwargs, (where, kwargs)
