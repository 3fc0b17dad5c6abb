"""Scores a workdir on lm-evaluation-harness tasks (the `eval` extra).

  python -m evaluation.evaluate --workdir=W --tasks=T1,T2 --out=DIR \
      [--include_path=DIR] [--limit=N] [--batch_size=8] [--num_fewshot=N] \
      [--max_gen_toks=256] [--data=PREPARED_DIR]

The workdir (local or gs://) runs as lm_eval's `gqa-lab` model
(evaluation/harness.py); tasks are lm_eval's own or the YAMLs in
--include_path, as its command line takes them. Writes OUT/results.json
(lm_eval's results, configs and versions, with the command and commit) and
OUT/report.md (lm_eval's table). --data also reports held-out loss and bits
per byte on a prepared corpus's held-out split, through the evaluator the
training loop runs (`lm.evaluator.evaluate_workdir`).
"""

import json
import logging
import pathlib
import sys

from infra.cli import check_output_dir, run_app
from infra import provenance as provenance_lib
from infra.errors import UserError


def task_manager(tasks: list[str], include_path: str | None,
                  include_defaults: bool = True, metadata=None):
  """lm_eval's TaskManager that knows `tasks`. Indexing lm_eval's own
  ~15,000 tasks takes seconds, so --include_path alone is tried first.
  include_defaults: False, the tasks of --include_path only. metadata:
  given to every task's config (lm_eval's --metadata)."""
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel
  if include_path is not None and not pathlib.Path(include_path).is_dir():
    raise UserError(f'--include_path={include_path} is not a folder; give '
                    'the folder of your task YAMLs')
  if include_path:
    manager = TaskManager(include_path=include_path, include_defaults=False,
                          metadata=metadata)
    if not include_defaults or not (
        set(tasks) - set(manager.match_tasks(tasks))):
      return _check_known(manager, tasks, include_path)
  return _check_known(TaskManager(include_path=include_path,
                                  metadata=metadata), tasks, include_path)


def require_lm_eval():
  """Refuses, in one line, a machine without lm_eval (the `eval` extra)."""
  try:
    import lm_eval  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise UserError("lm_eval is not installed; pip install -e '.[eval]'"
                    ) from None


def check_tasks(tasks: list[str], include_path: str | None):
  """Refuses, in one line and before any work, a missing lm_eval or a task
  name neither lm_eval nor --include_path knows (what `evaluate` would
  meet only after loading the model)."""
  require_lm_eval()
  task_manager(tasks, include_path)


def _check_known(manager, tasks: list[str], include_path: str | None):
  unknown = [t for t in tasks if not manager.match_tasks([t])]
  if unknown:
    where = ' or in ' + include_path if include_path else ''
    raise UserError(f'unknown task {", ".join(map(repr, unknown))}: not '
                    f'among lm_eval\'s tasks{where}; list them with '
                    '`lm_eval ls tasks` (or give --include_path)')
  return manager


def evaluate(workdir: str, tasks: list[str], *, include_path=None,
             limit=None, batch_size: int = 8, num_fewshot=None,
             seed: int = 0, log_samples: bool = False,
             max_gen_toks: int = 256) -> dict:
  """lm_eval.simple_evaluate of WORKDIR on TASKS; its results dict,
  without lm_eval's environment report, with 'checkpoint': the step and
  parameter fingerprint scored (`lm.checkpoint.fingerprint`)."""
  from unittest import mock  # pylint: disable=import-outside-toplevel
  import lm_eval  # pylint: disable=import-outside-toplevel
  from lm_eval import evaluator  # pylint: disable=import-outside-toplevel
  from evaluation import harness  # pylint: disable=import-outside-toplevel
  model = harness.WorkdirLM(workdir, batch_size=batch_size, seed=seed,
                            max_gen_toks=max_gen_toks, flag='--workdir')
  manager = task_manager(tasks, include_path)
  _check_generation_room(manager.load(tasks)['tasks'], model)
  # Its add_env_info runs torch's collect_env (pip list and more in
  # subprocesses: 4 of a small task's 5.7 s, measured) for keys that
  # write_results does not keep; a study scores dozens of checkpoints.
  with mock.patch.object(evaluator, 'add_env_info', lambda _: None):
    results = lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=manager, limit=limit,
        num_fewshot=num_fewshot, log_samples=log_samples, random_seed=seed,
        numpy_random_seed=seed, fewshot_random_seed=seed,
        bootstrap_iters=1000)
  return {**results, 'checkpoint': model.checkpoint}


def _check_generation_room(tasks: dict, model) -> None:
  """Refuses, in one line and before any task is scored, a generation task
  (of TaskManager.load's flat {name: Task}) whose max_gen_toks (its
  generation_kwargs', else the model's) leaves no room for a context in
  the model's max_len: found only when its requests ran, it threw away the
  tasks scored before it."""
  for name, task in tasks.items():
    if task.get_config('output_type') != 'generate_until':
      continue
    kwargs = task.get_config('generation_kwargs') or {}
    new = int(kwargs.get('max_gen_toks', model.max_gen_toks))
    if new >= model.max_length:
      raise UserError(
          f'task {name} generates up to max_gen_toks={new} tokens, not below '
          f'the model\'s max_len ({model.max_length}), which leaves no room '
          'for its context; give --max_gen_toks below max_len (or set '
          'max_gen_toks in the task\'s generation_kwargs)')


def report(results: dict, held_out: dict | None, provenance: dict) -> str:
  """Markdown: lm_eval's table, the held-out metrics, the command."""
  from lm_eval.utils import make_table  # pylint: disable=import-outside-toplevel
  lines = ['# Evaluation', '', make_table(results)]
  if held_out:
    lines += ['| held-out corpus | loss (nats/token) | bits per byte |',
              '| --- | --- | --- |',
              f'| {held_out["data"]} | {held_out["eval_loss"]:.4f} | '
              + (f'{held_out["eval_bpb"]:.4f} |' if 'eval_bpb' in held_out
                 else '- |'), '']
  lines += [f'`{provenance["command"]}` at commit {provenance["commit"]}', '']
  return '\n'.join(lines)


def write_results(workdir: str, tasks: list[str], out: str, *,
                  include_path=None, limit=None, batch_size: int = 8,
                  num_fewshot=None, seed: int = 0, data=None,
                  max_gen_toks: int = 256, argv=None) -> dict:
  """Evaluates WORKDIR; writes OUT/results.json and OUT/report.md; returns
  the record written. argv: the command's flags, for the provenance."""
  from lm_eval import utils as lm_utils  # pylint: disable=import-outside-toplevel
  from lm.evaluator import evaluate_workdir  # pylint: disable=import-outside-toplevel
  provenance = provenance_lib.record('evaluation.evaluate', out, argv)
  held_out = None
  if data:  # First: a wrong --data is refused before the tasks are scored.
    try:
      held_out = {'data': data, **evaluate_workdir(workdir,
                                                   data_path=data)}
    except UserError as e:
      raise UserError(f'--data={data}: {e}') from None
  results = evaluate(workdir, tasks, include_path=include_path, limit=limit,
                     batch_size=batch_size, num_fewshot=num_fewshot,
                     seed=seed, max_gen_toks=max_gen_toks)
  record = {'provenance': provenance, 'workdir': workdir,
            'checkpoint': results['checkpoint'], 'tasks': tasks,
            **{k: results[k] for k in ('results', 'groups', 'configs',
                                        'versions', 'n-shot', 'n-samples')
               if k in results}, 'held_out': held_out}
  path = pathlib.Path(out)
  path.mkdir(parents=True, exist_ok=True)
  (path / 'results.json').write_text(json.dumps(
      record, indent=2, default=lm_utils.handle_non_serializable))
  (path / 'report.md').write_text(report(results, held_out, provenance))
  return record


def main(argv):
  from absl import flags, logging as absl_logging  # pylint: disable=import-outside-toplevel
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax's reads.
  f = flags.FLAGS
  tasks = [t for t in f.tasks.split(',') if t]
  if not tasks:
    raise UserError('--tasks is empty; give task names, comma-separated')
  for name in ('batch_size', 'limit', 'max_gen_toks'):
    if getattr(f, name) is not None and getattr(f, name) < 1:
      raise UserError(f'--{name}={getattr(f, name)}: give a number >= 1')
  check_output_dir(f.out, new=True)
  require_lm_eval()
  logging.getLogger('lm_eval').setLevel(logging.ERROR)
  write_results(f.workdir, tasks, f.out, include_path=f.include_path,
                limit=f.limit, batch_size=f.batch_size,
                num_fewshot=f.num_fewshot, seed=f.seed, data=f.data,
                max_gen_toks=f.max_gen_toks)
  sys.stdout.write((pathlib.Path(f.out) / 'report.md').read_text())


def run():
  """The command line; flags are defined here, not on import."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  flags.DEFINE_string('workdir', None, 'a train.main workdir (or gs://)')
  flags.DEFINE_string('tasks', None, 'lm_eval task names, comma-separated')
  flags.DEFINE_string('out', None, 'new folder for results.json, report.md')
  flags.DEFINE_string('include_path', None, 'a folder of task YAMLs')
  flags.DEFINE_integer('limit', None, 'at most this many documents a task')
  flags.DEFINE_integer('batch_size', 8, 'sequences per forward pass')
  flags.DEFINE_integer('num_fewshot', None, 'examples in each prompt '
                       "(default: each task's)")
  flags.DEFINE_integer('seed', 0, 'few-shot and sampling seed')
  flags.DEFINE_integer('max_gen_toks', 256, 'generation tasks: at most this '
                       'many new tokens where the task sets none (lm_eval\'s '
                       'hf default); below the model\'s max_len')
  flags.DEFINE_string('data', None, 'a prepared corpus (train.prepare_data) '
                      'whose held-out loss and bits per byte to report too')
  run_app(main, required=['workdir', 'tasks', 'out'])


if __name__ == '__main__':
  run()
