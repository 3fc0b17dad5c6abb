"""The local tasks' documents, built here (nothing downloaded): `load`
reads a task's JSON Lines file beside its YAML (datasets' `json` builder
would resolve a relative path against the working directory instead);
`sums` draws a few-shot task's documents from a seed."""

import json
import pathlib

import datasets
import numpy as np


def load(data_files: str, **unused):
  del unused  # lm_eval passes the task's metadata too.
  path = pathlib.Path(__file__).parent / data_files
  rows = [json.loads(line) for line in path.read_text().splitlines() if line]
  return datasets.DatasetDict({'test': datasets.Dataset.from_list(rows)})


def sums(docs: int = 256, shots: int = 64, shots_seed: int = 0, **unused):
  """Sums of two numbers in 10..99: `docs` to answer ('test') and `shots`
  examples ('train'), drawn by numpy's generator seeded by `shots_seed`
  (lm_eval's task metadata: another seed, other shots, so a benchmark can
  start each pass with a prefix no earlier pass cached)."""
  del unused  # lm_eval passes the task's other metadata too.
  rng = np.random.default_rng(int(shots_seed))

  def split(n):
    a, b = rng.integers(10, 100, size=(2, int(n)))
    return datasets.Dataset.from_list(
        [{'question': f'{x} + {y} =', 'answer': str(x + y)}
         for x, y in zip(a.tolist(), b.tolist())])
  return datasets.DatasetDict({'train': split(shots), 'test': split(docs)})
