"""Command-line shells: flags parsed and checked, and a UserError printed as one
line with exit status 1 instead of a traceback."""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import sys
import tempfile
from typing import Callable, Sequence

from infra.errors import UserError


def exit_on_user_error(fn: Callable[[], object]):
  """Runs fn(); a UserError, or a bucket that cannot be reached, becomes one
  line on stderr and exit status 1 (an interruption's: 128 + its signal), as
  does a Ctrl-C that no run turned into a stop at a step."""
  from infra import storage  # pylint: disable=import-outside-toplevel
  try:
    _check_environment()
    fn()
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(getattr(e, 'exit_status', 1))
  except KeyboardInterrupt:
    print('error: interrupted (Ctrl-C)', file=sys.stderr)
    sys.exit(128 + signal.SIGINT)
  except Exception as e:  # pylint: disable=broad-except
    fault = storage.bucket_fault(e)
    if fault is None:
      raise
    print(f'error: {fault}', file=sys.stderr)
    sys.exit(1)


# Checks of environment variables that a room above reads late (lm registers
# GQA_LAB_CPU_KERNEL's, read when the first decode step is traced, deep inside
# jax): run first, so a bad value is one line before any work, not a
# traceback after it.
_ENVIRONMENT_CHECKS: list[Callable[[], object]] = []


def check_environment_with(check: Callable[[], object]):
  """Registers check(), which raises ValueError (its one line) on a bad
  environment variable, to run before every command's work."""
  _ENVIRONMENT_CHECKS.append(check)
  return check


def _check_environment():
  for check in _ENVIRONMENT_CHECKS:
    try:
      check()
    except ValueError as e:
      raise UserError(str(e)) from None


def run_app(main: Callable, *, required: Sequence[str] = (),
            parse: Callable | None = None):
  """absl's `app.run(main)`, every flag error and UserError one line, exit 1."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  flags.mark_flags_as_required(list(required))
  exit_on_user_error(lambda: app.run(main, flags_parser=parse or parse_flags))


def parse_flags(argv):
  """absl's flag parsing, an error raised as one UserError line."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    raise UserError(f'{str(e).rstrip(".")}; see --help') from None


class ArgumentParser(argparse.ArgumentParser):
  """argparse for the scripts: a bad flag is one UserError line; --help
  prints the description (a script's docstring) as it is written."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault('formatter_class', argparse.RawDescriptionHelpFormatter)
    main = getattr(sys.modules.get('__main__'), '__spec__', None)
    if main is not None and main.name.startswith('scripts.'):
      # As it is run (python -m scripts.X), not argparse's 'X.py'.
      kwargs.setdefault('prog', f'python -m {main.name}')
    super().__init__(*args, **kwargs)

  def error(self, message):
    raise UserError(f'{message.rstrip(".")}; see --help')


def positive_int(text: str) -> int:
  """An argparse type: an integer >= 1."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f'{text!r} is not a positive integer')
  return value


def int_list(text: str) -> list[int]:
  """'8,2,1' -> [8, 2, 1]: an argparse type of positive integers."""
  try:
    return [positive_int(x) for x in text.split(',')]
  except argparse.ArgumentTypeError:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not a comma-separated list of positive integers'
    ) from None


def int_range(text: str) -> list[int]:
  """'8,96' -> [8, 96]: an argparse type of an inclusive range LOW,HIGH of
  positive integers, LOW <= HIGH."""
  values = int_list(text)
  if len(values) != 2 or values[0] > values[1]:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not LOW,HIGH with 0 < LOW <= HIGH')
  return values


def float_list(text: str) -> list[float]:
  """'0,0.05' -> [0.0, 0.05]: an argparse type of numbers >= 0."""
  try:
    values = [float(x) for x in text.split(',')]
  except ValueError:
    values = [-1.0]
  if min(values) < 0:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not a comma-separated list of numbers >= 0')
  return values


def check_output_dir(path: str, flag: str = '--out', *, new: bool = False):
  """Refuses, before any work, an output folder that a script could not
  write its results into at the end.

  new: refuse one that already holds files (results that a rerun would
  otherwise mix with, or report as, its own)."""
  from infra.storage import refuse_url  # pylint: disable=import-outside-toplevel
  refuse_url(path, flag)
  if not str(path).strip():
    raise UserError(f'{flag} is empty; give a folder for the results')
  out = pathlib.Path(path).expanduser()
  if out.exists() and not out.is_dir():
    raise UserError(f'{flag}={path} is a file; give a folder for the results')
  if new and out.is_dir() and any(out.iterdir()):
    raise UserError(f'{flag}={path} already holds results; give a new folder '
                    '(or remove that one) so that every number is measured '
                    'by this run')
  parent = next(p for p in (out, *out.absolute().parents) if p.exists())
  if not parent.is_dir() or not os.access(parent, os.W_OK):
    raise UserError(f'{flag}={path} cannot be created in {parent}; give a '
                    'folder you can write to')
  # Permission bits do not tell (root may write /proc's bits, not its
  # files): a file is written where the results will go, and removed, with
  # the folders made for it (a refused command leaves nothing behind).
  made = next((p for p in (*reversed(out.absolute().parents), out.absolute())
               if not p.exists()), None)
  try:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out):
      pass
  except OSError as e:
    raise UserError(f'{flag}={path} cannot be written ({e.strerror}); give a '
                    'folder you can write to') from None
  finally:
    if made is not None and made.is_dir():
      shutil.rmtree(made, ignore_errors=True)
