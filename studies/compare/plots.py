"""The comparison's plots: loss against step, and training and decode
throughput beside the decode roofline."""

from __future__ import annotations

import numpy as np

from studies import report
from studies.compare import design


def loss(path, result):
  """Training loss (mean over seeds) and held-out loss with its seed band,
  against step; the held-out loss of the last half, zoomed."""
  plt = report.pyplot()
  fig, (by_step, zoom) = plt.subplots(1, 2, figsize=(11, 4))
  variants = sorted(result['variants'], key=lambda v: -v['K'])
  for i, v in enumerate(variants):
    curves = [s['curve'] for s in v['seeds']]
    steps = [m['step'] for m in curves[0]]
    train = np.mean([[m['loss'] for m in c] for c in curves], 0)
    by_step.plot(steps, train, color=f'C{i}', alpha=0.4)
    evals = [[m for m in c if 'eval_loss' in m] for c in curves]
    at = [m['step'] for m in evals[0]]
    held = np.array([[m['eval_loss'] for m in e] for e in evals])
    for ax in (by_step, zoom):
      ax.plot(at, held.mean(0), 'o-', color=f'C{i}', label=f'K={v["K"]}')
      if len(curves) > 1:  # ± sd over seeds, the report's convention.
        sd = held.std(0, ddof=1)
        ax.fill_between(at, held.mean(0) - sd, held.mean(0) + sd,
                        color=f'C{i}', alpha=0.2)
  last = max(m['step'] for v in variants for s in v['seeds']
             for m in s['curve'])
  zoom.set_xlim(last / 2, last * 1.02)
  zoom.autoscale(axis='y')
  by_step.set(xlabel='step', ylabel='loss (nats/token)',
              title='train (faint) and held-out loss, band: ± sd over seeds')
  zoom.set(xlabel='step', ylabel='held-out loss (nats/token)',
           title='held-out loss, second half')
  by_step.legend()
  report.save(fig, path)


def throughput(path, rows):
  """Training tokens/s (bars), decode tokens/s and its roofline (points on
  a log axis)."""
  plt = report.pyplot()
  fig, (train_ax, decode_ax) = plt.subplots(1, 2, figsize=(11, 4))
  names = [f'K={r["K"]}' for r in rows]
  train_ax.bar(names, [r['train'] for r in rows], color='C0')
  train_ax.set(ylabel='tokens/s', title='training throughput')
  decode_ax.plot(names, [r['decode'] for r in rows], 'o', color='C1',
                 markersize=10, label='measured')
  decode_ax.plot(names, [r['roofline'] for r in rows], 'k_', markersize=30,
                 mew=2, label='roofline (bytes or FLOPs, the lower)')
  decode_ax.set(ylabel='tokens/s (log)', yscale='log',
                title=f'decode (batch {design.DECODE_BATCH}, context '
                      f'{design.DECODE_CONTEXT})')
  decode_ax.legend()
  report.save(fig, path)
