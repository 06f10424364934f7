"""The shape of the code, read from its imports (parsed with `ast`, nothing is imported).

- no import cycle among the modules of `include/duality`, counting imports inside functions;
- the library never imports Airflow (DAGs and plugins wrap the library, not the other way);
- `duality.kafka` is the only module of the library, jobs, DAGs and plugins that imports
  `confluent_kafka`; type names imported under `if TYPE_CHECKING:` are no import at run time.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "include"
KAFKA_MODULE = "duality.kafka"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, root: Path) -> list[tuple[str, bool]]:
    """(imported module, only under `if TYPE_CHECKING:`) for every import in the file, at any
    depth; `from package import name` gives `package.name` too, which may be a module."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, typing_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, typing_only))
            found.extend((f"{base}.{alias.name}", typing_only) for alias in node.names)
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def modules(root: Path, package: str) -> dict[str, Path]:
    return {_module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}


def import_cycle(root: Path, package: str) -> list[str]:
    """One cycle of run-time imports among the modules of `package`, or [] when there is none."""
    known = modules(root, package)
    graph = {
        name: {
            target
            for target, typing_only in imports(path, root)
            if target in known and target != name and not typing_only
        }
        for name, path in known.items()
    }
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return []


def importers(paths: list[Path], root: Path, library: str, *, count_typing: bool) -> list[str]:
    """The files among `paths` that import `library` (or one of its modules)."""
    return sorted(
        str(path.relative_to(root))
        for path in paths
        if any(
            (target == library or target.startswith(library + "."))
            and (count_typing or not typing_only)
            for target, typing_only in imports(path, root)
        )
    )


def _python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def test_no_import_cycle_in_the_library():
    cycle = import_cycle(LIBRARY, "duality")
    assert not cycle, "import cycle: " + " -> ".join(reversed(cycle))


def test_the_library_never_imports_airflow():
    found = importers(_python_files("include/duality"), ROOT, "airflow", count_typing=True)
    assert found == [], f"these library modules import Airflow: {found}"


def test_only_the_kafka_module_imports_confluent_kafka():
    paths = _python_files("include/duality", "jobs", "dags", "plugins")
    kafka_module = modules(LIBRARY, "duality")[KAFKA_MODULE]
    found = importers(paths, ROOT, "confluent_kafka", count_typing=False)
    assert found == [str(kafka_module.relative_to(ROOT))], (
        f"confluent_kafka is imported outside {KAFKA_MODULE}: {found}"
    )


def test_the_checks_find_what_they_look_for(tmp_path: Path):
    """A package with a cycle through a function-level import, an Airflow import, and
    confluent_kafka imported once at run time and once for type names only."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\nimport confluent_kafka\n")
    (package / "b.py").write_text("def f():\n    from .sub import c\n")
    (package / "sub" / "c.py").write_text("from ..a import x\nfrom airflow.sdk import DAG\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from confluent_kafka import Message\n    from pkg import a\n"
    )
    files = sorted(package.rglob("*.py"))

    assert set(import_cycle(tmp_path, "pkg")) == {"pkg.a", "pkg.b", "pkg.sub.c"}
    assert importers(files, tmp_path, "airflow", count_typing=True) == ["pkg/sub/c.py"]
    assert importers(files, tmp_path, "confluent_kafka", count_typing=False) == ["pkg/a.py"]
    assert importers(files, tmp_path, "confluent_kafka", count_typing=True) == [
        "pkg/a.py",
        "pkg/typed.py",
    ]
    (package / "b.py").write_text("import typing\n")  # the cycle broken
    assert import_cycle(tmp_path, "pkg") == []
