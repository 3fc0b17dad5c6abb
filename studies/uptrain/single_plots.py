"""The single-source design's plots: held-out loss along the uptraining
runs (curves.png), the scratch-equivalent steps (compute.png) and the
recall arm (recall.png)."""

from __future__ import annotations

import math
import pathlib

import numpy as np

from studies import report
from studies.uptrain.single_summary import UP_METHODS, losses, scratch_curve


def _band(ax, runs: list[dict], label: str, ls: str):
  """The runs' seed-mean loss along their curve and the seeds' range."""
  steps = [p['step'] for p in runs[0]['curve']]
  y = np.array([[p['loss'] for p in r['curve']] for r in runs])
  line, = ax.plot(steps, y.mean(0), ls=ls, label=label)
  ax.fill_between(steps, y.min(0), y.max(0), color=line.get_color(),
                  alpha=0.15)


def curves(out: pathlib.Path, results: dict):
  """Held-out loss along the uptraining runs: seed means, the seeds' range."""
  plt = report.pyplot()
  lm, plan = results['lm'], results['lm']['plan']
  N, kv = plan['num_heads'], plan['kv_heads']
  fig, axes = plt.subplots(1, len(kv), squeeze=False, sharey=True,
                           figsize=(5.5 * len(kv), 4))
  for j, K in enumerate(kv):
    ax = axes[0, j]
    for method, start in [*((m, 'fresh') for m in UP_METHODS),
                          ('identity', 'pooled'), ('mean', 'pooled')]:
      k = N if method == 'identity' else K
      _band(ax, [r for r in lm['runs'] if (r['method'], r['K'], r['start'])
                 == (method, k, start)], f'{method}, {start} Adam',
            '-' if start == 'fresh' else '--')
    if 'mla' in lm:
      _band(ax, [r for r in lm['mla']['runs'] if r['K'] == K],
            f'MLA at K={K}\'s cache bytes, fresh Adam', '-.')
    ax.axhline(lm['source']['loss'], color='gray', lw=1, ls=':',
               label='source (MHA)')
    ax.set(title=f'MHA → K={K}', xlabel='uptraining step',
           ylabel='held-out loss (nats/token)', yscale='log')
  axes[0, 0].legend(fontsize=7)
  report.save(fig, out / 'curves.png', dpi=110)


def compute(out: pathlib.Path, results: dict, summ: dict):
  """From-scratch curves of MHA and K, and each mean-pooled uptrained loss
  at the source's steps plus its uptraining's, mapped to its E."""
  plt = report.pyplot()
  lm, plan = results['lm'], results['lm']['plan']
  N, S, kv = plan['num_heads'], plan['steps'], plan['kv_heads']
  fig, axes = plt.subplots(1, len(kv), squeeze=False, sharey=True,
                           figsize=(5.5 * len(kv), 4))
  for j, K in enumerate(kv):
    ax = axes[0, j]
    for k, name in ((N, 'MHA'), (K, f'K={K}')):
      steps, curves = scratch_curve(lm, k)
      line, = ax.plot(steps, curves.mean(0), label=f'{name} from scratch')
      ax.fill_between(steps, curves.min(0), curves.max(0),
                      color=line.get_color(), alpha=0.2)
    up = losses(lm, 'mean', K).mean(0)[1:]
    xs = [S + a for a in plan['alpha_steps']]
    ax.plot(xs, up, 'k*', label='mean-pooled, uptrained (at S + αS)')
    for x, y, r in zip(xs, up, summ['compute'][K]):
      e = r['equivalent']['mean']
      if math.isfinite(e):
        ax.plot([e, x], [y, y], color='k', lw=0.6, ls=':')
    if 'mla' in summ:  # On the same curve: GQA-K's, of equal cache bytes.
      mla = summ['mla']['by_K'][K]
      ys = [e['mean'] for e in mla['mla'][1:]]
      ax.plot(xs, ys, 'r^', label=f'MLA at K={K}\'s bytes, uptrained (E '
              f'on K={K}\'s curve)')
      for x, y, r in zip(xs, ys, mla['compute']):
        if math.isfinite(r['equivalent']['mean']):
          ax.plot([r['equivalent']['mean'], x], [y, y], color='r', lw=0.6,
                  ls=':')
    ax.set(title=f'K={K}: scratch-equivalent steps', xlabel='training step',
           ylabel='held-out loss (nats/token)', yscale='log')
  axes[0, 0].legend(fontsize=7)
  report.save(fig, out / 'compute.png', dpi=110)


def recall(out: pathlib.Path, results: dict):
  """Recall accuracy while uptraining each conversion, and from scratch."""
  plt = report.pyplot()
  arm = results['recall']
  fig, (up, sc) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  groups = {}
  for r in arm['runs'] + arm.get('mla', {}).get('runs', []):
    groups.setdefault(f'{r["method"]} K={r["K"]}', []).append(r)
  for i, (name, runs) in enumerate(groups.items()):
    for j, r in enumerate(runs):  # Each ends where it reached the target.
      up.plot([p['step'] for p in r['curve']],
              [p['accuracy'] for p in r['curve']], color=f'C{i}', lw=1,
              label=name if not j else None)
  for r in arm['scratch']:
    sc.plot([p['step'] for p in r['curve']],
            [p['accuracy'] for p in r['curve']], lw=1,
            label=f'K={r["K"]}, seed {r["seed"]}')
  for ax, title, x in ((up, 'after conversion', 'uptraining step'),
                       (sc, 'from scratch', 'step')):
    ax.axhline(arm['plan']['target'], color='gray', ls=':', lw=1)
    ax.set(title=f'Recall probe: {title}', xlabel=x,
           ylabel='held-out answer accuracy')
    ax.legend(fontsize=7)
  report.save(fig, out / 'recall.png', dpi=110)
