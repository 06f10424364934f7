"""The README and docs/ stay true to the code: the command, settings and test tables wherever
they live, every relative link and anchor, and the README's length."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

from duality.cli import build_parser
from duality.config import describe

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [
    README,
    *sorted((ROOT / "docs").rglob("*.md")),
    *(ROOT / folder / "README.md" for folder in ("include/duality/pipelines", "dags", "plugins")),
]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text without its fenced code blocks, which hold no tables, headings or links."""
    return _FENCE.sub("", text)


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _tables(text: str) -> Iterator[list[list[str]]]:
    """Each table of a page as its rows of cells, the header first and the |---| row dropped."""
    rows: list[list[str]] = []
    for line in [*_prose(text).splitlines(), ""]:
        if line.startswith("|"):
            rows.append(_cells(line))
        elif rows:
            yield [row for row in rows if not all(re.fullmatch(r":?-+:?", c) for c in row)]
            rows = []


def _table(*header: str) -> list[list[str]]:
    """The rows of the one table among README and docs/ whose header is `header`."""
    found = [
        (page, table[1:])
        for page in PAGES
        for table in _tables(page.read_text())
        if tuple(table[0]) == header
    ]
    assert len(found) == 1, f"expected one table headed {header}, found {[p for p, _ in found]}"
    return found[0][1]


def test_the_settings_table_is_the_settings():
    rows = _table("variable", "default", "meaning")
    documented = [re.fullmatch(r"`(DUALITY_[A-Z0-9_]+)`", row[0]) for row in rows]
    assert None not in documented, "a row of the settings table does not name one variable"
    assert {m.group(1) for m in documented if m} == {variable for variable, _, _ in describe()}


def test_readme_has_the_two_commands():
    commands = re.findall(r"^make (\w+)", README.read_text(), re.M)
    assert commands[:2] == ["demo", "test"], commands


def test_readme_is_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move detail to docs/"


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command the parser runs (`("stream", "start")`, ...) and its own parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {
                command: leaf
                for name, sub in action.choices.items()
                for command, leaf in _commands(sub, (*path, name)).items()
            }
    return {path: parser}


def _command_table(commands: dict[tuple[str, ...], object]) -> dict[tuple[str, ...], set[str]]:
    """The flags the command table documents for each command: those in the command cell and
    those in backquotes in its description (not `validate --no-publish`, another's)."""
    table: dict[tuple[str, ...], set[str]] = {}
    for usage_cell, description in _table("command", "what it does"):
        usage = re.fullmatch(r"`duality ([^`]+)`", usage_cell)
        assert usage, f"{usage_cell} in the command table is not a `duality ...` command"
        words = tuple(usage.group(1).split())
        matches = [c for c in commands if words[: len(c)] == c]
        assert matches, f"`duality {usage.group(1)}` in the command table is not a command"
        table.setdefault(max(matches, key=len), set()).update(
            re.findall(r"--[a-z][a-z-]*", usage.group(1)),
            re.findall(r"`(--[a-z][a-z-]*)", description),
        )
    return table


def test_the_command_table_documents_every_command_and_flag():
    commands = _commands(build_parser())
    table = _command_table(dict(commands))
    wrong = []
    for command, parser in commands.items():
        name = " ".join(("duality", *command))
        documented = table.get(command)
        if documented is None:
            wrong.append(f"{name} has no row")
            continue
        # Every command has --json, which the text above the table says once.
        flags = {f for a in parser._actions for f in a.option_strings if f.startswith("--")}
        flags -= {"--help", "--json"}
        if documented - flags:
            wrong.append(f"{name}: its parser has no {sorted(documented - flags)}")
        if flags - documented:
            wrong.append(f"{name}: {sorted(flags - documented)} not documented")
    assert not wrong, "the command table differs from the parser:\n" + "\n".join(wrong)


def test_the_testing_table_lists_every_test_file():
    documented = {row[0].strip("`") for row in _table("test file", "what it proves", "needs")}
    assert documented == {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: inline markup dropped, lower case, every
    character but letters, digits, `_`, `-` and spaces removed, spaces as `-`, repeats numbered."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", _prose(markdown), re.M):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_anchors_follow_github():
    page = (
        "# A `code` title: yes\n## Same\n## Same\n"
        "```\n# not a heading\n```\n## The stream's [x](y)\n"
    )
    assert _anchors(page) == {"a-code-title-yes", "same", "same-1", "the-streams-x"}


def test_every_relative_link_resolves():
    wrong = []
    for page in PAGES:
        for target in _LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not this repository's
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not path.is_relative_to(ROOT):
                wrong.append(f"{where} leaves the repository")
            elif not path.exists():
                wrong.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path.read_text()):
                wrong.append(f"{where}: no heading with that anchor")
    assert not wrong, "broken links:\n" + "\n".join(wrong)
