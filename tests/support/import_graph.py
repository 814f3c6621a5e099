"""loramux's import graph read from the sources with :mod:`ast` (no module is imported):
the no-cycles test counts every import statement, the engine's phase test only those that
run (``if TYPE_CHECKING:`` blocks aside) and the third-party ones too."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "adapters", "registry", "platform", "migrations")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the five packages: dotted name (``loramux.platform.app``) -> file."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(["loramux", *parts])] = path
    return modules


def _is_package(name: str, modules: Mapping[str, Path]) -> bool:
    path = modules.get(name)
    if path is not None and path.name == "__init__.py":
        return True
    return any(other.startswith(name + ".") for other in modules)


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name ``from <level dots><target> import ...`` in ``module`` means."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def import_statements(source: str, runtime_only: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of ``source``, anywhere (inside functions too); with
    ``runtime_only`` those under ``if TYPE_CHECKING:`` are left out."""
    stack: list[ast.AST] = [ast.parse(source)]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if runtime_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def imported_names(module: str, source: str, modules: Mapping[str, Path],
                   runtime_only: bool = False) -> set[str]:
    """The absolute names ``module`` imports (loramux's and third-party ones), ``from
    package import name`` as ``package.name`` where that is a loramux module, else
    ``package``; relative imports resolved."""
    found: set[str] = set()
    package = _is_package(module, modules)
    for node in import_statements(source, runtime_only):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = (
            _resolve_relative(module, package, node.level, node.module)
            if node.level
            else node.module or ""
        )
        found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names)
    return found


def imports_of(module: str, source: str, modules: Mapping[str, Path],
               runtime_only: bool = False) -> set[str]:
    """The loramux modules that ``module`` imports anywhere in ``source``."""
    found: set[str] = set()
    for target in imported_names(module, source, modules, runtime_only):
        # `import loramux.a.b` binds loramux.a.b; the longest known prefix is the module
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the loramux modules it imports (every import statement counted)."""
    modules = module_files(root)
    return {name: imports_of(name, path.read_text(), modules) for name, path in modules.items()}


