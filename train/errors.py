"""The one exception type for bad input that a person must fix."""


class UserError(Exception):
  """A bad config, flag, file or checkpoint.

  Its message is one line saying what is wrong and what to do; `train.main`
  prints it, without a traceback, and exits non-zero.
  """
