"""The package structure as docs/ARCHITECTURE.md states it, checked on the source (AST, no imports run): every
package imports only packages below it (no circle), runtime morphing reads only the profile format and the
calibration data of the profiler, nothing reaches another package's private names, and no module grows past
~400 lines without saying why."""
from __future__ import annotations

import ast
from pathlib import Path

import elastic_hf

PACKAGE_DIR = Path(elastic_hf.__file__).resolve().parent
ARCHITECTURE_DOC = PACKAGE_DIR.parent / "docs" / "ARCHITECTURE.md"
# Lowest first. A unit is a sub-package (memory, kv, ...) or a top-level module (config.py, elastic_model.py).
LAYERS = ["units", "paths", "topology", "config", "memory", "patches", "native", "layers", "kv", "model", "engine",
          "profiling", "morph", "parallel", "elastic_model", "serving"]
MORPH_MAY_READ_FROM_PROFILING = {"elastic_hf.profiling.profile_format", "elastic_hf.profiling.calibration"}
MAX_LINES = 400
LONG_MODULE_MARK = "Longer than 400 lines because"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: elastic_hf/__init__.py itself


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported elastic_hf module, imported names) of every import, lazy ones inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("elastic_hf")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("elastic_hf"):
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def test_the_documented_order_is_the_checked_order():
    text = ARCHITECTURE_DOC.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("Import order (lowest first):"))
    documented = [u.strip(" `.") for u in line.split(":", 1)[1].split(",")]
    assert documented == LAYERS


def test_every_unit_is_placed_in_the_order():
    units = {_unit(m) for m in _modules()} - {None}
    assert units <= set(LAYERS), f"add {sorted(units - set(LAYERS))} to LAYERS and docs/ARCHITECTURE.md"


def test_packages_import_only_packages_below_them():
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    violations = []
    for module, path in _modules().items():
        unit = _unit(module)
        if unit is None:
            continue  # the package root re-exports the facade lazily
        for line, target, _ in _imports(path):
            target_unit = _unit(target)
            if target_unit is not None and target_unit != unit and rank[target_unit] > rank[unit]:
                violations.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line} {unit} -> {target_unit}")
    assert not violations, "imports of higher packages:\n" + "\n".join(violations)


def test_runtime_morphing_reads_only_the_profile_format():
    for module, path in _modules().items():
        if _unit(module) != "morph":
            continue
        for line, target, _ in _imports(path):
            if _unit(target) == "profiling":
                assert target in MORPH_MAY_READ_FROM_PROFILING, f"{path.name}:{line} imports {target}"


def _private_names_by_unit() -> dict[str, set[str]]:
    """Private names (one leading underscore) each unit defines: functions, classes, attributes, variables."""
    defined: dict[str, set[str]] = {}
    for module, path in _modules().items():
        names = defined.setdefault(_unit(module), set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {u: {n for n in names if n.startswith("_") and not n.startswith("__")} for u, names in defined.items()}


def test_no_private_access_across_packages():
    private = _private_names_by_unit()
    violations = []
    for module, path in _modules().items():
        unit = _unit(module)
        foreign = set().union(*(names for u, names in private.items() if u != unit)) - private.get(unit, set())
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in foreign:
                violations.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno} .{node.attr}")
        for line, target, names in _imports(path):
            if _unit(target) != unit:
                hidden = [n for n in names if n.startswith("_")] + \
                         [p for p in target.split(".") if p.startswith("_") and not p.startswith("__")]
                violations += [f"{path.relative_to(PACKAGE_DIR.parent)}:{line} imports {n}" for n in hidden]
    assert not violations, "private names used across packages:\n" + "\n".join(violations)


def test_modules_stay_small_or_say_why():
    long = []
    for module, path in _modules().items():
        num_lines = len(path.read_text().splitlines())
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if num_lines > MAX_LINES and LONG_MODULE_MARK not in docstring:
            long.append(f"{path.relative_to(PACKAGE_DIR.parent)}: {num_lines} lines")
    assert not long, f"split these modules or state the reason ('{LONG_MODULE_MARK} ...'):\n" + "\n".join(long)
