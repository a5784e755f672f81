"""The package's import graph: no cycle, and nothing patched by importing.

The graph is read from the source (every ``import`` statement of every
``lossscale`` module, at module level and inside functions, and every
``importlib.import_module`` of a constant name), so a cycle is named even
where lazy imports would let it load.  Then each module is imported in a
fresh interpreter in several orders: each import succeeds, and afterwards
Keras 3's ``Model.compile`` is still stock Keras's.
"""

import ast
import os
import subprocess
import sys

import pytest

from helpers import TESTS, child_env

PACKAGE_DIR = os.path.join(os.path.dirname(TESTS), "lossscale")
PACKAGE = "lossscale"


def _modules():
    names = set()
    for entry in os.listdir(PACKAGE_DIR):
        stem, _, ext = entry.partition(".")
        if ext == "py" or (ext.endswith("so") and not stem.startswith("_lossscale_ops")):
            names.add(PACKAGE if stem == "__init__" else f"{PACKAGE}.{stem}")
    return names


MODULES = _modules()


def _file_of(module):
    stem = "__init__" if module == PACKAGE else module.split(".", 1)[1]
    return os.path.join(PACKAGE_DIR, stem + ".py")


PYTHON_MODULES = sorted(m for m in MODULES if os.path.exists(_file_of(m)))


def _imports(module):
    """``{imported package module: 'module level' or 'in a function'}``."""
    tree = ast.parse(open(_file_of(module), encoding="utf-8").read())
    found = {}

    def add(target, lazy):
        if target == module:
            return
        if target not in found or not lazy:
            found[target] = "in a function" if lazy else "module level"

    def visit(node, lazy):
        for child in ast.iter_child_nodes(node):
            child_lazy = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        add(alias.name, lazy)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module and (
                    child.module == PACKAGE or child.module.startswith(PACKAGE + ".")):
                if child.module == PACKAGE:
                    for alias in child.names:
                        sub = f"{PACKAGE}.{alias.name}"
                        add(sub if sub in MODULES else PACKAGE, lazy)
                else:
                    add(child.module, lazy)
            elif (isinstance(child, ast.Call) and child.args
                  and isinstance(child.args[0], ast.Constant)
                  and isinstance(child.args[0].value, str)
                  and child.args[0].value in MODULES
                  and getattr(child.func, "attr", getattr(child.func, "id", None))
                  in ("import_module", "__import__")):
                add(child.args[0].value, lazy)
            visit(child, child_lazy)

    visit(tree, False)
    return found


GRAPH = {module: _imports(module) for module in PYTHON_MODULES}


def _cycle(graph):
    """One cycle of ``graph`` as a list of modules, or None."""
    state = {}
    stack = []

    def walk(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = walk(target)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return None


def _describe(cycle, graph):
    return " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + \
        f" -> {cycle[-1]}"


def test_the_graph_is_read():
    # The reader sees the imports it must (a broken reader finds no cycle).
    assert GRAPH["lossscale.policy"]["lossscale.keras_patch"] == "module level"
    assert GRAPH["lossscale.keras_patch"]["lossscale._tf_keras"] == "in a function"
    assert "lossscale._tf_keras" in GRAPH["lossscale"]


def test_no_import_cycle_counting_lazy_imports():
    cycle = _cycle(GRAPH)
    assert cycle is None, f"import cycle: {_describe(cycle, GRAPH)}"


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": "module level"}, "b": {"c": "in a function"},
             "c": {"a": "module level"}, "d": {}}
    cycle = _cycle(graph)
    assert cycle == ["a", "b", "c", "a"]
    assert _describe(cycle, graph) == \
        "a (module level) -> b (in a function) -> c (module level) -> a"


def test_compile_hook_module_imports_nothing_from_the_package():
    # So that every other module may import it.
    assert GRAPH["lossscale._compile_hook"] == {}


def test_only_the_compat_module_names_private_modules():
    # Keras's and tf_keras' private modules (``keras.src``, ``tf_keras.src``)
    # and TensorFlow's ``tensorflow.python`` are imported in _compat.py alone.
    offenders = []
    for module in PYTHON_MODULES:
        if module == "lossscale._compat":
            continue
        tree = ast.parse(open(_file_of(module), encoding="utf-8").read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith(("keras.src", "tf_keras.src", "tensorflow.python")):
                    offenders.append(f"{module}:{node.lineno} imports {name}")
    assert not offenders, offenders


_CHILD = r"""
import importlib, os, sys
order = sys.argv[1].split(",")
for name in order:
    importlib.import_module(name)
if sys.argv[2:] == ["then patch_keras"]:
    importlib.import_module("lossscale").patch_keras()
package = os.path.dirname(importlib.import_module("lossscale").__file__)

def lossscale_code_in(fn, seen=()):
    # The function, or one it closes over, is lossscale's.
    code = getattr(fn, "__code__", None)
    if code is None or fn in seen:
        return False
    if os.path.dirname(os.path.abspath(code.co_filename)) == package:
        return True
    return any(lossscale_code_in(cell.cell_contents, seen + (fn,))
               for cell in (fn.__closure__ or ()))

from lossscale import _compat
assert not lossscale_code_in(_compat.trainer_class().__dict__["compile"]), "Keras 3 patched"
owner, name = _compat.tf_keras_optimizer_wrapping_method()
assert not lossscale_code_in(owner.__dict__[name]), "tf_keras patched"
print("OK", len(order))
"""

_FIRST = ["lossscale._tf_keras", "lossscale.keras_patch", "lossscale.policy",
          "lossscale.callbacks", "lossscale.experimental"]
ORDERS = {
    "sorted": PYTHON_MODULES,
    "reversed": PYTHON_MODULES[::-1],
    "hook users first": _FIRST + [m for m in PYTHON_MODULES if m not in _FIRST],
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_every_module_imports_in_a_fresh_interpreter(order):
    pytest.importorskip("tf_keras")
    modules = ORDERS[order]
    run = subprocess.run([sys.executable, "-c", _CHILD, ",".join(modules)],
                         env=child_env(), cwd=TESTS, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0 and f"OK {len(modules)}" in run.stdout, (
        f"importing {modules} in a fresh interpreter:\n{run.stdout[-3000:]}\n"
        f"{run.stderr[-3000:]}")


def test_the_child_sees_a_patch():
    run = subprocess.run([sys.executable, "-c", _CHILD, "lossscale.policy", "then patch_keras"],
                         env=child_env(), cwd=TESTS, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode != 0 and "Keras 3 patched" in run.stderr, run.stderr[-3000:]
