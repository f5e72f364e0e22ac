"""Who may change what (docs/ARCHITECTURE.md, "Ownership"), checked on the source (AST, no imports run):

- KV capacity has one owner on the control plane: only kv/kv_manager.py creates or reaches a BlockAllocator;
  everything else goes through a KVManager's methods.
- The serving page pools are resized only through the manager's KVResize (KVPagePool.resize, reached by the worker's
  resize_kv); besides the pool itself only a reshape's commit grows a new pool, to the capacity its planned
  manager lists: a new call site of attach_blocks / detach_blocks fails here until it is reviewed and listed.
- Policies (routing, the overload arbiter, the drop plan, lookahead, the morph controller and monitor) read typed
  views and return plans: they import nothing from parallel/ and reach no engine, runner, scheduler or deployment.
- The engine never reaches into a scheduler's KV manager to change it: the scheduler does that."""
from __future__ import annotations

import ast
from pathlib import Path

import elastic_hf

PACKAGE_DIR = Path(elastic_hf.__file__).resolve().parent
KV_OWNER = "kv/kv_manager.py"
ALLOCATOR_MODULE = "kv/block_allocator.py"
KV_MUTATORS = {"allocate", "free", "share", "hold", "release_held", "grow", "shrink", "shrink_to", "reset"}
POOL_RESIZERS = {"attach_blocks", "detach_blocks"}
# Where pages of a pool are committed or decommitted: the pool (applying a KVManager's KVResize), a reshape's
# commit, which grows a new pool to its planned manager's capacity, and a drop's exchange, which gives back the
# retired old pool's blocks (no KVManager owns it any more) chunk by chunk.
POOL_RESIZE_EXECUTORS = {"kv/page_pool.py", "parallel/worker_reshape.py", "parallel/worker_exchange.py"}
POLICY_MODULES = ["engine/routing.py", "engine/rebalance.py", "engine/overload.py", "engine/drop_plan.py",
                  "engine/lookahead.py", "morph/controller.py", "morph/monitor.py"]
POLICY_MUST_NOT_REACH = {"engine", "runner", "scheduler", "deployment", "dep", "pool", "instances"}


def _sources() -> dict[str, ast.Module]:
    return {path.relative_to(PACKAGE_DIR).as_posix(): ast.parse(path.read_text())
            for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _names(tree: ast.Module) -> set[str]:
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | \
        {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def _imported_modules(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _method_calls(tree: ast.Module, methods: set[str]) -> list[tuple[int, str, str]]:
    """(line, receiver source, method) of every call `receiver.method(...)` with method in `methods`."""
    return [(node.lineno, ast.unparse(node.func.value), node.func.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods]


def test_only_the_kv_manager_reaches_a_block_allocator():
    offenders = [path for path, tree in _sources().items() if path not in (KV_OWNER, ALLOCATOR_MODULE)
                 and ("elastic_hf.kv.block_allocator" in _imported_modules(tree)
                      or {"BlockAllocator", "_allocator"} & _names(tree))]
    assert not offenders, f"only {KV_OWNER} may create or reach a BlockAllocator: {offenders}"


def test_kv_capacity_changes_only_through_a_kv_manager():
    """Every call of a KV-changing method is on a KV manager (`kv`, `*.kv`, `kv_managers[...]`, ...): no second
    allocator-like object appears beside it."""
    offenders = []
    for path, tree in _sources().items():
        if path in (KV_OWNER, ALLOCATOR_MODULE):
            continue
        for line, receiver, method in _method_calls(tree, KV_MUTATORS):
            if method in ("free", "allocate") and not _is_kv_manager(receiver):
                offenders.append(f"{path}:{line} {receiver}.{method}()")
            elif method in ("grow", "shrink", "shrink_to", "share", "hold", "release_held", "reset") \
                    and "kv" in receiver.lower() and not _is_kv_manager(receiver):
                offenders.append(f"{path}:{line} {receiver}.{method}()")
    assert not offenders, "KV blocks changed outside a KVManager:\n" + "\n".join(offenders)


def _is_kv_manager(receiver: str) -> bool:
    """`kv`, `self.kv`, `engine.scheduler.kv`, `kv_managers[idx]`."""
    last = receiver.split(".")[-1]
    return last == "kv" or receiver.startswith("kv_managers[")


def test_page_pools_are_resized_only_by_the_data_plane_executors():
    offenders = [f"{path}:{line} {receiver}.{method}()" for path, tree in _sources().items()
                 if path not in POOL_RESIZE_EXECUTORS for line, receiver, method in _method_calls(tree, POOL_RESIZERS)]
    assert not offenders, "page pools resized outside the KV executors:\n" + "\n".join(offenders)


def test_the_engine_step_leaves_kv_changes_to_the_scheduler():
    tree = _sources()["engine/llm_engine.py"]
    offenders = [f"llm_engine.py:{line} {receiver}.{method}()" for line, receiver, method in
                 _method_calls(tree, KV_MUTATORS) if receiver.endswith(".kv")]
    assert not offenders, offenders


def test_policies_read_views_and_return_plans():
    sources = _sources()
    offenders = []
    for path in POLICY_MODULES:
        tree = sources[path]
        offenders += [f"{path} imports {m}" for m in _imported_modules(tree)
                      if m.startswith(("elastic_hf.parallel", "elastic_hf.elastic_model", "elastic_hf.serving"))]
        offenders += [f"{path}:{node.lineno} .{node.attr}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr in POLICY_MUST_NOT_REACH]
    assert not offenders, "policy modules reach live objects:\n" + "\n".join(offenders)


def test_the_checks_catch_what_they_forbid():
    """The checks above fail on code that breaks the rules (so they cannot pass by looking at nothing)."""
    bad = ast.parse("scheduler.allocator.free(ids)\nengine.scheduler.kv.grow(ids)\nself.pool.attach_blocks(4)\n"
                    "x = inst.engine.runner\n")
    calls = _method_calls(bad, KV_MUTATORS | POOL_RESIZERS)
    assert [(r, m) for _, r, m in calls] == [("scheduler.allocator", "free"), ("engine.scheduler.kv", "grow"),
                                            ("self.pool", "attach_blocks")]
    assert not _is_kv_manager("scheduler.allocator") and _is_kv_manager("engine.scheduler.kv")
    assert {"engine", "runner"} <= {n.attr for n in ast.walk(bad) if isinstance(n, ast.Attribute)}
