"""One figure per claim: every figure the README shows is a headline row of
benchmarks/RESULTS.md with the same value (tests/test_docs.py keeps tracker words out of it).

RESULTS.md's headline table ("## Headline results") has a column "README shows": the README's
own words for the figure. The README's results table (header `| config | task | measured`)
has one row per config; a row with figures has exactly one headline row whose "claim" names
the same config in backticks, with the same figures in the same order. Every "README shows"
cell must be found in the README (whitespace aside) and its figures in the row's "measured"
cell. So a figure changed on one side alone fails here.
"""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")

# A figure: 99.97, 0.06, 927,616, 2026 ...; not the digits inside a word (test_2016_flickr,
# H200, b868ed9) or a version's tail.
_FIGURE = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w])")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")

def _read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def _normal(text: str) -> str:
  """Markdown links as their text, whitespace runs as one space."""
  return " ".join(_LINK.sub(r"\1", text).split())


def figures(text: str) -> list[str]:
  return _FIGURE.findall(_normal(text))


def cells(line: str) -> list[str]:
  """The cells of a markdown table row; a `|` inside backticks is not a separator."""
  out, cell, in_code = [], [], False
  for ch in line.strip().strip("|"):
    if ch == "`":
      in_code = not in_code
    if ch == "|" and not in_code:
      out.append("".join(cell).strip())
      cell = []
    else:
      cell.append(ch)
  out.append("".join(cell).strip())
  return out


def table_after(text: str, start: int) -> list[dict[str, str]]:
  """The first markdown table at or after `start`, as one dict per row keyed by header."""
  lines = text[start:].splitlines()
  first = next(i for i, line in enumerate(lines) if line.startswith("|"))
  rows = []
  for line in lines[first:]:
    if not line.startswith("|"):
      break
    rows.append(cells(line))
  header, body = rows[0], rows[2:]                   # rows[1]: the | --- | separator
  for row in body:
    assert len(row) == len(header), f"a row with {len(row)} cells under {header}: {row}"
  return [dict(zip(header, row)) for row in body]


def readme_results(readme: str) -> list[dict[str, str]]:
  match = re.search(r"^\| config \| task \| measured", readme, re.MULTILINE)
  assert match, "README.md: no results table (| config | task | measured ...)"
  return table_after(readme, match.start())


def headline_rows(results: str) -> list[dict[str, str]]:
  match = re.search(r"^## Headline results\s*$", results, re.MULTILINE)
  assert match, "benchmarks/RESULTS.md: no '## Headline results' section"
  rows = table_after(results, match.end())
  for column in ("claim", "README shows", "measured", "command", "machine", "date"):
    assert column in rows[0], f"RESULTS.md's headline table has no column {column!r}"
  return rows


def disagreements(readme: str, results: str) -> list[str]:
  """Every way the README's figures and RESULTS.md's headline rows differ (empty: agree)."""
  problems = []
  headline = headline_rows(results)
  for row in readme_results(readme):
    key = re.search(r"`([^`]+)`", row["config"])
    shown = row[next(c for c in row if c.startswith("measured"))]
    if not key or not figures(shown):
      continue
    matches = [h for h in headline if f"`{key.group(1)}`" in h["claim"]]
    if len(matches) != 1:
      problems.append(f"README row {key.group(1)}: {len(matches)} headline rows name it, not 1")
      continue
    if figures(shown) != figures(matches[0]["README shows"]):
      problems.append(f"README row {key.group(1)} shows {figures(shown)}, its headline row "
                      f"{figures(matches[0]['README shows'])}")
  readme_text = _normal(readme)
  for h in headline:
    if _normal(h["README shows"]) not in readme_text:
      problems.append(f"headline row {h['claim']!r}: the README does not show "
                      f"{h['README shows']!r}")
    missing = set(figures(h["README shows"])) - set(figures(h["measured"]))
    if missing:
      problems.append(f"headline row {h['claim']!r}: {sorted(missing)} not in its measurement")
  return problems


def test_readme_figures_are_results_headline_rows():
  assert disagreements(_read(README), _read(RESULTS)) == []


def test_every_readme_result_row_with_figures_has_a_headline_row():
  headline = headline_rows(_read(RESULTS))
  for row in readme_results(_read(README)):
    shown = row[next(c for c in row if c.startswith("measured"))]
    if figures(shown):
      key = re.search(r"`([^`]+)`", row["config"]).group(1)
      assert any(f"`{key}`" in h["claim"] for h in headline), key


def test_each_headline_row_gives_command_machine_and_date():
  for row in headline_rows(_read(RESULTS)):
    assert row["command"] and row["machine"], row["claim"]
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", row["date"]), row["claim"]


def test_a_figure_changed_on_one_side_alone_is_found():
  readme, results = _read(README), _read(RESULTS)
  shown = headline_rows(results)[1]["README shows"]       # a figure both files show
  figure = figures(shown)[0]
  changed = shown.replace(figure, figure + "1", 1)
  assert disagreements(readme.replace(shown, changed), results)
  assert disagreements(readme, results.replace(f"| {shown} |", f"| {changed} |"))
