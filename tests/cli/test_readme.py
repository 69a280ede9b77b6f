"""The README stays short and its links work: at most 250 lines, and every relative link in
README.md and docs/*.md names a file of the repository (history and tables live in docs/)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_README_LINES = 250
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", flags=re.S)


def _broken_links(path: Path, root: Path = ROOT) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    broken = []
    for m in LINK.finditer(text):
        target = m[1].split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor, a URL, mailto:
            continue
        if not (path.parent / target).exists():
            broken.append(f"{path.relative_to(root)}: {m[1]}")
    return broken


def test_readme_is_at_most_250_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move history to "
        "docs/experiments.md and tables to docs/benchmarks.md"
    )


@pytest.mark.parametrize(
    "doc",
    ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))],
)
def test_relative_links_resolve(doc):
    broken = _broken_links(ROOT / doc)
    assert not broken, "relative links to no file:\n" + "\n".join(broken)


def test_link_check_catches_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text(
        "[ok](b.md) [url](https://example.org) [anchor](#x) [bad](docs/none.md)\n"
        "```\n[in code](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    (tmp_path / "b.md").write_text("", encoding="utf-8")
    assert _broken_links(tmp_path / "a.md", tmp_path) == ["a.md: docs/none.md"]
