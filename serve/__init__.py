"""Serving many requests at a fixed memory budget: a paged KV cache
(`serve.paged`), its page allocator (`serve.pages`), continuous batching
(`serve.engine`) and the `python -m serve.generate` command (`serve.generate`)."""
