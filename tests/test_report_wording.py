"""Every verdict in a published report is `stats.decision`'s (issue 60):
each report is rebuilt from its JSON with `Decision.words` marked, and no
verdict word may stand outside a mark (the statistics paragraph, which
states the rule, aside). A verdict typed into a writer, or into a report,
is unmarked and named with its line."""

import json
import pathlib
import re
import shutil
import sys

import pytest

from studies import report, stats

REPO = pathlib.Path(__file__).resolve().parent.parent
OPEN, CLOSE = '\u27e6', '\u27e7'  # Never in a report's own text.
# The words a verdict on a difference is written in (`stats.WORDS`), and
# the convention's words for them.
VERDICT = re.compile('|'.join(
    [r'\bresolved\b', r'\bnot claimed\b', r'\bwithheld\b',
     *(re.escape(r) for r in stats.REASONS if r != 'one seed')]),
                     re.IGNORECASE)
# (entry point, folder, the JSON its --report_only reads).
PUBLISHED = [
    ('scripts.compare', 'docs/results', 'results.json'),
    ('scripts.compare', 'docs/results/compare_aa', 'results.json'),
    ('scripts.recall_sweep', 'docs/results/recall/sweep', 'sweep.json'),
    ('scripts.uptrain_study', 'docs/results/uptrain', 'results.json'),
    ('scripts.uptrain_study', 'docs/results/uptrain/single_source',
     'results.json'),
    ('scripts.uptrain_study', 'docs/results/uptrain/single_source/quick',
     'results.json'),
    ('scripts.kv_frontier', 'docs/results/kv_frontier', 'frontier.json'),
    ('scripts.kv_frontier', 'docs/results/kv_frontier/quick',
     'frontier.json'),
    ('scripts.kv_frontier', 'docs/results/kv_frontier/zadouri',
     'frontier.json'),
    ('scripts.kv_frontier', 'docs/results/kv_frontier/tpa', 'frontier.json'),
    ('scripts.uptrain_recipe', 'docs/results/uptrain_recipe', 'results.json'),
]


def unmarked_verdicts(text: str) -> list[str]:
  """The lines of TEXT (a report rebuilt with `Decision.words` between
  OPEN and CLOSE) holding a verdict word outside every mark, with their
  line numbers; the statistics convention (the rule itself) is not one."""
  found = []
  for i, line in enumerate(text.split('\n'), 1):
    rest = re.sub(f'{OPEN}[^{CLOSE}]*{CLOSE}', '',
                  line.replace(stats.CONVENTION, ''))
    if VERDICT.search(rest):
      found.append(f'line {i}: {line}')
  return found


def rebuilt_marked(module: str, folder: str, source: str, tmp_path,
                   monkeypatch) -> str:
  """FOLDER's report as `python -m MODULE --out=TMP --report_only` makes it
  from a copy of FOLDER/SOURCE, every `Decision.words` marked."""
  words = stats.Decision.words.fget
  monkeypatch.setattr(stats.Decision, 'words',
                      property(lambda d: OPEN + words(d) + CLOSE))
  shutil.copy(REPO / folder / source, tmp_path / source)
  entry = __import__(module, fromlist=['main'])
  monkeypatch.setattr(sys, 'argv', [module, f'--out={tmp_path}',
                                    '--report_only'])
  entry.main()
  return (tmp_path / 'report.md').read_text()


@pytest.mark.slow
@pytest.mark.parametrize('module, folder, source', PUBLISHED,
                         ids=[f for _, f, _ in PUBLISHED])
def test_every_verdict_in_a_published_report_is_stats_decision_s(
    tmp_path, monkeypatch, module, folder, source):
  """No verdict word outside `Decision.words` in FOLDER/report.md; and the
  published report is that rebuild with the marks taken out (so it is the
  one checked: the rebuild tests check it byte for byte, this its words)."""
  marked = rebuilt_marked(module, folder, source, tmp_path, monkeypatch)
  found = unmarked_verdicts(marked)
  assert not found, (f'{folder}/report.md: verdict words not from '
                     'stats.decision:\n' + '\n'.join(found))
  plain = marked.replace(OPEN, '').replace(CLOSE, '')
  assert _without_rebuild(plain) == _without_rebuild(
      (REPO / folder / 'report.md').read_text())


def _without_rebuild(text: str) -> str:
  """TEXT without where it was rebuilt (its own line, `report.REBUILT`,
  or the uptrain reports' clause 'rebuilt by `...` at commit C on M'):
  the rebuild tests check that apart (`report.published_problems`)."""
  return re.sub(r'rebuilt by `[^`]*` at commit \S+ on [^.]*', 'rebuilt by',
                report.normalise_rebuilt(text))


def test_a_hand_written_verdict_is_named_with_its_line(tmp_path, monkeypatch):
  """The check fails on a verdict that `stats.decision` did not write: the
  uptrain report rebuilt, then one of its verdicts unmarked (typed), and a
  hand-written 'resolved' added to a line that had none."""
  marked = rebuilt_marked('scripts.uptrain_study', 'docs/results/uptrain',
                          'results.json', tmp_path, monkeypatch)
  assert not unmarked_verdicts(marked)
  typed = marked.replace(f'{OPEN}not claimed: failed Holm{CLOSE}',
                         'not claimed: failed Holm', 1)
  (line,) = unmarked_verdicts(typed)
  assert ' not claimed: failed Holm)' in line
  lines = marked.split('\n')
  j = next(i for i, l in enumerate(lines) if l.startswith('- **S = 1,600**'))
  lines[j] += ' The gap is resolved.'
  (line,) = unmarked_verdicts('\n'.join(lines))
  assert line.startswith(f'line {j + 1}: - **S = 1,600**')
