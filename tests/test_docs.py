"""The docs cannot drift from the code: the README's and docs/*.md's runnable blocks run, and
their relative links point to files (and headings) that exist.

A block is runnable when the line before its fence is the marker

    <!-- runnable -->
    ```bash            (or ```python)

Mark only cheap blocks (seconds: a 20-step training, `--help`, a model-API snippet); the
whole file should stay under a minute (`pytest tests/test_docs.py --durations=0`). The
blocks of one page run in order, in one fresh temporary directory that links the
repository's top-level files (so `python train.py`, `configs/...` work and `workdirs/`
lands in the temporary directory), with the repository on PYTHONPATH: bash blocks with
`bash -e -o pipefail`, python blocks with `python -`. A later block may use what an
earlier one of the same page wrote.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import unicodedata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- runnable -->"
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
BLOCK_TIMEOUT = 300


def _read(page: str) -> str:
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    return f.read()


def runnable_blocks(text: str) -> list[tuple[int, str, str]]:
  """(line number of the fence, language, code) of each block marked runnable."""
  lines, blocks, i = text.splitlines(), [], 0
  while i < len(lines):
    if lines[i].rstrip() == MARKER:                 # at the start of a line, not quoted
      fence = lines[i + 1].rstrip() if i + 1 < len(lines) else ""
      language = fence[3:].strip()
      if not fence.startswith("```") or language not in ("bash", "python"):
        raise ValueError(f"line {i + 1}: {MARKER} must stand right before a ```bash or "
                         f"```python fence, found {fence!r}")
      end = next((j for j in range(i + 2, len(lines)) if lines[j].rstrip() == "```"), None)
      if end is None:
        raise ValueError(f"line {i + 2}: the runnable block is never closed")
      blocks.append((i + 2, language, "\n".join(lines[i + 2:end]) + "\n"))
      i = end
    i += 1
  return blocks


def _scratch_dir(tmp_path) -> str:
  """A temporary directory that links the repository's top-level entries."""
  for name in os.listdir(ROOT):
    if not name.startswith(".") and name != "workdirs":
      os.symlink(os.path.join(ROOT, name), tmp_path / name)
  return str(tmp_path)


PAGES_WITH_BLOCKS = [p for p in PAGES if runnable_blocks(_read(p))]


@pytest.mark.parametrize("page", PAGES_WITH_BLOCKS)
def test_runnable_blocks_run(page, tmp_path):
  cwd = _scratch_dir(tmp_path)
  # One CPU device, as a reader has (conftest.py fakes eight for the sharding tests); its
  # compile-time flags stay.
  xla_flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                       if "xla_force_host_platform_device_count" not in f)
  env = {**os.environ, "XLA_FLAGS": xla_flags,
         "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
  for line, language, code in runnable_blocks(_read(page)):
    command = ([sys.executable, "-"] if language == "python"
               else ["bash", "-e", "-o", "pipefail", "-s"])
    done = subprocess.run(command, input=code, cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=BLOCK_TIMEOUT)
    assert done.returncode == 0, (f"{page}:{line}: the {language} block exited with "
                                  f"{done.returncode}:\n{code}\n--- output ---\n{done.stdout}")


def test_readme_is_a_landing_page_whose_examples_run():
  text = _read("README.md")
  assert len(text.splitlines()) <= 250
  languages = [language for _, language, _ in runnable_blocks(text)]
  assert "python" in languages and "bash" in languages   # the model API and a training run


def test_ci_runs_the_readme_test_command():
  """`.ci/run` runs exactly the test command the README gives a newcomer."""
  with open(os.path.join(ROOT, ".ci", "run")) as f:
    ci_command = [l.strip() for l in f if l.strip() and not l.startswith("#")][-1]
  assert ci_command.startswith("python -m pytest") and ci_command.endswith(" tests")
  assert re.search(rf"^{re.escape(ci_command)}$", _read("README.md"), re.MULTILINE)


def test_marker_must_precede_a_bash_or_python_fence():
  with pytest.raises(ValueError, match="must stand right before"):
    runnable_blocks(f"{MARKER}\n```text\nx\n```\n")
  assert runnable_blocks(f"a\n{MARKER}\n```bash\necho hi\n```\n```bash\nnot marked\n```\n") == [
      (3, "bash", "echo hi\n")]
  assert runnable_blocks(f"    {MARKER}\n    ```bash\n    quoted\n    ```\n") == []


# ----------------------------------------------------------------------------- links
_FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)


def _prose(text: str) -> str:
  return _CODE_SPAN.sub("", _FENCED.sub("", text))


def heading_anchors(text: str) -> set[str]:
  """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to
  hyphens, repeats numbered -1, -2, ..."""
  anchors: set[str] = set()
  for heading in _HEADING.findall(_FENCED.sub("", text)):
    heading = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    slug = "".join(c for c in heading
                   if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")
    anchor, n = slug, 0
    while anchor in anchors:
      n += 1
      anchor = f"{slug}-{n}"
    anchors.add(anchor)
  return anchors


def relative_links(page: str) -> list[tuple[str, str | None]]:
  """(path from the repository root, anchor or None) of each relative link of a page."""
  links = []
  for target in _LINK.findall(_prose(_read(page))):
    if re.match(r"^[a-z]+:", target):           # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    resolved = (os.path.normpath(os.path.join(os.path.dirname(page), path)) if path
                else page)
    links.append((resolved, anchor or None))
  return links


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_point_to_existing_files_and_headings(page):
  for path, anchor in relative_links(page):
    assert os.path.exists(os.path.join(ROOT, path)), f"{page}: link to missing {path}"
    if anchor and path.endswith(".md"):
      assert anchor in heading_anchors(_read(path)), f"{page}: no heading #{anchor} in {path}"


def test_anchors_follow_githubs_rules():
  assert heading_anchors("# Cloud TPU plans: ahead-of-time (XLA `est.`)\n## Data\n## Data\n") == {
      "cloud-tpu-plans-ahead-of-time-xla-est", "data", "data-1"}


# ------------------------------------------------- words that belong to the tracker
# The pages a reader sees speak of the project, not of how its work was organised: no
# references to tracker entries ("issue 12", "issue #12", "#12") and none of the words below.
WORDS_CHECKED_PAGES = (*PAGES, "benchmarks/RESULTS.md")
_TRACKER_WORDS = re.compile(
    r"\b(?:issues?|pull requests?|PRs?)\s+#?\d+"     # issue 12, issue #12, PR 7
    r"|(?<![\w&/#])#\d+\b"                           # #12 (not &#12; or a heading's #)
    r"|\blent\b|\bleas(?:e|es|ed|ing)\b|\bdevice[ -]time\b|\bsessions?\b",
    re.IGNORECASE)
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")          # [text](#12-anchor): a heading, not #12


def tracker_words(text: str) -> list[tuple[int, str]]:
  """(line number, match) of each tracker reference or banned word in a page's text."""
  found = []
  for number, line in enumerate(text.splitlines(), 1):
    found += [(number, m.group(0)) for m in _TRACKER_WORDS.finditer(_LINK_TARGET.sub("]", line))]
  return found


@pytest.mark.parametrize("page", WORDS_CHECKED_PAGES)
def test_pages_hold_no_tracker_references_or_its_words(page):
  assert tracker_words(_read(page)) == [], f"{page}: reword these (line, words)"


def test_tracker_words_are_found_and_ordinary_words_are_not():
  bad = ("see issue 12", "Issue #7 says", "fixed in #31.", "(#4)", "PR 9", "on a lent GPU",
         "the lease ends", "15 minutes of device time", "one session", "Sessions end")
  for text in bad:
    assert tracker_words(text), text
  assert tracker_words("a\nb #5\n") == [(2, "#5")]
  fine = ("Please release the silent, excellent, equivalent model", "## 2. Data",
          "see [the steps](#1-install)", "&#123;", "issues with padding", "a 12-step run",
          "x = y  # 12 rows")
  for text in fine:
    assert tracker_words(text) == [], text
