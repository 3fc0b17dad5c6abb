"""The one exception type for bad input that a person must fix."""


class UserError(Exception):
  """A bad config, flag, file or checkpoint.

  Its message is one line saying what is wrong and what to do; `train.main`
  prints it, without a traceback, and exits non-zero.
  """


def exit_on_user_error(fn):
  """Runs fn(); a UserError becomes one line on stderr and exit status 1."""
  import sys  # pylint: disable=import-outside-toplevel
  try:
    fn()
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(1)
