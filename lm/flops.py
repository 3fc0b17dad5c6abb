"""Model FLOPs per token, and MFU against the device's peak.

The formula (one place, used by the trainer and the benchmarks). Per layer and
token, counting a multiply-add as 2 FLOPs, with D model width, N query heads,
K key/value heads, H head dim, F MLP hidden, V vocabulary:

  Q and output projections   2·D·N·H + 2·N·H·D
  K and V projections        2·2·D·K·H              <- shrinks with K; none in
                                                      a layer sharing K/V
                             (GTA: 2·D·(K·H + Y), the tied states and a
                             Y-wide RoPE key shared by the heads; its scores
                             and mix are GQA's)
  attention scores and mix   2·2·N·H·C              C = mean keys a query sees
  gated MLP                  3·2·D·F
and once per token the output logits, 2·D·V. Each layout's attention
formula is its own (`attention.layout`: `flops_per_token`,
`attention_flops_per_key`); these are the built-in ones'. A multi-head
latent attention layer (attention.latent: A latent in G groups, G = 1 for MLA, each head
reading its group's A/G; Q query latent, I + Y query/key and U value features
per head) counts instead
  query                      2·D·N·(I+Y), or 2·D·Q + 2·Q·N·(I+Y) with Q
  latent and RoPE key        2·D·(A+Y)              <- none when sharing K/V
  keys and values from it    2·(A/G)·N·(I+U)
  scores and mix             2·N·(I+Y)·C + 2·N·U·C
  output projection          2·N·U·D
and decoding, which absorbs the up-projections (no per-head K/V), the
queries' 2·N·I·(A/G) and the outputs' 2·N·(A/G)·U for the keys and values
from the latent, and 2·N·(A/G+Y)·C + 2·N·(A/G)·C for the scores and mix. For causal attention over a
length-T sequence C = (T + 1) / 2 (masked blocks are not counted as work),
capped in local layers by their window w: C = mean over i of min(i + 1, w). Norms, soft caps
and the query scale are elementwise and not counted. Training costs
3x the forward pass (backward = 2x forward); rematerialised recomputation is
not counted, as in the PaLM paper's MFU.

A decode step's attention intensity (`attention_decode_intensity`) is its
scores' and mix's FLOPs per key over the bytes of one token's cache entry
(as `attention.layer.kv_cache_bytes` counts them): per cached number,
2·2·N·H / (2·K·H) = 2·G FLOPs for GQA (each cached key and value serves its
G query heads); 2·2·N·H / (K·H + Y) for GTA (the tied state serves the keys
and the values of G heads); 2·N·(2·A/G + Y) / (A + Y) for MLA and GLA
absorbed (each latent number serves its N/G heads twice, the RoPE key all N
once). Per byte, divided by the number's bytes: in bfloat16 the paper's
≈ 2·g_q / m_kv (Zadouri, Strauss & Dao 2025: g_q query heads per distinct
cached head, m_kv = 2 separate or 1 tied K/V), half that in float32.
"""

from __future__ import annotations

import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from attention import layer

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
  return _forward_flops(config, lambda window: mean_context(seq_len, window))


def decode_flops_per_token(config, context: int) -> float:
  """FLOPs to decode one token after `context` cached ones (C = context + 1
  keys, capped by a local layer's window)."""
  return _forward_flops(config, lambda window: min(context + 1,
                                                   window or context + 1),
                        absorbed=True)


def _forward_flops(config, context, absorbed: bool = False) -> float:
  """context(local_window or None) -> C, the keys a query sees; absorbed:
  each layout's attention as decoding computes it (MLA's absorbed)."""
  D, F = config.d_model, config.mlp_dim
  total = 2 * D * config.vocab_size
  for i in range(config.num_layers):
    options = config.attention(i)
    total += options.layout.flops_per_token(
        options, D, context(options.local_window), config.shares_kv(i),
        absorbed)
    total += 3 * 2 * D * F
  return total


def attention_flops_per_key(o: layer.Options, absorbed: bool = False
                            ) -> float:
  """The scores' and the mix's FLOPs per query token and key it sees, in
  one layer with options `o` (its layout's formula: 2·2·N·H for GQA and
  GTA; MLA's and GLA's in `attention.latent`)."""
  return o.layout.attention_flops_per_key(o, absorbed)


def attention_decode_intensity(o: layer.Options, dtype) -> float:
  """FLOPs per byte of KV cache read by a decode step's attention (its
  scores and mix, MLA's absorbed) in one layer with options `o`; dtype: the
  compute dtype, stored unless o.kv_cache_dtype says otherwise (int8's
  scales count as bytes read). The same for a local layer and one sharing
  another's K/V, whose steps read the keys they attend to (see the module
  docstring)."""
  entry_bytes = layer.kv_cache_bytes(o, batch=1, length=1, dtype=dtype)
  return attention_flops_per_key(o, absorbed=True) / entry_bytes


def training_flops_per_token(config, seq_len: int) -> float:
  return 3 * forward_flops_per_token(config, seq_len)


def attention_flops(B: int, T: int, N: int, H: int, backward: bool) -> float:
  """Causal attention's FLOPs (QK and PV over the unmasked half), counted as
  the model's: forward + backward = 3x forward (a kernel's recomputation is
  not work)."""
  forward = 2 * 2 * B * N * H * T * (T + 1) / 2
  return forward * (3 if backward else 1)


def decode_roofline_tokens_per_sec(config, batch: int, context: int,
                                   bandwidth: float, peak: float) -> dict:
  """Decode tokens/s bounds at `context` cached tokens: 'bandwidth' (each
  step reads the weights and the cache once at `bandwidth` bytes/s),
  'compute' (each token's FLOPs at `peak` FLOP/s), and 'roofline', the
  lower of the two, the bound that applies."""
  from lm import model  # pylint: disable=import-outside-toplevel
  step_bytes = (model.kv_cache_bytes(config, batch, context)
                + model.param_bytes(config))
  by_bandwidth = batch * bandwidth / step_bytes
  by_compute = peak / decode_flops_per_token(config, context)
  return {'bandwidth': by_bandwidth, 'compute': by_compute,
          'roofline': min(by_bandwidth, by_compute)}


def equal_params_mlp_dim(mlp_dim: int, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> int:
  """The MLP width that gives K K/V heads MHA's parameter count (Shazeer
  2019): 2·D·(N-K)·H fewer K/V weights, 3·D per gated MLP unit; a multiple
  of 8."""
  extra = 2 * (num_heads - num_kv_heads) * head_dim / 3
  return mlp_dim + int(round(extra / 8)) * 8


def peak_flops(device: jax.Device | None = None) -> tuple[float, str]:
  """(peak FLOP/s of one device, where the number comes from).

  Accelerators: the datasheet's dense bf16 peak. CPUs: the theoretical
  float32 peak from /proc/cpuinfo (`cpu_peak_flops`), which does not move
  with the machine's load; where that cannot be read, the best of several
  large matmuls, and the source says so.
  """
  device = device or jax.devices()[0]
  kind = device.device_kind
  if device.platform != 'cpu':
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
      if name.lower() in kind.lower():
        return PEAK_FLOPS[name], f'{kind} datasheet'
  theoretical = cpu_peak_flops()
  if theoretical is not None:
    return theoretical
  return (measured_matmul_flops(),
          f'{kind}: best of 10 2048x2048 float32 matmuls (no /proc/cpuinfo)')


def cpu_peak_flops(cpuinfo: str | None = None,
                   cores: int | None = None) -> tuple[float, str] | None:
  """(theoretical float32 FLOP/s, the formula) of the cores this process may
  use: cores x SIMD lanes x FMA units x 2 x clock, read from /proc/cpuinfo.

  Lanes from the widest vector ISA flag (avx512f 16, avx 8, else 4); 2 FMA
  units with the fma flag (every x86 core since Haswell and Zen 2; Zen 1
  splits 256-bit FMAs, so its true peak is half), else 1; the clock is the
  nominal 'cpu MHz' (turbo is not visible there, so a boosting chip can
  exceed it). None where cpuinfo lacks these fields (not Linux x86).
  """
  if cpuinfo is None:
    try:
      cpuinfo = pathlib.Path('/proc/cpuinfo').read_text()
    except OSError:
      return None
  fields = {}
  for line in cpuinfo.splitlines():
    key, _, value = line.partition(':')
    fields.setdefault(key.strip(), value.strip())
  try:
    mhz = float(fields['cpu MHz'])
    flags = set(fields['flags'].split())
  except (KeyError, ValueError):
    return None
  isa, lanes = next(((f, n) for f, n in (('avx512f', 16), ('avx', 8))
                     if f in flags), ('sse', 4))
  fma_units = 2 if 'fma' in flags else 1
  threads_per_core = max(1, int(fields.get('siblings', 1))
                         // max(1, int(fields.get('cpu cores', 1))))
  if cores is None:
    cores = max(1, len(os.sched_getaffinity(0)) // threads_per_core)
  peak = cores * lanes * fma_units * 2 * mhz * 1e6
  return peak, (f'theoretical float32: {cores} cores x {lanes} lanes ({isa}) '
                f'x {fma_units} FMA units x 2 x {mhz / 1e3:.2f} GHz, '
                'from /proc/cpuinfo')


def measured_matmul_flops(n: int = 2048, repeats: int = 10) -> float:
  """FLOP/s of the fastest of `repeats` jitted n x n float32 matmuls."""
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda a: a @ a)
  matmul(a).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / min(times)
