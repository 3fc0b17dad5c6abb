"""Reading programs in tests: compiled HLO text (which float arrays a program
holds) and StableHLO lowered for another platform with `jax.export`."""

import re

import jax
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


# cuDNN's fused attention, which JAX's export does not guarantee stable
# (a program lowered for CUDA on a host with cuDNN holds it).
CUDNN_TARGETS = tuple(f'__cudnn$fmha{kind}{backward}'
                      for kind in ('Softmax', 'SoftmaxDropout',
                                   'ScaleBiasSoftmax',
                                   'ScaleBiasSoftmaxDropout')
                      for backward in ('', 'Backward'))


def lowered(fn, *args, platform: str) -> str:
  """The StableHLO text of jit(fn)(*args) exported for `platform` ('tpu',
  'cuda'), on this host."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(t)
            for t in CUDNN_TARGETS] if platform == 'cuda' else []
  return jax.export.export(jax.jit(fn), platforms=[platform],
                           disabled_checks=checks)(*args).mlir_module()


def cudnn_attention(module_text: str) -> bool:
  """Whether a lowered program calls cuDNN's fused attention."""
  return '__cudnn$fmha' in module_text


def big_shapes(module_text: str, threshold: int) -> list[tuple[str, str]]:
  """(op, shape) of the StableHLO transposes, broadcasts, copies and
  converts of >= threshold elements."""
  found = []
  for line in module_text.splitlines():
    op = re.search(r'stablehlo\.(transpose|broadcast_in_dim|copy|convert)',
                   line)
    if not op:
      continue
    for dims in re.findall(r'tensor<([\dx]+)x(?:bf16|f32|i8)>', line):
      if np.prod([int(d) for d in dims.split('x')]) >= threshold:
        found.append((op.group(1), dims))
  return found


def grouped_matmuls(module_text: str, K: int, G: int) -> int:
  """How many dot_generals take a [.., K, G, ..] (grouped query) operand:
  the einsum over a query viewed as [B, T, K, G, H]."""
  return sum(f'x{K}x{G}x' in line for line in module_text.splitlines()
             if 'stablehlo.dot_general' in line)
