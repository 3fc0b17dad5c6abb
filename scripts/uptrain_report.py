"""The uptraining study's report: statistics over seeds, tables, the reading, plots.

`write(out, results)` takes `scripts.uptrain_study`'s results.json and writes
OUT/report.md, OUT/loss_vs_alpha.png and OUT/curves.png. Differences between
methods are paired by seed (same data order); an interval that excludes 0 at
95% (Student t over the seeds) "resolves".
"""

from __future__ import annotations

import math
import pathlib
import sys

import numpy as np

METHODS = ('identity', 'mean', 'first', 'random')
RECIPES = ('paper', 'continued')
SCRATCH_ALPHA = 0.05
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447,
       7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def losses(results, recipe, method, K, alpha) -> np.ndarray:
  """Held-out losses over seeds, in seed order."""
  rows = sorted((r['seed'], r['loss']) for r in results['runs']
                if (r['recipe'], r['method'], r['K'], r['alpha']) ==
                (recipe, method, K, alpha))
  return np.array([loss for _, loss in rows])


def interval(x) -> tuple[float, float, float]:
  """(mean, standard deviation, 95% half-width) of a sample."""
  x = np.asarray(x, float)
  if len(x) < 2:
    return float(x.mean()), 0.0, float('inf')
  sd = float(x.std(ddof=1))
  return float(x.mean()), sd, T95.get(len(x) - 1, 1.96) * sd / math.sqrt(len(x))


def unpaired(a, b) -> tuple[float, float]:
  """(mean(a) - mean(b), its 95% half-width), Welch's t."""
  a, b = np.asarray(a, float), np.asarray(b, float)
  va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
  if len(a) < 2 or len(b) < 2 or va + vb == 0:
    return float(a.mean() - b.mean()), float('inf')
  df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
  t = T95.get(max(1, int(df)), 1.96)
  return float(a.mean() - b.mean()), t * math.sqrt(va + vb)


def resolved(mean: float, half: float) -> bool:
  return abs(mean) > half


def _pm(x) -> str:
  mean, sd, _ = interval(x)
  return f'{mean:.4f}' if len(x) < 2 else f'{mean:.4f} ± {sd:.4f}'


def _diff(mean: float, half: float) -> str:
  verdict = 'resolves' if resolved(mean, half) else 'does not resolve'
  return f'{mean:+.4f} ± {half:.4f} ({verdict})'


def loss_table(results, recipe: str, K: int) -> list[str]:
  """Held-out loss by method (rows) and alpha (columns), mean ± sd."""
  plan = results['plan']
  alphas = plan['alphas']
  lines = ['| method | ' + ' | '.join(f'α={a:g}' for a in alphas) + ' |',
           '|---|' + '---|' * len(alphas)]
  for method in METHODS:
    k = plan['num_heads'] if method == 'identity' else K
    lines.append(f'| {method}{" (K=N)" if method == "identity" else ""} | '
                 + ' | '.join(_pm(losses(results, recipe, method, k, a))
                              for a in alphas) + ' |')
  return lines


def recovery(results, recipe, method, K, alpha) -> np.ndarray:
  """Per seed, the fraction of the conversion's drop (alpha 0's loss over
  the source's) that uptraining for alpha won back."""
  source = results['source']['loss']
  before = losses(results, recipe, method, K, 0)
  after = losses(results, recipe, method, K, alpha)
  return (before - after) / (before - source)


def recovery_table(results, K: int) -> list[str]:
  alphas = [a for a in results['plan']['alphas'] if a]
  lines = ['| method, recipe | ' + ' | '.join(f'α={a:g}' for a in alphas)
           + ' |', '|---|' + '---|' * len(alphas)]
  for method in METHODS[1:]:
    for recipe in RECIPES:
      cells = [interval(recovery(results, recipe, method, K, a))
               for a in alphas]
      lines.append(f'| {method}, {recipe} | ' + ' | '.join(
          f'{100 * m:.0f}% ± {100 * sd:.0f}' for m, sd, _ in cells) + ' |')
  return lines


def paired(results, recipe, a_method, b_method, K, alpha):
  """(mean, 95% half-width) of a_method's loss minus b_method's, by seed."""
  N = results['plan']['num_heads']
  a = losses(results, recipe, a_method,
             N if a_method == 'identity' else K, alpha)
  b = losses(results, recipe, b_method,
             N if b_method == 'identity' else K, alpha)
  mean, _, half = interval(a - b)
  return mean, half


PAIRS = (('mean', 'first'), ('first', 'random'), ('mean', 'random'),
         ('mean', 'identity'))


def paired_table(results, recipe: str, K: int) -> list[str]:
  alphas = results['plan']['alphas']
  lines = ['| difference | ' + ' | '.join(f'α={a:g}' for a in alphas) + ' |',
           '|---|' + '---|' * len(alphas)]
  for a_method, b_method in PAIRS:
    lines.append(f'| {a_method} − {b_method} | ' + ' | '.join(
        _diff(*paired(results, recipe, a_method, b_method, K, a))
        for a in alphas) + ' |')
  return lines


def scratch_table(results) -> list[str]:
  lines = ['| K | from scratch | ' + ' | '.join(
      f'mean-pooled, {r}' for r in RECIPES) + ' |', '|---|---|---|---|']
  for K in results['plan']['kv_heads']:
    scratch = [s['loss'] for s in results['scratch'] if s['K'] == K]
    lines.append(f'| {K} | {_pm(scratch)} | ' + ' | '.join(
        _pm(losses(results, r, 'mean', K, SCRATCH_ALPHA)) for r in RECIPES)
        + ' |')
  return lines


def control(results, recipe: str) -> dict:
  """{alpha: (mean, 95% half-width)} of the identity control's loss minus
  the source's, alpha > 0: what the recipe alone does to the model."""
  N = results['plan']['num_heads']
  out = {}
  for alpha in [a for a in results['plan']['alphas'] if a]:
    mean, _, half = interval(losses(results, recipe, 'identity', N, alpha)
                             - results['source']['loss'])
    out[alpha] = (mean, half)
  return out


def sound_recipe(results) -> str:
  """The recipe that does not shock the unconverted model (its control is
  never resolved above the source), the better control at the largest
  alpha among those (or among all, if both shock)."""
  shocked = {r: any(m > 0 and resolved(m, h)
                    for m, h in control(results, r).values())
             for r in RECIPES}
  top = results['plan']['alphas'][-1]
  return min(RECIPES, key=lambda r: (shocked[r], control(results, r)[top][0]))


def _better(difference, first: str, second: str) -> str:
  """Which of two is better, given (first - second, half-width) in loss."""
  if not resolved(*difference):
    return 'no resolved difference'
  return f'{first if difference[0] < 0 else second} is better'


def _ordering(results, recipe, K) -> tuple[str, list[str]]:
  """(verdict, lines): which of mean < first < random hold after
  uptraining, per alpha; reproduced if both do (resolved) at every alpha,
  partly if at some."""
  lines, held = [], []
  for better, worse in PAIRS[:2]:
    verdicts = []
    for i, alpha in enumerate([a for a in results['plan']['alphas'] if a]):
      mean, half = paired(results, recipe, better, worse, K, alpha)
      holds = mean < 0 and resolved(mean, half)
      held.append((i, holds))
      verdicts.append(f'α={alpha:g}: {mean:+.3f} ' + (
          ('(holds)' if mean < 0 else '(reversed)')
          if resolved(mean, half) else '(unresolved)'))
    lines.append(f'  - {better} < {worse}: ' + ', '.join(verdicts))
  both = [all(h for j, h in held if j == i) for i in {j for j, _ in held}]
  verdict = ('reproduced' if all(both) else
             'partly reproduced' if any(both) else 'not reproduced')
  return verdict, lines


def _recovery_verdict(recovered: float, net: float, source: float) -> str:
  """Claim 1: reproduced if the mean-pooled model ends within 2% of the
  source's loss of the control; partly if it recovered most of the drop."""
  if net <= 0.02 * source:
    return 'reproduced'
  return 'partly reproduced' if recovered >= 0.5 else 'not reproduced'


def _compute_verdict(difference) -> str:
  """Claim 3: uptraining beats training from scratch on the same tokens."""
  if not resolved(*difference):
    return 'unresolved'
  return 'reproduced' if difference[0] < 0 else 'not reproduced'


def reading(results) -> list[str]:
  """The findings, each from the numbers below it."""
  src, plan = results['source'], results['plan']
  N = plan['num_heads']
  flat = src['change'] < 0.01
  identity0 = losses(results, RECIPES[0], 'identity', N, 0)
  lines = [
      f'- **Source**: MHA (K = N = {N}) trained {src["steps"]} steps '
      f'({src["tokens"] / 1e6:.2f}M tokens) to a held-out loss of '
      f'{src["loss"]:.4f} nats/token; it changed {100 * src["change"]:.2f}% '
      f'over the last fifth of its steps ({"flat" if flat else "NOT flat"}: '
      'the criterion is < 1%' + ('' if flat else '; so part of any gain '
                                  'while uptraining is the source still '
                                  'learning, which the control measures too')
      + '). The identity conversion evaluates to '
      f'{identity0.mean():.4f} at α = 0 (the source: the conversion path is '
      f'{"exact" if abs(identity0 - src["loss"]).max() < 1e-4 else "NOT exact"}).']
  sound = sound_recipe(results)
  for recipe in RECIPES:
    shock = control(results, recipe)
    lines.append(
        f'- **The control, {recipe} recipe** (no conversion, the same '
        'uptraining): ' + ', '.join(f'α = {a:g}: {_diff(*d)}'
                                    for a, d in shock.items())
        + ' nats from the source.')
  lines.append(
      f'- The **{sound}** recipe is the sound one here: it does not shock the '
      'unconverted model (or shocks it least). Both recipes are read below.')
  for recipe in sorted(RECIPES, key=lambda r: r != sound):
    for K in plan['kv_heads']:
      lines += _claims(results, recipe, K)
  return lines


def _claims(results, recipe: str, K: int) -> list[str]:
  """Claim 1 (alpha = 0.05 recovers most) and claim 2 (mean < first <
  random) for one recipe and K."""
  src = results['source']['loss']
  rec = interval(recovery(results, recipe, 'mean', K, SCRATCH_ALPHA))
  gap = losses(results, recipe, 'mean', K, SCRATCH_ALPHA) - src
  net = paired(results, recipe, 'mean', 'identity', K, SCRATCH_ALPHA)
  scratch = [s['loss'] for s in results['scratch'] if s['K'] == K]
  vs_scratch = unpaired(
      losses(results, recipe, 'mean', K, SCRATCH_ALPHA), scratch)
  ordering, ordering_lines = _ordering(results, recipe, K)
  return [
      f'- **K = {K}, {recipe} recipe, claim 1 (α = {SCRATCH_ALPHA:g} recovers '
      f'most of MHA\'s quality): {_recovery_verdict(rec[0], net[0], src)}.** '
      f'Mean-pooled: {100 * rec[0]:.0f}% ± {100 * rec[1]:.0f} of the '
      f'conversion\'s drop recovered; {gap.mean():+.4f} nats from the source '
      f'({100 * gap.mean() / src:+.1f}%), {_diff(*net)} against the control.',
      f'- **K = {K}, {recipe} recipe, claim 3 (uptraining beats training K '
      f'from scratch on the same total tokens): '
      f'{_compute_verdict(vs_scratch)}.** Uptrained minus scratch: '
      f'{_diff(*vs_scratch)} '
      f'({_better(vs_scratch, "uptraining", "scratch")}).',
      f'- **K = {K}, {recipe} recipe, claim 2 (after uptraining, mean < first '
      f'< random, paired by seed): {ordering}.**', *ordering_lines]


def _grid(results, title: str):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  kv_heads = results['plan']['kv_heads']
  fig, axes = plt.subplots(len(RECIPES), len(kv_heads), squeeze=False,
                           figsize=(5 * len(kv_heads), 3.6 * len(RECIPES)),
                           sharey=True)
  fig.suptitle(title)
  for i, recipe in enumerate(RECIPES):
    for j, K in enumerate(kv_heads):
      axes[i, j].set_title(f'MHA -> K={K}, {recipe} recipe')
      axes[i, j].axhline(results['source']['loss'], color='gray', ls='--',
                         lw=1, label='source (MHA)')
  return fig, axes, plt


def plot_alpha(out: pathlib.Path, results):
  """Held-out loss against alpha, per method, with the seeds' range."""
  fig, axes, plt = _grid(results, 'Held-out loss after uptraining for α of '
                         'the source\'s tokens')
  plan = results['plan']
  for i, recipe in enumerate(RECIPES):
    for j, K in enumerate(plan['kv_heads']):
      ax = axes[i, j]
      for method in METHODS:
        k = plan['num_heads'] if method == 'identity' else K
        rows = np.array([losses(results, recipe, method, k, a)
                         for a in plan['alphas']])
        line, = ax.plot(plan['alphas'], rows.mean(1), marker='o', ms=3,
                        label=method + (' (control)' if k != K else ''))
        ax.fill_between(plan['alphas'], rows.min(1), rows.max(1),
                        color=line.get_color(), alpha=0.2)
      scratch = [s['loss'] for s in results['scratch'] if s['K'] == K]
      ax.errorbar([SCRATCH_ALPHA], [np.mean(scratch)],
                  yerr=[[np.mean(scratch) - min(scratch)],
                        [max(scratch) - np.mean(scratch)]],
                  fmt='k*', ms=9, label=f'K={K} from scratch')
      ax.set_xlabel('α (uptraining tokens / source tokens)')
      ax.set_ylabel('held-out loss (nats/token)')
      ax.set_yscale('log')
  axes[0, 0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / 'loss_vs_alpha.png', dpi=110)
  plt.close(fig)


def plot_curves(out: pathlib.Path, results):
  """Held-out loss along the largest alpha's uptraining: seed means, and
  the seeds' range as a band."""
  plan = results['plan']
  top = plan['alphas'][-1]
  fig, axes, plt = _grid(results, f'Held-out loss while uptraining (α={top:g})')
  for i, recipe in enumerate(RECIPES):
    for j, K in enumerate(plan['kv_heads']):
      for method in METHODS:
        k = plan['num_heads'] if method == 'identity' else K
        runs = [r for r in results['runs'] if (
            r['recipe'], r['method'], r['K'], r['alpha']) == (
                recipe, method, k, top)]
        start = losses(results, recipe, method, k, 0)
        steps = [0] + [s for s, _ in runs[0]['curve']]
        seeds = np.array([[start.mean()] + [loss for _, loss in r['curve']]
                          for r in runs])  # [seed, step]; from the start.
        line, = axes[i, j].plot(steps, seeds.mean(0), marker='.',
                                label=method)
        axes[i, j].fill_between(steps, seeds.min(0), seeds.max(0),
                                color=line.get_color(), alpha=0.2)
      axes[i, j].set_xlabel('uptraining step')
      axes[i, j].set_ylabel('held-out loss (nats/token)')
      axes[i, j].set_yscale('log')
  axes[0, 0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / 'curves.png', dpi=110)
  plt.close(fig)


def write(out: pathlib.Path, results):
  """OUT/report.md and its two plots."""
  plan, src = results['plan'], results['source']
  lines = ['# Uptraining MHA to GQA/MQA (Ainslie et al. 2023), with controls',
           '', f'Made by `python -m scripts.uptrain_study '
           f'{" ".join(sys.argv[1:])}` (source: {src["steps"]} steps; targets K = '
           f'{", ".join(map(str, plan["kv_heads"]))}; α = '
           f'{", ".join(f"{a:g}" for a in plan["alphas"])} of the source\'s '
           f'tokens; seeds {", ".join(map(str, plan["seeds"]))}). '
           'Held-out loss in nats/token, mean ± sd over seeds; differences '
           'paired by seed with their 95% half-width.', '', '## Reading', '',
           *reading(results), '',
           '![loss against alpha](loss_vs_alpha.png)', '',
           '![learning curves](curves.png)', '']
  for K in plan['kv_heads']:
    lines += [f'## MHA -> K = {K}', '']
    for recipe in RECIPES:
      lines += [f'Held-out loss, {recipe} recipe:', '',
                *loss_table(results, recipe, K), '',
                f'Paired differences, {recipe} recipe (negative: the first '
                'is better):', '', *paired_table(results, recipe, K), '']
    lines += ['Fraction of the conversion\'s drop recovered (mean ± sd):', '',
              *recovery_table(results, K), '']
  lines += [f'## Against training from scratch (same total tokens: the '
            f'source\'s plus α = {SCRATCH_ALPHA:g})', '',
            *scratch_table(results), '']
  (out / 'report.md').write_text('\n'.join(lines))
  plot_alpha(out, results)
  plot_curves(out, results)
  print('\n'.join(lines[:lines.index('![loss against alpha](loss_vs_alpha.png)')]))
  print(f'wrote {out / "report.md"}, loss_vs_alpha.png, curves.png')
