"""The one exception type for bad input: a message of one line that says what
is wrong and what to do (`infra.cli` prints it and exits 1)."""


class UserError(Exception):
  """A bad config, flag, file or checkpoint.

  Its message is one line saying what is wrong and what to do; the commands
  print it, without a traceback, and exit non-zero.
  """


def pip_install(extra: str, dist=None) -> str:
  """The command that installs gqa-lab's EXTRA packages where it is
  installed: in an editable install (a clone) its folder, `pip install -e
  'FOLDER[extra]'`; in any other, the package, `pip install
  'gqa-lab[extra]'`, and beside it the docs' form for a checkout, `pip
  install -e '.[extra]'`. dist: an importlib.metadata distribution
  (gqa-lab's)."""
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  import urllib.parse  # pylint: disable=import-outside-toplevel
  if dist is None:
    try:
      dist = importlib.metadata.distribution('gqa-lab')
    except importlib.metadata.PackageNotFoundError:  # Run from a clone.
      return f"pip install -e '{pathlib.Path(__file__).parent.parent}[{extra}]'"
  direct = json.loads(dist.read_text('direct_url.json') or '{}')
  if direct.get('dir_info', {}).get('editable'):
    folder = urllib.parse.unquote(urllib.parse.urlparse(direct['url']).path)
    return f"pip install -e '{folder}[{extra}]'"
  return (f"pip install 'gqa-lab[{extra}]' (in a checkout: pip install -e "
          f"'.[{extra}]')")
