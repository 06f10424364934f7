"""The README stays true to the code: its settings table, its command table and its links."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from pathlib import Path

from duality.cli import build_parser
from duality.config import describe

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_readme():
    for variable, _, _ in describe():
        assert f"`{variable}`" in README, f"{variable} missing from README's configuration table"


def test_readme_has_the_two_commands():
    assert "make demo" in README and "make test" in README


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


def _command_table(commands: Iterable[tuple[str, ...]]) -> dict[tuple[str, ...], set[str]]:
    """The flags README's command table documents for each command: those in the command cell
    and those in backquotes in its description (not `validate --no-publish`, another's)."""
    section = README.split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]
    table: dict[tuple[str, ...], set[str]] = {}
    for usage, description in re.findall(r"^\| `duality ([^`]+)` \| (.*) \|$", section, re.M):
        words = tuple(usage.split())
        matches = [c for c in commands if words[: len(c)] == c]
        assert matches, f"`duality {usage}` in README's command table is not a command"
        table.setdefault(max(matches, key=len), set()).update(
            re.findall(r"--[a-z][a-z-]*", usage), re.findall(r"`(--[a-z][a-z-]*)", description)
        )
    return table


def test_the_command_table_documents_every_command_and_flag():
    commands = _commands(build_parser())
    table = _command_table(commands)
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
    assert not wrong, "README's command table differs from the parser:\n" + "\n".join(wrong)


def test_links_stay_inside_the_repository():
    root = Path(__file__).resolve().parents[2]
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", README):
        if target.startswith(("http://", "https://")):
            continue
        path = (root / target).resolve()
        assert path.is_relative_to(root), f"README links outside the repository: {target}"
        assert path.exists(), f"README links to {target}, which does not exist"
