"""zpp.compat, DeepSpeed's module tree as one layer: every module under both names is one
module object, the core layers import nothing from it, and refusals read the same under
either name (zpp/compat/__init__.py, [Note: compat aliases])."""
from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import zpp
import zpp.compat

ROOT = Path(zpp.__file__).resolve().parent
COMPAT = ROOT / "compat"
#: zpp's own layers (README "Layers"): none may import zpp.compat or a name it aliases.
CORE = ("quant", "comm", "optim", "zero", "tune", "cluster", "bench", "log.py", "cli.py", "__main__.py")


def _compat_modules() -> list[str]:
    """Every module of zpp.compat, by its public name (zpp.runtime.zero.config, ...)."""
    out = []
    for path in sorted(COMPAT.rglob("*.py")):
        rel = path.relative_to(COMPAT)
        if rel.parts[0] == "_deepspeed_shim" or rel == Path("__init__.py"):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append("zpp." + ".".join(parts))
    return out


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_compat_package_holds_every_deepspeed_module_zpp_aliases():
    on_disk = {p.name.removesuffix(".py") for p in COMPAT.iterdir()
               if not p.name.startswith("_") and (p.suffix == ".py" or p.is_dir())}
    on_disk.discard("__pycache__")
    assert on_disk == set(zpp.compat.NAMES)
    for name in zpp.compat.NAMES:  # nothing left behind at the top of the package
        assert not (ROOT / name).exists() and not (ROOT / f"{name}.py").exists(), name


@pytest.mark.parametrize("public_first", [True, False], ids=["public-first", "compat-first"])
def test_every_module_is_one_object_under_both_names(public_first):
    names = [n for n in _compat_modules() if n != "zpp.run_command"]
    assert "zpp.runtime.zero.partition_parameters" in names and "zpp.ops.op_builder" in names
    # in a fresh interpreter, so the import order is the one under test
    out = _run(f"""
import importlib, sys
names = {names!r}
for n in names:
    pub = n
    real = n.replace("zpp.", "zpp.compat.", 1)
    first, second = (pub, real) if {public_first!r} else (real, pub)
    a = importlib.import_module(first)
    b = importlib.import_module(second)
    assert a is b, (n, a, b)
    assert sys.modules[pub] is sys.modules[real], n
    assert a.__name__ == real and a.__spec__.name == real, (n, a.__name__, a.__spec__.name)
twins = [k for k in sys.modules if k.startswith("zpp.") and not k.startswith("zpp.compat.")
         and "zpp.compat." + k[4:] in sys.modules and sys.modules[k] is not sys.modules["zpp.compat." + k[4:]]]
assert not twins, twins
print(len(names))
""")
    assert int(out) == len(names)


def test_class_identity_and_pickled_references_hold_across_the_names():
    from zpp.compat.runtime.zero.config import DeepSpeedZeroConfig as Real
    from zpp.runtime.zero.config import DeepSpeedZeroConfig as Public

    assert Public is Real and Real.__module__ == "zpp.compat.runtime.zero.config"
    # a reference pickled before the move (module "zpp.runtime.zero.config") loads as the class
    new = pickle.dumps(Real, protocol=0)  # text opcodes: a module name may change length
    old = new.replace(b"zpp.compat.runtime.zero.config", b"zpp.runtime.zero.config")
    assert old != new and b"zpp.compat" not in old
    assert pickle.loads(old) is Real
    assert zpp.get_accelerator is zpp.compat.accelerator.get_accelerator
    assert zpp.runtime is zpp.compat.runtime and zpp.unsupported is zpp.compat.unsupported


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == \
                "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value))
    return found


def _is_compat(module: str) -> bool:
    return module == "zpp.compat" or module.startswith("zpp.compat.") or \
        zpp.compat.real_name(module) != module


def test_the_core_imports_nothing_from_the_compat_layer():
    files = []
    for part in CORE:
        p = ROOT / part
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    assert len(files) > 60
    bad = {str(f.relative_to(ROOT)): sorted(m for m in _imports(f) if _is_compat(m)) for f in files}
    bad = {f: m for f, m in bad.items() if m}
    assert not bad, f"core modules importing zpp.compat: {bad}"
    # the checker sees such an import (a check that cannot fail proves nothing)
    assert _is_compat("zpp.utils.logging") and _is_compat("zpp.compat.ops") and not _is_compat("zpp.zero.engine")
    # and at run time: the core loaded, only the package and its refusals (zpp/__init__) are
    out = _run("""
import sys
import zpp.zero, zpp.zero.engine, zpp.comm, zpp.optim, zpp.quant, zpp.tune.cost, zpp.tune.command
import zpp.bench.command, zpp.cluster.cli, zpp.log, zpp.cli
print(sorted(k for k in sys.modules if k.startswith("zpp.compat")))
""")
    assert out.strip() == "['zpp.compat', 'zpp.compat.unsupported']"


@pytest.mark.parametrize("name", ["zpp.ops.transformer", "zpp.compat.ops.transformer",
                                  "zpp.runtime.pipe", "zpp.compat.runtime.pipe.engine"])
def test_a_refused_module_names_the_public_path_under_either_name(name):
    with pytest.raises(ImportError) as e:
        __import__(name)
    refused = "zpp.ops.transformer" if "transformer" in name else "zpp.runtime.pipe"  # a submodule: its parent
    assert str(e.value).startswith(f"{refused} (deepspeed.{refused[4:]}): ")


def test_a_missing_name_of_a_compat_module_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="zpp.ops.transformer .deepspeed.ops.transformer."):
        zpp.compat.ops.transformer  # noqa: B018
    with pytest.raises(AttributeError, match="module 'zpp.ops' has no attribute 'no_such_name'"):
        zpp.ops.no_such_name  # noqa: B018
    assert zpp.compat.runtime.zero.Init is zpp.zero.Init  # a submodule on first attribute access


def test_names_map_both_ways():
    assert zpp.compat.real_name("zpp.runtime.zero.config") == "zpp.compat.runtime.zero.config"
    assert zpp.compat.real_name("zpp.zero.engine") == "zpp.zero.engine"
    assert zpp.compat.real_name("zpp.runtimes") == "zpp.runtimes"
    assert zpp.compat.public_name("zpp.compat.ops.adam") == "zpp.ops.adam"
    assert zpp.compat.public_name("zpp.zero") == "zpp.zero"


def test_python_dash_m_runs_an_alias_as_its_target():
    """``python -m zpp.run_command`` (an alias) runs the code of zpp.compat.run_command; it
    failed with AttributeError 'get_code' before the alias loader could hand out code."""
    runs = [subprocess.run([sys.executable, "-m", name], capture_output=True, text=True, timeout=120)
            for name in ("zpp.run_command", "zpp.compat.run_command")]
    assert [(r.returncode, r.stdout, r.stderr) for r in runs] == [(0, "", "")] * 2, runs
