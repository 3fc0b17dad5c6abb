"""Grouped-query dot-product attention: one function for MHA, GQA and MQA.

Dimension letters, used in einsum strings, shape comments and checks:

  B  batch                       T  query length
  S  key/value length            N  query heads
  K  key/value heads             G  group size, N // K (query heads per KV head)
  H  head dimension

K == N is multi-head attention, 1 < K < N grouped-query attention, K == 1
multi-query attention. Query head n attends with KV head n // G: the order of
`jnp.repeat(key, G, axis=2)`, shared with `jax.nn.dot_product_attention`, Gemma
and MaxText, so weights move between them. Grouping is a [B, T, K, G, H] *view*
of the query, contracted against the [B, S, K, H] keys by einsum, so K and V
are never copied per query head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention import blockwise, decode

Array = jax.Array


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
    implementation: str | None = None,
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
    implementation: None chooses; 'xla' is the dense einsum below; 'decode'
      is `attention.decode` (reads a [B, S, K, H] cache in place: for a few
      query tokens); 'blockwise' is `attention.blockwise` (flash-style:
      masked blocks skipped, O(T) memory; no extra mask, window or soft cap);
      'cudnn' is cuDNN's flash attention via `jax.nn.dot_product_attention`
      (GPU, 16-bit inputs). None picks, on CPU, 'decode' for T <= 8 and
      'blockwise' for long sequences where they are faster; on GPU 'cudnn'
      where it applies; else 'xla'.

  Returns:
    [B, T, N, H] in the query's dtype. Logits and softmax are computed in
    float32 whatever the input dtype; a query row with no key to attend to
    returns zeros, never NaN.

  Raises:
    ValueError: on shapes that do not fit together, naming them.
  """
  B, T, N, H, S, K = _check_shapes(query, key, value)
  if local_window is not None and local_window < 1:
    raise ValueError(f'local_window must be a positive int, got {local_window}')
  if logits_soft_cap is not None and logits_soft_cap <= 0:
    raise ValueError(f'logits_soft_cap must be > 0, got {logits_soft_cap}')
  G = N // K
  scale = H**-0.5 if scale is None else scale
  plain = mask is None and local_window is None and logits_soft_cap is None
  if implementation is None:
    implementation = _choose(query.dtype, T, S, G, plain)
  if implementation == 'blockwise':
    if not plain:
      raise ValueError("implementation='blockwise' supports is_causal only, "
                       'not mask, local_window or logits_soft_cap')
    if is_causal and T > S:
      raise ValueError(f"implementation='blockwise' with is_causal needs "
                       f'T={T} <= S={S}')
    return blockwise.blockwise_attention(query, key, value,
                                         is_causal=is_causal, scale=scale)
  if implementation == 'cudnn':
    if not plain or (is_causal and T != S):
      raise ValueError("implementation='cudnn' supports is_causal with T == S "
                       'and no mask, local_window or logits_soft_cap')
    return jax.nn.dot_product_attention(
        query, key, value, mask=mask, is_causal=is_causal, scale=scale,
        implementation='cudnn')
  if implementation not in ('xla', 'decode'):
    raise ValueError(f'implementation={implementation!r}; use None, '
                     "'xla', 'decode', 'blockwise' or 'cudnn'")

  mask_BKGTS = _grouped_mask(mask, query.shape, key.shape, is_causal,
                             local_window)
  if implementation == 'decode':
    return decode.cache_layout_attention(
        query, key, value, mask_BKGTS, scale=scale,
        logits_soft_cap=logits_soft_cap)

  query_BTKGH = query.reshape(B, T, K, G, H)
  logits_BKGTS = jnp.einsum(
      'BTKGH,BSKH->BKGTS', query_BTKGH, key,
      preferred_element_type=jnp.float32) * scale
  if logits_soft_cap is not None:
    logits_BKGTS = logits_soft_cap * jnp.tanh(logits_BKGTS / logits_soft_cap)

  if mask_BKGTS is not None:
    # A large finite negative rather than -inf: a fully masked row then gives
    # a finite softmax, which the `where` below turns into zeros.
    big_negative = jnp.finfo(jnp.float32).min
    logits_BKGTS = jnp.where(mask_BKGTS, logits_BKGTS, big_negative)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1)
  if mask_BKGTS is not None:
    probs_BKGTS = jnp.where(mask_BKGTS, probs_BKGTS, 0.0)

  out_BTKGH = jnp.einsum(
      'BKGTS,BSKH->BTKGH', probs_BKGTS.astype(value.dtype), value,
      preferred_element_type=jnp.float32)
  return out_BTKGH.reshape(B, T, N, H).astype(query.dtype)


def _choose(dtype, T, S, G, plain) -> str:
  """The fastest implementation that supports the call (see BENCHMARKS.md)."""
  backend = jax.default_backend()
  if (backend == 'cpu' and plain and blockwise.MIN_LENGTH <= T <= S
      and blockwise.tiling(T, G)[1] < T):
    return 'blockwise'
  if (backend == 'gpu' and plain and T == S
      and dtype in (jnp.bfloat16, jnp.float16)):
    return 'cudnn'
  if backend == 'cpu' and T <= decode.MAX_QUERIES:
    return 'decode'  # Stream the [B, S, K, H] cache instead of transposing it.
  return 'xla'


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


def _grouped_mask(mask, q_shape, k_shape, is_causal, local_window):
  """Combines all masks into one boolean array broadcastable to [B, K, G, T, S]."""
  B, T, N, _ = q_shape
  S, K = k_shape[1], k_shape[2]
  G = N // K
  combined = None
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
      raise ValueError(f'mask must be boolean (True = attend), got {mask.dtype}')
    if mask.ndim == 2:  # Key padding.
      if mask.shape != (B, S):
        raise ValueError(
            f'a 2-D mask is a key-padding mask [B, S] = {(B, S)}, got '
            f'{mask.shape}; pass [B, 1, T, S] for a per-query mask')
      mask = mask[:, None, None, :]
    try:
      jnp.broadcast_shapes(mask.shape, (B, N, T, S))
    except ValueError:
      raise ValueError(
          f'mask of shape {mask.shape} does not broadcast to [B, N, T, S] = '
          f'{(B, N, T, S)}') from None
    combined = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # [b, n, t, s]
  structural = attention_mask(
      jnp.arange(S - T, S), jnp.arange(S),
      is_causal=is_causal, local_window=local_window)
  if structural is not None:
    structural = structural[None, None]  # [1, 1, T, S]
    combined = structural if combined is None else combined & structural
  if combined is None:
    return None
  b, n, t, s = combined.shape
  if n == 1:
    return combined[:, :, None]  # [b, 1, 1, t, s]
  return combined.reshape(b, K, G, t, s)


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
