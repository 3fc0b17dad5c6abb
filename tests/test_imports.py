"""The rooms and their arrows: every import between our packages points down.

Floor 0: attention/ imports none of ours, infra/ (errors, command-line
shells, storage, provenance) none; configs/ only attention/ (the layouts'
settings are config sections). Floor 1: lm/, the model and running it,
imports those. Floor 2: train/ (the loop, its commands
and the conversions), serve/ and evaluation/ import the floors below and not
each other: serving and evaluation never import the training loop. Floor 3:
studies/, the study machinery (statistics, runs, timing, task scores,
reports, each study's design and reading), imports the floors below. Floor
4: scripts/, the entry points, imports anything but another script: a piece
two commands share lives in a room below. A command lives in its room, and
a piece two rooms need moves down. Every import counts, at module level or
inside a function (a deferred import is still an arrow), and no chain of
them comes back to where it started."""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
ALLOWED = {  # Room -> the other rooms it may import.
    'attention': set(),
    'configs': {'attention'},
    'infra': set(),
    'lm': {'attention', 'configs', 'infra'},
    'train': {'attention', 'configs', 'infra', 'lm'},
    'serve': {'attention', 'configs', 'infra', 'lm'},
    'evaluation': {'attention', 'configs', 'infra', 'lm'},
    'studies': {'attention', 'configs', 'infra', 'lm', 'train', 'serve',
                'evaluation'},
    'scripts': {'attention', 'configs', 'infra', 'lm', 'train', 'serve',
                'evaluation', 'studies'},
}


def module_name(path: pathlib.Path) -> str:
  """'train/loop.py' -> 'train.loop'; 'train/__init__.py' -> 'train'."""
  parts = path.relative_to(REPO).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def our_modules() -> dict[str, pathlib.Path]:
  return {module_name(p): p for room in ALLOWED
          for p in sorted((REPO / room).rglob('*.py'))}


def imported(source: str, module: str, is_package: bool,
             known: set[str]) -> set[str]:
  """The modules of `known` that `source` (the text of `module`) imports,
  anywhere in it: `import a.b`, `from a import b`, `from a.b import c`,
  relative imports. A name is the longest of `known` it starts with, so
  `from train import loop` is train.loop and `from attention import
  Attention` is attention (its __init__)."""
  package = module if is_package else module.rpartition('.')[0]
  def ours(name):
    while name and name not in known:
      name = name.rpartition('.')[0]
    return name
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found.update(ours(a.name) for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # `from ..x import y` in package a.b: a.x.
        up = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(up + ([base] if base else []))
      found.update(ours(f'{base}.{a.name}') for a in node.names)
  return found - {'', module}


def import_graph() -> dict[str, set[str]]:
  modules = our_modules()
  return {m: imported(p.read_text(), m, p.name == '__init__.py', set(modules))
          for m, p in modules.items()}


def violations(graph: dict[str, set[str]]) -> list[str]:
  """'file: imports module (room A -> room B)' for each arrow the rooms do
  not allow."""
  found = []
  for module, targets in sorted(graph.items()):
    room = module.split('.')[0]
    for target in sorted(targets):
      other = target.split('.')[0]
      if other != room and other not in ALLOWED[room]:
        found.append(f'{module.replace(".", "/")}.py: imports {target} '
                     f'({room} -> {other})')
  return found


def scripts_importing_scripts(graph: dict[str, set[str]]) -> list[str]:
  """'scripts/a.py: imports scripts.b' for each entry point that imports
  another (scripts/ holds commands only: what two share lives in studies/
  or a room below); the package's __init__ is no command."""
  return [f'{module.replace(".", "/")}.py: imports {target}'
          for module, targets in sorted(graph.items())
          if module.startswith('scripts.')
          for target in sorted(targets) if target.startswith('scripts.')]


def cycles(graph: dict[str, set[str]]) -> list[str]:
  """One cycle, as 'a -> b -> a', for each strongly connected set of modules
  (Tarjan's algorithm), and each module that imports itself."""
  index, low, stack, on_stack, sets = {}, {}, [], set(), []
  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      members, w = set(), None
      while w != v:
        w = stack.pop()
        on_stack.discard(w)
        members.add(w)
      if len(members) > 1 or v in graph.get(v, ()):
        sets.append(members)
  for v in sorted(graph):
    if v not in index:
      visit(v)
  return [_cycle_through(min(members), graph, members)
          for members in sets]


def _cycle_through(start, graph, members) -> str:
  """The shortest path from `start` back to itself within `members`."""
  paths, seen = [[start]], set()
  while paths:
    path = paths.pop(0)
    for w in sorted(graph.get(path[-1], ())):
      if w == start:
        return ' -> '.join(path + [start])
      if w in members and w not in seen:
        seen.add(w)
        paths.append(path + [w])
  raise AssertionError(f'no cycle through {start}')


def test_every_import_points_down_a_room():
  found = violations(import_graph())
  assert not found, 'imports against the rooms:\n' + '\n'.join(found)


def test_no_script_imports_another():
  found = scripts_importing_scripts(import_graph())
  assert not found, 'scripts importing scripts:\n' + '\n'.join(found)


def test_no_modules_import_each_other_in_a_cycle():
  found = cycles(import_graph())
  assert not found, 'import cycles:\n' + '\n'.join(found)


def test_the_walker_sees_deferred_and_relative_imports():
  source = ('import attention.layer\n'
            'from lm import model, evaluator\n'
            'from attention import Attention\n'
            'def run():\n'
            '  from serve.engine import Engine\n'
            '  from . import stats\n'
            '  from ..train.convert.hf import HF\n')
  known = {'attention', 'attention.layer', 'lm', 'lm.model', 'lm.evaluator',
           'train', 'train.convert', 'train.convert.hf', 'serve',
           'serve.engine', 'studies', 'studies.stats'}
  assert imported(source, 'studies.x', False, known) == {
      'attention.layer', 'lm.model', 'lm.evaluator', 'attention',
      'serve.engine', 'studies.stats', 'train.convert.hf'}
  # And the real graph: a module-level arrow, and one inside a function.
  graph = import_graph()
  assert 'lm.checkpoint' in graph['studies.compare.runs']
  assert 'evaluation.evaluate' in graph['studies.task_scores']
  assert 'lm.evaluator' in graph['evaluation.evaluate']


def test_the_checks_fail_on_an_arrow_up_and_on_a_cycle():
  # Negative controls: the checks above can fail.
  assert violations({'attention.a': {'train.b', 'attention.c'},
                     'serve.s': {'evaluation.e'}}) == [
                         'attention/a.py: imports train.b (attention -> train)',
                         'serve/s.py: imports evaluation.e '
                         '(serve -> evaluation)']
  # An arrow up from each new floor, and the ones this map forbids since
  # lm/ holds inference and the evaluator.
  assert violations({'infra.errors': {'lm.model'},
                     'lm.checkpoint': {'train.loop', 'infra.storage'},
                     'serve.engine': {'train.sample', 'lm.inference'},
                     'evaluation.evaluate': {'train.loop'}}) == [
                         'evaluation/evaluate.py: imports train.loop '
                         '(evaluation -> train)',
                         'infra/errors.py: imports lm.model (infra -> lm)',
                         'lm/checkpoint.py: imports train.loop (lm -> train)',
                         'serve/engine.py: imports train.sample '
                         '(serve -> train)']
  assert scripts_importing_scripts({
      'scripts.a': {'scripts.b', 'studies.stats'}, 'scripts.b': set(),
      'studies.stats': set()}) == ['scripts/a.py: imports scripts.b']
  assert cycles({'train.a': {'train.b'}, 'train.b': {'train.c'},
                 'train.c': {'train.a', 'train.d'}, 'train.d': set()}) == [
                     'train.a -> train.b -> train.c -> train.a']
  assert cycles({'train.a': {'train.a'}}) == ['train.a -> train.a']
  assert cycles({'train.a': {'train.b'}, 'train.b': set()}) == []
