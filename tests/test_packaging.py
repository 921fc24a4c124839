"""What the code imports is what pyproject.toml installs.

The README's test command installs ``.[test]`` into a fresh environment; a test (or a perf
script a test runs) that imports a package only some machines happen to have passes there
and fails on a user's fresh install (matplotlib was one). So every import of a third-party
package, read from the source with :mod:`ast`, must be declared:

* in ``tests/`` and ``perf/`` (which the tests run): a core dependency or in the ``test``
  extra;
* in ``zpp/``: a core dependency or in some extra (``mpi``, ``cuda12``/``cuda13``, ``plot``),
  and an import of an extra's package is inside a function or a ``try`` (the package
  imports without the extra).

An import inside ``try: ... except ImportError`` is optional by construction. ``NOT_DEPENDENCIES``
lists the rest, each with its reason.
"""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# our packages, and modules scripts import from their own folder (perf/*.py, tests/frontends/common.py)
LOCAL = {"zpp", "tests", "perf", "tools"} | {p.stem for d in ("perf", "tests") for p in (ROOT / d).rglob("*.py")}

# import name -> distribution, where they differ
DISTRIBUTION = {"cupy": "cupy-cuda13x", "pytorch_lightning": "pytorch-lightning", "yaml": "pyyaml"}
# imported on purpose without being a dependency
NOT_DEPENDENCIES = {
    "deepspeed": "perf/train_bench.py compares against real DeepSpeed in a Python the user names "
                 "(--ds-python); zpp never needs it",
}


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def _names(reqs: list[str]) -> set[str]:
    return {_requirement_name(r) for r in reqs}


CORE = _names(PYPROJECT["dependencies"])
EXTRAS = {k: _names(v) for k, v in PYPROJECT["optional-dependencies"].items()}


def _imports(path: Path) -> list[tuple[str, int, bool, bool]]:
    """(top-level module, line, guarded by ``except ImportError``, at module level) for every import."""
    out = []

    def guarded(handlers) -> bool:
        for h in handlers:
            names = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
            if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception")
                   for n in names):
                return True
        return False

    def visit(node, in_try: bool, top: bool):
        if isinstance(node, ast.Import):
            out.extend((a.name.split(".")[0], node.lineno, in_try, top) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], node.lineno, in_try, top))
        if isinstance(node, ast.Try):
            g = in_try or guarded(node.handlers)
            for child in node.body:
                visit(child, g, top)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, in_try, top)
            return
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, in_try, inner)

    visit(ast.parse(path.read_text(), str(path)), False, True)
    return out


def _third_party(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name, line, in_try, top in _imports(path):
            if name in sys.stdlib_module_names or name in LOCAL or name == "__future__":
                continue
            yield path.relative_to(ROOT), line, name, DISTRIBUTION.get(name, name).lower().replace("_", "-"), \
                in_try, top


@pytest.mark.parametrize("folder", ["tests", "perf"])
def test_tests_and_perf_import_only_what_the_test_extra_installs(folder):
    allowed = CORE | EXTRAS["test"]
    missing = [f"{p}:{line}: import {name} ({dist})" for p, line, name, dist, in_try, _ in _third_party(folder)
               if dist not in allowed and not in_try and name not in NOT_DEPENDENCIES]
    assert not missing, (f"not in pyproject's dependencies or its 'test' extra, so a fresh `pip install -e "
                         f"'.[test]'` lacks them:\n" + "\n".join(missing))


def test_the_package_imports_only_declared_packages_and_extras_lazily():
    every_extra = set().union(*EXTRAS.values())
    bad = []
    for p, line, name, dist, in_try, top in _third_party("zpp"):
        if dist in CORE:
            continue
        if dist not in every_extra:
            bad.append(f"{p}:{line}: import {name} ({dist}) is in no extra")
        elif top and not in_try:
            bad.append(f"{p}:{line}: import {name} ({dist}, an extra) at module level: zpp would need it")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_an_undeclared_import(tmp_path):
    """The scan itself: a module-level, a guarded and a lazy import are told apart."""
    src = tmp_path / "m.py"
    src.write_text("import numpy\ntry:\n    import cupy\nexcept ImportError:\n    cupy = None\n"
                   "def f():\n    import matplotlib.pyplot as plt\n")
    assert _imports(src) == [("numpy", 1, False, True), ("cupy", 3, True, True), ("matplotlib", 7, False, False)]


def test_the_extras_name_what_users_are_told_to_install():
    """The MPI extra gives a working mpiexec (MPICH's wheel), as the README promises."""
    assert {"mpi4py", "mpich"} <= EXTRAS["mpi"]
    assert {"transformers", "accelerate", "pytorch-lightning", "matplotlib"} <= EXTRAS["test"]
