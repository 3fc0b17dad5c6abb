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


def command_at(run: Mapping, *, out: bool = False, unknown: str = '') -> str:
  """'`COMMAND` at commit C (--out O) on MACHINE' of a provenance record
  (`infra.provenance.record`, as a results file saved it): '(--out O)'
  where `out`, the machine where recorded, else `unknown` after ' on '
  when given."""
  text = f'`{run["command"]}` at commit {run["commit"]}'
  if out:
    text += f' (--out {run["out"]})'
  if run.get('machine'):
    return f'{text} on {provenance.describe(run["machine"])}'
  return f'{text} on {unknown}' if unknown else text


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
