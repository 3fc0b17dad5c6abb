"""scripts/bench_prefix_cache.py at tiny sizes: caching computes fewer
prompt tokens (those it found cached: the shared prefix's full page, for
every request admitted after the first two, which run together in two
slots and find nothing cached yet), and the tokens are identical with it
on and off."""

import json

import pytest

from scripts import bench_prefix_cache


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
