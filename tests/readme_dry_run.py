"""Parses a command's flags as `python -m MODULE ARGS` would, then stops:
nothing is trained, read or written (tests/test_readme.py runs it).

  python tests/readme_dry_run.py MODULE [ARGS...]

Exit status 0 when MODULE exists and takes ARGS as written; otherwise the
command's own one-line error and its status.
"""

import runpy
import sys

from absl import app

from infra import cli


def _parse_then_stop(parse_args):
  def parse(self, *args, **kwargs):
    parse_args(self, *args, **kwargs)
    sys.exit(0)
  return parse


def _run_flags_only(main, argv=None, flags_parser=None):
  del main
  (flags_parser or cli.parse_flags)(sys.argv if argv is None else argv)
  sys.exit(0)


if __name__ == '__main__':
  cli.ArgumentParser.parse_args = _parse_then_stop(
      cli.ArgumentParser.parse_args)
  app.run = _run_flags_only
  module = sys.argv[1]
  sys.argv = [module, *sys.argv[2:]]
  runpy.run_module(module, run_name='__main__', alter_sys=True)
  sys.exit(f'{module} ran without parsing any flags')
