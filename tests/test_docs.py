"""The docs stay true: README's "Adding a dataset" / "Adding a partitioner" name the places every
built-in is registered in, docs/ holds prose and docs/results/ what commands regenerate, and every
relative link in README.md and docs/*.md points at a file that exists."""

import re
from pathlib import Path

import pytest

import feddata
from feddata import builtin, hub, partition
from fedapp.models.text import prompt_template

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def _table_names(section: str, header: str) -> set[str]:
    """Backticked names in the first column of the table whose header row starts with `header`."""
    lines = section[section.index(header):].splitlines()[2:]
    rows = [line for line in lines if line.startswith("|")]
    rows = rows[: next((i for i, line in enumerate(lines) if not line.startswith("|")), len(rows))]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


@pytest.mark.parametrize("title, places", [
    ("Adding a dataset", {"feddata/hub.py": ["HUB_ALIASES"],
                          "feddata/builtin.py": ["_SPECS", "BUILTINS", "NATIVE_SIZE", "_ATTRIBUTES", "def render("],
                          "fedapp/models/text.py": ["def prompt_template("]}),
    ("Adding a partitioner", {"feddata/partition.py": ["PARTITIONER_PARAMS", "PARAMS", "Rule", "PARTITIONERS",
                                                       "class Assignment", "def partition("]}),
])
def test_the_guides_name_places_that_exist(title, places):
    text = _section(title)
    for path, symbols in places.items():
        assert f"`{path}`" in text, (title, path)
        source = (ROOT / path).read_text()
        for symbol in symbols:
            assert symbol in source, (path, symbol)
            assert symbol.removeprefix("def ").removeprefix("class ").rstrip("(") in text, (title, symbol)


def test_every_dataset_is_registered_where_the_guide_says():
    assert builtin.BUILTINS == tuple(builtin._SPECS)
    assert feddata.DATASETS == builtin.BUILTINS + tuple(hub.HUB_ALIASES)
    for name, (grey, rendering) in builtin._SPECS.items():
        assert grey in builtin.NATIVE_SIZE and rendering in builtin._ATTRIBUTES, name
        assert prompt_template(name) == "a photo of the digit {}", name  # digit class names need the digit prompt
    for alias, hub_id in hub.HUB_ALIASES.items():
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", hub_id), alias
    table = _table_names(_section("Choosing the method, data and partitioner"), "| `dataset` |")
    assert set(feddata.DATASETS) <= table, set(feddata.DATASETS) - table


def test_every_partitioner_is_registered_where_the_guide_says():
    assert feddata.PARTITIONERS == tuple(feddata.PARTITIONER_PARAMS)
    for name, spec in feddata.PARTITIONER_PARAMS.items():
        assert "per-class" in spec, name
        assert set(spec) <= set(partition.PARAMS), (name, set(spec) - set(partition.PARAMS))
    assert set(re.findall(r'partitioner == "([^"]+)"', (ROOT / "feddata/partition.py").read_text())) == set(
        feddata.PARTITIONERS)  # a branch in partition() each
    pyproject = (ROOT / "pyproject.toml").read_text()
    for key in {k for spec in feddata.PARTITIONER_PARAMS.values() for k in spec}:
        assert re.search(rf'^"?partitioner\.{re.escape(key)}"?\s*=', pyproject, re.M), key
    table = _table_names(_section("Choosing the method, data and partitioner"), "| `partitioner.name` |")
    assert set(feddata.PARTITIONERS) == table


def test_docs_holds_prose_and_results_what_commands_write():
    top = [p.name for p in (ROOT / "docs").iterdir() if p.is_file()]
    assert top and all(name.endswith(".md") for name in top), top
    assert {p.name for p in (ROOT / "docs").iterdir() if p.is_dir()} == {"results"}
    assert not list((ROOT / "docs" / "results").rglob("*.md"))


@pytest.mark.parametrize("doc", ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))])
def test_every_relative_link_points_at_a_file(doc):
    text = (ROOT / doc).read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)
               if not t.startswith(("http://", "https://", "mailto:", "#"))]
    assert targets or doc != "README.md"
    missing = [t for t in targets if not (ROOT / doc).parent.joinpath(t).exists()]
    assert not missing, missing


# Words that narrate how the work was organised rather than what fedapp is: numbered sittings, issue numbers,
# the team, superseded figures. Users read README.md and docs/; git history keeps the rest.
HISTORY = re.compile(r"\bsessions?\b|\bissues? #?\d+|"
                     r"(?:^|[\s(])#\d{1,3}\b|\bthe team\b|\bsittings?\b|\bsuperseded\b|\bre-measured\b", re.I | re.M)


def test_the_history_pattern_catches_what_it_should():
    caught = ["measured in session 11", "a new Ray session", "issue 30's goal", "see #27", "the team allows",
              "a superseded figure"]
    kept = ["issue a warning", "colour #ff0000", "a teammate's laptop"]
    assert all(HISTORY.search(text) for text in caught)
    assert not any(HISTORY.search(text) for text in kept)


@pytest.mark.parametrize("doc", ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))])
def test_user_docs_tell_no_history(doc):
    text = (ROOT / doc).read_text()
    found = [(text.count("\n", 0, m.start()) + 1, m.group(0).strip()) for m in HISTORY.finditer(text)]
    assert not found, found


def test_the_readme_stays_short():
    assert len(README.splitlines()) <= 300


def _equation_rows(page: str) -> list[str]:
    text = (ROOT / "docs" / page).read_text()
    section = text[text.index("\n## Equations → code\n"):]
    section = section[: section.find("\n## ", 1)]
    return [line for line in section.splitlines() if line.startswith("|") and "`" in line]


@pytest.mark.parametrize("page", ["espresso.md", "feddifrc.md", "pfdm.md", "dcfm.md"])
def test_each_equation_names_code_that_exists(page):
    """A method page's equations → code table names files that exist and, after each file, functions, classes or
    names defined in it."""
    rows = _equation_rows(page)
    assert len(rows) >= 5, page
    missing = []
    for row in rows:
        path = None
        for token in re.findall(r"`([^`]+)`", row.split("|")[-2]):
            if re.fullmatch(r"[\w/]+\.py", token):
                path = ROOT / token
                if not path.exists():
                    missing.append(token)
                    path = None
            elif path is not None and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", token):
                name = token.split(".")[-1]
                if not re.search(rf"^\s*(?:async def|def|class)\s+{name}\b|^\s*{name}\s*[:=]", path.read_text(), re.M):
                    missing.append(f"{path.relative_to(ROOT)}:{token}")
    assert not missing, missing
