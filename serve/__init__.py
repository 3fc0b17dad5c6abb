"""Serving many requests at a fixed memory budget, split as vLLM and
JetStream split a server: a model-free step scheduler (`serve.scheduler`:
chunked prefill beside decoding, preemption by recompute) over pages grown
on demand (`serve.kv_pages`, on `serve.pages`' allocator), the model's
forward pass over the paged cache (`serve.paged`), the engine that runs a
plan per step (`serve.engine`: add_request, step) and the
`python -m serve.generate` command (`serve.generate`), a thin loop over it."""
