"""Serving many requests at a fixed memory budget, split as vLLM and
JetStream split a server: a model-free step scheduler (`serve.scheduler`:
chunked prefill beside decoding, preemption by recompute; its plan carries
the page ids each row uses) over pages grown on demand (`serve.pages`), the
device side (`serve.runner`: the pool, the model's forward pass over it,
the jitted step), the engine that runs a plan per step (`serve.engine`:
add_request, step) and the `python -m serve.generate` command
(`serve.generate`, reading prompts with `serve.prompts` and keeping its
results file with `serve.results`), a thin loop over it."""
