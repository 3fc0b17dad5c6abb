"""How the CPU decode kernels are compiled: the one list of their sources
and compiler flags, which setup.py builds the installed library with and
the tests build a library for one target alone with (`command`).

No -march=native: the kernels' hot loops are compiled for x86-64-v4
(AVX-512), v3 (AVX2) and the baseline and chosen when the library is loaded
(function multi-versioning in the source, GQA_LAB_CLONES in
decode_common.h), so one build serves every x86-64 CPU. This file imports
nothing: setup.py reads it before anything is installed.
"""

from __future__ import annotations

import os

NAME = 'attention.cpu.libgrouped_decode'  # attention/cpu/libgrouped_decode.so
SOURCES = ('attention/cpu/grouped_decode.cc', 'attention/cpu/tied_decode.cc')
HEADERS = ('attention/cpu/decode_common.h',)  # Rebuilt when they change.
FLAGS = ('-std=c++17', '-O3', '-g0', '-fvisibility=hidden', '-fno-math-errno')


def command(include: str, output: str, clones: str | None = None,
            root: str = '.') -> list[str]:
  """g++'s arguments building the library at `output` from the sources
  under `root`, with XLA's FFI headers from `include`; clones: the target
  attribute that replaces GQA_LAB_CLONES (e.g. a single
  '__attribute__((target("arch=x86-64-v3")))', or '' for the compiler's
  default), None for every target as setup.py builds it."""
  defines = [] if clones is None else [f'-DGQA_LAB_CLONES={clones}']
  return ['g++', *FLAGS, '-shared', '-fPIC', f'-I{include}', *defines,
          *(os.path.join(root, s) for s in SOURCES), '-o', output]
