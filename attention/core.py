"""Grouped-query dot-product attention: one function for MHA, GQA and MQA.

Dimension letters, used in einsum strings, shape comments and checks:

  B  batch                       T  query length
  S  key/value length            N  query heads
  K  key/value heads             G  group size, N // K (query heads per KV head)
  H  head dimension

and, where they occur (one meaning each across the codebase):

  D  model width                 F  MLP hidden units
  V  vocabulary                  L  layers
  E  N + 2K fused QKV heads      C  K·H cache columns (decode)
  J  a second KV head index      R  T·K·G query rows (decode)
  M  a length, T or S            P  key-value pairs (the recall task)
  X  B·T tokens as one axis      Z  B·K rows of a heads-major KV cache
  k  KV heads of one step        g  query heads of one step per KV head
  b  query rows of one block     (k, g, b: blockwise)
  A  MLA's latent (kv_lora_rank) Q  MLA's query latent (q_lora_rank)
  I, Y, U  MLA's per-head key features without RoPE, RoPE key features,
           value features (attention.latent); I and Y mean the same in
           grouped-tied attention (attention.tied)

K == N is multi-head attention, 1 < K < N grouped-query attention, K == 1
multi-query attention. Query head n attends with KV head n // G: the order of
`jnp.repeat(key, G, axis=2)`, shared with `jax.nn.dot_product_attention`, Gemma
and MaxText, so weights move between them. Grouping is a [B, T, K, G, H] *view*
of the query, contracted against the [B, S, K, H] keys by einsum, so K and V
are never copied per query head.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from attention import blockwise, decode, numerics, splash

Array = jax.Array


# The kernels `dot_product_attention` can run (`choose` picks one per
# platform; an explicit name that cannot take the call raises ValueError):
#   'xla'          the dense einsum below, anywhere, with every option;
#   'short_query'  `attention.decode`: a few query tokens (decoding) against a
#                  long [B, S, K, H] cache, read in place (CPU);
#   'blockwise'    `attention.blockwise`: flash-style, masked blocks skipped,
#                  O(T) memory; causal or full only (CPU);
#   'splash'       `attention.splash`: TPU splash attention (Pallas), causal,
#                  full or windowed, soft cap; T and S multiples of 128; no
#                  explicit mask. Elsewhere it runs in Pallas interpret mode
#                  (slow; for tests);
#   'cudnn'        cuDNN flash attention through `jax.nn.dot_product_attention`
#                  (GPU, 16-bit inputs, head dim a multiple of 8 up to 256,
#                  T == S when causal, windows only when causal, no mask or
#                  soft cap); needs cuDNN where the function is traced.
Implementation = Literal['xla', 'short_query', 'blockwise', 'splash', 'cudnn']
PLATFORMS = ('cpu', 'cuda', 'tpu')


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    local_window: int | None = None,
    logits_soft_cap: float | None = None,
    implementation: Implementation | None = None,
) -> Array:
  """Scaled dot-product attention with K key/value heads shared by N query heads.

  Args:
    query: [B, T, N, H].
    key: [B, S, K, H], with N divisible by K.
    value: [B, S, K, H].
    mask: boolean, True = attend. A 2-D mask is a key-padding mask [B, S];
      otherwise anything that broadcasts to [B, N, T, S].
    is_causal: query i may attend to key positions <= S - T + i: the causal
      mask is aligned bottom-right, so a query block that continues a longer
      key sequence (decoding, chunked prefill) sees exactly its past.
    scale: logits multiplier; defaults to 1 / sqrt(H).
    local_window: w > 0, sliding-window attention. With `is_causal` each query
      sees its w most recent positions, itself included; without it, the keys
      less than w positions away on either side.
    logits_soft_cap: c > 0, logits become c * tanh(logits / c) before masking
      (Gemma 2).
    implementation: None chooses, per platform (`choose`); or one of
      `Implementation` (see there), which must take the call.

  Returns:
    [B, T, N, H] in the query's dtype. Logits and softmax are computed in
    float32 whatever the input dtype; a query row with no key to attend to
    returns zeros, never NaN.

  Raises:
    ValueError: on shapes that do not fit together, naming them.
  """
  H = _check(query, key, value, local_window, logits_soft_cap, implementation)
  call = _Call(query, key, value, mask, is_causal,
               H**-0.5 if scale is None else scale, local_window,
               logits_soft_cap)
  if implementation is not None:
    refusal = _REFUSALS[implementation](call)
    if refusal:
      raise ValueError(f'implementation={implementation!r} cannot take this '
                       f'call: {refusal}')
    return _IMPLEMENTATIONS[implementation](call)
  chosen = {platform: choose(platform, call) for platform in PLATFORMS}
  if len(set(chosen.values())) == 1:  # One program for every platform.
    return _IMPLEMENTATIONS[chosen['cpu']](call)
  # Each platform lowers only its own branch: one jitted function carries
  # the CPU, CUDA and TPU kernels, whatever the host that traces it.
  return jax.lax.platform_dependent(**{
      platform: functools.partial(_IMPLEMENTATIONS[name], call)
      for platform, name in chosen.items()})


def _check(query, key, value, local_window, logits_soft_cap,
           implementation) -> int:
  """H, once the shapes and options are known to fit; ValueError if not."""
  H = _check_shapes(query, key, value)[3]
  if local_window is not None and local_window < 1:
    raise ValueError(f'local_window must be a positive int, got {local_window}')
  if logits_soft_cap is not None and logits_soft_cap <= 0:
    raise ValueError(f'logits_soft_cap must be > 0, got {logits_soft_cap}')
  if implementation is not None and implementation not in _IMPLEMENTATIONS:
    raise ValueError(f'implementation={implementation!r}; use None or one of '
                     f'{", ".join(map(repr, _IMPLEMENTATIONS))}')
  return H


@dataclasses.dataclass(frozen=True)
class _Call:
  """One call's arrays and options, validated."""
  query: Array
  key: Array
  value: Array
  mask: Array | None
  is_causal: bool
  scale: float
  local_window: int | None
  logits_soft_cap: float | None

  @property
  def plain(self) -> bool:  # Causal or full attention, nothing else.
    return (self.mask is None and self.local_window is None
            and self.logits_soft_cap is None)


def choose(platform: str, call: _Call) -> str:
  """The fastest implementation that takes `call` on `platform` (BENCHMARKS.md).

  cpu   'short_query' for T <= 8; 'blockwise' for plain attention over 256 or
        more tokens; else 'xla'.
  tpu   'splash' where it applies (see its entry above); else 'xla'
        (decoding included: the grouped einsum reads the cache in place).
  cuda  'cudnn' where it applies and cuDNN is present at trace time; else
        'xla'. Lowering for CUDA on a host without cuDNN therefore gives the
        einsum: export on a GPU machine to get the cuDNN kernel.
  """
  B, T, N, H = call.query.shape
  S, K = call.key.shape[1:3]
  if platform == 'cpu':
    if (call.plain and blockwise.MIN_LENGTH <= T <= S
        and blockwise.tiling(T, N // K, N)[1] < T):
      return 'blockwise'
    if T <= decode.MAX_QUERIES:
      return 'short_query'  # Reads the [B, S, K, H] cache; no copy.
    return 'xla'
  if platform == 'tpu':
    return 'splash' if not _refuse_splash(call) else 'xla'
  if platform == 'cuda':
    return 'cudnn' if not _refuse_cudnn(call) else 'xla'
  raise ValueError(f'platform={platform!r}; one of {PLATFORMS}')


def _xla(call: _Call) -> Array:
  query, key, value = call.query, call.key, call.value
  B, T, N, H = query.shape
  K = key.shape[2]
  G = N // K
  mask_BKGTS = _grouped_mask(call.mask, query.shape, key.shape,
                             call.is_causal, call.local_window)
  query_BTKGH = query.reshape(B, T, K, G, H)
  logits_BKGTS = jnp.einsum(
      'BTKGH,BSKH->BKGTS', query_BTKGH, key,
      preferred_element_type=jnp.float32) * call.scale
  probs_BKGTS = numerics.masked_softmax(
      numerics.soft_cap(logits_BKGTS, call.logits_soft_cap), mask_BKGTS)

  out_BTKGH = jnp.einsum(
      'BKGTS,BSKH->BTKGH', probs_BKGTS.astype(value.dtype), value,
      preferred_element_type=jnp.float32)
  return out_BTKGH.reshape(B, T, N, H).astype(query.dtype)


def _short_query(call: _Call) -> Array:
  mask_BKGTS = _grouped_mask(call.mask, call.query.shape, call.key.shape,
                             call.is_causal, call.local_window)
  return decode.cache_layout_attention(
      call.query, call.key, call.value, mask_BKGTS, scale=call.scale,
      logits_soft_cap=call.logits_soft_cap)


def _blockwise(call: _Call) -> Array:
  return blockwise.blockwise_attention(call.query, call.key, call.value,
                                       is_causal=call.is_causal,
                                       scale=call.scale)


def _splash(call: _Call, *, interpret: bool | None = None) -> Array:
  run = functools.partial(
      splash.splash_attention, call.query, call.key, call.value,
      is_causal=call.is_causal, scale=call.scale,
      local_window=call.local_window, logits_soft_cap=call.logits_soft_cap)
  if interpret is not None:
    return run(interpret=interpret)
  # The compiled kernel where lowering for TPU, interpret mode elsewhere.
  return jax.lax.platform_dependent(tpu=lambda: run(interpret=False),
                                    default=lambda: run(interpret=True))


def _cudnn(call: _Call) -> Array:
  window = None
  if call.local_window is not None:
    window = (call.local_window - 1, 0)
  return jax.nn.dot_product_attention(
      call.query, call.key, call.value, is_causal=call.is_causal,
      scale=call.scale, local_window_size=window, implementation='cudnn')


def _refuse_none(call: _Call) -> str | None:
  del call
  return None


def _refuse_blockwise(call: _Call) -> str | None:
  T, S = call.query.shape[1], call.key.shape[1]
  if not call.plain:
    return 'it supports is_causal only, not mask, local_window or soft cap'
  if call.is_causal and T > S:
    return f'is_causal needs T={T} <= S={S}'
  return None


def _refuse_splash(call: _Call) -> str | None:
  return splash.supports(call.query.shape[1], call.key.shape[1],
                         mask=call.mask, is_causal=call.is_causal)


def _refuse_cudnn(call: _Call) -> str | None:
  T, H = call.query.shape[1], call.query.shape[3]
  S = call.key.shape[1]
  if call.query.dtype not in (jnp.bfloat16, jnp.float16):
    return f'it needs bfloat16 or float16 inputs, got {call.query.dtype}'
  if H % 8 or H > 256:
    return f'it needs a head dim H that is a multiple of 8 up to 256, got {H}'
  if call.mask is not None or call.logits_soft_cap is not None:
    return 'it takes no mask or logits_soft_cap'
  if call.local_window is not None and not call.is_causal:
    # cuDNN's non-causal windows also show future tokens (JAX PR 39576).
    return 'a local_window needs is_causal'
  if call.is_causal and T != S:
    return f'is_causal needs T == S (T={T}, S={S})'
  if not cudnn_available():
    return 'cuDNN is not present where this is traced'
  return None


@functools.cache
def cudnn_available() -> bool:
  """JAX's own trace-time check for cuDNN (false on a CPU-only host)."""
  try:
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version  # pylint: disable=import-outside-toplevel
    check_cudnn_version()
    return True
  except Exception:  # pylint: disable=broad-except
    return False


_IMPLEMENTATIONS = {'xla': _xla, 'short_query': _short_query,
                    'blockwise': _blockwise, 'splash': _splash,
                    'cudnn': _cudnn}
_REFUSALS = {'xla': _refuse_none, 'short_query': _refuse_none,
             'blockwise': _refuse_blockwise, 'splash': _refuse_splash,
             'cudnn': _refuse_cudnn}


def attention_mask(
    query_positions: Array,
    key_positions: Array,
    *,
    is_causal: bool,
    local_window: int | None = None,
) -> Array | None:
  """Causal and/or sliding-window mask from absolute positions, True = attend.

  Args:
    query_positions: [..., T] integer positions of the queries.
    key_positions: [..., S] integer positions of the keys.
    is_causal: keys after the query are hidden.
    local_window: w, keys w or more positions away (behind, or on either side
      when not causal) are hidden.

  Returns:
    [..., T, S] boolean, or None when neither option is set.
  """
  if not is_causal and local_window is None:
    return None
  q_T1 = query_positions[..., :, None]
  k_1S = key_positions[..., None, :]
  mask_TS = jnp.ones(jnp.broadcast_shapes(q_T1.shape, k_1S.shape), bool)
  if is_causal:
    mask_TS &= k_1S <= q_T1
  if local_window is not None:
    mask_TS &= jnp.abs(q_T1 - k_1S) < local_window
  return mask_TS


def as_4d_mask(mask: Array, B: int, S: int) -> Array:
  """A boolean mask as 4-D [b, n, t, s]: a [B, S] key-padding mask becomes
  [B, 1, 1, S], anything else gets leading 1s."""
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise ValueError(f'mask must be boolean (True = attend), got {mask.dtype}')
  if mask.ndim == 2:  # Key padding.
    if mask.shape != (B, S):
      raise ValueError(
          f'a 2-D mask is a key-padding mask [B, S] = {(B, S)}, got '
          f'{mask.shape}; pass [B, 1, T, S] for a per-query mask')
    return mask[:, None, None, :]
  return mask.reshape((1,) * (4 - mask.ndim) + mask.shape)


def _grouped_mask(mask, q_shape, k_shape, is_causal, local_window):
  """Combines all masks into one boolean array broadcastable to [B, K, G, T, S]."""
  B, T, N, _ = q_shape
  S, K = k_shape[1], k_shape[2]
  combined = None
  if mask is not None:
    combined = as_4d_mask(mask, B, S)  # [b, n, t, s]
    try:
      jnp.broadcast_shapes(combined.shape, (B, N, T, S))
    except ValueError:
      raise ValueError(
          f'mask of shape {jnp.shape(mask)} does not broadcast to '
          f'[B, N, T, S] = {(B, N, T, S)}') from None
  structural = attention_mask(
      jnp.arange(S - T, S), jnp.arange(S),
      is_causal=is_causal, local_window=local_window)
  if structural is not None:
    structural = structural[None, None]  # [1, 1, T, S]
    combined = structural if combined is None else combined & structural
  if combined is None:
    return None
  return numerics.grouped_mask(combined, K)


def _check_shapes(query, key, value):
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(
        'expected query [B, T, N, H] and key/value [B, S, K, H], got ranks '
        f'{query.ndim}, {key.ndim}, {value.ndim} (shapes {query.shape}, '
        f'{key.shape}, {value.shape})')
  B, T, N, H = query.shape
  _, S, K, _ = key.shape
  if key.shape != value.shape:
    raise ValueError(
        f'key {key.shape} and value {value.shape} must have the same shape '
        '[B, S, K, H]')
  if key.shape[0] != B or key.shape[3] != H:
    raise ValueError(
        f'query [B, T, N, H] = {query.shape} and key [B, S, K, H] = '
        f'{key.shape} must agree on batch B and head dim H')
  if K == 0 or N % K:
    raise ValueError(
        f'query heads N={N} must be a multiple of key/value heads K={K} '
        f'(query {query.shape}, key {key.shape})')
  return B, T, N, H, S, K
