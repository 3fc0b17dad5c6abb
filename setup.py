"""The optional C++ part of the package: the CPU decode kernels
(attention/cpu/grouped_decode.cc and, for grouped-tied attention,
tied_decode.cc: XLA FFI custom calls in one library that
attention/cpu_kernel.py loads with ctypes). Everything else is declared in
setup.cfg.

Its headers are jaxlib's (xla/ffi/api/ffi.h), which pyproject.toml's
[build-system] requires in the range setup.cfg requires of jax. The
extension is optional: where it cannot be built (no C++ compiler, no jaxlib
headers) the install goes on and decoding uses the pure-JAX path.

No -march=native: the kernel's hot loops are compiled for x86-64-v4
(AVX-512), v3 (AVX2) and the baseline and chosen when the library is loaded
(function multi-versioning in the source), so one build serves every x86-64
CPU.
"""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def ffi_include_dir() -> str | None:
  """jaxlib's include directory, where it holds XLA's FFI headers."""
  spec = importlib.util.find_spec('jaxlib')
  if spec is None or not spec.submodule_search_locations:
    return None
  include = os.path.join(spec.submodule_search_locations[0], 'include')
  header = os.path.join(include, 'xla', 'ffi', 'api', 'ffi.h')
  return include if os.path.isfile(header) else None


class BuildLibrary(build_ext):
  """Names the library lib<name>.so, not a Python module's name (it has no
  PyInit and is loaded with ctypes, never imported)."""

  def get_ext_filename(self, fullname):
    *package, name = fullname.split('.')
    return os.path.join(*package, f'{name}.so')


include = ffi_include_dir()
if include is None:
  print('gqa-lab: no jaxlib FFI headers (pip installs jaxlib into the build '
        'environment); skipping the CPU decode kernel')
kernels = [] if include is None else [Extension(
    'attention.cpu.libgrouped_decode',
    sources=['attention/cpu/grouped_decode.cc',
             'attention/cpu/tied_decode.cc'],
    depends=['attention/cpu/decode_common.h'],  # Rebuilt when it changes.
    include_dirs=[include],
    language='c++',
    extra_compile_args=['-std=c++17', '-O3', '-g0', '-fvisibility=hidden',
                        '-fno-math-errno'],
    optional=True,  # No compiler, or it fails: install without it.
)]

setup(ext_modules=kernels, cmdclass={'build_ext': BuildLibrary})
