"""The language model and running it: the model (`lm.model`) and its config
(`lm.config_lib`), the tokenizer and the data (`lm.data`), checkpoints
(`lm.checkpoint`), sampling, inference over the KV cache (`lm.inference`),
the loss and the held-out evaluator (`lm.evaluator`), FLOPs and sharding.
Training (train/), serving (serve/) and evaluation (evaluation/) stand on it;
it imports none of them."""
