"""Specification: one request, one text, whichever front end generates it.

`train.sample` (dense cache, one prompt), `serve.generate` (the paged engine,
any --slots, beside other requests, prefilled in chunks) and the lm_eval
model's `generate_until` (dense cache, batches of contexts) all sample
through `lm.sampling`: the same prompt, settings and seed give the same
text, greedy or sampled. The request's seed is `train.sample --seed`, the
prompt line's "seed" and the gen_kwargs' `seed` (where a request names none,
serve.generate and the lm_eval model derive one from their own seed and the
request's id: tests/test_seeds.py).
"""

import json
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip('lm_eval')

from evaluation import harness  # pylint: disable=wrong-import-position
from serve import generate  # pylint: disable=wrong-import-position
from lm.sampling import SamplingParams  # pylint: disable=wrong-import-position

REPO = pathlib.Path(__file__).parent.parent
PROMPT, NEW = 'def ', 14
NEIGHBOURS = ['import', 'x = 1', 'class A:\n ', 'for i in', 'return']


def _train_sample(workdir, settings: SamplingParams) -> str:
  args = [f'--temperature={settings.temperature}', f'--top_k={settings.top_k}',
          f'--top_p={settings.top_p}', f'--seed={settings.seed}',
          *[f'--stop={s}' for s in settings.stop]]
  result = subprocess.run(
      [sys.executable, '-m', 'train.sample', f'--workdir={workdir}',
       f'--prompt={PROMPT}', f'--max_new_tokens={NEW}', *args],
      cwd=REPO, capture_output=True, timeout=180)
  assert result.returncode == 0, result.stderr.decode()
  return result.stdout.decode('utf-8')[:-1]  # Its line break.


def _serve(workdir, tmp_path, settings: SamplingParams, slots: int,
           neighbours: list[str]) -> str:
  """The text of request 'me' served with `neighbours` around it."""
  prompts, out = tmp_path / f'p{slots}.jsonl', tmp_path / f'o{slots}.jsonl'
  lines = [{'id': f'n{i}', 'prompt': p} for i, p in enumerate(neighbours)]
  lines.insert(len(lines) // 2, {'id': 'me', 'prompt': PROMPT,
                                 'seed': settings.seed})
  prompts.write_text(''.join(json.dumps(line) + '\n' for line in lines))
  generate.generate_file(str(workdir), str(prompts), str(out),
                         kv_memory='1MiB', max_new_tokens=NEW,
                         settings=settings, slots=slots, page_size=4,
                         prefill_chunk=2)
  results = {e['id']: e for e in map(json.loads, out.read_text().splitlines())}
  return results['me']['text']


def _lm_eval(workdir, settings: SamplingParams) -> str:
  model = harness.WorkdirLM(str(workdir), batch_size=3)
  kwargs = {'until': list(settings.stop) or ['\x00\x00'], 'max_gen_toks': NEW,
            'do_sample': settings.temperature > 0,
            'temperature': settings.temperature, 'top_k': settings.top_k,
            'top_p': settings.top_p, 'seed': settings.seed}
  requests = [harness_request(context, kwargs)
              for context in ['Def ', PROMPT, 'deg ']]  # Same length: batched.
  return model.generate_until(requests)[1]


def harness_request(context, kwargs):
  from lm_eval.api.instance import Instance  # pylint: disable=import-outside-toplevel
  return Instance('generate_until', {}, (context, kwargs), 0)


@pytest.mark.slow
@pytest.mark.slowest  # 11-17 s each on 2 cores.
@pytest.mark.parametrize('settings', [
    SamplingParams(),
    SamplingParams(temperature=0.9, top_k=60, top_p=0.95, seed=7),
    SamplingParams(temperature=1.3, seed=2**32 - 1, stop=(' ',)),
], ids=['greedy', 'sampled', 'hot-with-stop'])
def test_the_same_request_gives_the_same_text_from_every_front_end(
    trained, tmp_path, settings):
  expected = _train_sample(trained, settings)
  assert _serve(trained, tmp_path, settings, 1, NEIGHBOURS[:2]) == expected
  assert _serve(trained, tmp_path, settings, 3, NEIGHBOURS) == expected
  assert _lm_eval(trained, settings) == expected
  if settings.temperature > 0 and not settings.stop:  # A control: another
    # seed, another text.
    other = SamplingParams(temperature=settings.temperature,
                           top_k=settings.top_k, top_p=settings.top_p,
                           seed=settings.seed ^ 1, stop=settings.stop)
    assert _train_sample(trained, other) != expected


@pytest.mark.slow
@pytest.mark.parametrize('command', ['train.sample', 'serve.generate'])
def test_help_lists_the_sampling_flags(command):
  """The sampling flags lm.inference defines for every generating command
  are the command's own in --help, not hidden under --helpfull."""
  result = subprocess.run([sys.executable, '-m', command, '--help'], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
  listed = set(re.findall(r'^  --(?:\[no\])?(\w+)', result.stdout, re.M))
  assert 'workdir' in listed, result.stdout + result.stderr
  assert {'temperature', 'top_k', 'top_p', 'seed', 'stop'} <= listed, (
      result.stdout)
