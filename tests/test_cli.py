"""The scripts' flag types (infra/cli.py): a bad value is one UserError line
naming the flag and what it must be, before any work."""

import pytest

from infra import cli
from infra.cli import ArgumentParser, float_list, int_list, int_range
from infra.errors import UserError


def _parser() -> ArgumentParser:
  parser = ArgumentParser()
  parser.add_argument('--kv_heads', type=int_list)
  parser.add_argument('--prompt_len', type=int_range)
  parser.add_argument('--alphas', type=float_list)
  return parser


def test_good_values_parse():
  args = _parser().parse_args(
      ['--kv_heads=8,2,1', '--prompt_len=8,96', '--alphas=0,0.05'])
  assert args.kv_heads == [8, 2, 1]
  assert args.prompt_len == [8, 96]
  assert args.alphas == [0.0, 0.05]
  assert _parser().parse_args(['--prompt_len=5,5']).prompt_len == [5, 5]


@pytest.mark.parametrize('flag, said', [
    ('--prompt_len=96,8', "'96,8' is not LOW,HIGH"),
    ('--prompt_len=8', "'8' is not LOW,HIGH"),
    ('--prompt_len=1,2,3', "'1,2,3' is not LOW,HIGH"),
    ('--prompt_len=0,8', "'0,8' is not a comma-separated list of positive"),
    ('--prompt_len=a,b', "'a,b' is not a comma-separated list of positive"),
    ('--kv_heads=8,-2', "'8,-2' is not a comma-separated list of positive"),
    ('--alphas=0,-1', "'0,-1' is not a comma-separated list of numbers >= 0"),
])
def test_a_bad_value_is_one_line_naming_the_flag(flag, said):
  with pytest.raises(UserError) as e:
    _parser().parse_args([flag])
  message = str(e.value)
  assert '\n' not in message
  assert f'argument {flag.split("=")[0]}: {said}' in message
  assert message.endswith('; see --help')


@pytest.mark.parametrize('path, says', [
    ('', '--out is empty'),
    ('/proc/gqa_lab_x', 'cannot be written'),  # Writable bits, as root.
])
def test_an_output_folder_that_takes_no_file_is_refused_first(path, says):
  """check_output_dir writes a file where the results will go (permission
  bits said yes to /proc as root, and a study trained for minutes before
  failing), and an empty --out is refused, not read as the current folder."""
  with pytest.raises(UserError, match=says):
    cli.check_output_dir(path)


def test_checking_an_output_folder_leaves_nothing_behind(tmp_path):
  """The folders made to try a write are removed again: a command refused
  later leaves no empty --out."""
  cli.check_output_dir(str(tmp_path / 'a' / 'b'))
  assert not (tmp_path / 'a').exists()
  (tmp_path / 'kept').mkdir()
  cli.check_output_dir(str(tmp_path / 'kept'))
  assert (tmp_path / 'kept').is_dir() and not any((tmp_path / 'kept').iterdir())
