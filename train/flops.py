"""Model FLOPs per token, and MFU against the device's peak.

The formula (one place, used by the trainer and the benchmarks). Per layer and
token, counting a multiply-add as 2 FLOPs, with D model width, N query heads,
K key/value heads, H head dim, F MLP hidden, V vocabulary:

  Q and output projections   2·D·N·H + 2·N·H·D
  K and V projections        2·2·D·K·H              <- shrinks with K
  attention scores and mix   2·2·N·H·C              C = mean keys a query sees
  gated MLP                  3·2·D·F
and once per token the output logits, 2·D·V. For causal attention over a
length-T sequence C = (T + 1) / 2 (masked blocks are not counted as work),
capped by the local window w: C = mean over i of min(i + 1, w). Training costs
3x the forward pass (backward = 2x forward); rematerialised recomputation is
not counted, as in the PaLM paper's MFU.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

# Dense bfloat16 peak FLOP/s per chip (vendor datasheets; no sparsity).
PEAK_FLOPS = {
    'TPU v2': 45e12, 'TPU v3': 123e12, 'TPU v4': 275e12, 'TPU v5 lite': 197e12,
    'TPU v5e': 197e12, 'TPU v5p': 459e12, 'TPU v5': 459e12, 'TPU v6 lite': 918e12,
    'TPU v6e': 918e12, 'TPU7x': 2307e12,
    'H200': 989e12, 'H100': 989e12, 'A100': 312e12, 'L40S': 362e12,
    'L4': 121e12, 'A10G': 70e12, 'A10': 125e12, 'V100': 125e12, 'T4': 65e12,
    'RTX 4090': 165e12, 'RTX 3090': 71e12, 'GB200': 2250e12, 'B200': 2250e12,
}


def mean_context(seq_len: int, local_window: int | None = None) -> float:
  """C: keys a causal query sees, averaged over positions 0..T-1."""
  i = np.arange(seq_len)
  seen = i + 1 if local_window is None else np.minimum(i + 1, local_window)
  return float(seen.mean())


def forward_flops_per_token(config, seq_len: int) -> float:
  """Forward FLOPs per token of the causal LM `config` (a ModelConfig) over
  sequences of seq_len (see the module docstring)."""
  D, N, K = config.d_model, config.num_heads, config.num_kv_heads
  H, F = config.head_dim, config.mlp_dim
  C = mean_context(seq_len, config.local_window)
  per_layer = (2 * D * N * H + 2 * N * H * D + 2 * 2 * D * K * H
               + 2 * 2 * N * H * C + 3 * 2 * D * F)
  return config.num_layers * per_layer + 2 * D * config.vocab_size


def training_flops_per_token(config, seq_len: int) -> float:
  return 3 * forward_flops_per_token(config, seq_len)


def peak_flops(device: jax.Device | None = None) -> tuple[float, str]:
  """(peak FLOP/s of one device, where the number comes from)."""
  device = device or jax.devices()[0]
  kind = device.device_kind
  if device.platform != 'cpu':
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
      if name.lower() in kind.lower():
        return PEAK_FLOPS[name], f'{kind} datasheet'
  return measured_matmul_flops(), f'{kind}: measured float32 matmul'


def measured_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
  """FLOP/s of a jitted n x n float32 matmul on the default device (median)."""
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda a: a @ a)
  matmul(a).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / float(np.median(times))
