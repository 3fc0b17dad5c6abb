"""The one exception type for bad input: a message of one line that says what
is wrong and what to do (`train.cli` prints it and exits 1)."""


class UserError(Exception):
  """A bad config, flag, file or checkpoint.

  Its message is one line saying what is wrong and what to do; the commands
  print it, without a traceback, and exit non-zero.
  """
