"""Downstream evaluation of workdirs with EleutherAI's lm-evaluation-harness
(the `eval` extra): `harness` is the `gqa-lab` model, `lm_eval_cli` the
harness's own command line with it registered. `python -m evaluation.evaluate`
runs both and reports held-out loss beside them."""
