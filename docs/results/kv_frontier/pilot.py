"""Pilot (pilots.md): one seed of a kv_recall layout, first-query accuracy every N steps.
PYTHONPATH=. python docs/results/kv_frontier/pilot.py NAME STEPS EVERY section.field=value ...
The base config: $PILOT_CONFIG (default kv_recall); the pilots used 03c8275's configs/kv_recall.py
(git show 03c8275:configs/kv_recall.py > /tmp/kv_recall_old.py; PILOT_CONFIG=/tmp/kv_recall_old.py).
Lines go to /tmp/kv_pilots/NAME/log.txt (the loop's log), the last one also to stdout."""
import os, sys, time, pathlib, shutil
import jax, numpy as np
from studies import study
from lm import config_lib, data
from lm.model import Transformer
name, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = config_lib.load(os.environ.get('PILOT_CONFIG', 'kv_recall'))
for kv in sys.argv[4:]:
  k, v = kv.split('=')
  sec, field = k.split('.') if k.count('.') == 1 else (None, k)
  v = eval(v) if v not in ('G', 'L', 'LLGG', 'LG', 'LLG', 'LGLG') else v
  if sec: config[sec][field] = v
  else: config[field] = v
config.train.update(steps=steps, eval_every=every, checkpoint_every=steps,
                    min_learning_rate_ratio=1.0, log_every=every)
if 'L' in config.model.attention_pattern and not config.model.local_window:
  config.model.local_window = 4
mc = config_lib.model_config(config)
dc = config.data
task = data.load('', val_fraction=0.0, seq_len=dc.seq_len, task='recall', recall_pairs=dc.recall_pairs,
                 recall_gap=dc.recall_gap, vocab_size=mc.vocab_size)
model = Transformer(mc)
predict = jax.jit(lambda p, t: model.apply({'params': p}, t).argmax(-1))
held = task.batch('val', seed=0, step=0, batch_size=512, seq_len=dc.seq_len, stream=1)
wd = pathlib.Path('/tmp/kv_pilots') / name
shutil.rmtree(wd, ignore_errors=True)
t0, c0 = time.perf_counter(), time.process_time()
hist = []
def on_eval(step, params, record):
  bq = task.accuracy_by_query(predict(params, held[:, :-1]), held)
  hist.append((step, round(record['loss'], 3), round(float(bq[0]), 3), round(float(bq.mean()), 3)))
  print(name, step, hist[-1][1:], f'{time.process_time()-c0:.0f}s cpu', flush=True)
  return bool(bq[0] >= 0.99 and bq.min() >= 0.99)
study.train(config, wd, wd / 'log.txt', on_eval=on_eval)
cpu = time.process_time() - c0
reached = next((h[0] for h in hist if h[2] >= 0.95), None)
print('RESULT', name, ' '.join(sys.argv[4:]), 'steps', hist[-1][0], 'first', hist[-1][2], 'mean', hist[-1][3],
      'reached', reached, f'cpu {cpu:.0f}s wall {time.perf_counter()-t0:.0f}s', flush=True)
