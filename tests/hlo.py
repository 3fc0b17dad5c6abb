"""Reading compiled HLO text in tests: which float arrays a program holds."""

import re

import numpy as np

_ARRAY = re.compile(r'%[\w.\-]+ = (?:f32|bf16|f16)\[([\d,]*)\]\{[\d,]*\} '
                    r'([\w\-]+)\(')


def arrays(compiled_text: str) -> list[tuple[str, int]]:
  """(opcode, element count) of every float-valued instruction."""
  return [(op, int(np.prod([int(d) for d in dims.split(',') if d])))
          for dims, op in _ARRAY.findall(compiled_text)]


def element_counts(compiled_text: str, dtypes=('f32', 'bf16', 'f16')
                   ) -> set[int]:
  """The sizes of all float arrays anywhere in the program (results,
  operands, tuple elements, fused computations)."""
  shapes = re.findall(rf'\b(?:{"|".join(dtypes)})\[([\d,]+)\]', compiled_text)
  return {int(np.prod([int(d) for d in s.split(',')])) for s in shapes}


def copies_of_size(compiled_text: str, size: int) -> int:
  """How many copy instructions produce an array of `size` elements."""
  return sum(op == 'copy' and n == size for op, n in arrays(compiled_text))
