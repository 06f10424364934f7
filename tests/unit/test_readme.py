"""The README stays true to the code: its settings table and its two commands."""

from __future__ import annotations

from pathlib import Path

from duality.cli import build_parser
from duality.config import describe

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_readme():
    for variable, _, _ in describe():
        assert f"`{variable}`" in README, f"{variable} missing from README's configuration table"


def test_readme_has_the_two_commands():
    assert "make demo" in README and "make test" in README


def test_every_command_is_in_the_readme():
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in commands:
        assert f"`duality {name}" in README, f"duality {name} missing from README"


def test_links_stay_inside_the_repository():
    import re

    root = Path(__file__).resolve().parents[2]
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", README):
        if target.startswith(("http://", "https://")):
            continue
        path = (root / target).resolve()
        assert path.is_relative_to(root), f"README links outside the repository: {target}"
        assert path.exists(), f"README links to {target}, which does not exist"
