"""The README's example runs and prints what the README says it prints."""

import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).parent.parent / 'README.md'


@pytest.mark.slow
def test_readme_example_prints_what_it_claims():
  text = README.read_text()
  blocks = re.findall(r'```python\n(.*?)```', text, re.S)
  expected = re.search(r'prints\n\n```\n(.*?)```', text, re.S).group(1)
  out = io.StringIO()
  namespace = {}
  with contextlib.redirect_stdout(out):
    for block in blocks:
      exec(block, namespace)  # pylint: disable=exec-used
  assert out.getvalue() == expected


def test_ci_runs_the_readme_test_command():
  ci = (README.parent / '.ci' / 'run').read_text()
  commands = re.findall(r'```bash\n(.*?)\n```', README.read_text(), re.S)
  test_command = next(c for c in commands if 'pytest' in c)
  assert test_command in ci


def _command_lines() -> list[tuple[int, str]]:
  """(block number, line) for every command of the README's bash blocks
  (a `#` line says what the next one is for)."""
  blocks = re.findall(r'```bash\n(.*?)\n```', README.read_text(), re.S)
  return [(i, line) for i, block in enumerate(blocks)
          for line in block.splitlines()
          if line.strip() and not line.lstrip().startswith('#')]


def _invocations(line: str) -> list[list[str]]:
  """The `python -m MODULE ARGS...` a command line runs, as token lists:
  through `&&`, inside gcloud's --command, after srun's options. Every other
  command must be one of the few known shell steps."""
  tokens = shlex.split(line)
  found, segment = [], []
  for token in [*tokens, '&&']:
    if token != '&&':
      segment.append(token)
      continue
    head = segment[:2]
    if head == ['gcloud', 'compute']:
      inner = [t.split('=', 1)[1] for t in segment
               if t.startswith('--command=')]
      found += [i for command in inner for i in _invocations(command)]
    elif head and head[0] == 'srun':
      found.append(segment[segment.index('python'):])
    elif head in (['python', '-m'], ['python3', '-m']) and (
        segment[2] != 'venv'):
      found.append(segment)
    else:
      assert head[0] in ('python3', 'pip', '.', 'cd'), line  # venv, install.
    segment = []
  return found


def test_readme_commands_name_distinct_outputs():
  """Two commands writing one --out would overwrite each other's results."""
  outs = [t for _, line in _command_lines() for command in _invocations(line)
          for t in command if t.startswith('--out=')]
  assert outs and len(outs) == len(set(outs)), outs


@pytest.mark.slow
@pytest.mark.parametrize('number, line', _command_lines())
def test_every_readme_command_is_taken_as_written(number, line, tmp_path):
  """Each `python -m` command of the README parses its flags as written
  (tests/readme_dry_run.py: nothing runs). A --config naming a workdir that
  an earlier command of the same block writes is read as `tiny`, since the
  workdir does not exist yet. The blocks that can run on this machine run
  for real elsewhere: the test command in CI, the Hugging Face block in
  test_hf, the Python blocks above."""
  earlier = {t.split('=', 1)[1] for n, other in _command_lines() if n == number
             for command in _invocations(other) for t in command
             if t.startswith('--workdir=')}
  for command in _invocations(line):
    if command[2] == 'pytest':
      continue  # The test command: CI runs it (the test above).
    args = []
    for token in command[3:]:
      if token.startswith('--config=') and '/' in token:
        assert token.split('=', 1)[1] in earlier, (line, token)
        token = '--config=tiny'
      args.append(token)
    result = subprocess.run(
        [sys.executable, str(README.parent / 'tests' / 'readme_dry_run.py'),
         command[2], *args], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env={**os.environ, 'PYTHONPATH': str(README.parent)})
    assert result.returncode == 0, (line, result.stderr[-2000:])
    assert not list(tmp_path.iterdir()), line  # Nothing was written.


def _written_workdirs(page: pathlib.Path) -> set[str]:
  """The --workdir values of a page's `python -m` commands."""
  return set(re.findall(r'^python -m \S+ .*?--workdir=(\S+)', page.read_text(),
                        re.M))


def test_readme_exports_to_gguf_a_model_docs_gguf_exports():
  """The README's GGUF recipe exports docs/hugging_face.md's workflow model
  (SwiGLU, a byte-level BPE tokenizer; test_hf runs that block) as
  docs/gguf.md does, not a Llama 2 import, whose SentencePiece tokenizer
  docs/gguf.md and train/convert/gguf_vocab.py refuse."""
  docs = README.parent / 'docs'
  made = _written_workdirs(docs / 'hugging_face.md')
  exported = set(re.findall(r'--source=(\S+) --to_gguf=',
                            (docs / 'gguf.md').read_text()))
  sources = [t.split('=', 1)[1] for _, line in _command_lines()
             for command in _invocations(line)
             if any(t.startswith('--to_gguf=') for t in command)
             for t in command if t.startswith('--source=')]
  assert sources and exported, (sources, exported)
  for source in sources:
    assert source in made and source in exported, (source, made, exported)


def test_docs_point_to_the_page_whose_workflow_makes_their_model():
  """'the model of PAGE's workflow (`runs/X`': PAGE has the command that
  writes runs/X."""
  pattern = (r"(README)'s workflow[^(]*\(`(runs/\w+)`|"
             r"\[[^\]]*\]\(([\w./]+\.md)\)'s workflow[^(]*\(`(runs/\w+)`")
  docs = README.parent / 'docs'
  found = []
  for page in docs.glob('*.md'):
    for readme, readme_run, other, other_run in re.findall(
        pattern, page.read_text()):
      maker = README if readme else docs / other
      run = readme_run or other_run
      found.append((page.name, maker.name, run))
      assert run in _written_workdirs(maker), found[-1]
  assert ('gguf.md', 'hugging_face.md', 'runs/hf_gqa') in found, found
