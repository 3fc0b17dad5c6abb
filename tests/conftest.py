"""Fixtures shared by test files, the cpu_only marker, and how the tests
compile (a compilation cache; on the CPU, LLVM unoptimised)."""

import ctypes
import gc
import importlib.metadata
import importlib.util
import os
import tempfile

# Many tests compile the same programs (the tiny model's train and eval steps,
# in this process and in train.main subprocesses, which inherit the
# environment): JAX's persistent cache loads the executable instead of
# compiling it again. One directory per test run, shared by the xdist workers;
# set before jax is imported, since jax reads these variables then.
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(
    tempfile.gettempdir(), 'gqa-lab-test-compilation-cache',
    os.environ.get('PYTEST_XDIST_TESTRUNUID', f'run-{os.getpid()}')))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')


def _accelerator_installed() -> bool:
  """A GPU or TPU runtime for jax (read before jax starts any backend)."""
  return bool(importlib.metadata.entry_points(group='jax_plugins')) or any(
      importlib.util.find_spec(name) for name in ('libtpu', 'jax_plugins'))


# The tests compile far more than they run (small models, many programs):
# on the CPU, LLVM's optimisation level 0 compiles them faster, the whole
# suite in 14 minutes instead of 18-19 on 2 cores. XLA's HLO passes (fusion,
# layouts, buffers in place, which tests inspect) run as ever; users' runs
# keep the default level. Not on a GPU or TPU, whose kernels the tests are
# there to check as users get them. Subprocesses inherit it (see
# tests/host_devices.py for those that set XLA_FLAGS).
if not _accelerator_installed():
  os.environ['XLA_FLAGS'] = ' '.join(filter(None, (
      os.environ.get('XLA_FLAGS'), '--xla_backend_optimization_level=0')))

# What a test that runs more than it compiles (the *_base models' steps)
# passes as jax.jit(..., compiler_options=OPTIMIZED): the users' level back
# for that one program (XLA:CPU's default, 3), whose steps then run 2-3
# times faster than unoptimised, well beyond its longer compile.
OPTIMIZED = {'xla_backend_optimization_level': 3}

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=wrong-import-position

from configs import tiny  # pylint: disable=wrong-import-position
from tests import xdist_groups  # pylint: disable=wrong-import-position
from train import loop  # pylint: disable=wrong-import-position


def pytest_configure(config):
  config.pluginmanager.register(xdist_groups, 'xdist_groups')
  # The tests compare float32 results with references to ~1e-5; a GPU's
  # default float32 matmul is TF32 (a 10-bit mantissa, errors ~1e-3), the
  # CPU's and TPU's tests are unaffected.
  if jax.default_backend() == 'gpu':
    jax.config.update('jax_default_matmul_precision', 'highest')


# The longest tests of the last whole run (2 workers), longest first: fed
# to the workers before the other slow ones, so that neither is left with
# one of them at the end while the other idles.
LONGEST = (
    'test_the_readme_workflow_runs_on_this_machine',
    'test_sigkill_at_random_moments_then_resume_equals_a_straight_run',
    'test_the_study_runs_end_to_end_through_the_training_loop',
    'test_a_checkpoint_moves_between_two_processes_and_one',
    'test_base_configs_train_in_bfloat16_close_to_float32',
    'test_the_prepared_device_command_runs_end_to_end',
    'test_kv_frontier_trains_reads_and_reports_a_small_grid',
    'test_a_bucket_run_killed_and_resumed_equals_a_local_run_and_samples',
    'test_a_lost_peer_ends_the_survivor_in_one_line',
    'test_two_processes_train_to_the_losses_of_one_with_four_devices',
    'test_grouped_heads_need_less_peak_memory_than_mha',
    'test_sigterm_saves_once_and_resumes',
    'test_splash_runs_per_shard_under_a_mesh_that_splits_heads',
    'test_cached_decoding_equals_the_full_pass',
)


def pytest_collection_modifyitems(config, items):
  """Runs the tests marked slow first, the LONGEST first of all, so that
  the xdist workers, fed in this order, finish together on short ones. On
  a GPU or TPU, skips tests marked cpu_only (XLA:CPU kernels, layouts,
  simulated host devices); everything else runs there as here."""
  del config
  rank = {name: i for i, name in enumerate(LONGEST)}
  items.sort(key=lambda item: (  # Stable.
      'slow' not in item.keywords,
      rank.get(getattr(item, 'originalname', item.name), len(LONGEST))))
  if jax.default_backend() == 'cpu':
    return
  skip = pytest.mark.skip(reason='asserts behaviour of the CPU backend')
  for item in items:
    if 'cpu_only' in item.keywords:
      item.add_marker(skip)


# A worker's memory, bounded. Each test's compiled programs stay in jax's
# caches (with any constants traced into them) for the worker's life: over
# the suite's ~1,400 tests two workers each held ~7 GiB of the CI machine's
# 24. After a test that leaves the worker MEMORY_GROWTH above where it stood
# after the last drop, the caches are dropped and the freed memory handed
# back to the system (glibc's malloc_trim), so a run's memory stays flat.
MEMORY_GROWTH = 1536 << 20
_memory_floor = [0]


def _resident_bytes() -> int:
  """This process's resident memory (Linux's /proc), or 0 elsewhere."""
  try:
    with open('/proc/self/statm', encoding='ascii') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  except (OSError, ValueError, IndexError):
    return 0


def _drop_compiled_programs():
  jax.clear_caches()
  gc.collect()
  try:
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):  # Not glibc.
    pass


@pytest.fixture(autouse=True)
def _bounded_memory():
  yield
  resident = _resident_bytes()
  if resident - _memory_floor[0] > MEMORY_GROWTH:
    _drop_compiled_programs()
    _memory_floor[0] = _resident_bytes()


@pytest.fixture(scope='session')
def trained(tmp_path_factory):
  """A workdir holding a `tiny` model trained for its 20 steps."""
  workdir = tmp_path_factory.mktemp('trained')
  loop.train_and_evaluate(tiny.get_config(), str(workdir))
  return workdir


@pytest.fixture(scope='session')
def served(trained):
  """(the Server, its base URL): `trained` served on a free localhost port
  (its --seed 11), shared by the tests of the server and its clients."""
  from tests import api_server  # pylint: disable=import-outside-toplevel
  with api_server.running(trained, seed=11) as (server, url):
    yield server, url
