"""Builds MHA, GQA and MQA from one parameter; prints their sizes and a timing.

  python -m scripts.variants
"""

import time

import jax
import jax.numpy as jnp

from attention import Attention

B, T, D, N, H = 4, 256, 512, 8, 64


def main():
  x_BTD = jax.random.normal(jax.random.key(0), (B, T, D))
  print(f'{"variant":<8}{"K":>3}{"params":>10}{"KV bytes/token":>16}'
        f'{"fwd ms":>9}  (B={B}, T={T}, D={D}, N={N}, H={H}, float32)')
  for name, K in (('MHA', N), ('GQA', 2), ('MQA', 1)):
    layer = Attention(num_heads=N, num_kv_heads=K, head_dim=H)
    params = layer.init(jax.random.key(1), x_BTD)
    forward = jax.jit(layer.apply)
    forward(params, x_BTD).block_until_ready()
    times = []
    for _ in range(10):
      start = time.perf_counter()
      forward(params, x_BTD).block_until_ready()
      times.append(time.perf_counter() - start)
    kv_per_token = layer.kv_cache_bytes(batch=1, length=1, dtype=jnp.bfloat16)
    print(f'{name:<8}{K:>3}{layer.num_params(D):>10,}{kv_per_token:>16,}'
          f'{1e3 * sorted(times)[5]:>9.2f}')


if __name__ == '__main__':
  main()
