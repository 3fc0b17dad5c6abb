"""README.md and docs/results.md quote the reports; they do not paraphrase
them (issue 60). A quote is a blockquote whose line before it names the
report it comes from ('... [text](path/report.md):'); each of its excerpts
(split at ' … ') is in that report verbatim, spaces aside; and a verdict
word outside a quote fails, with its line."""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = ('README.md', 'docs/results.md')
# A verdict, in the convention's words and a claim's.
VERDICT = re.compile(
    r'\b(resolved|unresolved|not claimed|reproduced|reproduces|contradicted|'
    r'withheld|failed Holm|interval holds 0|below the detectable effect|'
    r'marginal)\b', re.IGNORECASE)
SOURCE = re.compile(r'\]\(([^)\s]*report\.md)\)[^\n]*:\s*$')


def _spaces(text: str) -> str:
  return ' '.join(text.split())


def quotes(text: str) -> list[tuple[int, str, str]]:
  """(line, the report named on the line before, the quote's text) of each
  blockquote in TEXT; the report is '' where no line names one."""
  lines, found, i = text.split('\n'), [], 0
  while i < len(lines):
    if not lines[i].startswith('>'):
      i += 1
      continue
    start = i
    while i < len(lines) and lines[i].startswith('>'):
      i += 1
    named = SOURCE.search(lines[start - 1]) if start else None
    found.append((start + 1, named.group(1) if named else '',
                  ' '.join(l[1:].strip() for l in lines[start:i])))
  return found


def misquoted(doc: str, text: str) -> list[str]:
  """The quotes in TEXT (the file DOC) not verbatim in the report they
  name, or naming none, one line each."""
  problems = []
  for line, source, quote in quotes(text):
    if not source:
      problems.append(f'{doc}:{line}: a quote whose line before names no '
                      'report.md it comes from')
      continue
    path = (REPO / doc).parent / source
    if not path.is_file():
      problems.append(f'{doc}:{line}: quotes {source}, which does not exist')
      continue
    report = _spaces(path.read_text())
    for piece in quote.split(' … '):
      piece = _spaces(piece.strip('… '))
      if piece and piece not in report:
        problems.append(f'{doc}:{line}: not in {source}: {piece[:120]!r}')
  return problems


def paraphrased(doc: str, text: str) -> list[str]:
  """The lines of TEXT (the file DOC) outside every quote that hold a
  verdict word: a verdict said in the doc's own words."""
  return [f'{doc}:{i}: {VERDICT.search(line).group(0)!r} outside a quote: '
          f'{line[:160]}'
          for i, line in enumerate(text.split('\n'), 1)
          if not line.startswith('>') and VERDICT.search(line)]


@pytest.mark.parametrize('doc', DOCS)
def test_every_quote_is_verbatim_in_the_report_it_names(doc):
  problems = misquoted(doc, (REPO / doc).read_text())
  assert not problems, '\n'.join(problems)
  assert quotes((REPO / doc).read_text())  # It does quote the reports.


@pytest.mark.parametrize('doc', DOCS)
def test_no_verdict_is_said_outside_a_quote(doc):
  problems = paraphrased(doc, (REPO / doc).read_text())
  assert not problems, '\n'.join(problems)


def test_a_paraphrase_or_an_edited_quote_is_named_with_its_line():
  """The two checks fail where they should: a quote edited by one word,
  a quote with no report named, a verdict written outside a quote."""
  text = (REPO / 'docs/results.md').read_text()
  line, source, quote = quotes(text)[0]
  lines = text.split('\n')
  word = quote.split()[-1]
  lines[line - 1] = lines[line - 1].replace(' ', ' very ', 1)
  found = misquoted('docs/results.md', '\n'.join(lines))
  assert found and found[0].startswith(f'docs/results.md:{line}: not in ')
  assert word  # The quote had words to edit.
  unnamed = '\n'.join(lines[:line - 2] + ['Plain text.'] + lines[line - 1:])
  assert any('names no report.md' in p
             for p in misquoted('docs/results.md', unnamed))
  said = text + '\nGQA-2 is resolved worse than MHA.\n'
  (found,) = paraphrased('docs/results.md', said)
  assert found.startswith(f'docs/results.md:{len(said.split(chr(10))) - 1}: '
                          "'resolved' outside a quote")
