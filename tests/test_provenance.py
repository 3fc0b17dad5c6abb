"""What a results file records of how it was made (`infra.provenance`)."""

import pathlib
import subprocess
import sys

from infra import provenance


def test_a_record_names_the_command_commit_out_and_given_fields():
  p = provenance.record('scripts.compare', pathlib.Path('runs/x'),
                        ['--quick', '--out=runs/x'], statistics='sd over seeds')
  assert p == {'command': 'python -m scripts.compare --quick --out=runs/x',
               'commit': provenance.commit(), 'out': 'runs/x',
               'machine': provenance.machine(),
               'statistics': 'sd over seeds'}


def test_the_machine_names_the_cpu_and_its_vector_extensions():
  info = ('processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum\n'
          'flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\n')
  m = provenance.machine(info)
  assert (m['cpu'], m['avx2'], m['avx512f']) == (
      'Intel(R) Xeon(R) Platinum', True, True)
  older = provenance.machine(info.replace(' avx512f avx512bw', ''))
  assert (older['avx2'], older['avx512f']) == (True, False)
  assert 'AVX2, no AVX-512F' in provenance.describe(older)
  assert provenance.machine('')['avx512f'] is None  # Unknown, not False.


def test_the_machine_names_the_family_and_the_vector_flags_where_listed():
  """What a benchmark's VM kind is told by: two AMD EPYC VMs of the same
  model name differ in family (Zen 4: 25, Zen 5: 26) and flags."""
  info = ('processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\n'
          'model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma avx512f '
          'avx512_bf16 avx512_vnni\n')
  m = provenance.machine(info)
  assert (m['family'], m['model'], m['vector_flags']) == (
      26, 2, ['avx2', 'fma', 'avx512f', 'avx512_bf16', 'avx512_vnni'])
  assert provenance.describe(m).startswith(
      'AMD EPYC, family 26 model 2 (AVX-512F), ')
  old = {k: v for k, v in m.items() if k not in ('family', 'model')}
  assert provenance.describe(old).startswith('AMD EPYC (AVX-512F), ')


def test_without_argv_the_command_is_this_process_flags(monkeypatch):
  monkeypatch.setattr(sys, 'argv', ['ignored.py', '--out=y'])
  assert provenance.record('evaluation.evaluate', 'y')['command'] == (
      'python -m evaluation.evaluate --out=y')


def test_the_commit_is_this_checkout_head():
  root = pathlib.Path(provenance.__file__).resolve().parent.parent
  head = subprocess.run(['git', '-C', str(root), 'rev-parse', '--short=7',
                         'HEAD'], capture_output=True, text=True, check=False)
  if head.returncode:  # Outside a git checkout (an installed copy).
    assert provenance.commit() == 'unknown'
  else:
    assert provenance.commit().removesuffix('+dirty') == head.stdout.strip()
