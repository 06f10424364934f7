"""The import rules of the code, read with `ast` (nothing is imported): each test names its rule."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "include"
KAFKA_PACKAGE = "duality.kafka"
LOCAL_STACK = "duality.local"
CLI = "duality.cli"


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


def _python_files(root: Path, *folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((root / folder).rglob("*.py"))]


def confluent_kafka_importers(root: Path) -> list[str]:
    """Files of the library, jobs, DAGs, plugins and bench outside the package `duality.kafka`
    that import confluent_kafka at run time."""
    paths = _python_files(root, "include/duality", "jobs", "dags", "plugins", "bench")
    own = root / "include" / "duality" / "kafka"
    found = importers(paths, root, "confluent_kafka", count_typing=False)
    return [name for name in found if own not in (root / name).parents]


def local_stack_importers(root: Path) -> list[str]:
    """Library modules other than the CLI, the demo and the local stack's own that import the
    local stack (`duality.local` or a module of it) at run time."""
    library = root / "include"
    own = library / "duality" / "local"
    allowed = {own.parent / "demo.py", own.with_suffix(".py")}
    cli = own.parent / "cli"
    paths = [
        path
        for path in _python_files(library, "duality")
        if path not in allowed and own not in path.parents and cli not in path.parents
    ]
    # Module names from include/ (relative imports), file names from the checkout.
    found = importers(paths, library, LOCAL_STACK, count_typing=False)
    return [f"include/{name}" for name in found]


def cli_importers(root: Path) -> list[str]:
    """Files of `jobs/` and `plugins/` that import the CLI (`duality.cli`)."""
    return importers(_python_files(root, "jobs", "plugins"), root, CLI, count_typing=True)


def test_no_import_cycle_in_the_library():
    cycle = import_cycle(LIBRARY, "duality")
    assert not cycle, "import cycle: " + " -> ".join(reversed(cycle))


def test_the_library_never_imports_airflow():
    found = importers(_python_files(ROOT, "include/duality"), ROOT, "airflow", count_typing=True)
    assert found == [], f"these library modules import Airflow: {found}"


def test_only_the_kafka_package_imports_confluent_kafka():
    assert {
        _module_name(path, LIBRARY)
        for path in _python_files(LIBRARY, "duality")
        if any(target == "confluent_kafka" for target, _ in imports(path, LIBRARY))
    } >= {f"{KAFKA_PACKAGE}.client", f"{KAFKA_PACKAGE}.topics", f"{KAFKA_PACKAGE}.offsets"}
    found = confluent_kafka_importers(ROOT)
    assert found == [], f"confluent_kafka is imported outside {KAFKA_PACKAGE}: {found}"


def test_only_the_cli_and_the_demo_import_the_local_stack():
    found = local_stack_importers(ROOT)
    assert found == [], f"these library modules import {LOCAL_STACK}: {found}"


def test_jobs_and_plugins_never_import_the_cli():
    found = cli_importers(ROOT)
    assert found == [], f"these entry points import {CLI}: {found}"


def test_each_rule_fails_on_a_planted_violation(tmp_path: Path):
    """A checkout with the allowed imports passes every rule; each violation planted in turn
    fails its rule, naming the file."""
    files = {
        "include/duality/__init__.py": "",
        "include/duality/kafka/__init__.py": "",
        "include/duality/kafka/client.py": "import confluent_kafka\n",
        "include/duality/kafka/topics.py": "from confluent_kafka.admin import NewTopic\n",
        "include/duality/cli/__init__.py": "from duality.cli import stack\n",
        "include/duality/cli/stack.py": "from duality import local\nfrom duality.local import up\n",
        "include/duality/demo.py": "from duality.local.broker import LocalBroker\n",
        "include/duality/local/__init__.py": "from .stack import up\n",
        "include/duality/local/stack.py": "from duality.local import broker\nfrom . import web\n",
        "include/duality/local/broker.py": "from duality import process\n",
        "include/duality/local/web.py": "",
        "include/duality/process.py": "",
        "include/duality/stream.py": "from duality.kafka import client\n",
        "jobs/stream_aggregate.py": "from duality.arguments import stream\n",
        "plugins/duality_airflow/operators.py": "CLI = ['python', '-m', 'duality.cli']\n",
        "dags/pipelines.py": "from duality import spec\n",
        "bench/streaming.py": (
            "from duality.kafka import topics\nfrom duality.local import broker\n"
        ),
    }

    def checkout(root: Path, planted: dict[str, str]) -> Path:
        for name, text in {**files, **planted}.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        return root

    kafka, local, cli = confluent_kafka_importers, local_stack_importers, cli_importers
    clean = checkout(tmp_path / "clean", {})
    assert [rule(clean) for rule in (kafka, local, cli)] == [[], [], []]
    planted = [
        (kafka, "bench/baselines.py", "from confluent_kafka import KafkaError\n"),
        (kafka, "include/duality/stream/topics.py", "from confluent_kafka import Producer\n"),
        (kafka, "plugins/duality_airflow/hooks.py", "import confluent_kafka\n"),
        (local, "include/duality/stream.py", "from duality.local import free_port\n"),
        (local, "include/duality/status.py", "def f():\n    from .local import stack\n"),
        (local, "include/duality/control.py", "from duality import local\n"),
        (cli, "jobs/repartition.py", "from duality.cli import ARGUMENTS\n"),
        (cli, "plugins/duality_airflow/hooks.py", "from duality import cli\n"),
    ]
    for n, (rule, name, text) in enumerate(planted):
        assert rule(checkout(tmp_path / str(n), {name: text})) == [name], (rule.__name__, name)


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
