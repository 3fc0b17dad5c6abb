"""The optional C++ part of the package: the CPU decode kernels
(attention/cpu/grouped_decode.cc and, for grouped-tied and latent
attention, tied_decode.cc: XLA FFI custom calls in one library that
attention/cpu_kernel.py loads with ctypes). Everything else is declared in
setup.cfg.

Its headers are jaxlib's (xla/ffi/api/ffi.h), which pyproject.toml's
[build-system] requires in the range setup.cfg requires of jax. The
extension is optional: where it cannot be built (no C++ compiler, no jaxlib
headers) the install goes on and decoding uses the pure-JAX path.

The sources and compiler flags are attention/cpu/build.py's, which the
tests build single-target libraries with too.
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


def kernel_build():
  """attention/cpu/build.py as a module, read from its file (nothing of the
  package is importable before it is installed)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'attention',
                      'cpu', 'build.py')
  spec = importlib.util.spec_from_file_location('gqa_lab_kernel_build', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


class BuildLibrary(build_ext):
  """Names the library lib<name>.so, not a Python module's name (it has no
  PyInit and is loaded with ctypes, never imported)."""

  def get_ext_filename(self, fullname):
    *package, name = fullname.split('.')
    return os.path.join(*package, f'{name}.so')


build = kernel_build()
include = ffi_include_dir()
if include is None:
  print('gqa-lab: no jaxlib FFI headers (pip installs jaxlib into the build '
        'environment); skipping the CPU decode kernel')
kernels = [] if include is None else [Extension(
    build.NAME,
    sources=list(build.SOURCES),
    depends=list(build.HEADERS),
    include_dirs=[include],
    language='c++',
    extra_compile_args=list(build.FLAGS),
    optional=True,  # No compiler, or it fails: install without it.
)]

setup(ext_modules=kernels, cmdclass={'build_ext': BuildLibrary})
