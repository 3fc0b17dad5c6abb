"""Serving many requests at a fixed memory budget: a paged KV cache
(`serve.paged`), its page allocator (`serve.pages`), continuous batching
(`serve.engine`) and the `python -m train.generate` command (`serve.cli`);
a model-free step scheduler (`serve.scheduler`: chunked prefill beside
decoding, preemption by recompute) over pages grown on demand
(`serve.kv_pages`), for the engine to run."""
