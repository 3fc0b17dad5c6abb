"""Trains a GQA/MHA/MQA language model: `python -m train.main --config=gqa_small`.

Flags:
  --config=NAME|PATH   a config in configs/ by name (even where a folder NAME
                       is here: ./NAME for that), or a path to a config file,
                       a .json file or a workdir
  --config.SECTION.FIELD=VALUE   overrides, e.g. --config.model.num_kv_heads=1
  --workdir=DIR        checkpoints, metrics.jsonl and TensorBoard events;
                       rerunning with the same DIR resumes

SIGTERM or SIGINT (Ctrl-C) saves a checkpoint and exits (status 128 + signal);
with several processes, all of them at the next step they log
(train.log_every), so that they stop together.
Launched as one of several processes (a multi-host TPU slice, SLURM, Open MPI,
or JAX_COORDINATOR_ADDRESS set), it trains in a watched child process that
joins JAX's distributed runtime (infra/peers.py: a lost peer ends the run in
one line, the child dies with its watcher, and the multi-process variables
are checked first, GQA_LAB_COORDINATOR_TIMEOUT bounding the wait for the
others).
"""

import os
import signal
import sys

from absl import flags, logging
from ml_collections import config_flags

from infra import peers, signals
from lm import config_lib
from infra.errors import UserError
from infra.cli import exit_on_user_error, run_app

_CONFIG = config_flags.DEFINE_config_file('config', None, 'config name or file')
_WORKDIR = flags.DEFINE_string('workdir', None, 'output directory')


def main(argv):
  if len(argv) > 1:
    raise UserError(f'unexpected arguments {argv[1:]}; flags look like '
                    '--config.train.steps=100')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
  if peers.is_multiprocess(os.environ):
    import jax  # pylint: disable=import-outside-toplevel
    # TPU slices, SLURM and Open MPI are detected by jax; a hand-made cluster
    # names itself with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    # JAX_PROCESS_ID.
    setup = peers.distributed_args(os.environ)
    print('joining the run\'s processes through '
          f'{os.environ.get("JAX_COORDINATOR_ADDRESS", "the cluster")} '
          f'(waiting up to {setup["initialization_timeout"]} s for all of '
          'them: GQA_LAB_COORDINATOR_TIMEOUT)', flush=True)
    jax.distributed.initialize(**setup)
  from train import loop  # pylint: disable=import-outside-toplevel
  # A peer lost mid-collective: one line (infra/peers.py).
  with signals.recorded() as received, peers.reported_as_lost_peer(
      _WORKDIR.value):
    record = loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value,
                                     should_stop=lambda: bool(received))
  if 'stopped_at' in record:  # A peer's signal stops this process too.
    sys.exit(128 + (received[0] if received else signal.SIGTERM))


def parse_flags(argv):
  """absl's parsing, with every flag or override error as one UserError line."""
  try:
    return flags.FLAGS(config_lib.resolve(argv))
  except flags.Error as e:
    raise UserError(str(e)) from None
  except (AttributeError, KeyError) as e:  # config_flags: an unknown field.
    overrides = [a.split('=')[0] for a in argv if a.startswith('--config.')]
    # AttributeError(KeyError("'stepz'\nDid you mean \"steps\" ...?")).
    error = e
    while error.args and isinstance(error.args[0], Exception):
      error = error.args[0]
    message = str(error.args[0]) if error.args else str(error)
    field, *hint = message.splitlines() or ['?']
    field = field.strip(chr(39) + chr(34) + ' ')
    naming = [o for o in overrides if field in o.split('.')[1:]]
    if not naming:
      raise  # Not an override naming a missing field: a bug, shown whole.
    flag, elsewhere = _bad_override(naming, field)
    if elsewhere:
      hint = f' (did you mean {" or ".join(elsewhere)}?)'
    else:
      hint = f' ({" ".join(hint).strip()})' if hint else ''
    raise UserError(
        f'unknown config field {field!r} in {flag}{hint}; the fields are '
        'those of the config file (sections model, data, train, mesh)'
    ) from None


def _bad_override(naming: list[str], field: str) -> tuple[str, list[str]]:
  """Which of the overrides naming FIELD names no field of the defaults
  (the first, if each does: a field the config file itself lacks), and the
  overrides that would name FIELD where it is, in another section or at the
  top level."""
  paths = config_lib.field_paths()
  flag = next((o for o in naming if o.removeprefix('--config.') not in paths),
              naming[0])
  elsewhere = sorted(f'--config.{p}' for p in paths
                     if p.split('.')[-1] == field and f'--config.{p}' != flag)
  return flag, elsewhere


def run():
  if os.environ.get(peers.WATCHED):
    peers.follow_watcher(os.environ)  # Killed with its watcher, even by -9.
  elif peers.is_multiprocess(os.environ):
    # One of several processes: train in a watched child (infra/peers.py).
    workdir = next((a.split('=', 1)[1] for a in sys.argv
                    if a.startswith('--workdir=')), None)
    exit_on_user_error(lambda: sys.exit(
        peers.watch('train.main', sys.argv[1:], workdir)))
  run_app(main, required=['config', 'workdir'], parse=parse_flags)


if __name__ == '__main__':
  run()
