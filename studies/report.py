"""What every study's report.md is made of, written once: provenance
sentences, the rebuild line, estimates with their intervals, tables,
sections, bullets, figures, and the plots' matplotlib.

A report is a function of its study's saved results alone (so
`--report_only` rebuilds it byte for byte): a study composes these pieces
into lines and `document` joins them. The verdicts are `studies.stats`'s
(`stats.decide`); this module only writes them down.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

from infra import provenance
from studies import stats

# --- provenance ---------------------------------------------------------------


def command_at(run: Mapping, *, out: bool = False,
               unknown: str = 'a machine not recorded') -> str:
  """'`COMMAND` at commit C (--out O) on MACHINE' of a provenance record
  (`infra.provenance.record`, as a results file saved it): '(--out O)'
  where `out`, the machine where recorded, else `unknown` after ' on '
  (a record without its machine says so); where the checkout had moved by
  the command's end (`provenance.ended`), 'at commit C (the checkout at D
  by its end)'."""
  text = f'`{run["command"]}` at commit {run["commit"]}'
  if run.get('commit_at_end'):
    text += f' (the checkout at {run["commit_at_end"]} by its end)'
  if out:
    text += f' (--out {run["out"]})'
  return f'{text} on {machine(run, unknown)}'


def machine(run: Mapping, unknown: str = 'a machine not recorded') -> str:
  """The machine of a provenance record, in words (`provenance.describe`),
  or UNKNOWN where it records none."""
  return provenance.describe(run['machine']) if run.get('machine') else unknown


# A report rebuilt from its saved results (--report_only) says where, on a
# line of its own that starts with this (the tests that rebuild a published
# report normalise that line alone: the commit and machine of the rebuild).
REBUILT = 'Statistics and reading rebuilt'


def record_rebuild(prov: dict, module: str, out) -> dict:
  """PROV (a results file's provenance, as saved) with this rebuild beside
  it, never in its place: 'rebuilt' (the command, commit and machine of
  this --report_only: `python -m MODULE ...`), and the statistics
  convention the rebuild applies."""
  now = provenance.record(module, out)
  prov.update(statistics=stats.CONVENTION, rebuilt={
      k: now[k] for k in ('command', 'commit', 'machine')})
  return prov


def rebuilt_lines(prov: dict, source: str) -> list[str]:
  """The report's rebuild line (`REBUILT` from SOURCE by ...) and a blank
  line, or none when the results were not rebuilt."""
  if 'rebuilt' not in prov:
    return []
  return [f'{REBUILT} from {source} by {command_at(prov["rebuilt"])}.', '']


def normalise_rebuilt(report: str) -> str:
  """REPORT with its rebuild line (`REBUILT` ...) replaced by the prefix
  alone: what a rebuild at another commit or machine leaves unchanged."""
  return '\n'.join(REBUILT if line.startswith(REBUILT) else line
                   for line in report.split('\n'))


def published_problems(folder: str, prov: Mapping, text: str, module: str,
                       source: str, made: Mapping | None = None
                       ) -> list[str]:
  """What is untrue in the provenance of the published report FOLDER/
  report.md (TEXT, made from FOLDER/SOURCE, whose provenance PROV holds
  the rebuild; MADE: the measuring command's record, PROV where not
  given), one line each, naming the report and what to do; [] when none:
  numbers measured, or a report rebuilt, at a commit with uncommitted
  changes (`provenance.DIRTY`) or at none known; a rebuild line that is
  not the one PROV records (a hand edit); a recorded rebuild that does
  not rebuild FOLDER (`python -m MODULE --out=FOLDER --report_only`); a
  rebuild at a commit this checkout's history does not hold."""
  made = prov if made is None else made
  again = f'python -m {module} --out={folder} --report_only'
  found = []
  if made.get('commit') and not provenance.is_clean(made['commit']):
    found.append(f'{folder}/{source}: measured at commit {made["commit"]}, '
                 'which no commit holds: rerun its command at a clean commit')
  rebuilt = prov.get('rebuilt')
  if rebuilt is None:
    return found
  if not provenance.is_clean(rebuilt['commit']):
    found.append(f'{folder}/report.md: rebuilt at commit {rebuilt["commit"]}'
                 ' (not a clean commit): commit the changes, then rebuild it '
                 f'at the clean commit: {again}')
  elif provenance.in_history(rebuilt['commit']) is False:
    found.append(f'{folder}/report.md: rebuilt at commit {rebuilt["commit"]}'
                 f', not in this history: rebuild it: {again}')
  if rebuilt['command'] != again:
    found.append(f'{folder}/{source}: its rebuild was `{rebuilt["command"]}`'
                 f', which does not rebuild this folder: rebuild it: {again}')
  line = rebuilt_lines(prov, source)[0]
  if any(l.startswith(REBUILT) and l != line for l in text.split('\n')):
    found.append(f'{folder}/report.md: its rebuild line is not the one '
                 f'{source} records ({line!r}): rebuild it: {again}')
  return found


# --- numbers ----------------------------------------------------------------


def interval(est: stats.Estimate | Mapping, spec: str = '+.4f',
             unit: str = 'seed') -> str:
  """'mean [low, high]' of an estimate (or its as_dict()); '(1 seed)' or
  '(equal on all n seeds)' where it has no interval (stats.CONVENTION).
  unit: the unit of replication ('source' where sources are)."""
  e = stats.as_estimate(est)
  if e.n < 2:
    return f'{e.mean:{spec}} (1 {unit})'
  if e.deterministic:
    return f'{e.mean:{spec}} (equal on all {e.n} {unit}s)'
  return f'{e.mean:{spec}} [{e.low:{spec}}, {e.high:{spec}}]'


def mean_sd(values: Sequence[float], spec: str = '.4f') -> str:
  """'mean ± sd' over seeds ('mean' alone for one seed; '-' when nothing
  was measured, every value NaN)."""
  x = np.asarray(values, float)
  if np.isnan(x).all():
    return '-'
  if len(x) == 1:
    return f'{x[0]:{spec}}'
  return f'{x.mean():{spec}} ± {x.std(ddof=1):{spec}}'


def number(value: float, spec: str = '.4f', missing: str = '-') -> str:
  """VALUE in SPEC, or `missing` where it is not finite (an sd of one seed,
  a detectable effect of no spread)."""
  return f'{value:{spec}}' if math.isfinite(value) else missing


def share(ratios: Sequence[float]) -> str:
  """A range of ratios as percentages: '50%' or '50-75%'."""
  low, high = (f'{100 * min(ratios):.0f}', f'{100 * max(ratios):.0f}')
  return f'{low}%' if low == high else f'{low}-{high}%'


# --- markdown ---------------------------------------------------------------


def row(cells: Iterable) -> str:
  """'| a | b |'."""
  return '| ' + ' | '.join(map(str, cells)) + ' |'


def table(head: Sequence, rows: Iterable[Iterable]) -> list[str]:
  """A markdown table: the head, its rule and one line per row of cells.
  A head cell '' is a column without a heading ('| |')."""
  top = '|' + '|'.join(f' {h} ' if h != '' else ' ' for h in head) + '|'
  return [top, '|' + '---|' * len(head), *map(row, rows)]


def section(title: str, level: int = 2) -> list[str]:
  """'## TITLE' and a blank line."""
  return [f'{"#" * level} {title}', '']


def bullets(items: Iterable[str]) -> list[str]:
  return [f'- {item}' for item in items]


def figure(alt: str, file: str) -> str:
  return f'![{alt}]({file})'


def document(lines: Iterable[str]) -> str:
  """The report's text: its lines joined."""
  return '\n'.join(lines)


# --- plots ------------------------------------------------------------------


def pyplot():
  """matplotlib.pyplot drawing to files (no display), imported when a
  report draws (a study that only reads its numbers never does)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def save(fig, path, dpi: int = 100):
  """FIG laid out, written to PATH and closed."""
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)
