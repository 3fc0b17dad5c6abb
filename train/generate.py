"""Generates continuations of a file of prompts with continuous batching over
a paged KV cache: `python -m train.generate --workdir=DIR --prompts=FILE.jsonl
--out=OUT.jsonl --kv_memory=256MiB --max_new_tokens=N`. The command lives in
`serve.cli` (its docstring has the flags and formats)."""

from serve.cli import run

if __name__ == '__main__':
  run()
