"""The repository's own references resolve: every `design §n` citation names a section of
docs/design.md, and every recipe path the code and docs mention is a shipped recipe."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (
    *("core", "target", "data", "eval", "eyas", "heads", "export", "train"),
    *("scripts", "recipes", "docs", "tests"),
)
CITATION = re.compile(r"\b(?:DESIGN|[Dd]esign)(?:\.md)?\]?(?:\([^)]*\))? ?§ ?(\d+(?:\.\d+)*)")
RECIPE = re.compile(r"\brecipes/([A-Za-z0-9_.-]+\.yaml)\b")


def _texts():
    files = [ROOT / "README.md"]
    for folder in SOURCES:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".yaml", ".sh"}]
    for path in files:
        if path.name != "test_docs_references.py":
            yield path, path.read_text(encoding="utf-8")


def design_sections() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", text, flags=re.M))


def test_design_doc_has_numbered_sections():
    sections = design_sections()
    assert {"1", "2", "2.1", "3", "4", "5", "5.1", "6", "6.2", "7"} <= sections


def test_every_design_citation_names_a_section_of_docs_design_md():
    sections = design_sections()
    missing = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: §{m[1]}"
        for path, text in _texts()
        for m in CITATION.finditer(text)
        if m[1] not in sections
    ]
    assert not missing, "citations of sections docs/design.md lacks:\n" + "\n".join(missing)


def test_every_recipe_path_mentioned_is_a_shipped_recipe():
    shipped = {p.name for p in (ROOT / "recipes").glob("*.yaml")}
    missing = sorted(
        f"{path.relative_to(ROOT)}: recipes/{m[1]}"
        for path, text in _texts()
        for m in RECIPE.finditer(text)
        if m[1] not in shipped
    )
    assert not missing, "recipe paths that name no file in recipes/:\n" + "\n".join(missing)
