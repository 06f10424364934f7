"""How the command line shows a result: rich tables of text cells, or JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any

from rich.table import Table


def table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], right: Sequence[str] = ()
) -> Table:
    """A table of text cells, left-justified but for the columns named in `right`."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left")
    for row in rows:
        table.add_row(*row)
    return table


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=json_value))


def json_value(value: Any) -> Any:
    """What `json.dumps` cannot write itself: a result dataclass as its fields, else text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)
