"""frontier.png: each panel's NLL against KV bytes per token, every model
through each cache, with the frontier drawn through its points."""

from __future__ import annotations

import pathlib

import numpy as np

from studies import report, stats
from studies.kv_frontier.analysis import points


def _label(m: dict) -> str:
  """A point's label: its layout's part of the variant's name (K1, MLA32,
  GTA2, GLA32g2r16), and for a conversion its source and steps."""
  return m['variant'].split('_')[0] + (
      f' from {m["source"]} +{m["uptrain_steps"]}' if m.get('source') else '')


def plot(result: dict, path: pathlib.Path):
  plt = report.pyplot()
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel
  panels = result['panels']
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5),
                           squeeze=False)
  for ax, (name, panel) in zip(axes[0], panels.items()):
    pts = points(panel['models'])
    kinds = sorted({(m['attention_pattern'], m['kv_share'])
                    for m in panel['models']})
    colors = {kind: f'C{i}' for i, kind in enumerate(kinds)}
    for m, p in ((m, p) for m in panel['models'] for p in pts
                 if p['variant'] == m['variant']):
      e = stats.mean(p['nll'])
      half = 0.0 if e.n < 2 else e.high - e.mean
      color = colors[m['attention_pattern'], m['kv_share']]
      ax.errorbar(p['kv_bytes_per_token'], e.mean, yerr=half, color=color,
                  marker='o' if p['cache'] == 'float' else 's',
                  mfc=color if p['cache'] == 'float' else 'none', capsize=2)
      ax.annotate(_label(m), (p['kv_bytes_per_token'], e.mean),
                  fontsize=7, xytext=(3, 3), textcoords='offset points')
    on = sorted((p for p in pts if p['name'] in panel['analysis']['frontier']),
                key=lambda p: p['kv_bytes_per_token'])
    ax.plot([p['kv_bytes_per_token'] for p in on],
            [np.mean(p['nll']) for p in on], 'k--', lw=1, label='frontier')
    for (pattern, share), color in colors.items():
      ax.plot([], [], 'o', color=color, label=f'{pattern}, kv_share {share}')
    ax.plot([], [], 's', mfc='none', color='k', label='int8 cache (hollow)')
    ax.set(xscale='log', xlabel='KV cache bytes per token (at max_len)',
           ylabel='held-out NLL of the scored targets (nats)',
           title=f'{name}: NLL against bytes (95% intervals over seeds)')
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.legend(fontsize=7)
  report.save(fig, path)
