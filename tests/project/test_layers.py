"""The package's layers, enforced: imports go down (or stay in their layer), never up, and no import circle exists.

Every import counts, also one inside a function, and importing ``vlmbind.a.b`` also runs the package ``vlmbind.a``
(its ``__init__``), so that is an import of ``vlmbind.a`` too (except from inside ``vlmbind.a`` and for the root
package, which every import runs). A module that no layer claims fails the test, so a new module gets a place on
purpose. The layers and what each may import are described in docs/architecture.md.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vlmbind"

# bottom to top: a module's layer is its folder under vlmbind/ (a root module's, its own name), so a new module in a
# folder needs no edit here; a module may import modules of its own layer and of the layers below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("core", "version")),
    ("data", ("stimuli", "probes", "viz")),
    ("models", ("adapters", "tiny")),
    ("engine", ("engine",)),
    ("analyses", ("analysis", "organisms")),
    ("app", ("app", "cli", "__main__", "")),
)
ROOT = "vlmbind"
# what may sit at the package root besides its folders
ROOT_MODULES = {"vlmbind", "vlmbind.__main__", "vlmbind.cli", "vlmbind.version"}


def module_names(package: Path) -> dict[str, Path]:
    """``dotted name -> file`` of every module under ``package`` (``__init__`` files name their package)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """``module -> {imported module: line}`` for imports of the package's own modules, function-local ones
    included, plus the packages those imports run (see the module docstring)."""
    modules = module_names(package)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        base = name.split(".") if is_package else name.split(".")[:-1]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    stem = base[: len(base) - node.level + 1] + ([node.module] if node.module else [])
                    mod = ".".join(stem)
                else:
                    mod = node.module or ""
                if mod.split(".")[0] != ROOT:
                    continue
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == ROOT]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                chain = target.split(".")
                # the target and every package above it that the import runs
                for k in range(len(chain), 1, -1):
                    dep = ".".join(chain[:k])
                    if dep != name and not (k < len(chain) and name.startswith(dep + ".")):
                        edges.setdefault(dep, node.lineno)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int | None:
    """The rank of ``module``'s layer, read from its first folder under the package (None: no layer has it)."""
    parts = module.split(".")
    if parts[0] != ROOT:
        return None
    top = parts[1] if len(parts) > 1 else ""
    for rank, (_, folders) in enumerate(LAYERS):
        if top in folders:
            return rank
    return None


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """One line per import that goes to a higher layer."""
    bad = []
    for module, edges in sorted(graph.items()):
        for dep, line in sorted(edges.items()):
            if layer_of(dep) > layer_of(module):
                bad.append(f"{module}:{line} imports {dep} ({LAYERS[layer_of(module)][0]} -> "
                           f"{LAYERS[layer_of(dep)][0]})")
    return bad


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_every_module_has_a_layer():
    unplaced = [m for m in module_names(PACKAGE) if layer_of(m) is None]
    assert not unplaced, f"put these modules in a layer's folder (docs/architecture.md): {unplaced}"


def test_the_package_root_holds_only_its_entry_points():
    """Every module but the entry points and the version sits in its layer's folder."""
    at_root = {m for m in module_names(PACKAGE) if m.count(".") <= 1 and (PACKAGE / f"{m.split('.')[-1]}.py").is_file()}
    assert at_root | {"vlmbind"} <= ROOT_MODULES, sorted(at_root - ROOT_MODULES)


def test_a_new_module_takes_its_folders_layer():
    assert LAYERS[layer_of("vlmbind.engine.brand_new")][0] == "engine"
    assert LAYERS[layer_of("vlmbind.analysis.brand_new")][0] == "analyses"
    assert layer_of("vlmbind.brand_new") is None  # a new root module has no layer: it belongs in a folder


def test_imports_go_down_only():
    assert upward_imports(import_graph(PACKAGE)) == []


def test_no_import_circles():
    assert import_circles(import_graph(PACKAGE)) == []


# modules whose functions import what they use: the command line, so that `vlmbind --help` and the checks of the
# arguments import nothing heavy (its modules import vlmbind.core.choices, vlmbind.core.errors and .arguments at the top)
DEFERRING = ("vlmbind.app.commands",)


def test_imports_are_at_the_top_of_modules():
    """No function-local import of vlmbind's own modules (a module's header says what it depends on); deferral is
    kept for the optional heavy dependencies only, and for the command line (:data:`DEFERRING`)."""
    deferred_ok = ("plotly", "dash", "peft", "nnsight", "kaleido", "transformer_lens", "torchvision", "sklearn")
    local = []
    for name, path in module_names(PACKAGE).items():
        if any(name == d or name.startswith(d + ".") for d in DEFERRING):
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    top = "vlmbind" if node.level else (node.module or "").split(".")[0]
                elif isinstance(node, ast.Import):
                    top = node.names[0].name.split(".")[0]
                else:
                    continue
                if top not in deferred_ok:
                    local.append(f"{name}:{node.lineno} ({top})")
    assert local == []


@pytest.mark.parametrize("where, source", [
    ("top", "from ..app.commands import main\n"),
    ("function", "def _sneaky():\n    from ..analysis.mediation import locate\n    return locate\n"),
    ("package", "import vlmbind.organisms.training\n"),
])
def test_the_checks_catch_an_upward_import(tmp_path, where, source):
    """The same checks on a copy of the package with one upward import added to the engine's hooks module: at the
    top, inside a function, or through a package whose ``__init__`` sits higher."""
    copy = tmp_path / "vlmbind"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("weights", "__pycache__"))
    hooks = copy / "engine" / "hooks.py"
    hooks.write_text(hooks.read_text() + "\n" + source)
    bad = upward_imports(import_graph(copy))
    assert len(bad) >= 1 and all(line.startswith("vlmbind.engine.hooks:") for line in bad), bad
    assert "engine -> " in bad[0]


def test_the_circle_check_catches_a_circle(tmp_path):
    copy = tmp_path / "vlmbind"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("weights", "__pycache__"))
    errors = copy / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\nfrom .io import write_text_atomic  # noqa\n")
    assert ["vlmbind.core.errors", "vlmbind.core.io"] in import_circles(import_graph(copy))


def test_every_command_module_is_a_subcommand():
    """A subcommand is one module in vlmbind/app/commands with its ``HELP_ORDER`` (the architecture recipe):
    ``COMMANDS`` finds it, and the parser offers it under its module's name."""
    from vlmbind.app import commands

    modules = {p.stem for p in (PACKAGE / "app" / "commands").glob("*.py")} - {"__init__", *commands.HELPERS}
    assert {c.__name__.rsplit(".", 1)[1] for c in commands.COMMANDS} == modules
    orders = [c.HELP_ORDER for c in commands.COMMANDS]
    assert orders == sorted(set(orders)), "two commands share a HELP_ORDER"
    parser = commands.build_parser()
    names = list(parser._subparsers._group_actions[0].choices)  # noqa: SLF001 - argparse keeps them here
    assert names == [c.__name__.rsplit(".", 1)[1] for c in commands.COMMANDS]


def run_in_a_copy(tmp_path: Path, new_file: str, source: str, code: str) -> subprocess.CompletedProcess:
    """``python -c code`` against a copy of the package with one new module, ``new_file``, written into it."""
    copy = tmp_path / "vlmbind"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("weights", "__pycache__"))
    (copy / new_file).write_text(source)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_a_new_command_module_is_found(tmp_path):
    """The recipe's claim: a new module in vlmbind/app/commands is a subcommand with no other file touched."""
    done = run_in_a_copy(
        tmp_path, "app/commands/hello.py",
        "HELP_ORDER = 15\n\n\n"
        "def add_parser(sub, common):\n"
        "    sub.add_parser('hello', parents=[common], help='say hello').set_defaults(func=cmd_hello)\n\n\n"
        "def cmd_hello(args, command):\n"
        "    return {'hello': True}, 'hello', 0\n",
        "import sys; from vlmbind.app.commands import main; sys.exit(main(['hello']))")
    assert done.returncode == 0 and done.stdout.strip() == "hello", done.stderr[-2000:]


def test_a_new_analysis_module_registers_its_result_kind(tmp_path):
    """The recipe's claim: a result class in a new analysis module is in the table of kinds (and so known to
    vlmbind export) with no other file touched."""
    done = run_in_a_copy(
        tmp_path, "analysis/planted.py",
        "from dataclasses import dataclass\n"
        "from ..core.results import Result, register_result\n\n\n"
        "@register_result\n@dataclass\nclass Planted(Result):\n    kind = 'planted'\n",
        "import vlmbind.app.export, vlmbind.core.results as r; print(sorted(r.RESULTS))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'planted'" in done.stdout and "'locate'" in done.stdout


def test_no_package_name_hides_one_of_its_modules():
    """``from .rsa import rsa`` in a package ``__init__`` would make ``vlmbind.analysis.rsa`` the function; every
    submodule stays reachable as a module, except ``vb.stimuli.rsa_set``, a public function named as its module on
    purpose."""
    import importlib
    import types

    on_purpose = {"vlmbind.stimuli.rsa_set"}
    hidden = []
    for name, path in module_names(PACKAGE).items():
        if path.name != "__init__.py":
            continue
        package = importlib.import_module(name)
        for child in sorted(p.stem for p in path.parent.glob("*.py") if p.stem not in ("__init__", "__main__")):
            value = getattr(package, child, None)
            if value is not None and not isinstance(value, types.ModuleType) and f"{name}.{child}" not in on_purpose:
                hidden.append(f"{name}.{child}")
    assert hidden == []
