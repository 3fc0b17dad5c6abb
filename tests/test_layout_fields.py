"""A layout's settings are read by its own module, the config and the
conversions: nowhere else branches on them (`attention.layout`).

A read is an attribute load (`x.kv_lora_rank`), `getattr(x, 'tie_kv')`, a
subscript by the name (`m['latent_groups']`) or `.get('latent_groups')`.
Writing one (a keyword argument, a dict key, a config update) is how the
config, a benchmark or a study names a layout, and is allowed anywhere.
"""

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOMS = ('attention', 'configs', 'train', 'lm', 'infra', 'serve',
         'evaluation', 'studies', 'scripts')
# The settings of the built-in layouts that no other layer option shares,
# and tie_kv, the flag that meant GTA before layouts had names.
FIELDS = frozenset({'kv_lora_rank', 'q_lora_rank', 'qk_nope_head_dim',
                    'v_head_dim', 'latent_groups', 'latent_norm',
                    'rope_pairs', 'tie_kv', 'q_rank', 'k_rank', 'v_rank',
                    'head_bias'})
# Who may read them: each layout's module, the config (and its reading of
# configs written before layouts had names), and the conversions.
ALLOWED = ('attention/latent.py', 'attention/tied.py',
           'attention/tensor_product.py', 'configs/', 'lm/config_lib.py',
           'train/convert/')


def reads(source: str) -> list[tuple[int, str]]:
  """(line, field) of every read of a FIELDS name in `source`, in order."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
        and node.attr in FIELDS):
      found.append((node.lineno, node.attr))
    elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
      if _constant(node.slice) in FIELDS:
        found.append((node.lineno, node.slice.value))
    elif isinstance(node, ast.Call) and _key_read(node) in FIELDS:
      found.append((node.lineno, _key_read(node)))
  return sorted(found)


def _constant(node) -> object:
  return node.value if isinstance(node, ast.Constant) else None


def _key_read(call: ast.Call) -> object:
  """The name `getattr(x, 'name')` or `x.get('name')` reads, else None."""
  if (isinstance(call.func, ast.Name) and call.func.id == 'getattr'
      and len(call.args) >= 2):
    return _constant(call.args[1])
  if (isinstance(call.func, ast.Attribute) and call.func.attr == 'get'
      and call.args):
    return _constant(call.args[0])
  return None


def violations() -> list[str]:
  out = []
  for room in ROOMS:
    for path in sorted((REPO / room).rglob('*.py')):
      relative = path.relative_to(REPO).as_posix()
      if relative.startswith(ALLOWED):
        continue
      out += [f'{relative}:{line}: reads {name}'
              for line, name in reads(path.read_text())]
  return out


def test_no_module_outside_a_layout_the_config_or_conversions_reads_them():
  found = violations()
  assert not found, ('layout settings read outside their layout, the config '
                     'and the conversions (ask the layout instead):\n'
                     + '\n'.join(found))


def test_the_walker_sees_every_kind_of_read_and_no_write():
  # Negative control: each read is found, each write is not.
  source = ('def f(o, m, config):\n'
            '  a = o.kv_lora_rank\n'
            '  b = m["latent_groups"]\n'
            '  c = m.get("tie_kv")\n'
            '  d = getattr(o, "rope_pairs")\n'
            '  config.model.update(attention="mla", mla=dict(kv_lora_rank=8))\n'
            '  e = {"latent_groups": 2}\n'
            '  o.tie_kv = True\n')
  assert reads(source) == [(2, 'kv_lora_rank'), (3, 'latent_groups'),
                           (4, 'tie_kv'), (5, 'rope_pairs')]
