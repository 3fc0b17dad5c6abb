"""The recipe study (issue #60): its design as specified (the recipes, both
endpoints annealed, the compute-matched scratch runs), its statistics'
readings against the margin, and its published report rebuilt from its
JSON alone."""

import json
import pathlib
import sys

import chex
import pytest

from infra.cli import exit_on_user_error
from scripts import uptrain_recipe
from studies import report, study
from studies.uptrain import recipe
from studies.uptrain import recipe_summary as rs
from studies.uptrain.design import NEAR

REPO = pathlib.Path(__file__).resolve().parent.parent
PUBLISHED = REPO / 'docs' / 'results' / 'uptrain_recipe'


def _source(seed: int, steps: int, gqa: dict, control: dict, scratch: dict,
            at0=(3.0, 2.0)) -> dict:
  """A synthetic source: {(rate, schedule, alpha): loss} per arm."""
  runs = []
  for arm, losses in (('gqa', gqa), ('control', control)):
    for (rate, schedule, alpha), loss in losses.items():
      runs.append({'arm': arm, 'rate': rate, 'schedule': schedule,
                   'curve': [{'step': 0, 'loss': at0[arm == 'control']}],
                   'reads': [{'alpha': alpha, 'loss': loss}]})
  return {'steps': steps, 'seed': seed, 'source': {'loss': 2.0},
          'runs': runs, 'scratch': [{'alpha': a, 'loss': l}
                                    for a, l in scratch.items()]}


def _part(gaps: dict, scratch_gap: float, steps: int = 3200) -> list[dict]:
  """Three sources whose GQA is gaps[recipe] (+ source noise) above the
  control, and scratch_gap below GQA's from-scratch loss."""
  noise = (-0.004, 0.001, 0.003)
  return [_source(seed, steps,
                  gqa={k: 2.0 + g + n for k, g in gaps.items()},
                  control={k: 2.0 for k in gaps},
                  scratch={0.05: 2.0 + min(gaps.values()) - scratch_gap},
                  at0=(3.0 + 10 * n, 2.0))
          for seed, n in enumerate(noise)]


def test_recipes_are_rate_by_schedule_and_cosine_runs_one_per_alpha():
  """Six recipes (3 rates x constant/cosine); a constant recipe is one run
  read at every alpha, a cosine one a run per alpha (each annealed)."""
  names = [r.name for r in recipe.recipes()]
  assert names == ['constant_0.0001', 'constant_0.0003', 'constant_0.001',
                   'cosine_0.0001', 'cosine_0.0003', 'cosine_0.001']
  jobs = recipe._jobs(  # pylint: disable=protected-access
      recipe.recipes(), recipe.ALPHAS)
  assert [a for r, a in jobs if r.schedule == 'constant'] == [None] * 3
  assert [a for r, a in jobs if r.schedule == 'cosine'] == list(
      recipe.ALPHAS) * 3
  assert recipe.PUBLISHED == {'rate': 1e-3, 'schedule': 'constant'}


def test_a_cell_is_reproduced_only_when_resolved_within_the_margin():
  """Claim cells against NEAR: far below it 'reproduced', far beyond it
  'not reproduced', at the margin stats.decision's words."""
  def outcome(values):
    return rs.holm([rs.difference(values)])[0]['outcome']
  assert outcome([0.001, 0.002, 0.0015]) == 'reproduced'
  assert outcome([0.2, 0.21, 0.205]) == 'not reproduced'
  assert outcome([NEAR - 0.01, NEAR + 0.01, NEAR]) == (
      'not claimed: interval holds 0')


def test_a_claim_is_not_reproduced_at_this_scale_only_if_no_recipe_is():
  """One recipe within the margin reproduces the claim in that part; the
  'not reproduced at this scale' verdict needs every recipe beyond it."""
  beyond = {(r, s, 0.05): 0.2 for r in (1e-4, 1e-3)
            for s in ('constant', 'cosine')}
  part = _part(beyond, scratch_gap=0.0)
  cells = rs.holm(rs.cells(part, rs.recipes_of(part), 'control'))
  assert rs.claim_verdict(cells, 0.05) == (
      'not reproduced at this scale under any of the grid\'s 4 recipes')
  one_good = {**beyond, (1e-4, 'cosine', 0.05): 0.001}
  part = _part(one_good, scratch_gap=0.0)
  cells = rs.holm(rs.cells(part, rs.recipes_of(part), 'control'))
  assert rs.claim_verdict(cells, 0.05) == 'reproduced under cosine 0.0001'
  assert rs.best(part, 'gqa', 0.05)['recipe'] == {'rate': 1e-4,
                                                   'schedule': 'cosine'}


def test_holm_corrects_a_whole_family_not_a_cell():
  """A cell that clears the margin alone fails it inside its family of
  18: the correction is over the family fixed in advance."""
  values = [0.06, 0.07, 0.08]  # p = 0.013 against NEAR alone.
  alone = rs.holm([rs.difference(values)])[0]
  assert alone['holm']
  family = rs.holm([rs.difference(values)] * 18)
  assert not any(c['holm'] for c in family)
  assert {c['outcome'] for c in family} == {'not claimed: failed Holm'}


@pytest.mark.slowest
@pytest.mark.slow
def test_the_recipe_study_runs_end_to_end_with_annealed_endpoints(tmp_path):
  """--quick with two sources: every part trains, the report and plot are
  written; a cosine run ends at the source's end ratio x its rate, a
  constant one holds its rate, GQA from scratch runs S(1 + alpha) steps
  and ends annealed; --report_only rebuilds the same report, its rebuild
  line added."""
  import subprocess  # pylint: disable=import-outside-toplevel
  out = tmp_path / 'study'
  subprocess.run([sys.executable, '-m', 'scripts.uptrain_recipe',
                  f'--out={out}', '--quick', '--source_seeds=2'],
                 check=True, cwd=REPO, capture_output=True)
  results = study.saved(out / 'results.json')
  S = recipe.QUICK['sweep']
  root = out / 'sweep' / f'S{S}_s0'

  def lr(run):
    return [json.loads(l)['learning_rate'] for l in
            (run / 'metrics.jsonl').read_text().splitlines()
            if 'learning_rate' in l]
  cosine = lr(root / 'runs' / 'cosine_0.001' / 'fresh' / 'mean_K2' / 'a0.2')
  chex.assert_trees_all_close(cosine[-1], 1e-3 * 0.1, rtol=0.05)
  held = lr(root / 'runs' / 'constant_0.001' / 'fresh' / 'mean_K2' / 'held')
  chex.assert_trees_all_close(held[-1], 1e-3, rtol=1e-6)
  scratch = study.saved(root / 'scratch' / 'K2_a0.1_s0' / 'config.json')
  assert scratch['train']['steps'] == S + round(0.1 * S)
  assert lr(root / 'scratch' / 'K2_a0.1_s0')[-1] == pytest.approx(
      scratch["train"]["learning_rate"] * 0.1, rel=0.05)
  assert len(results['parts']['sweep'][0]['runs']) == 2 * (3 + 9)
  assert set(rs.FAMILIES) <= set(results['summary'])
  assert len(results['summary']['sweep_claim1']) == 18
  assert results['provenance']['trained']
  first = (out / 'report.md').read_text()
  assert (out / 'recipes.png').stat().st_size > 10_000
  subprocess.run([sys.executable, '-m', 'scripts.uptrain_recipe',
                  f'--out={out}', '--report_only'], check=True, cwd=REPO,
                 capture_output=True)
  rebuilt = (out / 'report.md').read_text()
  line = next(l for l in rebuilt.split('\n') if l.startswith(report.REBUILT))
  assert 'uptrain_recipe' in line and '--report_only' in line
  assert rebuilt.replace(line + '\n\n', '') == first


def test_the_published_recipe_report_is_what_its_json_makes(tmp_path,
                                                            monkeypatch):
  """docs/results/uptrain_recipe/report.md is what --report_only makes
  from the results.json beside it (nothing hand-written), and its
  provenance is true (`report.published_problems`)."""
  if not PUBLISHED.exists():
    pytest.fail('docs/results/uptrain_recipe is missing: publish the study')
  (tmp_path / 'results.json').write_text(
      (PUBLISHED / 'results.json').read_text())
  monkeypatch.setattr(sys, 'argv', ['uptrain_recipe', f'--out={tmp_path}',
                                    '--report_only'])
  uptrain_recipe.main()
  text = (PUBLISHED / 'report.md').read_text()
  assert report.normalise_rebuilt((tmp_path / 'report.md').read_text()) == (
      report.normalise_rebuilt(text))
  problems = report.published_problems(
      'docs/results/uptrain_recipe', study.saved(
          PUBLISHED / 'results.json')['provenance'], text,
      'scripts.uptrain_recipe', 'results.json')
  assert not problems, '\n'.join(problems)


def test_report_only_refuses_another_study_s_results(tmp_path, monkeypatch,
                                                     capsys):
  """--report_only on a folder whose results.json another study wrote (the
  replicated uptraining study's) says so in one line and exits non-zero."""
  (tmp_path / 'results.json').write_text(
      (REPO / 'docs/results/uptrain/results.json').read_text())
  monkeypatch.setattr(sys, 'argv', ['uptrain_recipe', f'--out={tmp_path}',
                                    '--report_only'])
  with pytest.raises(SystemExit) as exit_:
    exit_on_user_error(uptrain_recipe.main)
  assert exit_.value.code != 0
  err = capsys.readouterr().err.strip()
  assert "is not the recipe study's" in err and len(err.split('\n')) == 1


def test_one_source_is_refused_before_anything_trains(tmp_path, monkeypatch,
                                                      capsys):
  """The source is the unit of replication: one has no interval (it had
  trained the whole design, then divided by zero)."""
  monkeypatch.setattr(sys, 'argv', ['uptrain_recipe', f'--out={tmp_path}',
                                    '--quick', '--source_seeds=1'])
  with pytest.raises(SystemExit) as exit_:
    exit_on_user_error(uptrain_recipe.main)
  assert exit_.value.code != 0
  assert '--source_seeds=1: give at least 2' in capsys.readouterr().err
  assert not any(tmp_path.iterdir())


def test_a_length_whose_negative_control_fails_has_its_claims_withheld():
  """Where GQA's conversion is not beyond the margin before uptraining
  (the setup cannot see the gap uptraining closes), that length's claim
  cells are withheld, though their differences alone would decide."""
  part = _part({(1e-4, 'cosine', 0.05): 0.001}, scratch_gap=0.0)
  gate = {c['steps']: c['outcome'] == rs.NEGATIVE[1]
          for c in rs._negative({'sweep': part})}  # pylint: disable=protected-access
  assert gate == {3200: True}
  cell, = rs.holm(rs.cells(part, rs.recipes_of(part), 'control'), gate=gate)
  assert cell['outcome'] == 'reproduced'
  cell, = rs.holm(rs.cells(part, rs.recipes_of(part), 'control'),
                  gate={3200: False})
  assert cell['outcome'] == 'not claimed: withheld by the control gate'
