"""What a service's code imports, read from its source: the third-party modules an image must
install, and the modules that need triton (the CPU worker image has none)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def third_party_imports(service: str, without: set[str] = frozenset()) -> set[str]:
    """Top-level modules imported by the service's code (less the modules `without`) and by the
    libs/llmserve modules it reaches."""
    libs = REPO / "libs"
    queue = [p for p in service_files(service) if module_name(p) not in without]
    seen, modules = set(queue), set()
    while queue:
        imported = imports(queue.pop())
        modules |= top_level(imported)
        for name in imported:
            if name.startswith("llmserve.") and not name.startswith("llmserve.v1"):  # v1: generated stubs
                path = libs / (name.replace(".", "/") + ".py")
                if path.exists() and path not in seen:
                    seen.add(path)
                    queue.append(path)
    ours = {"services", "llmserve", "__future__"}
    return {m for m in modules - ours if m not in sys.stdlib_module_names}


def needing_triton(service: str) -> set[str]:
    """The service's modules that cannot be imported without triton: those importing it, or such a
    module, at module level (the Triton backends load them lazily, on a GPU)."""
    loads = {module_name(p): imports(p, module_level=True) for p in service_files(service)}
    found: set[str] = set()
    while True:
        more = {m for m, imported in loads.items() if m not in found
                and ("triton" in top_level(imported) or imported & found)}
        if not more:
            return found
        found |= more


def service_files(service: str) -> list[Path]:
    return sorted((REPO / "services" / service).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module_level: bool = False) -> set[str]:
    """Absolute module names a file imports (`from a import b` counts as a and a.b: b may be a
    module); with module_level, only those run when the module is imported (no function bodies)."""
    tree = ast.parse(path.read_text())
    nodes = _module_level(tree.body) if module_level else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _module_level(body: list[ast.stmt]):
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):   # try: import x / except ImportError, if TYPE_CHECKING
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *(h.body for h in getattr(node, "handlers", []))):
                yield from _module_level(block)


def top_level(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}
