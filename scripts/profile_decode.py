"""Where a decode step's time goes: its operations, by kind, per layout.

  python -m scripts.profile_decode [--config=gqa_small]
      [--variants=K2,GTA1,MLA48] [--batches=1,16,256] [--contexts=2048]
      [--repeats=3] [--top=8]

For each variant (bench_decode's names), batch and context, traces `repeats`
calls of the decode step that bench_decode times (`timing.decode_steps`,
train.sample's loop, 8 tokens a call) with `jax.profiler`, XLA's CPU
runtime recording each of its operations (xla_cpu_enable_xprof_traceme),
and prints the milliseconds per token step in each kind of operation: the
C++ decode kernels (XLA custom calls, `attention.cpu_kernel`), XLA's
matmuls (the weights', and the pure-JAX path's attention), fusions (the
elementwise work, and YNNPACK's fused matmuls and reductions), and the
rest; then the `top` operations by time. A kind's time is the sum of its
operations' spans, threads included, so on a loaded machine a span also
holds the time its thread waited for a core: read the shares, not the
sums.
"""

from __future__ import annotations

import collections
import os
import pathlib
import tempfile

_FLAG = '--xla_cpu_enable_xprof_traceme=true'

KINDS = (  # Kind -> what its operations' names hold, first match.
    ('decode kernel', ('ffi_call', 'custom-call', 'custom_call')),
    ('matmul', ('dot',)),
    ('fusion', ('fusion', 'wrapped_')),  # YNNPACK's too (matmuls or not).
)
# Events of the runtime and of Python, not operations of the step.
_NOT_OPS = ('$', 'Thunk', 'PjitFunction', 'Pjrt', 'Common', 'Execute', 'Await',
            'SlinkyThreadPool', 'while', 'conditional', 'call')


def kind(name: str) -> str:
  """The kind of the operation named `name` (its HLO name)."""
  base = name.split('.')[0]
  for label, parts in KINDS:
    if any(part in base for part in parts):
      return label
  return 'other'


def profile(go, repeats: int) -> collections.Counter:
  """{operation name: nanoseconds} over `repeats` traced calls of go."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(go())
  with tempfile.TemporaryDirectory() as where:
    with jax.profiler.trace(where):
      for _ in range(repeats):
        jax.block_until_ready(go())
    [path] = pathlib.Path(where).rglob('*.xplane.pb')
    data = ProfileData.from_file(str(path))
  spans = collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        if not event.name.startswith(_NOT_OPS):
          spans[event.name] += event.duration_ns
  return spans


def main():
  # Before jax starts XLA: the CPU runtime records operations only then.
  if _FLAG not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {_FLAG}'
  from infra.cli import ArgumentParser, int_list, positive_int  # pylint: disable=import-outside-toplevel
  from lm import config_lib  # pylint: disable=import-outside-toplevel
  from studies import timing, variants  # pylint: disable=import-outside-toplevel
  parser = ArgumentParser(description=__doc__)
  parser.add_argument('--config', default='gqa_small')
  parser.add_argument('--variants', type=variants.variant_list,
                      default='K2,GTA1,MLA48')
  parser.add_argument('--batches', type=int_list, default=[1, 16, 256])
  parser.add_argument('--contexts', type=int_list, default=[2048])
  parser.add_argument('--repeats', type=positive_int, default=3)
  parser.add_argument('--top', type=int, default=8)
  args = parser.parse_args()
  config = config_lib.load(args.config)
  steps = timing.DECODE_STEPS
  for v in args.variants:
    v.apply_to(config.model)
    config_lib.validate(config, batch_shards=1)
    mc = config_lib.model_config(config)
    for batch in args.batches:
      for context in args.contexts:
        spans = profile(timing.decode_steps(mc, batch, context, steps),
                        args.repeats)
        per_step = lambda ns: ns / 1e6 / args.repeats / steps
        by_kind = collections.Counter()
        for name, ns in spans.items():
          by_kind[kind(name)] += ns
        total = sum(by_kind.values())
        print(f'{v.name} batch {batch} context {context}: '
              f'{per_step(total):.2f} ms of operations a token step; ' +
              ', '.join(f'{label} {per_step(ns):.2f} ms ({ns / total:.0%})'
                        for label, ns in by_kind.most_common()), flush=True)
        for name, ns in spans.most_common(args.top):
          print(f'  {per_step(ns):8.3f} ms  {kind(name):14} {name}')


if __name__ == '__main__':
  from infra.cli import exit_on_user_error  # pylint: disable=import-outside-toplevel
  exit_on_user_error(main)
