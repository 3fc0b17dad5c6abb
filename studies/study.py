"""What every study shares: its common flags, a run trained once and
quietly, a conversion made once, a result saved as strict JSON and read
back for --report_only.

Reuse is keyed by content: a finished run is reused only under the settings
it was trained with (`check_reusable`), a conversion only while the
parameters it was made from and its settings are the same (`made_once`:
the source's fingerprint, `lm.checkpoint.fingerprint`), and a run that
starts from a conversion only while that conversion is the one it started
from (`train`'s `start`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import shutil
from typing import Callable

from train import loop
from lm import checkpoint
from lm import config_lib
from infra import provenance
from infra.cli import ArgumentParser, int_list, positive_int
from infra.errors import UserError


def parser(doc: str, *, config: str, kv_heads: list[int] | None = None,
           seeds: int | None = None, report_only: str | None = None,
           helps: dict[str, str] | None = None) -> ArgumentParser:
  """The flags every study takes: --out, --config, --kv_heads, --seeds,
  --steps, --quick and (where the study can rebuild its report from what
  it saved, `report_only` says from what) --report_only; `helps` says
  what a default of None means for each."""
  helps = helps or {}
  p = ArgumentParser(description=doc)
  p.add_argument('--out', required=True)
  p.add_argument('--config', default=config, help=helps.get('config'))
  p.add_argument('--kv_heads', type=int_list, default=kv_heads,
                 help=helps.get('kv_heads'))
  p.add_argument('--seeds', type=positive_int, default=seeds,
                 help=helps.get('seeds'))
  p.add_argument('--steps', type=positive_int, default=None,
                 help=helps.get('steps'))
  p.add_argument('--quick', action='store_true', help=helps.get('quick'))
  if report_only:
    p.add_argument('--report_only', action='store_true',
                   help=f'rebuild the report from {report_only}')
  return p


# Strict JSON has no infinities or NaN (Python writes the bare words
# Infinity and NaN, which jq, JavaScript and most JSON readers refuse); an
# unbounded interval (one seed, or every seed equal) is saved as these
# strings and read back as floats.
NON_FINITE = {'inf': math.inf, '-inf': -math.inf, 'nan': math.nan}


def to_json(result) -> str:
  """`result` (Python numbers, strings, lists and dicts) as strict JSON,
  indented: a non-finite float as 'inf', '-inf' or 'nan', which `saved`
  reads back as floats (so no text a study saves may be one of those)."""
  def strict(x):
    if isinstance(x, float) and not math.isfinite(x):
      return 'nan' if math.isnan(x) else ('inf' if x > 0 else '-inf')
    if isinstance(x, dict):
      return {k: strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [strict(v) for v in x]
    return x
  return json.dumps(strict(result), indent=1, allow_nan=False)


def saved(path: pathlib.Path) -> dict:
  """What a finished run or study saved (JSON, `to_json`'s or Python's own
  with bare Infinity), for --report_only."""
  if not path.is_file():
    raise UserError(f'{path} not found' + (' (a folder)' if path.exists()
                                           else '') +
                    ': --report_only rebuilds the report from finished runs '
                    'in --out; run without it first')
  def floats(x):
    if isinstance(x, str):
      return NON_FINITE.get(x, x)
    if isinstance(x, dict):
      return {k: floats(v) for k, v in x.items()}
    if isinstance(x, list):
      return [floats(v) for v in x]
    return x
  try:
    return floats(json.loads(path.read_text()))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f'{path} is not the JSON a study writes ({e}); rerun the '
                    'study without --report_only (finished runs are '
                    'reused)') from None


# Settings that cannot change a run's numbers (how often it logs and saves,
# where tokenized data is cached): a finished run that differs from the one
# asked for only in these is that run. Every other field must match.
CANNOT_CHANGE_RESULTS = frozenset({
    'train.log_every', 'train.checkpoint_every', 'train.keep_checkpoints',
    'data.cache_dir'})


def _flat(config) -> dict:
  """{'section.field': value} of a config, as its JSON holds it."""
  def walk(node, prefix):
    if not isinstance(node, dict):
      return {prefix: node}
    return {k: v for key, value in node.items()
            for k, v in walk(value, f'{prefix}.{key}' if prefix else key
                             ).items()}
  return walk(json.loads(config.to_json()), '')


def differences(old, new) -> list[str]:
  """'field old -> new' for each setting, outside CANNOT_CHANGE_RESULTS,
  in which config `new` differs from `old`."""
  a, b = _flat(old), _flat(new)
  return [f'{key} {a.get(key, "(absent)")} -> {b.get(key, "(absent)")}'
          for key in sorted(a.keys() | b.keys())
          if key not in CANNOT_CHANGE_RESULTS and a.get(key) != b.get(key)]


# Beside each run, the settings the study asked it to train with, written
# before its first step: train.main's resume takes schedule, data and seed
# changes (config_lib.RESUME_MAY_CHANGE), so an interrupted run's own
# config.json cannot say whether it was started by this study's settings.
REQUESTED = 'study_config.json'


def _refuse_if_changed(recorded: pathlib.Path, config, workdir: pathlib.Path,
                       what: str, consequence: str):
  changed = differences(config_lib.from_json(recorded), config)
  if changed:
    shown = '; '.join(changed[:5]) + (
        f'; and {len(changed) - 5} more' if len(changed) > 5 else '')
    raise UserError(f'{workdir} holds {what} with other settings ({shown})'
                    f'{consequence}; give another --out, or delete {workdir} '
                    'to train it again')


def check_reusable(config, workdir: pathlib.Path,
                   start: pathlib.Path | None = None):
  """Refuses, in one line, a finished run in WORKDIR (final.json) whose
  config.json is not `config` (a study reusing it would report its numbers
  under settings it was not trained with), and an interrupted one that this
  or another study started with other settings (resuming it would mix the
  two); with `start` (the conversion it starts from, `made_once`'s), a run
  started from another conversion than START holds now. Call it for every
  run before any trains, so that a study is refused at its start, not
  hours in."""
  if start is not None and workdir.exists():
    _check_start(workdir, start)
  if not finished(workdir):
    if (workdir / REQUESTED).exists():
      _refuse_if_changed(workdir / REQUESTED, config, workdir,
                         'an interrupted run', ', and resuming it would mix '
                         'the two')
    return  # Nothing started, or started as asked: trained (or resumed).
  written = workdir / 'config.json'
  if not written.exists():
    raise UserError(f'{workdir} holds a finished run without its config.json, '
                    'so its settings are unknown; give another --out, or '
                    f'delete {workdir} to train it again')
  _refuse_if_changed(written, config, workdir, 'a finished run', '')


def train(config, workdir: pathlib.Path, log: pathlib.Path, *,
          on_eval=None, start: pathlib.Path | None = None) -> dict:
  """`train.main`'s loop, its lines (and warnings) in LOG; a finished run
  (WORKDIR/final.json) is reused if it was trained with `config`
  (`check_reusable`, refused otherwise), an interrupted one resumed.
  on_eval: the loop's (returning True ends the run there, as finished).
  start: a conversion (`made_once`'s workdir) the run starts from, copied
  into WORKDIR with its record of what it was made from, which a rerun
  checks."""
  check_reusable(config, workdir, start)
  if finished(workdir):
    return json.loads((workdir / 'final.json').read_text())
  if start is not None and not workdir.exists():
    shutil.copytree(start, workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  requested = workdir / REQUESTED
  if not requested.exists():
    partial = requested.with_suffix('.partial')
    partial.write_text(config.to_json(indent=2))
    partial.replace(requested)
  log.parent.mkdir(parents=True, exist_ok=True)
  # Where this run was trained (the commit as it starts, not as it ends):
  # a study that reuses it later says so.
  trained = provenance.record('studies.study', workdir)
  with log.open('a') as f, contextlib.redirect_stdout(f), (
      contextlib.redirect_stderr(f)):
    record = loop.train_and_evaluate(config, str(workdir), on_eval=on_eval)
  (workdir / TRAINED_BY).write_text(json.dumps(provenance.ended(
      {k: trained[k] for k in ('commit', 'machine')})))
  return record


TRAINED_BY = 'trained_by.json'  # Beside a run `train` trained: its commit.


def finished(workdir: pathlib.Path) -> bool:
  """Whether WORKDIR holds a finished run (which `train` would reuse): a
  final.json that is not a stop's (the loop writes one, with 'stopped_at',
  when a signal stops a run mid-way; that run is resumed, not reused)."""
  final = pathlib.Path(workdir) / 'final.json'
  return final.exists() and 'stopped_at' not in json.loads(final.read_text())


_FINGERPRINTS: dict = {}


def fingerprint(workdir: pathlib.Path) -> str:
  """The parameters of WORKDIR's latest checkpoint, as 16 hex digits
  (`lm.checkpoint.fingerprint`); computed once per checkpoint a
  process reads (keyed by its folder's path, step and modification time,
  so a checkpoint written again is read again)."""
  root = pathlib.Path(workdir) / 'checkpoints'
  steps = [p for p in root.iterdir() if p.name.isdigit()] if root.is_dir() \
      else []
  latest = max(steps, key=lambda p: int(p.name), default=None)
  key = (str(latest and latest.resolve()),
         latest and latest.stat().st_mtime_ns)
  if latest is None or key not in _FINGERPRINTS:
    _, state = checkpoint.restore_latest(workdir)
    _FINGERPRINTS[key] = checkpoint.fingerprint(state['params'])
  return _FINGERPRINTS[key]


# Beside a conversion `made_once` made: what it was made from (the source's
# parameters and the conversion's settings). A run that starts from it
# carries a copy (`train`'s start), which a rerun compares.
MADE_FROM = 'made_from.json'


def made_once(workdir: pathlib.Path, inputs: dict,
              make: Callable[[], object]) -> pathlib.Path:
  """WORKDIR as make() writes it from `inputs` (what decides it: e.g.
  {'source': fingerprint(SOURCE), 'method': 'mean', 'K': 2}), made once:
  reused while its record (WORKDIR/made_from.json) holds the same inputs,
  refused in one line when it holds others (runs may have started from
  it), made again when it has none (interrupted, or made before records
  were kept)."""
  record = workdir / MADE_FROM
  if record.exists():
    made = json.loads(record.read_text())
    if made == inputs:
      return workdir
    changed = '; '.join(f'{k} {made.get(k, "(absent)")} -> '
                        f'{inputs.get(k, "(absent)")}'
                        for k in sorted(made.keys() | inputs.keys())
                        if made.get(k) != inputs.get(k))
    raise UserError(f'{workdir} holds a conversion made from other inputs '
                    f'({changed}); give another --out, or delete {workdir} '
                    'and the runs started from it to make it again')
  shutil.rmtree(workdir, ignore_errors=True)
  workdir.parent.mkdir(parents=True, exist_ok=True)
  make()
  partial = record.with_suffix('.partial')
  partial.write_text(json.dumps(inputs, indent=1))
  partial.replace(record)
  return workdir


def _check_start(workdir: pathlib.Path, start: pathlib.Path):
  """Refuses a run in WORKDIR started from another conversion than the one
  START holds now (its copy of made_from.json differs, or has none)."""
  read = lambda p: json.loads(p.read_text()) if p.exists() else None
  mine, now = read(workdir / MADE_FROM), read(start / MADE_FROM)
  if mine != now:
    what = ('no record of it (made before studies kept one)' if mine is None
            else f'made from {mine}, not {now}')
    raise UserError(f'{workdir} holds a run started from another conversion '
                    f'than {start} ({what}); give another --out, or delete '
                    f'{workdir} to train it again')


def run_records(workdirs) -> dict[str, dict | None]:
  """{name: {'commit', 'machine'}} of each run in WORKDIRS, as its
  TRAINED_BY recorded where it was trained (None: a run with no record,
  trained before runs kept one). A run's name is its folder's path below
  the folder all of WORKDIRS share ('K2_s1', 'S400_s1/source')."""
  paths = [pathlib.Path(w) for w in workdirs]
  if not paths:
    return {}
  root = pathlib.Path(os.path.commonpath(paths))
  root = root.parent if len(paths) == 1 else root
  read = lambda p: json.loads(p.read_text()) if p.exists() else None
  return {str(w.relative_to(root)): read(w / TRAINED_BY) for w in paths}


def describe_runs(records: dict[str, dict | None]) -> str | None:
  """Where the runs of RECORDS (`run_records`) were trained, in one line:
  'commit C on MACHINE (n runs)' per commit and machine, the runs named
  where the machine is not recorded ('commit C on a machine not recorded
  (2 runs: K8_s1, K8_s2)'), then the runs with no record, named ('1 run
  with no record: K1_s3'); never a run left out. None when RECORDS is
  empty."""
  found, unknown = {}, []
  for name, r in records.items():
    if r is None:
      unknown.append(name)
      continue
    machine = r.get('machine') and provenance.describe(r['machine'])
    c = r.get('commit') or 'not recorded'
    if r.get('commit_at_end'):
      c += f' (the checkout at {r["commit_at_end"]} by its end)'
    found.setdefault((c, machine or ''), []).append(name)
  runs = lambda names: f'{len(names)} run{"s" * (len(names) != 1)}'
  parts = [f'commit {c} on {m} ({runs(names)})' if m else
           f'commit {c} on a machine not recorded ({runs(names)}: '
           f'{", ".join(names)})'
           for (c, m), names in sorted(found.items())]
  if unknown:
    parts.append(f'{runs(unknown)} with no record: {", ".join(unknown)}')
  return '; '.join(parts) or None


def trained_by(workdirs) -> str | None:
  """Where the runs in WORKDIRS were trained (`describe_runs` of their
  `run_records`); None when there are none."""
  return describe_runs(run_records(workdirs))
