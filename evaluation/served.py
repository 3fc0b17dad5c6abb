"""Tasks scored through a completions server: lm_eval's `local-completions`.

  from evaluation import served
  scored = served.evaluate('http://127.0.0.1:8000', model='tiny',
                           max_len=1024, tasks=['gqa_lab_fewshot'],
                           include_path='tests/lm_eval_tasks')
  scored.responses['gqa_lab_fewshot']  # each document's, in document order

The model_args are those docs/serving.md gives a user: the server's own
tokenizer through its /tokenize route (tokenizer_backend=remote), so the
requests are token ids; max_length the model's max_len (local-completions
assumes 2048 and would send contexts the server refuses). Requests go
batch_size prompts to a POST, num_concurrent POSTs at a time (lm_eval's
defaults: 1, one batch after another). `metadata` reaches the tasks'
`custom_dataset` functions (as `lm_eval --metadata` does): the local
few-shot task takes `shots_seed` there.
"""

from __future__ import annotations

import dataclasses
import time
from unittest import mock

from evaluation import evaluate as evaluate_lib


# The model's methods lm_eval calls with a task's requests.
REQUEST_TYPES = ('generate_until', 'loglikelihood', 'loglikelihood_rolling')


@dataclasses.dataclass
class Scored:
  """responses: {task: [each document's filtered responses]}; contexts:
  {task: [each document's first request's context]}; metrics: {task:
  lm_eval's metrics}; seconds: wall time of lm_eval's evaluation (tasks
  built, every request answered, metrics computed); request_seconds: the
  part in the model's request methods (contexts tokenized through the
  server's /tokenize, then the completions POSTs), without lm_eval's own
  work (building each document's prompt, scoring)."""
  responses: dict
  contexts: dict
  metrics: dict
  seconds: float
  request_seconds: float


def _time_requests(lm) -> list[float]:
  """The seconds of each call lm_eval makes to lm's request methods, as
  they come (the methods wrapped on the instance)."""
  seconds = []
  for name in REQUEST_TYPES:
    def timed(*args, _method=getattr(lm, name), **kwargs):
      start = time.perf_counter()
      try:
        return _method(*args, **kwargs)
      finally:
        seconds.append(time.perf_counter() - start)
    setattr(lm, name, timed)
  return seconds


def evaluate(url: str, *, model: str, max_len: int, tasks: list[str],
             include_path: str | None = None, limit: int | None = None,
             num_fewshot: int | None = None, batch_size: int = 16,
             num_concurrent: int = 1, metadata: dict | None = None
             ) -> Scored:
  """lm_eval.simple_evaluate of `local-completions` against the server at
  url (its base, http://host:port) on tasks."""
  evaluate_lib.require_lm_eval()
  import lm_eval  # pylint: disable=import-outside-toplevel
  from lm_eval import evaluator  # pylint: disable=import-outside-toplevel
  from lm_eval.api.registry import get_model  # pylint: disable=import-outside-toplevel
  manager = evaluate_lib.task_manager(tasks, include_path, metadata=metadata)
  model_args = {'model': model, 'base_url': f'{url}/v1/completions',
                'tokenizer_backend': 'remote', 'max_length': max_len,
                'batch_size': batch_size, 'num_concurrent': num_concurrent,
                'max_retries': 1}
  lm = get_model('local-completions').create_from_arg_obj(model_args)
  requests = _time_requests(lm)
  start = time.perf_counter()
  # Its add_env_info runs torch's collect_env (pip list and more, seconds
  # in subprocesses) for keys not kept here; not part of scoring.
  with mock.patch.object(evaluator, 'add_env_info', lambda _: None):
    results = lm_eval.simple_evaluate(
        model=lm, tasks=tasks,
        task_manager=manager, limit=limit, num_fewshot=num_fewshot,
        log_samples=True, bootstrap_iters=0)
  seconds = time.perf_counter() - start
  samples = {task: sorted(rows, key=lambda s: s['doc_id'])
             for task, rows in results['samples'].items()}
  return Scored(
      responses={t: [s['filtered_resps'] for s in rows]
                 for t, rows in samples.items()},
      contexts={t: [s['arguments'][0][0] for s in rows]
                for t, rows in samples.items()},
      metrics={t: results['results'][t] for t in samples},
      seconds=seconds, request_seconds=sum(requests))
