"""scripts/load_test_server.py at tiny sizes: it runs end to end (a server
process, clients leaving mid-stream, serve.generate beside it) with every
check holding, and each of its checks fails on what it is there to catch:
a lost answer, a duplicated one, a text unlike serve.generate's, a request
the server did not finish, a pool not back to empty."""

import dataclasses
import json

import pytest

from scripts import load_test_server as lt


@pytest.mark.slowest
def test_the_load_test_runs_and_its_checks_hold(trained, tmp_path):
  out = tmp_path / 'out'
  status = lt.main([f'--workdir={trained}', '--clients=8',
                    '--disconnect=0.25', '--prompt_len=4,12',
                    '--output_len=4,16', '--kv_memory=1MiB', '--warmups=0',
                    f'--out={out}'])
  result = json.loads((out / 'load_test.json').read_text())
  assert status == 0 and result['failures'] == [], result['failures']
  assert result['clients'] == 8 and result['disconnects'] == 2
  for name in ('server', 'serve.generate'):
    assert result[name]['tokens'] > 0 and result[name]['ttft_s']['p99'] > 0
  assert result['machine']['cpu'] and len(result['load_before']) == 3


def _a_clean_run():
  """(trace, answers, reference texts, server state before and after) of a
  run where everything held: three requests, the last leaving."""
  trace = lt.make_trace(3, 0, [4, 8], [5, 5], seed=0)
  trace[2].leaves = True
  gots = [lt.Got(s.id, {f'cmpl-{s.id}'}, text=f'text {i}',
                 finish_reason='length', tokens=5)
          for i, s in enumerate(trace)]
  gots[2] = lt.Got(trace[2].id, {f'cmpl-{trace[2].id}'}, text='te')
  reference = {s.id: f'text {i}' for i, s in enumerate(trace)}
  before = {'pages_in_use': 0, 'running': 0, 'waiting': 0, 'finished': 10}
  return trace, gots, reference, before, {**before, 'finished': 13}


def test_each_check_fails_on_what_it_is_there_to_catch():
  trace, gots, reference, before, after = _a_clean_run()
  assert lt.check(trace, gots, reference, before, after) == []
  broken = {
      'lost': (trace, gots[:2], reference, before, after),
      'duplicated': (trace, gots + [gots[0]], reference, before, after),
      'one completion for two': (trace, [gots[0], dataclasses.replace(
          gots[1], completion_ids=gots[0].completion_ids), gots[2]],
                                 reference, before, after),
      'cut short': (trace, [dataclasses.replace(gots[0], tokens=4),
                            *gots[1:]], reference, before, after),
      'another text': (trace, gots, {**reference, trace[1].id: 'other'},
                       before, after),
      'an error': (trace, [dataclasses.replace(gots[0], error='HTTP 500'),
                           *gots[1:]], reference, before, after),
      'not finished': (trace, gots, reference, before,
                       {**after, 'finished': 12}),
      'pages held': (trace, gots, reference, before,
                     {**after, 'pages_in_use': 1}),
      'still waiting': (trace, gots, reference, before,
                        {**after, 'waiting': 1}),
  }
  for name, args in broken.items():
    assert lt.check(*args), name
