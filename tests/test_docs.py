"""The docs stay a front door and a set of pages that hold together: every relative link in
README.md and docs/*.md resolves (to a file, and to a heading where it names one), the README
stays short, BENCHMARKS.md answers its fixed questions without dated headings, and the exit-code
table of docs/fault-tolerance.md lists every code of exitcodes.py with its number and class.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import exitcodes

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
BENCHMARK_SECTIONS = [
    "Method",
    "Overhead",
    "Scaling",
    "Loaders",
    "MFU",
    "Checkpoints",
    "Strategies",
    "Image folders",
    "Recipes",
    "GPU",
]
# Pages written by a script rather than by hand: a link to one is checked once its generator
# exists (before that, on a branch without the generator, the page cannot exist either).
GENERATED = {"docs/configuration.md": "scripts/config_docs.py"}

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
DATE = re.compile(r"\b(19|20)\d\d-\d\d-\d\d\b")


def doc_pages(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", lambda m: " " * len(m.group()), line)))
    return out


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every heading outside code blocks."""
    found = []
    for _, line in prose_lines(text):
        match = HEADING.match(line)
        if match:
            found.append((len(match.group(1)), match.group(2)))
    return found


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    title = re.sub(r"[`*]", "", title).strip().lower()  # markup is not part of the anchor
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
    return re.sub(r"[^\w\- ]", "", title).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers, GitHub's -1, -2 suffixes for repeats included."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in headings(path.read_text()):
        base = slug(title)
        count = seen.get(base, 0)
        out.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def broken_links(page: Path, repo: Path) -> list[str]:
    """Relative links of `page` whose file, or heading, does not exist."""
    problems = []
    text = page.read_text()
    for number, line in prose_lines(text):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(repo)}:{number}: {target}"
            relative = (
                resolved.relative_to(repo).as_posix() if resolved.is_relative_to(repo) else ""
            )
            generator = GENERATED.get(relative)
            if generator and not resolved.exists() and not (repo / generator).exists():
                continue
            if not resolved.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where} (no heading #{anchor} in {resolved.name})")
    return problems


@pytest.mark.parametrize("page", doc_pages(REPO), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert not broken_links(page, REPO), "\n".join(broken_links(page, REPO))


def test_the_docs_pages_are_the_topics_listed() -> None:
    expected = {
        "running.md",
        "your-model-and-data.md",
        "strategies.md",
        "fault-tolerance.md",
        "checkpoints.md",
        "observability.md",
        "debugging.md",
        "testing.md",
        "design.md",
        "recipes.md",
    }
    present = {p.name for p in (REPO / "docs").glob("*.md")}
    assert expected <= present, f"missing: {sorted(expected - present)}"


def test_the_readme_is_at_most_300_lines() -> None:
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_benchmarks_has_no_dated_heading() -> None:
    dated = [t for _, t in headings((REPO / "BENCHMARKS.md").read_text()) if DATE.search(t)]
    assert not dated, f"dated headings belong in CHANGELOG.md: {dated}"


def test_benchmarks_sections_are_the_questions_in_order() -> None:
    sections = [t for level, t in headings((REPO / "BENCHMARKS.md").read_text()) if level == 2]
    assert sections == BENCHMARK_SECTIONS


def test_changelog_entries_are_dated_newest_first() -> None:
    dates = [
        DATE.search(t).group()
        for level, t in headings((REPO / "CHANGELOG.md").read_text())
        if level == 2 and DATE.search(t)
    ]
    assert dates, "CHANGELOG.md has no dated ## entry"
    assert dates == sorted(dates, reverse=True), dates


def exit_code_rows(text: str) -> dict[int, tuple[str, str]]:
    """{code: (name, class)} from the table under '## Exit codes'."""
    section = text.split("\n## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rows[int(cells[0])] = (cells[1].strip("`"), cells[2])
    return rows


def exit_codes() -> dict[int, str]:
    """exitcodes.py's codes by number, rendered from the module (EXIT_* constants)."""
    return {
        value: name
        for name, value in vars(exitcodes).items()
        if name.startswith("EXIT_") and isinstance(value, int)
    }


def test_the_exit_code_table_lists_every_code_with_its_number_name_and_class() -> None:
    rows = exit_code_rows((REPO / "docs" / "fault-tolerance.md").read_text())
    codes = exit_codes()
    assert codes, "no EXIT_* constant found in exitcodes.py"
    for code, name in sorted(codes.items()):
        assert code in rows, f"{name} = {code} is not in docs/fault-tolerance.md's table"
        documented_name, documented_class = rows[code]
        assert documented_name == name, (code, documented_name, name)
        expected_class = "final" if exitcodes.is_final(code) else "retryable"
        assert documented_class == expected_class, (code, documented_class, expected_class)
    assert set(rows) == set(codes), (
        f"codes documented but not in exitcodes.py: {set(rows) - set(codes)}"
    )


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """A broken link, a broken anchor, a dated heading and a missing exit code are all found."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Real heading\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#real-heading) [gone](docs/missing.md) [bad](docs/a.md#no-such)\n"
        "`[code](not/a/link.md)`\n```\n[fenced](not/a/link.md)\n```\n"
    )
    problems = broken_links(page, tmp_path)
    assert len(problems) == 2, problems
    assert "docs/missing.md (no such file)" in problems[0]
    assert "no heading #no-such" in problems[1]
    assert [t for _, t in headings("# Benchmarks\n## On a GPU (2026-11-26)\n") if DATE.search(t)]
    table = "\n## Exit codes\n\n| code | name | class |\n| --- | --- | --- |\n"
    table += "| 0 | `EXIT_OK` | final |\n"
    rows = exit_code_rows(table)
    assert rows == {0: ("EXIT_OK", "final")}
    assert set(exit_codes()) - set(rows), "a table with one code must miss the others"


def test_headings_get_githubs_anchors() -> None:
    assert slug("Restarts and torchrun's store") == "restarts-and-torchruns-store"
    assert (
        slug("TORCH_DISTRIBUTED_DEBUG and NCCL_DEBUG") == "torch_distributed_debug-and-nccl_debug"
    )
    assert slug("`metrics.jsonl` rows") == "metricsjsonl-rows"
    assert slug("What fsdp does differently, so that the results do not") == (
        "what-fsdp-does-differently-so-that-the-results-do-not"
    )
