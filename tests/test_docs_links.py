"""The README, benchmarks/README.md and docs/ point only at things the repository holds: every relative link (and its
#anchor) resolves, every results file they name exists, every repository path and test they name is there."""

import itertools
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "benchmarks" / "README.md", *(REPO / "docs").rglob("*.md")])
TOP_DIRS = ("jkv", "tests", "benchmarks", "pallas_kernels", "convert", "colab", "docs")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are not links
CODE_SPAN = re.compile(r"`([^`\n]+)`")
RESULTS = re.compile(r"(?:benchmarks/)?results/[\w./{},*-]+")
REPO_PATH = re.compile(r"^(?:%s)/[\w./-]+\.\w+(?:::\w+)?$" % "|".join(TOP_DIRS))
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _rel(page: pathlib.Path) -> str:
  return str(page.relative_to(REPO))


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces hyphens."""
  text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set:
  text = FENCE.sub("", page.read_text())
  return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def expand_braces(pattern: str) -> list:
  """``a_{x,y}.json`` -> [``a_x.json``, ``a_y.json``] (shell brace expansion, one level per group)."""
  parts = re.split(r"\{([^{}]*)\}", pattern)
  options = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
  return ["".join(c) for c in itertools.product(*options)]


def results_named(text: str) -> set:
  """The results paths a page names, as written (trailing punctuation of the sentence dropped); a pattern with a
  placeholder (``results/kernel_decode_<device>.json``) names no file."""
  return {m.group(0).rstrip(".,;:") for m in RESULTS.finditer(text) if not text.startswith("<", m.end())}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_and_anchors_resolve(page):
  text = FENCE.sub("", page.read_text())
  missing = []
  for target in LINK.findall(text):
    if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
      missing.append(target)
    elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
      missing.append(f"{target} (no such heading)")
  assert not missing, f"{_rel(page)} links to what is not there: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_results_files_exist(page):
  missing = []
  for name in results_named(page.read_text()):
    rel = name if name.startswith("benchmarks/") else "benchmarks/" + name
    for pattern in expand_braces(rel):
      if "*" not in pattern and not pattern.endswith("/") and not pathlib.PurePath(pattern).suffix:
        pattern += ".*"  # an output prefix (`jkv compare --output PREFIX`): its files
      if not (list(REPO.glob(pattern)) if "*" in pattern else (REPO / pattern).exists()):
        missing.append(pattern)
  assert not missing, f"{_rel(page)} names results files that do not exist: {sorted(missing)}"


def _test_names() -> set:
  return {m.group(1) for f in (REPO / "tests").glob("*.py") for m in re.finditer(r"def (test_\w+)", f.read_text())}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_paths_and_tests_exist(page):
  """A code span that is a repository path (``tests/test_x.py`` or ``tests/test_x.py::test_name``) names a file
  that exists (and a test defined in it); one that is a bare test name names a test some test file defines."""
  tests, missing = _test_names(), []
  for span in CODE_SPAN.findall(page.read_text()):
    if "*" in span or "<" in span:
      continue
    if REPO_PATH.match(span):
      path, _, test = span.partition("::")
      if not (REPO / path).exists():
        missing.append(span)
      elif test and f"def {test}" not in (REPO / path).read_text():
        missing.append(span)
    elif re.fullmatch(r"test_\w+", span) and span not in tests:
      missing.append(span)
  assert not missing, f"{_rel(page)} names paths or tests that do not exist: {missing}"


def test_the_checks_catch_what_is_missing(tmp_path):
  """The patterns the tests rely on, on a page written to fail."""
  page = tmp_path / "page.md"
  page.write_text("See [x](gone.md), [y](https://example.com), `results/none_{a,b}.json`, `results/x_<device>.json` "
                  "and `tests/nope.py`.\n"
                  "```\n[in a fence](ignored.md)\n```\n")
  text = FENCE.sub("", page.read_text())
  assert LINK.findall(text) == ["gone.md", "https://example.com"]
  assert expand_braces("results/none_{a,b}.json") == ["results/none_a.json", "results/none_b.json"]
  assert results_named(page.read_text()) == {"results/none_{a,b}.json"}
  assert REPO_PATH.match("tests/nope.py") and REPO_PATH.match("tests/test_ott.py::test_compete_equals_brute_force")
  assert slug("Defaults, and where they depart from the paper") == "defaults-and-where-they-depart-from-the-paper"
  assert slug("The `kivi` method: **KIVI-2**") == "the-kivi-method-kivi-2"
