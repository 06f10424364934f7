"""The command line's parser: argparse that says what to do next on bad usage, and the
`Commands` each command module adds its own sub-commands to."""

from __future__ import annotations

import argparse
import sys
from argparse import Namespace
from collections.abc import Callable
from typing import Any

from rich.console import Console

from duality.config import Settings

Handler = Callable[[Settings, Namespace, Console], Any]


class Parser(argparse.ArgumentParser):
    """argparse that says what to do next when the usage is wrong (exit code 2)."""

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class Commands:
    """The sub-commands of `duality`: a command module adds each of its own with `add` (and a
    group of actions, `duality stream start`, with `actions`)."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._commands = parser.add_subparsers(
            dest="command", metavar="COMMAND", parser_class=Parser
        )
        self._commands.required = True

    def add(
        self,
        name: str,
        handler: Handler,
        help_text: str,
        pipeline: bool = False,
        under: Any = None,
    ) -> argparse.ArgumentParser:
        """The command `name` (under the actions `under`, else at the top), which `handler`
        runs; every command takes `--json`, and with `pipeline` a pipeline's name."""
        group = self._commands if under is None else under
        sub: argparse.ArgumentParser = group.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--json", action="store_true", help="print the result as JSON")
        sub.set_defaults(handler=handler)
        if pipeline:
            sub.add_argument("pipeline", help="pipeline name or spec file")
        return sub

    def actions(self, name: str, dest: str, help_text: str) -> Any:
        """A command of actions (`duality stream ACTION`); `dest` names the chosen action."""
        sub = self._commands.add_parser(name, help=help_text).add_subparsers(
            dest=dest, metavar="ACTION"
        )
        sub.required = True
        return sub
