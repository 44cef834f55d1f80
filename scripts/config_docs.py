"""Render docs/configuration.md from config.py: every key with its type, default and doc.

    python scripts/config_docs.py          # write the page
    python scripts/config_docs.py --check  # exit 1, showing the difference, when it is stale

The docs are the attribute docstrings under the fields in config.py, read by docstring_parser,
the parser tyro reads them with for --help (a dependency of tyro): the page and --help share
one source. tests/test_config_docs.py fails when the committed page is stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import docstring_parser

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repo's flat modules

import config  # noqa: E402

PAGE = REPO / "docs" / "configuration.md"
COMMAND = "python scripts/config_docs.py"
INTRO = """\
Every key is set on the command line, `--section.field=value` or `--section.field value`, or in
TOML files given with `--config FILE.toml` (the same keys in `[section]` tables; several files
are merged, and a key set in two of them is refused). The command line beats the files, which
beat the defaults. Lists are comma-separated on the command line (`--model.widths=16,32,64`)
and arrays in a file; booleans are `true` or `false`. `python train.py --help` prints the same
keys and docs; an unknown key is refused with the nearest known one, and a key that this run
would ignore (say `data.crop_scale` without `data.dataset=imagefolder`) is refused too."""


def one_line(text: str) -> str:
    return " ".join(text.split())


def field_docs(section: type) -> dict[str, str]:
    """Each field's attribute docstring, searched from the class up its bases as tyro does
    (a subclass's own doc wins), on one line."""
    docs: dict[str, str] = {}
    for cls in reversed(section.__mro__):
        if cls.__module__ != "builtins":
            params = docstring_parser.parse_from_object(cls).params
            docs |= {p.arg_name: one_line(p.description) for p in params if p.description}
    return docs


def escaped(text: str) -> str:
    """`text` safe in a Markdown table cell: no cell break, emphasis or HTML tag."""
    for char in "\\|*<":
        text = text.replace(char, "\\" + char)
    return text


def type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in typing.get_args(annotation))
    if typing.get_origin(annotation) is tuple:
        return f"list of {typing.get_args(annotation)[0].__name__}"
    return annotation.__name__


def default_value(value: Any) -> str:
    """The default as it is written on the command line."""
    if value in ("", ()):
        return "(empty)"
    if isinstance(value, tuple):
        value = ",".join(map(str, value))
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def section_table(name: str, section: type) -> list[str]:
    docs = field_docs(section)
    hints = typing.get_type_hints(section)
    lines = ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(section):
        cells = (f"`{name}.{f.name}`", type_name(hints[f.name]), default_value(f.default))
        lines.append(f"| {' | '.join(cells)} | {escaped(docs.get(f.name, ''))} |")
    return lines


def render(schema: type = config.Config) -> str:
    """The page for `schema` (config.Config, or a variant of it in a test)."""
    sections = typing.get_type_hints(schema)
    names = [f.name for f in dataclasses.fields(schema)]
    lines = [
        "# Configuration",
        "",
        f"> Generated from `config.py` by `{COMMAND}`: edit the field docs there, not this page.",
        "",
        INTRO,
        "",
        "Sections: " + ", ".join(f"[{name}](#{name})" for name in names) + ".",
    ]
    for name in names:
        section = sections[name]
        lines += ["", f"## {name}", "", one_line(section.__doc__ or ""), ""]
        lines += section_table(name, section)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument("--page", type=Path, default=PAGE, help="default: docs/configuration.md")
    args = parser.parse_args(argv)
    page = render()
    if not args.check:
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text(page)
        return 0
    committed = args.page.read_text() if args.page.exists() else ""
    if committed == page:
        return 0
    diff = difflib.unified_diff(
        committed.splitlines(keepends=True),
        page.splitlines(keepends=True),
        fromfile=f"{args.page} (as it is)",
        tofile=f"{args.page} (from config.py)",
    )
    sys.stderr.writelines(diff)
    print(f"{args.page} differs from config.py: run {COMMAND}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
