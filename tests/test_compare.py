"""The comparison's report (studies/compare/, python -m scripts.compare):
per-seed losses, paired differences against MHA with the smallest
difference the seeds detect, and claims about the papers only where the
seeds can tell (issue 38, item 4); the report a function of results.json
alone, the published ones rebuilt identically (issue #49). From made-up
runs: nothing trains."""

import json
import math
import pathlib
import shutil
import sys
import types

import numpy as np
import pytest

from scripts import compare
from studies import report, stats, study
from studies.compare import analysis, design, plots
from studies.compare import runs as compare_runs, text as compare_text
from infra import provenance
from infra.errors import UserError

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / 'docs' / 'results'


def _losses(losses: dict[int, list[float]]) -> dict[int, dict[int, float]]:
  """K -> loss by seed, as analysis.comparisons takes them."""
  return {K: dict(enumerate(by_seed)) for K, by_seed in losses.items()}


def _arm(losses: list[float], K: int = 8) -> dict:
  """A control arm as results.json holds it."""
  return dict(K=K, seeds=list(range(len(losses))), losses=list(losses))


def _runs(losses: dict[int, list[float]]) -> list[dict]:
  """Fake finished runs of gqa_small (8 query heads): K -> loss by seed."""
  runs = []
  for K, by_seed in losses.items():
    config = design.variant_config('gqa_small', K, 0, 10, False)
    for seed, loss in enumerate(by_seed):
      runs.append(dict(K=K, seed=seed, config=config,
                       record=dict(eval_loss=loss, eval_accuracy=0.4),
                       metrics=[dict(step=10, loss=loss, eval_loss=loss,
                                     tokens_per_sec=1000.0 + K)]))
  return runs


# Seeds differ by far more than the variants do: only pairing resolves them.
SEEDS = np.array([2.20, 2.26, 2.17, 2.24])


def test_differences_are_paired_by_seed_with_their_detectable_effect():
  mqa = SEEDS + 0.1 + np.array([0.001, -0.002, 0.002, -0.001])
  gqa = SEEDS + np.array([0.001, -0.001, 0.002, 0.0])
  found = {c['K']: c for c in analysis.comparisons(
      _losses({8: list(SEEDS), 2: list(gqa), 1: list(mqa)}), 8)}
  d = found[1]['difference']
  assert found[1]['reference_K'] == 8 and d.n == 4
  assert d.mean == pytest.approx(0.1)
  assert d.sd == pytest.approx(np.std(mqa - SEEDS, ddof=1))
  assert found[1]['detectable'] == pytest.approx(stats.detectable(d.sd, 4))
  assert d.resolved and not stats.mean(mqa).low > stats.mean(SEEDS).high
  assert found[1]['verdict'].startswith(
      'MQA minus MHA +0.100 nats per byte: resolved (detectable 0.0')
  assert found[1]['verdict'].endswith(
      "Shazeer's MQA cost (0.010-0.015 nats) is per subword token at equal "
      'parameters, another unit: not compared')
  assert found[2]['verdict'].startswith('agrees with GQA near MHA (within '
                                        "±0.02 nats per byte, this lab's margin")


@pytest.mark.parametrize('cost', [0.012, 0.1, -0.05])
def test_a_per_byte_loss_is_never_compared_with_shazeers_per_token_cost(
    cost):
  jitter = 0.002 * np.array([1.0, -1.0, 0.5, -0.5])
  found = analysis.comparisons(_losses({8: list(SEEDS),
                                       1: list(SEEDS + cost + jitter)}), 8)[0]
  assert 'nats per byte' in found['verdict']
  assert found['verdict'].endswith('another unit: not compared')
  for word in ('disagrees', 'consistent', 'agrees'):
    assert word not in found['verdict']


def test_gqa_resolved_inside_the_margin_agrees_and_names_the_seeds_needed():
  inside = SEEDS + 0.001 * np.array([1.0, -1.0, 0.5, -0.5])
  found = analysis.comparisons(_losses({8: list(SEEDS), 2: list(inside)}),
                              8)[0]
  assert found['verdict'].startswith('agrees with GQA near MHA (within '
                                     '±0.02 nats per byte')
  noisy = SEEDS + 0.03 * np.array([1.0, -1.0, 0.5, -0.5])
  found = analysis.comparisons(_losses({8: list(SEEDS), 2: list(noisy)}),
                              8)[0]
  n = analysis.seeds_to_detect(found['difference'].sd, 0.020)
  assert f'about {n} seeds would detect 0.020' in found['verdict']
  assert stats.detectable(found['difference'].sd, n) <= 0.020 < (
      stats.detectable(found['difference'].sd, n - 1))


def test_gqa_crossing_the_near_margin_is_unresolved():
  gqa = SEEDS + np.array([0.03, -0.01, 0.02, 0.0])
  found = analysis.comparisons(_losses({8: list(SEEDS), 2: list(gqa)}), 8)[0]
  assert found['verdict'].startswith('cannot resolve GQA near MHA (within '
                                     "±0.02 nats per byte, this lab's margin")


def test_one_seed_and_no_mha_claim_nothing():
  one = analysis.comparisons(_losses({8: [2.2], 1: [2.3]}), 8)[0]
  assert one['verdict'].startswith('not claimed: one seed') and math.isinf(
      one['detectable'])
  no_mha = analysis.comparisons(_losses({4: list(SEEDS), 1: list(SEEDS)}),
                               8)[0]
  assert no_mha['reference_K'] == 4
  assert 'no paper' in no_mha['verdict']
  # A results.json that does not record the query heads cannot say which
  # K is MHA: no claim.
  unknown = analysis.comparisons(_losses({8: list(SEEDS), 1: list(SEEDS)}),
                                None)[0]
  assert unknown['reference_K'] == 8
  assert unknown['verdict'].startswith('results.json does not record the '
                                       'query heads')


def test_the_report_and_results_json_carry_every_seed(tmp_path, monkeypatch):
  monkeypatch.setattr('sys.argv', ['compare', '--seeds=4',
                                   f'--out={tmp_path}'])
  for plot in ('loss', 'throughput'):  # Seconds; not read here.
    monkeypatch.setattr(plots, plot, lambda *_: None)
  mqa = SEEDS + 0.012 + np.array([0.03, -0.03, 0.015, -0.015])
  runs = _runs({8: list(SEEDS), 1: list(mqa)})
  args = types.SimpleNamespace(seeds=4, equal_params=False,
                               config='gqa_small')
  control_losses = list(SEEDS + 0.3 + np.array([0.01, -0.01, 0.0, 0.002]))
  compare_text.write(tmp_path, compare_runs.results(
      runs, {8: 1000.0, 1: 3000.0}, 20e9, tmp_path, args,
      _control(control_losses)))
  report = (tmp_path / 'report.md').read_text()
  losses = _losses({8: list(SEEDS), 1: list(mqa)})
  control = analysis.control_check(_arm(control_losses), losses)
  d = control['difference']
  assert (f'| no context | {d:+.4f} | {d.sd:.4f} | '
          f'{control["detectable"]:.4f} | {control["reading"]} |') in report
  assert control['seen']
  result = json.loads((tmp_path / 'results.json').read_text())
  saved = result['control']
  assert saved['difference']['mean'] == pytest.approx(d.mean)
  assert saved['losses'] == pytest.approx(control['losses'])
  # Every seed the same difference: no interval, not counted as seen.
  equal = analysis.control_check(_arm(list(SEEDS + 0.3)), losses)
  assert not equal['seen'] and equal['reading'].startswith(
      'equal on all 4 seeds (+0.300 nats)')
  assert stats.CONVENTION in report
  assert f'`python -m scripts.compare --seeds=4 --out={tmp_path}` at commit ' \
      in report
  # The losses by seed, one row a seed, MHA's column first.
  assert '| seed | K=8 | K=1 |' in report
  assert f'| 2 | {SEEDS[2]:.4f} | {mqa[2]:.4f} |' in report
  found = analysis.comparisons(losses, 8)[0]
  d = found['difference']
  assert (f'| 1 | {d:+.4f} | {d.sd:.4f} | {found["detectable"]:.4f} | '
          f'{found["verdict"]} |') in report
  assert 'Shazeer compared at equal parameters: --equal_params' in report
  # The reading: each difference with stats.decide's verdict.
  assert (f'K=1 {d.mean:+.3f} nats, {stats.decision(d).words} (detectable: '
          f'{found["detectable"]:.3f})') in report
  assert result['provenance']['command'] == (
      f'python -m scripts.compare --seeds=4 --out={tmp_path}')
  assert result['provenance']['out'] == str(tmp_path)
  by_K = {v['K']: v for v in result['variants']}
  assert [s['eval_loss'] for s in by_K[1]['seeds']] == pytest.approx(mqa)
  assert [s['seed'] for s in by_K[8]['seeds']] == [0, 1, 2, 3]
  c = result['comparisons'][0]
  assert c['losses'] == pytest.approx(mqa) and c['seeds'] == [0, 1, 2, 3]
  assert c['difference']['low'] == pytest.approx(d.low)
  assert by_K[8]['decode_tokens_per_sec'] == 1000.0
  # Everything the report states is in results.json: the settings, and
  # each run's curve (for loss.png).
  assert result['settings']['num_heads'] == 8
  assert (result['settings']['steps'], result['settings']['unit']) == (
      10, 'byte')
  assert by_K[1]['seeds'][0]['curve'] == [
      dict(step=10, loss=mqa[0], eval_loss=mqa[0])]
  assert '4 layers, d_model 256, 8 query heads of 32; 10 steps of' in report


def _control(losses):
  runs = _runs({8: losses})
  return [r | {'config': design.control_config('gqa_small', 8, r['seed'],
                                                10)} for r in runs]


@pytest.mark.parametrize('offset, seen', [(0.3, True), (0.0, False),
                                          (-0.3, False)])
def test_the_negative_control_says_whether_the_setup_sees_attention(
    offset, seen):
  """MHA without context, the same seeds: resolved worse, or a report that
  says no difference between the variants is evidence of anything."""
  jitter = np.array([0.01, -0.01, 0.005, -0.004])
  losses = _losses({8: list(SEEDS), 1: list(SEEDS + 0.01)})
  control = analysis.control_check(_arm(list(SEEDS + offset + jitter)),
                                  losses)
  assert control['K'] == 8 and control['seeds'] == [0, 1, 2, 3]
  assert control['difference'].mean == pytest.approx(offset + jitter.mean())
  assert control['seen'] == seen
  assert control['reading'].startswith({
      0.3: 'the setup sees attention: without context the held-out loss '
           'is +0.300 nats worse',
      0.0: 'not claimed: interval holds 0 (4 seeds detect',
      -0.3: 'BETTER without context (-0.300 nats, resolved): K=8 does not '
            'use its context'}[offset])
  reading = compare_text.reading([dict(K=8, decode=1.0),
                                  dict(K=1, decode=2.0)],
                                 analysis.comparisons(losses, 8), control)
  assert reading.startswith('Negative control (a model without context): '
                            f'{control["reading"]}.')


def test_the_control_is_seen_only_as_stats_decide_resolves_it():
  """An interval that excludes 0 but an effect below what the seeds detect
  is not claimed (stats.decide), so the control is not counted as seen."""
  base = np.array([2.2, 2.3, 2.1, 2.25, 2.15])
  # Mean 0.02 with a tight interval: resolved by the interval alone.
  diffs = 0.02 + np.array([0.004, -0.004, 0.003, -0.003, 0.0])
  d = stats.paired(base + diffs, base)
  assert d.resolved and stats.decide(d) == 'resolved'
  tight = analysis.control_check(_arm(list(base + diffs)),
                                {8: dict(enumerate(base))})
  assert tight['seen']
  # Wider spread: the interval still excludes 0, the effect is below the
  # detectable one.
  diffs = 0.02 + np.array([0.016, -0.016, 0.012, -0.012, 0.0])
  d = stats.paired(base + diffs, base)
  assert d.resolved and abs(d.mean) < stats.detectable(d.sd, d.n)
  loose = analysis.control_check(_arm(list(base + diffs)),
                                {8: dict(enumerate(base))})
  assert not loose['seen'] and loose['reading'].startswith('not claimed')


def test_a_control_needs_seeds_and_the_model_it_controls():
  config = design.control_config('gqa_small', 8, 0, 10)
  assert (config.model.attention_pattern, config.model.local_window) == (
      'L', 1)
  assert config.model.num_kv_heads == 8
  one = analysis.control_check(_arm([2.5]), _losses({8: [2.2]}))
  assert one['reading'].startswith('one seed') and not one['seen']
  assert analysis.control_check(None, _losses({8: [2.2]})) is None
  assert design.reference_K([2, 1], 8) == 2
  assert design.reference_K([8, 2, 1], 8) == 8


def test_report_only_rebuilds_from_results_json_alone(tmp_path, monkeypatch):
  """--report_only reads OUT/results.json and nothing else (no run folder,
  no timing): the provenance as saved, the rebuild beside it, the report
  as the training command wrote it but for the rebuild's line."""
  for plot in ('loss', 'throughput'):
    monkeypatch.setattr(plots, plot, lambda *_: None)
  monkeypatch.setattr(compare_runs.timing, 'decode_step_seconds', None)  # Unused.
  runs = _runs({8: list(SEEDS), 1: list(SEEDS + 0.01)})
  monkeypatch.setattr('sys.argv', ['compare', '--seeds=4',
                                   f'--out={tmp_path}'])
  args = types.SimpleNamespace(seeds=4, equal_params=False, config='gqa_small')
  prov = provenance.record('scripts.compare', tmp_path,
                           statistics=stats.CONVENTION)
  prov['runs'] = {f'K{K}_s{seed}': {'commit': 'abc1234'}
                  for K in (8, 1) for seed in range(4)}
  compare_text.write(tmp_path, compare_runs.results(
      runs, {8: 1000.0, 1: 3000.0}, 20e9, tmp_path, args, prov=prov))
  trained = (tmp_path / 'report.md').read_text()
  monkeypatch.setattr('sys.argv', ['compare', f'--out={tmp_path}',
                                   '--report_only'])
  compare.main()
  rebuilt = (tmp_path / 'report.md').read_text()
  compare.main()
  assert (tmp_path / 'report.md').read_text() == rebuilt  # Idempotent.
  lines = rebuilt.split('\n')
  assert lines[2].startswith(
      'Runs trained by commit abc1234 on a machine not recorded (8 runs: '
      'K8_s0, K8_s1, K8_s2, K8_s3, K1_s0, K1_s1, K1_s2, K1_s3); decode timed '
      'and results.json written by `python -m scripts.compare '
      f'--seeds=4 --out={tmp_path}` at commit ')
  assert lines[4].startswith(
      f'{report.REBUILT} from results.json by `python -m scripts.compare '
      f'--out={tmp_path} --report_only` at commit ')
  assert report.normalise_rebuilt(rebuilt).replace(
      f'{report.REBUILT}\n\n', '') == trained
  saved = json.loads((tmp_path / 'results.json').read_text())
  assert saved['provenance']['command'] == (
      f'python -m scripts.compare --seeds=4 --out={tmp_path}')
  assert saved['provenance']['rebuilt']['command'].endswith('--report_only')
  monkeypatch.setattr('sys.argv', ['compare', f'--out={tmp_path}',
                                   '--report_only', '--tasks=x'])
  with pytest.raises(UserError, match='^--tasks scores runs as compare '
                     'trains them, not with --report_only'):
    compare.main()


def test_an_older_results_json_says_what_it_does_not_hold(tmp_path,
                                                          monkeypatch):
  """A results.json written before compare saved its settings and curves:
  the report renders what it holds and names what it lacks (no number
  made up), and redraws no loss.png."""
  monkeypatch.setattr('sys.argv', ['compare', '--seeds=4',
                                   f'--out={tmp_path}'])
  drawn = []
  monkeypatch.setattr(plots, 'loss', lambda *a: drawn.append(a))
  monkeypatch.setattr(plots, 'throughput', lambda *_: None)
  args = types.SimpleNamespace(seeds=4, equal_params=False, config='gqa_small')
  result = compare_runs.results(_runs({8: list(SEEDS), 1: list(SEEDS + 0.01)}),
                           {8: 1000.0, 1: 3000.0}, 20e9, tmp_path, args)
  del result['settings']
  for v in result['variants']:
    for s in v['seeds']:
      del s['curve']
  compare_text.write(tmp_path, result)
  report = (tmp_path / 'report.md').read_text()
  assert not drawn
  assert ('Settings (layers, width, heads, steps, batch, sequence length, '
          'compute dtype, data): not in this results.json') in report
  assert 'Training curves: not in this results.json' in report
  assert 'results.json does not record the query heads' in report


@pytest.mark.parametrize('folder', ['docs/results', 'docs/results/compare_aa'])
def test_a_published_report_rebuilds_identically_from_its_json(
    tmp_path, monkeypatch, folder):
  """FOLDER/report.md is what `python -m scripts.compare --out=DIR
  --report_only` makes from the results.json beside it, byte for byte,
  rebuilt here into a fresh folder from a copy of that JSON alone. Only
  the rebuild's own line (report.REBUILT: the command, commit and machine
  of the rebuild) is normalised, in both; that line is checked apart: the
  rebuild its JSON records, at a clean commit of this history, by the
  command that rebuilds FOLDER (`report.published_problems`)."""
  published = REPO / folder
  shutil.copy(published / 'results.json', tmp_path / 'results.json')
  monkeypatch.setattr(sys, 'argv', ['compare', f'--out={tmp_path}',
                                    '--report_only'])
  compare.main()
  text = (published / 'report.md').read_text()
  assert report.normalise_rebuilt((tmp_path / 'report.md').read_text()) == (
      report.normalise_rebuilt(text))
  problems = report.published_problems(
      folder, study.saved(published / 'results.json')['provenance'], text,
      'scripts.compare', 'results.json')
  assert not problems, '\n'.join(problems)


def test_the_aa_control_measures_the_paired_sd_of_a_kv_redraw():
  losses = _losses({8: list(SEEDS), 1: list(SEEDS + 0.01 + 0.02 * np.array(
      [1.0, -1.0, 0.5, -0.5]))})
  found = analysis.comparisons(losses, 8)
  aa = _arm(list(SEEDS + 0.004 * np.array([1.0, -1.0, -0.5, 0.5])))
  check = analysis.aa_check(aa, losses, found)
  assert check['difference'].mean == pytest.approx(0.0)
  assert check['verdict'] == 'not claimed'
  assert check['difference'].sd < found[0]['difference'].sd
  assert 'K=1 0.0' in check['reading'] and 'not claimed' in check['reading']
  assert analysis.aa_check(None, losses, found) is None
  # With no variant beside it, nothing to set its sd against: said so.
  alone = analysis.aa_check(aa, _losses({8: list(SEEDS)}), [])
  assert alone['reading'].endswith('no other variant ran beside it here, so '
                                   'there is no paired sd of a variant to '
                                   'set it against')


def test_aa_start_redraws_only_the_kv_projections(tmp_path):
  from flax import linen as nn  # pylint: disable=import-outside-toplevel
  from lm import checkpoint  # pylint: disable=import-outside-toplevel
  from train import loop  # pylint: disable=import-outside-toplevel
  from lm.model import Transformer  # pylint: disable=import-outside-toplevel
  config = design.variant_config('tiny', 4, 3, 10, False)
  design.aa_start(tmp_path / 'aa', config, 3)
  _, params, _ = checkpoint.load_workdir(str(tmp_path / 'aa'))
  from lm import config_lib  # pylint: disable=import-outside-toplevel
  start = nn.unbox(loop.init_params(
      Transformer(config_lib.model_config(config)), 3))
  import jax  # pylint: disable=import-outside-toplevel
  from train import convert  # pylint: disable=import-outside-toplevel
  same, redrawn = [], []
  jax.tree_util.tree_map_with_path(
      lambda path, a, b: (redrawn if convert.is_kv_kernel(path) else same
                          ).append(bool(np.array_equal(a, b))),
      start, params)
  assert redrawn and not any(redrawn)  # Every K/V kernel drawn anew.
  assert same and all(same)  # Every other weight the reference's.


@pytest.mark.slow  # Two 10-step tiny runs: about 15 s.
def test_an_aa_run_without_the_redraw_is_the_reference_run(tmp_path,
                                                           monkeypatch):
  """The A/A path (a step-0 workdir, then train.main) trains what the
  reference trains from init: with the redraw's seed equal to the run's,
  the same held-out loss to the bit; so an A/A difference is the redraw's."""
  from studies import study  # pylint: disable=import-outside-toplevel
  config = design.variant_config('tiny', 4, 1, 10, False)
  reference = study.train(config, tmp_path / 'K4_s1', tmp_path / 'log.txt')
  monkeypatch.setattr(design, 'AA_REDRAW', 0)
  design.aa_start(tmp_path / 'aa_s1', config, 1)
  same = study.train(config, tmp_path / 'aa_s1', tmp_path / 'log.txt')
  assert same['eval_loss'] == reference['eval_loss']
  assert json.loads((tmp_path / 'aa_s1' / study.TRAINED_BY).read_text())[
      'machine']['cores'] >= 1
  assert study.trained_by([tmp_path / 'K4_s1', tmp_path / 'aa_s1',
                           tmp_path / 'none']).endswith(
                               '(2 runs); 1 run with no record: none')
