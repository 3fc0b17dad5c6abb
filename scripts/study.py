"""What every study script shares: its common flags, a run trained once and
quietly, a saved result read back for --report_only."""

from __future__ import annotations

import contextlib
import json
import pathlib

from train import loop
from train.cli import ArgumentParser, int_list, positive_int
from train.errors import UserError


def parser(doc: str, *, config: str, kv_heads: list[int] | None = None,
           seeds: int | None = None, report_only: str | None = None,
           helps: dict[str, str] | None = None) -> ArgumentParser:
  """The flags every study takes: --out, --config, --kv_heads, --seeds,
  --steps, --quick and (where the study can rebuild its report from what
  it saved, `report_only` says from what) --report_only; `helps` says
  what a default of None means for each."""
  helps = helps or {}
  p = ArgumentParser(description=doc.split('\n')[0])
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


def saved(path: pathlib.Path) -> dict:
  """What a finished run or study saved (JSON), for --report_only."""
  if not path.exists():
    raise UserError(f'{path} not found: --report_only rebuilds the report '
                    'from finished runs in --out; run without it first')
  return json.loads(path.read_text())


def train(config, workdir: pathlib.Path, log: pathlib.Path,
          on_eval=None) -> dict:
  """`train.main`'s loop, its lines (and warnings) in LOG; a finished run
  (WORKDIR/final.json) is reused, an interrupted one resumed. on_eval: the
  loop's (returning True ends the run there, as finished)."""
  final = workdir / 'final.json'
  if final.exists():
    return json.loads(final.read_text())
  log.parent.mkdir(parents=True, exist_ok=True)
  with log.open('a') as f, contextlib.redirect_stdout(f), (
      contextlib.redirect_stderr(f)):
    return loop.train_and_evaluate(config, str(workdir), on_eval=on_eval)
