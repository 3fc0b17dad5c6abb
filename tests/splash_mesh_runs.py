"""Splash attention per shard under meshes of 8 simulated devices; prints JSON.

Run by tests/test_accelerators.py as
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
      python -m tests.splash_mesh_runs

Prints {mesh: [forward error, [dQ, dK, dV errors]]} against the reference.
"""

import json

import jax
import jax.numpy as jnp

from attention import dot_product_attention
from tests import reference

B, T, N, H = 2, 128, 8, 32
# (data, tensor, K): tensor divides K; K < tensor, so a shard's query heads
# share one replicated KV head (MQA, and GQA-2 with tensor 4).
MESHES = [(2, 4, 4), (1, 8, 8), (2, 4, 1), (2, 4, 2)]


def main():
  assert jax.device_count() == 8, jax.devices()
  errors = {}
  for data, tensor, K in MESHES:
    mesh = jax.make_mesh((data, 1, tensor), ('data', 'fsdp', 'tensor'),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    kq, kk, kv = jax.random.split(jax.random.key(K), 3)
    q = jax.random.normal(kq, (B, T, N, H))
    k = jax.random.normal(kk, (B, T, K, H))
    v = jax.random.normal(kv, (B, T, K, H))
    loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()
    ours = lambda q, k, v: dot_product_attention(
        q, k, v, is_causal=True, local_window=100, implementation='splash')
    ref = lambda q, k, v: reference.reference_attention(
        q, k, v, is_causal=True, local_window=100)
    with jax.set_mesh(mesh):
      out = jax.jit(ours)(q, k, v)
      grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    errors[f'data{data}_tensor{tensor}_K{K}'] = [
        float(jnp.abs(out - ref(q, k, v)).max()),
        [float(jnp.abs(a - b).max()) for a, b in zip(grads, ref_grads)]]
  print(json.dumps(errors))


if __name__ == '__main__':
  main()
