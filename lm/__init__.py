"""The language model and running it: the model (`lm.model`) and its config
(`lm.config_lib`), the tokenizer and the data (`lm.data`), checkpoints
(`lm.checkpoint`), sampling, FLOPs and sharding. Training (train/), serving
(serve/) and evaluation (evaluation/) stand on it."""
