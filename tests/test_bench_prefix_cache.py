"""scripts/bench_prefix_cache.py at tiny sizes, and the few-shot task its
--harness mode scores.

- The made-up trace: caching computes fewer prompt tokens (those it found
  cached: the shared prefix's full page, for every request admitted after
  the first two, which run together in two slots and find nothing cached
  yet), and the tokens are identical with it on and off.
- gqa_lab_fewshot (tests/lm_eval_tasks): every document's prompt starts
  with the same shots, the first num_fewshot of their split; another
  shots_seed starts with other shots (each benchmark pass cold); lm_eval's
  default sampler, the control, shares less than one shot.
- --harness: lm_eval's local-completions through two servers, caching on
  and off: the same generations and metrics, and with caching on the
  shots' full pages found cached for every document after the first POST;
  and its checks fail (exit status 1) on a generation that differs, a
  server that counts another number of requests, one that does not drain.
"""

import json
import os
import pathlib

import pytest

from evaluation import served
from scripts import bench_prefix_cache
from tests import api_server
from tests.lm_eval_tasks import local_data

TASK = pathlib.Path(__file__).parent / 'lm_eval_tasks' / 'gqa_lab_fewshot.yaml'


@pytest.mark.slow
def test_caching_skips_the_shared_prefix_and_changes_no_token(trained,
                                                             tmp_path):
  out = tmp_path / 'out'
  status = bench_prefix_cache.main([
      f'--workdir={trained}', '--requests=6', '--prefix_len=16',
      '--suffix_len=2,4', '--new_tokens=4', '--kv_memory=1MiB',
      '--slots=2', '--repeats=1', f'--out={out}'])
  result = json.loads((out / 'bench_prefix_cache.json').read_text())
  assert status == 0 and result['identical']
  on, off = result['on'], result['off']
  assert off['cached_tokens'] == 0 and on['cached_tokens'] >= 16 * 3
  assert on['prefill_tokens'] == off['prefill_tokens'] - on['cached_tokens']


def _contexts(**overrides) -> list[str]:
  """The prompts of gqa_lab_fewshot's first 8 documents, its YAML's
  settings replaced by overrides."""
  pytest.importorskip('lm_eval')
  from lm_eval.api.task import ConfigurableTask  # pylint: disable=import-outside-toplevel
  from lm_eval.tasks import _yaml_loader  # pylint: disable=import-outside-toplevel
  task = ConfigurableTask(config=_yaml_loader.load_yaml(TASK) | overrides)
  task.build_all_requests(limit=8)
  return [instance.args[0] for instance in task.instances]


def test_the_fewshot_tasks_prompts_start_with_the_same_shots():
  contexts = _contexts()
  shots = [f'{d["question"]} {d["answer"]}\n'
           for d in local_data.sums()['train']][:40]
  docs = local_data.sums()['test']
  assert contexts == [''.join(shots) + d['question'] for d in docs][:8]
  other = _contexts(metadata={'shots_seed': 1})
  assert len(os.path.commonprefix([contexts[0], other[0]])) < 16  # A page.
  drawn = _contexts(fewshot_config={'sampler': 'default'})  # The control.
  assert len(os.path.commonprefix(drawn)) < len(shots[0])


def test_harness_flags_are_refused_without_harness_and_back():
  with pytest.raises(bench_prefix_cache.UserError, match='--task is read '
                     'only with --harness; add --harness or drop it'):
    bench_prefix_cache.parse(['--workdir=W', '--task=x'])
  with pytest.raises(bench_prefix_cache.UserError, match='--prefix_len, '
                     '--new_tokens are read only without --harness; drop '
                     'them'):
    bench_prefix_cache.parse(['--workdir=W', '--harness', '--prefix_len=8',
                              '--new_tokens=2'])


@pytest.mark.slowest
def test_harness_caching_skips_the_shots_and_changes_no_generation(
    tmp_path):
  pytest.importorskip('lm_eval')
  workdir = api_server.train_workdir(tmp_path / 'tiny', max_len=128,
                                     steps=2)
  out = tmp_path / 'out'
  status = bench_prefix_cache.main([
      f'--workdir={workdir}', '--harness', '--docs=6', '--num_fewshot=4',
      '--batch_size=2', '--kv_memory=1MiB', '--slots=2', '--repeats=1',
      f'--out={out}'])
  result = json.loads((out / 'bench_prefix_cache_harness.json').read_text())
  assert status == 0 and result['identical'] and not result['failures']
  on, off = result['on'], result['off']
  assert on['requests'] == off['requests'] == 6
  assert on['prompt_tokens'] == off['prompt_tokens']
  # 4 shots, 52-56 characters: 3 full pages of 16, found by the 4
  # documents after the first POST's 2 (which compute them side by side).
  assert on['shared_prefix_chars'] >= 48
  assert off['cached_tokens'] == 0 and on['cached_tokens'] >= 4 * 48
  assert on['prefill_tokens'] == off['prefill_tokens'] - on['cached_tokens']
  for r in (on, off):  # The requests are a part of lm_eval's evaluation.
    assert 0 < r['request_seconds'] < r['seconds']


class _FakeServer:
  """serve.process.ServerProcess's surface; each pass's requests counted
  as its /metrics would (drop: fewer), its exit status after SIGTERM."""
  drop, status = {True: 0, False: 0}, {True: 0, False: 0}
  by_url = {}

  def __init__(self, workdir, *flags):
    del workdir
    self.caching = '--noprefix_caching' not in flags
    self.url, self.finished = f'fake-{self.caching}', 0
    _FakeServer.by_url[self.url] = self

  def model(self):
    return {'id': 'fake', 'max_model_len': 64}

  def counters(self):
    return {'gqa_lab_requests_finished_total': self.finished}

  def stop(self):
    return self.status[self.caching]


def _fake_evaluate(differ: bool):
  """served.evaluate's surface: 3 documents, each one generation (another
  with caching off if differ)."""
  def evaluate(url, *, tasks, metadata, **unused):
    del unused
    server = _FakeServer.by_url[url]
    server.finished += 3 - server.drop[server.caching]
    text = 'x' if server.caching or not differ else 'y'
    return served.Scored(
        responses={tasks[0]: [[text]] * 3}, contexts={tasks[0]: ['a'] * 3},
        metrics={tasks[0]: {'exact_match,none': 0.0}}, seconds=2.0,
        request_seconds=1.0)
  return evaluate


@pytest.mark.parametrize('fault', ['none', 'differ', 'drop', 'exit'])
def test_the_harness_checks_fail_on_what_they_catch(fault, monkeypatch,
                                                    capsys):
  monkeypatch.setattr(bench_prefix_cache.process, 'ServerProcess',
                      _FakeServer)
  monkeypatch.setattr(_FakeServer, 'drop', {True: 0, False: int(
      fault == 'drop')})
  monkeypatch.setattr(_FakeServer, 'status', {True: 0, False: int(
      fault == 'exit')})
  monkeypatch.setattr(bench_prefix_cache.served, 'evaluate',
                      _fake_evaluate(differ=fault == 'differ'))
  monkeypatch.setattr(bench_prefix_cache, 'COUNT_WAIT_S', 0.2)
  status = bench_prefix_cache.main(['--workdir=W', '--harness',
                                    '--repeats=2'])
  said = capsys.readouterr().out
  assert status == (0 if fault == 'none' else 1), said
  assert ('identical: NO' in said) == (fault == 'differ')
  assert ('a pass sent 3 requests and the server with caching off '
          'counted 2' in said) == (fault == 'drop')
  assert ('the server with caching off exited 1 after SIGTERM' in said) == (
      fault == 'exit')


@pytest.mark.slow  # lm_eval indexes its own ~15,000 tasks looking for it.
def test_an_unknown_task_is_refused_before_a_server_starts(monkeypatch):
  pytest.importorskip('lm_eval')
  monkeypatch.setattr(bench_prefix_cache.process, 'ServerProcess', None)
  with pytest.raises(bench_prefix_cache.UserError,
                     match="unknown task 'gqa_lab_nothing'"):
    bench_prefix_cache.main(['--workdir=W', '--harness',
                             '--task=gqa_lab_nothing'])
