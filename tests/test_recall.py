"""Specification of the recall probe (data.task='recall')."""

import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import recall, tiny
from scripts import compare
from studies.compare import runs as compare_runs
from lm import data, evaluator
from train import loop
from lm.model import Transformer

P, V, T = 6, 64, 32


def _task():
  return data.load('', val_fraction=0.1, seq_len=T, task='recall',
                   recall_pairs=P, vocab_size=V)


def test_rows_list_pairs_then_ask_every_key_once():
  rows = _task().batch('train', seed=0, step=3, batch_size=16, seq_len=T)
  assert rows.shape == (16, T + 1) and rows.dtype == np.int32
  for row in rows:
    keys, values = row[0:2 * P:2], row[1:2 * P:2]
    queries, answers = row[2 * P:4 * P:2], row[2 * P + 1:4 * P:2]
    assert len(set(keys)) == P and keys.max() < V // 2
    assert values.min() >= V // 2 and values.max() < V
    assert sorted(queries) == sorted(keys)
    pairs = dict(zip(keys, values))
    assert [pairs[q] for q in queries] == list(answers)
    assert not row[4 * P:].any()  # Padding.


def test_only_the_answers_are_scored():
  task = _task()
  rows = task.batch('train', seed=0, step=0, batch_size=4, seq_len=T)
  scored = rows[:, 1:][:, task.loss_weights == 1]  # Targets are tokens[1:].
  np.testing.assert_array_equal(scored, rows[:, 2 * P + 1:4 * P:2])
  assert task.loss_weights.shape == (T,) and task.loss_weights.sum() == P


def test_a_gap_of_filler_puts_every_key_that_far_before_its_query():
  gap = 9
  task = data.load('', val_fraction=0.1, seq_len=T, task='recall',
                   recall_pairs=P, recall_gap=gap, vocab_size=V)
  rows = task.batch('train', seed=0, step=3, batch_size=16, seq_len=T)
  q = 2 * P + gap  # The first query.
  no_gap = _task().batch('train', seed=0, step=3, batch_size=16, seq_len=T)
  # The same pairs and queries as without a gap, the queries moved by it.
  np.testing.assert_array_equal(rows[:, :2 * P], no_gap[:, :2 * P])
  np.testing.assert_array_equal(rows[:, q:q + 2 * P],
                                no_gap[:, 2 * P:4 * P])
  assert (rows[:, 2 * P:q] == V - 1).all()  # Filler, never a key.
  assert not rows[:, q + 2 * P:].any()
  scored = rows[:, 1:][:, task.loss_weights == 1]
  np.testing.assert_array_equal(scored, rows[:, q + 1:q + 2 * P:2])
  with pytest.raises(data.UserError, match=(
      r'recall_pairs=6 does not fit: .* 4P <= data.seq_len \+ 1 - '
      r'data.recall_gap 12 = 21 tokens.*use 1..5')):
    data.load('', val_fraction=0.1, seq_len=T, task='recall', recall_pairs=P,
              recall_gap=12, vocab_size=V)


def test_batches_are_pure_in_seed_and_step_and_shard_exactly():
  task = _task()
  kw = dict(seed=1, step=5, batch_size=8, seq_len=T)
  b = task.batch('train', **kw)
  np.testing.assert_array_equal(b, task.batch('train', **kw))
  assert not np.array_equal(b, task.batch('train', **{**kw, 'step': 6}))
  assert not np.array_equal(b, task.batch('val', **kw, stream=1))
  shards = [task.batch('train', **kw, shard=i, num_shards=4) for i in range(4)]
  np.testing.assert_array_equal(np.concatenate(shards), b)


@pytest.mark.slow
def test_weighted_loss_and_accuracy_count_only_weighted_targets():
  config = tiny.get_config()
  model = Transformer(loop.config_lib.model_config(config))
  params = jax.tree.map(jnp.asarray, loop.init_state(
      model, loop.make_optimizer(config.train)[0], 0).params)
  tokens = jax.random.randint(jax.random.key(0), (2, T + 1), 0, 256)
  weights = np.zeros(T, np.float32)
  weights[[3, 10]] = 1
  logits = model.apply({'params': params}, tokens[:, :-1])
  logp = jax.nn.log_softmax(logits)
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
  expected = -picked[:, [3, 10]].mean()
  loss, accuracy = evaluator.loss_fn(params, model, tokens,
                                     jnp.asarray(weights), with_accuracy=True)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  hits = logits.argmax(-1)[:, [3, 10]] == tokens[:, 1:][:, [3, 10]]
  np.testing.assert_allclose(accuracy, hits.mean())


@pytest.mark.slowest
@pytest.mark.slow
def test_training_on_recall_learns_the_task_through_the_weights(tmp_path):
  """Only answers are scored: the model learns they are values of its row."""
  config = tiny.get_config()
  config.model.update(vocab_size=32)
  config.data.update(task='recall', recall_pairs=4, seq_len=32)
  config.train.update(steps=150, batch_size=32, learning_rate=1e-2,
                      warmup_steps=10, log_every=50, eval_every=150,
                      checkpoint_every=150)
  record = loop.train_and_evaluate(config, str(tmp_path))
  chance = 1 / 16  # Values are 16 ids.
  assert record['eval_accuracy'] > 2 * chance, record
  assert record['eval_loss'] < math.log(16) - 0.5, record
  assert 'eval_bpb' not in record  # Not text: no bits per byte.
  # scripts/compare.py splits the accuracy by query (the first is retrieval).
  by_query = compare_runs.recall_accuracy_by_query(tmp_path)
  assert len(by_query) == 4
  # Over other held-out rows, the same accuracy as the loop's evaluation.
  assert np.mean(by_query) == pytest.approx(record['eval_accuracy'], abs=0.1)
  # A recall model is not a text model: train.sample refuses it in one line.
  result = subprocess.run(
      [sys.executable, '-m', 'train.sample', f'--workdir={tmp_path}',
       '--prompt=x'], cwd=pathlib.Path(__file__).parent.parent,
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert "trained on data.task='recall', not text" in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.slowest
@pytest.mark.slow
def test_a_small_model_learns_to_retrieve_every_answer(tmp_path):
  """The probe is learnable: train.main's loop on the recall config, narrowed
  to a test-sized model (4 pairs), answers every query, the first included
  (retrieval by content, which crossing out cannot fake). Fails if the task,
  the positions or the loss break the induction circuit."""
  config = recall.get_config()
  config.model.update(d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      mlp_dim=128, max_len=16)
  config.data.update(recall_pairs=4, seq_len=16)
  config.train.update(steps=800, eval_every=800, checkpoint_every=800,
                      log_every=100, min_learning_rate_ratio=1.0)
  record = loop.train_and_evaluate(config, str(tmp_path))
  by_query = compare_runs.recall_accuracy_by_query(tmp_path)
  assert len(by_query) == 4
  assert min(by_query) >= 0.95, by_query
  assert record['eval_accuracy'] >= 0.95, record
