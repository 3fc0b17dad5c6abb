"""The single-source design's reading ('## Reading' of its report): a
bullet a finding, each made from `single_summary.summary`'s numbers; every
verdict `stats.decide`'s, read against the claims as the paper states
them."""

from __future__ import annotations

import math

from studies import stats
from studies.uptrain.common import (detectable, estimate,
                                    ranking_verdict)
from studies.uptrain.single_summary import GATE_RULE, PAPER_COLUMN, _resolved
from train.convert import to_mla


def _near_verdict(rows: list[dict], paper: int, near: float,
                  floor: float = 0.0) -> str:
  """Claim 1 (GQA) at the paper's alpha, from one source: reproduced if
  the distance from the margin `near` is resolved below it
  (`stats.decide`), not reproduced at this scale if resolved beyond it and
  clear of the gate's `floor` (one source cannot say whether the gap
  shrinks with the source's length: never "contradicted"), otherwise not
  claimed, with the smallest difference the seeds detect."""
  row = rows[paper]
  decided = stats.decision(stats.shifted(row, near), withheld=(
      near < row['mean'] < floor))
  if decided.verdict != 'resolved':
    return (f'{decided.words} (' + (detectable(row) if decided.reason !=
        'withheld by the control gate' else
        f'beyond the margin, below the gate\'s {floor:.4f} nats') + ')')
  if row['mean'] < near:
    return 'reproduced'
  return ('not reproduced at this scale (one source: whether the gap '
          'shrinks with the source\'s length is the source-replicated '
          'study\'s question)')


def _compute_verdict(row: dict) -> str:
  """Claim 3 as a marginal cost: the advantage minus 1 read by
  `stats.decide`: reproduced (above 1), contradicted (below), otherwise
  not claimed (censored seeds: not claimed)."""
  adv = row['advantage']
  if adv.get('censored'):
    return 'no verdict (seeds beyond the scratch curve: no interval)'
  decided = stats.decision(stats.shifted(adv, 1.0))
  if decided.verdict != 'resolved':
    return decided.words
  return 'reproduced' if adv['mean'] > 1 else 'contradicted'


def _start_recommendation(family: list[dict]) -> str:
  """Which optimizer start to use after a conversion: the one the
  mean-pooled comparisons resolve for (Holm); fresh when none resolves
  (nothing to carry). Arm-vs-arm: the gate does not apply (GATE_RULE)."""
  means = [c for c in family if c['method'] == 'mean' and
           stats.decide(c, rejected=c['holm']) == 'resolved']
  won = {'pooled' if c['mean'] < 0 else 'fresh' for c in means}
  words = lambda c: stats.decision(c, rejected=c['holm']).words
  if len(won) == 1:
    return (f'**{won.pop()}** Adam wins on this source (' + '; '.join(
        f'{c["method"]} K={c["K"]}: {words(c)}' for c in means)
            + f', after Holm over the {len(family)} comparisons at α = '
            '0.05; one source: its uptraining seeds replicate the data '
            'order only, not the source)')
  if not won:
    return ('no start wins after Holm (' + '; '.join(
        f'{c["method"]} K={c["K"]}: {words(c)}, {detectable(c)}'
        for c in family if c['method'] == 'mean') + '): **fresh** Adam is '
            'recommended, as the simpler start (no state to carry), not as '
            'the better one')
  return 'mixed: pooled wins for one K and fresh for another'


def reading(results: dict, summ: dict) -> list[str]:
  """'## Reading': a bullet a finding, from the numbers (every verdict
  `stats.decide`'s)."""
  lm, plan = results['lm'], results['lm']['plan']
  return [*_setting(lm, summ), *_gap_lines(plan, summ),
          *_claim1_lines(plan, summ), *_claim2_lines(plan, summ),
          *_claim3_lines(plan, summ), _start_line(plan, summ),
          _recall_line(summ), *_mla_reading(results, summ)]


def _setting(lm: dict, summ: dict) -> list[str]:
  """One source; the source, the learning-rate pilot, the control gate."""
  plan, src, pilot, gate = lm['plan'], lm['source'], lm['pilot'], summ['gate']
  N, S, a_steps, near = (plan['num_heads'], plan['steps'],
                         plan['alpha_steps'], plan['near'])
  return [
      '- **One source**: every uptraining comparison below converts the same '
      'source checkpoint (seed 0), so its seeds replicate only the '
      'uptraining data order and the conversion (α = 0) is equal on all of '
      'them; a claim about uptraining in general needs sources replicated '
      '(the source-replicated study, `scripts.uptrain_study` without '
      '`--single_source`).',
      f'- **Source**: MHA (K = N = {N}), {S} steps ({src["tokens"] / 1e6:.2f}M '
      f'tokens, seed 0), held-out loss {src["loss"]:.4f} nats/token. The '
      f'identity conversion evaluates to it within '
      f'{summ["control_exact"]:.1e} (the conversion path is exact).',
      f'- **Learning-rate pilot** (seed 0, {pilot["steps"]} steps, mean-pooled '
      f'K = {pilot["K"]} and the control): ' + '; '.join(
          f'{r["rate"]:.2g}: mean {r["mean"]:.4f}, control drift '
          f'{r["drift"]:+.4f}' for r in pilot['rows'])
      + f'. Chosen by the rule fixed in advance (the lowest mean-pooled loss '
      f'among rates whose control drifts ≤ {near} nats): '
      f'**{pilot["rate"]:.2g}**, warmup {a_steps[0]} steps then constant.',
      '- **Control gate**: the identity control\'s drift from the source '
      'at every α: ' + ', '.join(
          f'{d["alpha_steps"] / S:g}: {estimate(d)}'
          for d in summ['control_drift'])
      + f'; the largest, {estimate(gate["drift"])} at α = '
      f'{gate["drift"]["alpha_steps"] / S:g}, sets the floor: effects under '
      f'4 × |drift| = {gate["floor"]:.4f} nats are not read as effects. ' + (
          ('It **passes**: every effect claimed below is at least that'
           if gate['claims'] else 'No effect is claimed, so nothing is '
           'below it') if gate['passes'] else
          '**It fails for**: ' + ', '.join(
              f'{name} ({e:+.4f})' for name, e in gate['below'])
          + ' (reported: '
          + stats.Decision('not claimed', 'withheld by the control gate').words
          + ')') + '. ' + GATE_RULE]


def _gap_lines(plan: dict, summ: dict) -> list[str]:
  """The MHA-K gap from scratch, per K."""
  lines = []
  for K in plan['kv_heads']:
    gap = summ['gap'][K]
    lines.append(
        f'- **MHA–K gap from scratch, K = {K}** (K minus MHA, paired by seed, '
        f'{len(plan["seeds"])} seeds): {estimate(gap["end"])} nats after '
        f'{gap["end_step"]} steps (detectable: {gap["end"]["detectable"]:.4f}),'
        f' {estimate(gap["at_source_steps"])} at step {plan["steps"]}. ' + (
            f'The gap: {stats.decision(gap["end"]).words}.' + (
                '' if _resolved(gap['end']) else ' Any gap is below about '
                f'{gap["end"]["detectable"]:.3f} nats.')))
  return lines


def _claim1_lines(plan: dict, summ: dict) -> list[str]:
  """Claim 1 per K (MQA reported, not judged: the paper sets it no
  margin)."""
  S, a_steps, near = plan['steps'], plan['alpha_steps'], plan['near']
  paper = plan['alphas'].index(plan['paper_alpha'])
  lines = []
  for K in plan['kv_heads']:
    rows = summ['near'][K]
    if K == 1 and max(plan['kv_heads']) > 1:  # MQA: the paper sets no margin.
      lines.append(
          f'- **MQA (K = 1), reported, not a claim of nearness** (the paper '
          'says uptrained MQA loses some quality; it sets no margin): '
          'mean-pooled minus the control: ' + ', '.join(
              f'α = {s / S:g}: {estimate(r)}' for s, r in zip(a_steps, rows))
          + f' ({detectable(rows[paper])} at α = {plan["paper_alpha"]}).')
      continue
    lines.append(
        f'- **Claim 1, K = {K} (α = {plan["paper_alpha"]} of uptraining brings '
        f'mean-pooled K near MHA: ≤ {near} nats above the control, fixed in '
        f'advance): {_near_verdict(rows, paper, near, summ["gate"]["floor"])}'
        '.** Mean-pooled minus the control: ' + ', '.join(
            f'α = {s / S:g}: {estimate(r)}' for s, r in zip(a_steps, rows))
        + f' ({detectable(rows[paper])} at α = {plan["paper_alpha"]}). '
        '(Reproduced: the distance from the margin claimed below it; not '
        'reproduced at this scale: claimed beyond it. One source cannot '
        'say "contradicted": that needs the gap\'s trend over sources of '
        'several lengths.)')
  return lines


def _claim2_lines(plan: dict, summ: dict) -> list[str]:
  lines = []
  for K in plan['kv_heads']:
    cells = [c for c in summ['ranking'] if c['K'] == K]
    lines.append(
        f'- **Claim 2, K = {K} (after uptraining α = {plan["paper_alpha"]}, '
        f'mean < first < random): '
        f'{ranking_verdict(summ["ranking"], K)}** (Holm over '
        f'the {len(summ["ranking"])} comparisons): ' + '; '.join(
            f'{c["better"]} − {c["worse"]} {estimate(c)}, p = {c["p"]:.3g}, '
            f'{detectable(c)} '
            f'({stats.decision(c, rejected=c["holm"]).words})'
            for c in cells) + '. (Arm-vs-arm differences from one source: '
        'the conversion is the same on every seed; what varies is the uptraining '
        'data order.)')
  return lines


def _claim3_lines(plan: dict, summ: dict) -> list[str]:
  """Claim 3 per K: scratch-equivalent steps and the cost advantage, and
  the paper's stronger framing (the uptrained model against K trained S
  steps from scratch) where every seed has its scratch run."""
  S, paper = plan['steps'], plan['alphas'].index(plan['paper_alpha'])
  lines = []
  for K in plan['kv_heads']:
    rows = summ['compute'][K]
    row = rows[paper]
    lines.append(
        f'- **Claim 3, K = {K} (the marginal cost of a K model given the MHA '
        f'checkpoint: uptraining beats training K from scratch to the same '
        f'loss): {_compute_verdict(row)}.** After {row["alpha_steps"]} '
        f'uptraining steps (α = {row["alpha_steps"] / S:g}) mean-pooled K '
        f'is worth {estimate(row["equivalent"], ".0f")} steps of K from '
        f'scratch: a cost advantage of {estimate(row["advantage"], ".2f")}x, '
        f'retained compute ρ = {estimate(row["retained"], ".3f")} of the '
        f'source\'s {S} steps. By α: ' + ', '.join(
            f'{r["alpha_steps"] / S:g}: {estimate(r["advantage"], ".2f")}x'
            for r in rows) + '. (Each seed\'s uptrained loss is read on the '
        'same seed\'s scratch curve, so the interval is paired by seed'
        + ('' if not summ['compute_unpaired'][K] else
           '; seeds ' + ', '.join(map(str, summ['compute_unpaired'][K]))
           + ' have no scratch run and are read on the seed-mean curve')
        + '; a point along a from-scratch cosine '
        'run is not annealed, so E leans high and the advantage with it.)'
        + ('' if K not in summ.get('above_scratch', {}) else
           ' The paper\'s cost claim is stronger: that α = '
           f'{plan["paper_alpha"]} of uptraining replaces training a '
           f'separate K model. Here the uptrained model sits '
           f'{estimate(summ["above_scratch"][K])} nats above K trained {S} '
           f'steps from scratch (paired by seed; '
           f'{stats.decision(summ["above_scratch"][K]).words}), so at this '
           'scale it '
           'does not replace one.'))
  return lines


def _start_line(plan: dict, summ: dict) -> str:
  return (
      '- **Optimizer start** (pooled Adam moments minus fresh Adam, '
      f'α = {plan["paper_alpha"]}, Holm over {len(summ["start"])}): ' +
      '; '.join(f'{c["method"]} K={c["K"]}: {estimate(c)}, {detectable(c)} '
                f'({stats.decision(c, rejected=c["holm"]).words})'
                for c in summ['start'])
      + f'. Recommendation: {_start_recommendation(summ["start"])}.')


def _recall_line(summ: dict) -> str:
  rec = summ['recall']
  budget, source_steps = f'{rec["budget"]} steps', 'the source\'s steps'
  return (
      f'- **Recall arm**: the MHA source reaches held-out accuracy '
      f'{rec["source_accuracy"]:.3f} (' + (
          f'≥ {rec["target"]} first at step {rec["source_steps_to_target"]}'
          if rec['source_steps_to_target'] is not None else
          f'NOT converged: never ≥ {rec["target"]}') + f'). Steps to regain ≥ '
      f'{rec["target"]} after conversion (within {rec["budget"]} steps), k of '
      'n seeds: ' + '; '.join(f'{name.replace("_", " ")}: {c["k"]} of {c["n"]}'
                              f'{_median(c, budget)}'
                              for name, c in rec['arms'].items())
      + '. From scratch (within the source\'s steps): ' + '; '.join(
          f'K={K}: {c["k"]} of {c["n"]}{_median(c, source_steps)}'
          for K, c in rec['scratch'].items()) + '.')


def _mla_verdict(c: dict) -> str:
  """MLA minus GQA at one alpha, read after Holm: which is lower, or not
  resolved with the smallest difference the seeds detect. A difference
  below that is not claimed, resolved or not (stats.CONVENTION)."""
  decided = stats.decision(c, rejected=c['holm'])
  if decided.verdict == 'resolved':
    return 'MLA lower' if c['mean'] < 0 else 'GQA lower'
  return f'{decided.words} ({detectable(c)})'


def _mla_reading(results: dict, summ: dict) -> list[str]:
  """The MLA arm's lines: per K, MLA against mean-pooled GQA at equal
  cache bytes; the recall arm's MLA conversion."""
  if 'mla' not in summ:
    return []
  plan = results['lm']['plan']
  lines = [_mla_line(plan, K, r, summ['mla']['paper'])
           for K, r in summ['mla']['by_K'].items()]
  recall = results['recall'].get('mla')
  if recall:
    lines.append(_mla_recall_line(results['recall'], recall))
  return lines


def _mla_line(plan: dict, K: int, r: dict, family: list[dict]) -> str:
  """MHA -> MLA at K's cache bytes against mean-pooled K (r: its
  `single_summary._mla` by_K entry, family: the Holm family over K)."""
  S, c = plan['steps'], r['conversion']
  cell = next(f for f in family if f['K'] == K)
  row = r['compute'][PAPER_COLUMN - 1]
  latent = to_mla.latent(c)
  return (
      f'- **MHA → MLA against MHA → mean-pooled GQA at equal cache bytes, '
      f'K = {K}: {_mla_verdict(cell)}** at α = {plan["paper_alpha"]} (MLA '
      f'minus GQA, paired by seed, Holm over the {len(family)} K): '
      f'{estimate(cell)}, p = {cell["p"]:.3g}, {detectable(cell)}. The '
      'conversion (`train.convert --to_mla`, SVD of [W_K | W_V], partial '
      f'RoPE): kv_lora_rank {latent.width} + {latent.rope} RoPE dims = '
      f'{latent.width + latent.rope} numbers per token and layer, '
      f'{c["kv_bytes_per_token"]:g} bytes/token ' + (
          'as GQA K = ' if c['kv_bytes_per_token'] ==
          c['gqa_kv_bytes_per_token'] else
          'NOT equal (the nearest its ranks allow) to GQA K = ')
      + f'{K}\'s {c["gqa_kv_bytes_per_token"]:g}; energy kept per layer '
      + ', '.join(f'{e:.3f}' for e in c['energy_kept'] if e is not None)
      + f'. Before uptraining (α = 0): MLA {estimate(r["mla"][0], ".4f")} '
      f'against GQA {estimate(r["gqa"][0], ".4f")} nats. Both uptrained by '
      'the same recipe (the chosen rate, fresh Adam, one run per seed). MLA '
      'minus GQA by α: ' + ', '.join(
          f'{s / S:g}: {estimate(d)}' for s, d in zip(plan['alpha_steps'],
                                                      r['minus_gqa'][1:]))
      + f'. After {row["alpha_steps"]} uptraining steps MLA is worth '
      f'{estimate(row["equivalent"], ".0f")} steps of GQA K = {K} trained '
      f'from scratch (each seed on its own curve), '
      f'{estimate(row["advantage"], ".2f")}x its uptraining steps: read on '
      'the from-scratch curve of the layout with the same cache bytes, since '
      'no MLA is trained from scratch here; so not claim 3\'s marginal '
      'cost of an MLA model, but the steps an equal-cache GQA model '
      'needs to match it.')


def _mla_recall_line(recall_arm: dict, mla: dict) -> str:
  """The recall arm's MLA conversions: their widths and bytes, and where
  the latent is as wide as d_model (lossless by shape), that it says
  nothing of MLA below that width."""
  d_model = recall_arm.get('plan', {}).get('config', {}).get(
      'model', {}).get('d_model', math.inf)
  conversions = [(c, to_mla.latent(c), c.get('d_model', d_model))
                 for c in mla['conversions']]
  return (
      '- **Recall arm, MLA**: the rows `mla K` above are MHA → MLA at K\'s '
      'cache bytes (' + '; '.join(
          f'K = {c["K"]}: kv_lora_rank {latent.width} + '
          f'{latent.rope} RoPE dims, {c["kv_bytes_per_token"]:g} '
          f'bytes/token against GQA\'s {c["gqa_kv_bytes_per_token"]:g}, '
          'energy kept ' + ', '.join(f'{e:.3f}' for e in c['energy_kept']
                                     if e is not None)
          + ', held-out accuracy before uptraining ' + ', '.join(sorted({
              f'{r["curve"][0]["accuracy"]:.3f}' for r in mla['runs']
              if r['K'] == c['K']}))
          for c, latent, _ in conversions)
      + '), uptrained as the recall arm\'s GQA conversions are. '
      + ' '.join(
          f'At K = {c["K"]} the latent ({latent.width} + '
          f'{latent.rope}) is as wide as d_model '
          f'({width}): the conversion is lossless by shape, so '
          'its needing no uptraining says nothing of MLA below that '
          'width (the regime of MHA2MLA and TransMLA; the '
          'source-replicated study has an arm there).'
          for c, latent, width in conversions
          if latent.width + latent.rope >= width))


def _median(c: dict, budget: str) -> str:
  """The median over all seeds (— : beyond the budget, counted larger than
  every observed value) and each seed's steps."""
  if not c['k']:
    return ''
  median = (f'> {budget}' if math.isinf(c['median']) else
            f'{c["median"]:.0f} steps')
  censored = (', — counted beyond the budget' if c['k'] < len(c['steps'])
              else '')
  return f' (median {median}{censored}; each: ' + ', '.join(
      '—' if s is None else str(s) for s in c['steps']) + ')'
