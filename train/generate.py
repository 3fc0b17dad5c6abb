"""Autoregressive generation with the KV cache: prefill, then a fixed-shape scan."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from train.model import Transformer, unroll_layers


def sample_logits(rng, logits_BV, temperature: float, top_k: int):
  """Greedy when temperature is 0, else softmax sampling, optionally top-k."""
  if temperature == 0:
    return jnp.argmax(logits_BV, axis=-1)
  logits_BV = logits_BV / temperature
  if top_k:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  return jax.random.categorical(rng, logits_BV, axis=-1)


@functools.partial(jax.jit, static_argnames=('model', 'max_new_tokens',
                                             'temperature', 'top_k'))
def generate(params, prompt_BP, rng, *, model: Transformer,
             max_new_tokens: int, temperature: float, top_k: int):
  """[B, P] prompt tokens -> [B, max_new_tokens] generated tokens."""
  B = prompt_BP.shape[0]
  model, params = unroll_layers(model, params)
  cache = jax.tree.map(
      jnp.zeros_like,
      jax.eval_shape(model.init, jax.random.key(0),
                     jnp.zeros((B, model.config.max_len), jnp.int32))['cache'])
  cache = nn.unbox(cache)
  logits_BPV, mutated = model.apply({'params': params, 'cache': cache},
                                    prompt_BP, mutable=['cache'])
  rngs = jax.random.split(rng, max_new_tokens)
  first_B = sample_logits(rngs[0], logits_BPV[:, -1], temperature, top_k)

  def step(carry, rng):
    cache, token_B = carry
    logits_B1V, mutated = model.apply({'params': params, 'cache': cache},
                                      token_B[:, None], mutable=['cache'])
    next_B = sample_logits(rng, logits_B1V[:, 0], temperature, top_k)
    return (mutated['cache'], next_B), next_B

  _, rest_NB = jax.lax.scan(step, (mutated['cache'], first_B), rngs[1:])
  return jnp.concatenate([first_B[:, None], rest_NB.T], axis=1)
