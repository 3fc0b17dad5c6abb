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


def _git(root, *args):
  return subprocess.run(
      ['git', '-C', str(root), '-c', 'user.name=t', '-c', 'user.email=t@t',
       *args], capture_output=True, text=True, check=True).stdout.strip()


def _repo(tmp_path):
  """A git repository holding one committed module, and its commit."""
  _git(tmp_path, 'init', '-q')
  (tmp_path / 'model.py').write_text('x = 1\n')
  (tmp_path / '.gitignore').write_text('runs/\n')
  _git(tmp_path, 'add', '.')
  _git(tmp_path, 'commit', '-q', '-m', 'first')
  return _git(tmp_path, 'rev-parse', '--short=7', 'HEAD')


def test_the_commit_is_dirty_when_the_files_that_ran_are_not_all_its(
    tmp_path):
  """A changed tracked file, or an untracked module (which a run may import
  and the commit does not hold), makes the commit +dirty; an untracked
  file that is no module, or an ignored one, does not."""
  head = _repo(tmp_path)
  assert provenance.commit(tmp_path) == head
  (tmp_path / 'notes.txt').write_text('a note\n')
  (tmp_path / 'runs').mkdir()
  (tmp_path / 'runs' / 'made.py').write_text('')  # Ignored.
  assert provenance.commit(tmp_path) == head
  (tmp_path / 'pkg').mkdir()
  (tmp_path / 'pkg' / 'extra.py').write_text('y = 2\n')
  assert provenance.commit(tmp_path) == head + provenance.DIRTY
  (tmp_path / 'pkg' / 'extra.py').unlink()
  (tmp_path / 'model.py').write_text('x = 2\n')
  assert provenance.commit(tmp_path) == head + provenance.DIRTY
  assert not provenance.is_clean(provenance.commit(tmp_path))
  assert provenance.commit(tmp_path / 'runs' / 'nowhere') == 'unknown'
  assert not provenance.is_clean('unknown') and provenance.is_clean(head)


def test_in_history_tells_an_ancestor_from_a_commit_elsewhere(tmp_path):
  first = _repo(tmp_path)
  (tmp_path / 'model.py').write_text('x = 3\n')
  _git(tmp_path, 'commit', '-q', '-am', 'second')
  second = _git(tmp_path, 'rev-parse', '--short=7', 'HEAD')
  _git(tmp_path, 'checkout', '-q', '-b', 'other', first)
  (tmp_path / 'model.py').write_text('x = 4\n')
  _git(tmp_path, 'commit', '-q', '-am', 'elsewhere')
  assert provenance.in_history(first, tmp_path)
  assert provenance.in_history(first + provenance.DIRTY, tmp_path)
  assert provenance.in_history(second, tmp_path) is False  # Another branch.
  assert provenance.in_history('0000000', tmp_path) is False
  assert provenance.in_history(first, tmp_path / 'none') is None


def test_a_checkout_that_moved_while_a_command_ran_is_recorded(monkeypatch):
  """A record made as a command starts names the code it runs; where the
  checkout is at another commit by its end (issue 60: the A/A run started
  at 9dae49b recorded the 724679d checked out as it ended), the record
  keeps both."""
  started = {'commit': 'abc1234', 'machine': {}}
  monkeypatch.setattr(provenance, 'commit', lambda: 'abc1234')
  assert provenance.ended(dict(started)) == started
  monkeypatch.setattr(provenance, 'commit', lambda: 'def5678+dirty')
  assert provenance.ended(dict(started)) == {
      **started, 'commit_at_end': 'def5678+dirty'}
