"""The package's structure, as tests: no import cycles (lazy imports inside functions and imports under
``if TYPE_CHECKING:`` count: they are dependencies too), ``rlhf_lit.models`` and ``rlhf_lit.functional`` never
import Lightning, the RL core ``rlhf_lit.rl`` never reaches ``rlhf_lit.modules`` nor reads a private attribute
of another object, ``PPOModule`` stays a shell, and files and functions stay small enough to read (the
exceptions are listed with the reason each is argued)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

PACKAGES = ("rlhf_lit", "bench")
LIGHTNING = ("lightning", "pytorch_lightning")
LIGHTNING_FREE = ("rlhf_lit.models", "rlhf_lit.functional")
RL_CORE, MODULES_PACKAGE = "rlhf_lit.rl", "rlhf_lit.modules"


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imported_names(tree: ast.AST, module: str, is_package: bool, type_checking: bool = True) -> set[str]:
    """Dotted names of every import in a module, at any depth (functions included, and ``if TYPE_CHECKING:``
    blocks unless ``type_checking`` is False: an import kept only for type hints is still a dependency of the
    design, though it loads nothing at run time); relative imports resolved."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _graph(type_checking: bool = True) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, third-party top-level packages each module imports). Importing
    ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``: edges to those, except to the importer's own
    enclosing packages (Python is already running them)."""
    edges: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        names = _imported_names(ast.parse(path.read_text()), module, path.name == "__init__.py", type_checking)
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        targets = set()
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate in MODULES and candidate not in own:
                    targets.add(candidate)
        edges[module] = targets
        external[module] = {n.split(".")[0] for n in names if n.split(".")[0] not in PACKAGES}
    return edges, external


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
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
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# Cycles closed only by an ``if TYPE_CHECKING:`` import (an annotation), outside the RL core, that predate the
# rule that such imports count; each would be listed with the import that closes it, so a new cycle fails (none
# is left: BackboneConfig lives in models/backbone_settings.py, below both the loader and the file finder).
TYPE_HINT_CYCLES: list[list[str]] = []


def test_no_import_cycles():
    edges, _ = _graph()
    assert len(edges) > 80 and edges["rlhf_lit.cli"]  # the walk sees the package
    assert _cycles(_graph(type_checking=False)[0]) == []  # none at run time
    assert _cycles(edges) == TYPE_HINT_CYCLES  # none with type-hint imports but the listed ones


def test_type_checking_imports_count_as_dependencies():
    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhf_lit.modules.ppo import PPOModule\n"
    assert "rlhf_lit.modules.ppo" in _imported_names(ast.parse(code), "rlhf_lit.rl.x", False)


def _reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(edges[module])
    return seen


def test_the_rl_core_never_reaches_the_lightning_modules():
    """No module of ``rlhf_lit.rl`` imports ``rlhf_lit.modules``, directly or through another module
    (``TYPE_CHECKING`` imports included): the core's components are built with what they need."""
    edges, _ = _graph()
    core = [m for m in MODULES if m == RL_CORE or m.startswith(RL_CORE + ".")]
    assert len(core) >= 6
    for start in core:
        bad = sorted(m for m in _reachable(edges, start) if m.startswith(MODULES_PACKAGE))
        assert not bad, f"{start} reaches {bad}"


@pytest.mark.parametrize("package", ["evaluation", "models", "functional", "data", "rewards", "parallel"])
def test_the_layers_below_the_lightning_modules_never_reach_them(package):
    """What the stage modules are built from never imports them back (``TYPE_CHECKING`` and lazy imports
    included): e.g. ``rlhf-lit evaluate``'s report reads the calibration bounds from ``functional``."""
    edges, _ = _graph()
    start = f"rlhf_lit.{package}"
    for module in [m for m in MODULES if m == start or m.startswith(start + ".")]:
        bad = sorted(m for m in _reachable(edges, module) if m.startswith(MODULES_PACKAGE))
        assert not bad, f"{module} reaches {bad}"


def test_the_rl_core_reads_no_private_attribute_of_another_object():
    """``x._name`` in ``rlhf_lit.rl`` only on ``self`` (a component reading a module's private state is a
    class in disguise)."""
    found = []
    for module, path in MODULES.items():
        if not module.startswith(RL_CORE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} .{node.attr}")
    assert found == []


def test_the_ppo_module_is_a_shell():
    """``PPOModule`` holds the Lightning hooks only, in one file of at most 300 lines with no helper module of its
    own beside it; its settings, loading, assembly and iteration live in ``rlhf_lit.rl``."""
    assert len((REPO_ROOT / "rlhf_lit/modules/ppo.py").read_text().splitlines()) <= 300
    assert sorted(p.name for p in (REPO_ROOT / "rlhf_lit/modules").glob("ppo*.py")) == ["ppo.py"]


def test_models_and_functional_never_import_lightning():
    """Statically (every import that runs, lazy ones included, and everything they import in turn) ..."""
    edges, external = _graph(type_checking=False)  # a type-hint import loads nothing
    for start in [m for m in MODULES if m.startswith(LIGHTNING_FREE)]:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            bad = external[module] & set(LIGHTNING)
            assert not bad, f"{start} reaches {module}, which imports {sorted(bad)}"
            todo.extend(edges[module])


def test_importing_models_and_functional_loads_no_lightning():
    """... and at run time, in a fresh interpreter."""
    modules = [m for m in MODULES if m.startswith(LIGHTNING_FREE)]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted({{n.split('.')[0] for n in sys.modules}} & {set(LIGHTNING)!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    assert out.stdout.strip() == "[]"


# Files and functions over the limits, each with the reason it stays (~300-line files that read
# top to bottom; the limits are ~400 lines and ~80 lines).
FILE_LIMIT, FUNCTION_LIMIT = 400, 80
LONG_FILES = {
    # its docstrings hold the --help text of its arguments and the sources of its loss terms
    "rlhf_lit/modules/reward.py": "the reward LightningModule's hooks; its math is in functional/, its switches' "
    "terms in reward_length, its evaluation and export record in reward_eval",
    # one protocol read top to bottom: the folder lock, the export transaction (stage, commit, recover) and the
    # run that holds both; split it when a second writer of outputs appears
    "rlhf_lit/outputs.py": "folder locks, export transactions and one run's outputs",
}
LONG_FUNCTIONS: dict[str, str] = {}


def _long_functions() -> dict[str, int]:
    out = {}
    for module, path in MODULES.items():
        if not module.startswith("rlhf_lit"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LIMIT:
                    out[f"{path.relative_to(REPO_ROOT)}:{node.name}"] = length
    return out


def test_files_and_functions_stay_short():
    long_files = {
        str(p.relative_to(REPO_ROOT)): n
        for m, p in MODULES.items()
        if m.startswith("rlhf_lit") and (n := len(p.read_text().splitlines())) > FILE_LIMIT
    }
    assert set(long_files) <= set(LONG_FILES), {f: n for f, n in long_files.items() if f not in LONG_FILES}
    long_functions = _long_functions()
    assert set(long_functions) <= set(LONG_FUNCTIONS), long_functions


@pytest.mark.parametrize("name", sorted(LONG_FILES))
def test_every_listed_exception_still_exists(name):
    assert (REPO_ROOT / name).exists()


# Where one PPO / GRPO iteration runs: the module's hooks and the RL core with the layers beneath it. Besides,
# only the leaf modules every layer reads (metric names, errors, value ranges).
ITERATION_PLACES = ("modules", "rl", "functional", "models", "parallel")
LEAF_MODULES = ("metrics.py", "errors.py", "ranges.py")


def _files_run_by_training_step(tmp_path, **module_kwargs) -> set[str]:
    """The package's source files whose functions run during ``training_step`` (one tiny iteration)."""
    from tests.ppo.helpers import make_data, make_module, make_trainer

    module = make_module(**module_kwargs)
    package = str(REPO_ROOT / "rlhf_lit") + "/"
    files: set[str] = set()
    step = module.training_step

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            files.add(frame.f_code.co_filename[len(package) :])

    def traced_step(*args, **kwargs):
        sys.setprofile(tracer)
        try:
            return step(*args, **kwargs)
        finally:
            sys.setprofile(None)

    module.training_step = traced_step
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))
    assert module.iteration == 1
    return files


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_an_iteration_runs_in_the_module_and_the_rl_core_only(tmp_path, estimator):
    """Every file a PPO (GAE) or GRPO iteration enters lies in ``modules/``, ``rl/``, ``functional/``, ``models/``
    or ``parallel/`` (plus the leaf modules of names, errors and ranges), and the RL core is most of it."""
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.settings import PPOConfig

    kwargs = {}
    if estimator == "grpo":
        kwargs = dict(
            ppo=PPOConfig(advantage_estimator="grpo", ppo_epochs=1, ppo_minibatch_size=4, total_iterations=1),
            sampling=SamplingConfig(max_new_tokens=8, temperature=0.7, num_samples_per_prompt=2),
        )
    files = _files_run_by_training_step(tmp_path, **kwargs)
    outside = sorted(f for f in files if f.split("/")[0] not in ITERATION_PLACES and f not in LEAF_MODULES)
    assert outside == []
    assert {"modules/ppo.py", "rl/rollout.py", "rl/update.py", "rl/estimators.py"} <= files


LIGHTNING_MODULE_NAMES = ("pl_module", "lightning_module")


def test_no_function_outside_the_lightning_modules_takes_one():
    """Outside ``rlhf_lit.modules`` (and the Lightning callbacks, whose hooks Lightning calls with the module),
    no function takes a LightningModule: no parameter annotated with one or named ``module`` / ``pl_module`` where
    a LightningModule is meant. The RL core gets the trainer's side as callables (``rl.assembly.TrainerHooks``)."""
    found = []
    for module, path in MODULES.items():
        if not module.startswith("rlhf_lit.") or module.startswith(("rlhf_lit.modules", "rlhf_lit.callbacks")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if "LightningModule" in annotation or "PPOModule" in annotation or arg.arg in LIGHTNING_MODULE_NAMES:
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}({arg.arg})")
    assert found == []
