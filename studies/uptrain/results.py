"""results.json and the report of its design: the single-source design's
(`single_tables`) or the source-replicated one's (`replicated_report`,
results that hold 'sources'), each a function of results.json alone."""

from __future__ import annotations

import pathlib

from studies import report, study
from studies.uptrain import (replicated_report, replicated_summary,
                             single_summary, single_tables)


def _design(results: dict):
  """(its summary, its report) modules of the design RESULTS is of."""
  if 'sources' in results:
    return replicated_summary, replicated_report
  return single_summary, single_tables


def text(results: dict) -> str:
  """The report.md RESULTS makes."""
  return _design(results)[1].text(results)


def write(out: pathlib.Path, results: dict):
  """OUT/results.json with its summary, and the report of its design."""
  summary, report_ = _design(results)
  results['summary'] = summary.summary(results)
  (out / 'results.json').write_text(study.to_json(results))
  report_.write(out, results)


def rebuild(out: pathlib.Path, module: str):
  """--report_only: the per-seed results as trained (OUT/results.json);
  the statistics and the reading as this commit computes them, the rebuild
  recorded beside the runs' provenance (as `python -m MODULE`)."""
  results = study.saved(out / 'results.json')
  report.record_rebuild(results['provenance'], module, out)
  write(out, results)
