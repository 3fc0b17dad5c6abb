"""What every study script does with a run: train it once, quietly."""

from __future__ import annotations

import contextlib
import json
import pathlib

from train import loop


def train(config, workdir: pathlib.Path, log: pathlib.Path) -> dict:
  """`train.main`'s loop, its lines (and warnings) in LOG; a finished run
  (WORKDIR/final.json) is reused, an interrupted one resumed."""
  final = workdir / 'final.json'
  if final.exists():
    return json.loads(final.read_text())
  log.parent.mkdir(parents=True, exist_ok=True)
  with log.open('a') as f, contextlib.redirect_stdout(f), (
      contextlib.redirect_stderr(f)):
    return loop.train_and_evaluate(config, str(workdir))
