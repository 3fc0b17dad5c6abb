"""Loads a task's JSON Lines file beside its YAML (nothing downloaded;
datasets' `json` builder would resolve a relative path against the working
directory instead)."""

import json
import pathlib

import datasets


def load(data_files: str, **unused):
  del unused  # lm_eval passes the task's metadata too.
  path = pathlib.Path(__file__).parent / data_files
  rows = [json.loads(line) for line in path.read_text().splitlines() if line]
  return datasets.DatasetDict({'test': datasets.Dataset.from_list(rows)})
