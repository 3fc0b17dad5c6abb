"""Task scores in the studies: a run's checkpoint scored on
lm-evaluation-harness tasks by `evaluation.evaluate`, and the tables that
put the scores beside held-out loss, by seed and paired by seed.

  --tasks=T1,T2 [--include_path=DIR] [--task_limit=N]

`spec(args)` checks these flags before anything trains (lm_eval installed,
every task known to it or to --include_path: `evaluation.evaluate.check_tasks`);
without --tasks it is None and lm_eval is never imported. `score(spec,
workdir, out)` is `evaluation.evaluate.write_results` of WORKDIR into OUT (its
results.json and report.md, whose provenance is the `python -m
evaluation.evaluate` command that remakes them), then OUT/scored.json: each
task's metrics, the settings, the run's final.json and the fingerprint of
the checkpoint scored (`lm.checkpoint.fingerprint`). A rerun reuses a
scored.json of the same settings, the same finished run and the same
parameters; anything else (other tasks, the run trained again, another
checkpoint in its place) is scored again. `lines(arms,
reference)` and `comparisons(arms, reference)`: the report's tables and
results.json's paired differences (studies/stats.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import pathlib

from studies import report, stats, study
from infra.cli import positive_int
from infra.errors import UserError


@dataclasses.dataclass(frozen=True)
class Spec:
  """What to score: lm_eval task names, a folder of task YAMLs, at most
  `limit` documents a task (evaluation.evaluate's --tasks, --include_path,
  --limit)."""
  tasks: tuple[str, ...]
  include_path: str | None = None
  limit: int | None = None

  def flags(self) -> list[str]:
    """evaluation.evaluate's flags for these settings."""
    return ([f'--tasks={",".join(self.tasks)}']
            + [f'--include_path={self.include_path}'] * bool(self.include_path)
            + [f'--limit={self.limit}'] * bool(self.limit))

  def settings(self) -> dict:
    return {'tasks': list(self.tasks), 'include_path': self.include_path,
            'limit': self.limit}


def add_flags(parser):
  parser.add_argument('--tasks', default=None,
                      help='lm_eval tasks, comma-separated: score each run '
                      'on them as evaluation.evaluate does (pip install -e '
                      "'.[eval]')")
  parser.add_argument('--include_path', default=None,
                      help='a folder of task YAMLs (as evaluation.evaluate)')
  parser.add_argument('--task_limit', type=positive_int, default=None,
                      help="at most this many documents a task "
                      "(evaluation.evaluate's --limit)")


def spec(args) -> Spec | None:
  """The flags' Spec, checked (one line, before any training); None
  without --tasks."""
  if args.tasks is None:
    if args.include_path or args.task_limit:
      raise UserError('--include_path and --task_limit go with --tasks; '
                      'give --tasks=T1,T2')
    return None
  tasks = tuple(t for t in args.tasks.split(',') if t)
  if not tasks:
    raise UserError('--tasks is empty; give task names, comma-separated')
  from evaluation import evaluate  # pylint: disable=import-outside-toplevel
  logging.getLogger('lm_eval').setLevel(logging.ERROR)
  evaluate.check_tasks(list(tasks), args.include_path)
  return Spec(tasks, args.include_path, args.task_limit)


def score(what: Spec, workdir: pathlib.Path, out: pathlib.Path) -> dict:
  """WORKDIR's latest checkpoint scored on `what` (evaluation.evaluate's
  write_results, its lines in OUT/log.txt), or the saved scores of the
  same run (WORKDIR/final.json) under the same settings. Returns
  OUT/scored.json's {'scores': {task: {metric: value}}, 'documents':
  {task: n}, 'higher_is_better': {task: {metric: bool}}, ...}."""
  run = json.loads((workdir / 'final.json').read_text())
  parameters = study.fingerprint(workdir)
  done = out / 'scored.json'
  if done.exists():
    saved = json.loads(done.read_text())
    if (saved['settings'] == what.settings() and saved['run'] == run and
        saved.get('checkpoint') == parameters):
      return saved
  from evaluation import evaluate  # pylint: disable=import-outside-toplevel
  logging.getLogger('lm_eval').setLevel(logging.ERROR)
  out.mkdir(parents=True, exist_ok=True)
  with (out / 'log.txt').open('a') as f, contextlib.redirect_stdout(f), (
      contextlib.redirect_stderr(f)):
    record = evaluate.write_results(
        str(workdir), list(what.tasks), str(out),
        include_path=what.include_path, limit=what.limit,
        argv=[f'--workdir={workdir}', *what.flags(), f'--out={out}'])
  saved = {'settings': what.settings(), 'run': run, 'checkpoint': parameters,
           **main_scores(record, what.tasks)}
  done.write_text(json.dumps(saved, indent=1))
  return saved


def main_scores(record: dict, tasks) -> dict:
  """Each task's metrics as lm_eval's table shows them (',none', the
  unfiltered, left out of the name; not their stderr), the documents
  scored and which way is better. The rows of the names asked (a group's
  aggregate), or every row when a name asked is a tag."""
  rows = record['results']
  names = list(tasks) if all(t in rows for t in tasks) else sorted(rows)
  scores, better = {}, {}
  for name in names:
    scores[name] = {
        key.removesuffix(',none'): float(value)
        for key, value in rows[name].items()
        if ',' in key and '_stderr' not in key
        and isinstance(value, (int, float)) and not isinstance(value, bool)}
    listed = record.get('configs', {}).get(name, {}).get('metric_list', [])
    better[name] = {m['metric']: m['higher_is_better'] for m in listed
                    if 'higher_is_better' in m}
  documents = {name: record.get('n-samples', {}).get(name, {}).get(
      'effective') for name in names}
  return {'scores': scores, 'documents': documents,
          'higher_is_better': better}


# --- the tables --------------------------------------------------------------

def _keys(arms: dict) -> list[tuple[str, str]]:
  """(task, metric) in the order first met."""
  keys = {}
  for by_seed in arms.values():
    for scores in by_seed.values():
      for task, metrics in scores.items():
        for metric in metrics:
          keys[task, metric] = None
  return list(keys)


def _values(by_seed: dict, task: str, metric: str) -> dict[int, float]:
  return {seed: s[task][metric] for seed, s in by_seed.items()
          if metric in s.get(task, {})}


def _arrow(better: dict, task: str, metric: str) -> str:
  up = better.get(task, {}).get(metric.split(',')[0])
  return '' if up is None else (' ↑' if up else ' ↓')


def _paired(arms: dict, reference: str) -> list[dict]:
  """Each arm but `reference`, each (task, metric): the arm minus the
  reference over their common seeds (a `stats.Estimate`) and the smallest
  difference those seeds detect (`stats.detectable`)."""
  found = []
  for label, by_seed in arms.items():
    if label == reference:
      continue
    for task, metric in _keys(arms):
      mine = _values(by_seed, task, metric)
      base = _values(arms[reference], task, metric)
      seeds = sorted(mine.keys() & base.keys())
      a, b = [mine[s] for s in seeds], [base[s] for s in seeds]
      if not seeds or not all(map(math.isfinite, a + b)):
        continue  # No pair, or a score stats cannot average (inf).
      d = stats.paired(a, b)
      found.append(dict(
          arm=label, reference=reference, task=task, metric=metric,
          seeds=seeds, values=a, reference_values=b, difference=d,
          detectable=stats.detectable(d.sd, d.n)))
  return found


def comparisons(arms: dict, reference: str) -> list[dict]:
  """results.json's paired differences (`_paired`; an interval of one
  seed is infinite, which `study.to_json` writes as 'inf'). arms: {label:
  {seed: {task: {metric: value}}}}."""
  return [{**c, 'difference': c['difference'].as_dict()}
          for c in _paired(arms, reference)]


def _estimate(values: list[float]) -> str:
  if not values:
    return '-'
  if not all(map(math.isfinite, values)):
    return ', '.join(f'{v:.4g}' for v in values)
  return format(stats.mean(values), '.4g')


def lines(arms: dict, reference: str, better: dict | None = None
          ) -> list[str]:
  """Markdown: each arm's scores, mean [95% t interval] over seeds; the
  scores by seed; each arm minus `reference`, paired by seed, with the
  sd of the differences and the detectable difference. better: {task:
  {metric: higher is better}} for the arrows."""
  better = better or {}
  labels = list(arms)
  seeds = sorted({s for by_seed in arms.values() for s in by_seed})
  keys = _keys(arms)
  out = ['Mean [95% interval] over seeds:', '', *report.table(
      ['task', 'metric', *labels],
      [[task, metric + _arrow(better, task, metric),
        *(_estimate(list(_values(arms[a], task, metric).values()))
          for a in labels)] for task, metric in keys])]
  out += ['', 'By seed:', '', *report.table(
      ['task', 'metric', 'seed', *labels],
      [[task, metric, seed, *('-' if v is None else f'{v:.4g}' for v in (
          _values(arms[a], task, metric).get(seed) for a in labels))]
       for task, metric in keys for seed in seeds])]
  found = _paired(arms, reference)
  if found:
    out += ['', f'Paired by seed, each minus {reference} (a difference '
            'below the detectable one is not claimed):', '', *report.table(
                ['task', 'metric', 'arm', 'difference [95% interval]',
                 'sd of differences', 'detectable'],
                [_paired_cells(c, better) for c in found])]
  return out


def _paired_cells(c: dict, better: dict) -> list:
  """A row of the paired table: an arm's difference on a task's metric."""
  d = c['difference']
  return [c['task'], c['metric'] + _arrow(better, c['task'], c['metric']),
          c['arm'], f'{d:+.4g}', f'{d.sd:.4g}' if d.n > 1 else '-',
          f'{c["detectable"]:.4g}' if math.isfinite(c['detectable'])
          else '-']
