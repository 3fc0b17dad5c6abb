r"""lm_eval's own command line, with the `gqa-lab` model registered.

  gqa-lab-lm-eval --model gqa-lab --model_args workdir=W --batch_size 8 \
      --tasks hellaswag [any other lm_eval flag]

(The batch size is lm_eval's --batch_size, which lm_eval passes to the model
beside --model_args: in both, it is given twice.)

lm_eval 0.4.13 finds a model only in its registry and imports no plugins
(no entry-point group), so its `lm_eval` command cannot see a model defined
in another package; this is that command after `evaluation.harness` has
registered itself (installed as a console script with the project).
"""

from evaluation import harness  # pylint: disable=unused-import
from infra.cli import exit_on_user_error


def main():
  """A bad workdir is one line (infra.errors.UserError), as in every
  command of gqa-lab."""
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel
  exit_on_user_error(cli_evaluate)


if __name__ == '__main__':
  main()
