"""The package's structure, checked file by file: imports run one way (no import of a higher
layer from a lower one, no circle of module-level imports), no environment switch inside the
library, and no file over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "cp_modules"

# Lower numbers are lower layers; a module may import its own layer and those below.
LAYERS = {
    "config": 0, "policy": 0, "pinned": 0,
    "distributed": 1,
    "partition": 2, "cache": 2,
    "reference": 3,
    "kernels": 4,
    "step": 5,
    "ops": 6,
    "modules": 7, "compile": 7,
    "models": 8, "training": 8, "testing": 8, "loading": 8,
    "engine": 9, "integrations": 9, "verify": 9, "plan": 9,
    "__init__": 10,
}  # fmt: skip
# The flat kernel modules of earlier versions and where each lives now (the old names stay
# importable: cp_modules/kernels/<old>.py hands back the new module itself).
OLD_KERNEL_PATHS = {
    "attention_blocks": "prefill.attention_blocks",
    "pcp_blocks": "prefill.pcp_blocks",
    "pcp_key_major": "prefill.pcp_key_major",
    "pcp_varlen": "prefill.pcp_varlen",
    "grad_assembly": "prefill.grad_assembly",
    "masked_flash": "masked.flash",
    "masked_pack": "masked.pack",
    "masked_prefill": "masked.prefill",
    "flex_backward": "masked.flex_backward",
    "paged_decode": "decode.paged",
    "paged_decode_mla": "decode.mla",
    "paged_decode_mla_gluon": "decode.mla_gluon",
    "paged_decode_mla_gluon_config": "decode.mla_gluon_config",
    "paged_decode_mla_gluon_epilogue": "decode.mla_gluon_epilogue",
    "paged_decode_mla_gluon_parts": "decode.mla_gluon_parts",
    "lse_merge": "merge",
    "kv_cache": "cache",
}
# Environment variables the library may read: the launcher's rank and world (torchrun's), and
# the Triton interpreter switch that the test harness hands on to the processes it spawns.
LAUNCH_VARIABLES = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TRITON_INTERPRET",
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, ast.parse(path.read_text())


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(tree: ast.AST, top_level_only: bool):
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("cp_modules")
        ):
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("cp_modules"))


def test_every_module_has_a_layer():
    unknown = {_layer(m) for m, _, _ in _modules()} - set(LAYERS)
    assert not unknown, f"add these to LAYERS: {sorted(unknown)}"


def test_imports_never_go_up_a_layer():
    up = [
        f"{m} -> {n}"
        for m, _, tree in _modules()
        for n in _imports(tree, top_level_only=False)
        if LAYERS[_layer(n)] > LAYERS[_layer(m)]
    ]
    assert not up, "imports from a lower layer to a higher one:\n" + "\n".join(up)


def _import_edges(tree: ast.AST, modules: set[str]):
    # Every import, at any depth (functions and TYPE_CHECKING blocks included): a circle that
    # only a deferred import keeps working is still a circle. ``from package import module``
    # counts as an import of the module.
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("cp_modules")
        ):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield sub if sub in modules else node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("cp_modules"))


def test_no_import_circles():
    trees = {m: t for m, _, t in _modules()}
    graph = {m: {n for n in _import_edges(t, set(trees)) if n != m} for m, t in trees.items()}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path, m, n]))
            if n in graph and not state.get(n):
                visit(n, [*path, m])
        state[m] = 2

    for m in graph:
        if not state.get(m):
            visit(m, [])


def test_the_circle_check_sees_deferred_imports():
    # engine.graphs once imported engine.engine inside a function and under TYPE_CHECKING.
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from cp_modules.engine.engine import GenerationEngine\n"
        "def f():\n    from cp_modules.engine import engine\n"
    )
    modules = {"cp_modules.engine", "cp_modules.engine.engine"}
    assert set(_import_edges(tree, modules)) == {"cp_modules.engine.engine"}


def test_old_kernel_paths_are_the_new_modules():
    import importlib

    for old, new in OLD_KERNEL_PATHS.items():
        a = importlib.import_module(f"cp_modules.kernels.{old}")
        assert a is importlib.import_module(f"cp_modules.kernels.{new}"), old


def test_no_environment_switches_in_the_library():
    reads = []
    for m, _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("get", "getenv"):
                owner = node.func.value
                is_env = (isinstance(owner, ast.Attribute) and owner.attr == "environ") or (
                    isinstance(owner, ast.Name) and owner.id == "os"
                )
                key = node.args[0] if node.args else None
                if is_env and not (isinstance(key, ast.Constant) and key.value in LAUNCH_VARIABLES):
                    reads.append(f"{m}:{node.lineno}")
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
                if node.value.attr == "environ" and isinstance(node.ctx, ast.Load):
                    key = node.slice
                    if not (isinstance(key, ast.Constant) and key.value in LAUNCH_VARIABLES):
                        reads.append(f"{m}:{node.lineno}")
    assert not reads, f"environment reads outside the launch variables: {reads}"


def test_no_file_over_600_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for _, p, _ in _modules()
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, long
