"""README.md's snippets, run as written (as doctest would): every ```python and ```bash block.

A block may carry a directive on the line before its fence (an HTML comment, invisible on
GitHub):

* ``<!-- readme-test: torchrun N VAR=VALUE ... -->``: the python block runs as a script under
  ``torchrun --nproc-per-node N`` with those variables;
* ``<!-- readme-test: cluster -->``: the bash block builds an emulated cluster (root); it runs
  only where the cluster tests run (``ZPP_TEST_CLUSTER=1``, see tests/conftest.py);
* ``<!-- readme-test: skip (REASON) -->``: not run (benchmarks of minutes to hours).

Other python blocks run as ``python block.py``; bash blocks run line by line with ``bash``,
each in a scratch directory. Two kinds of line are checked instead of run: ``pip install``
(its extras must exist in pyproject.toml and its torch pin must be CI's; nothing is
installed) and the test command itself (it must be the one .ci/run runs). A ``zpp bench``
line whose comment claims a node layout ("2 emulated nodes x 2", "2 x 2") must print it.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import CLUSTER_ENV

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEST_COMMAND = "python -m pytest -q"
LINE_TIMEOUT_S = 240
_DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->$")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "ZPP_RANKS_PER_NODE", "ZPP_COMM_BACKEND", "ZPP_BENCH_CHILD")


def readme_blocks(text: str) -> list[dict]:
    """Every ```python / ```bash block: language, code, directive, the README line it starts at."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(python|bash)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        d = _DIRECTIVE.match(lines[i - 1].strip()) if i else None
        blocks.append({"lang": m.group(1), "code": "\n".join(lines[i + 1:j]) + "\n",
                       "directive": d.group(1) if d else "", "line": i + 1})
        i = j + 1
    return blocks


BLOCKS = readme_blocks(README.read_text())


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: str | list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    shell = isinstance(cmd, str)
    res = subprocess.run(["bash", "-c", cmd] if shell else cmd, cwd=cwd, env={**_env(), **(env or {})},
                         capture_output=True, text=True, timeout=LINE_TIMEOUT_S)
    assert res.returncode == 0, f"{cmd!r} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def _check_pip(command: str) -> None:
    """A README ``pip install`` names extras that exist and CI's torch; nothing is installed."""
    args = shlex.split(command)
    assert args[:2] == ["pip", "install"], command
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ci = (ROOT / ".ci" / "run").read_text()
    for a in args[2:]:
        m = re.match(r"^\.(?:\[(.+)\])?$", a)
        if m:
            for extra in filter(None, (m.group(1) or "").split(",")):
                assert extra in extras, f"{command}: no extra {extra!r} in pyproject.toml"
        elif a.startswith("torch=="):
            version = a.split("==", 1)[1]
            assert f"torch-{version}+cpu" in ci and f"torch=={version}" in ci, f"{command}: CI pins another torch"
        elif a == "--index-url":
            assert "download.pytorch.org/whl/cpu" in command, command
        else:
            assert a in ("-e", "https://download.pytorch.org/whl/cpu"), f"{command}: unexpected {a!r}"


def _claimed_layout(comment: str) -> tuple[int, int] | None:
    m = re.search(r"(\d+) (?:emulated )?(?:nodes )?x (\d+)", comment)
    return (int(m.group(1)), int(m.group(2))) if m else None


_ran: dict[str, subprocess.CompletedProcess] = {}  # a command the README shows twice runs once


def _run_bash_line(line: str, cwd: Path) -> None:
    code, _, comment = line.partition("  #")
    code = code.strip()
    for part in (p.strip() for p in code.split("&&")):
        if part.startswith("pip install"):
            _check_pip(part)
        elif part == TEST_COMMAND:
            assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(), "the README's test command is not CI's"
        else:
            if part.split()[0] == "zpp" and shutil.which("zpp") is None:
                pytest.skip("the zpp command is not installed (pip install -e .)")
            res = _ran.get(part) or _run(part, cwd)
            _ran[part] = res
            layout = _claimed_layout(comment)
            if "zpp bench" in part and layout:
                nodes, per_node = layout
                assert f"= {nodes} nodes x {per_node} ranks per node" in res.stdout, (line, res.stdout[:600])


def _is_slow(block) -> bool:
    """The quick lane leaves out the blocks that run `zpp bench` (30 s each) and the 4-rank worlds."""
    if block["lang"] == "bash":
        return "zpp bench" in block["code"]
    parts = block["directive"].split()
    return parts[:1] == ["torchrun"] and len(parts) > 1 and int(parts[1]) >= 4


def _params():
    out = []
    for b in BLOCKS:
        marks = []
        kind = b["directive"].split(" ", 1)[0]
        if kind == "skip":
            marks.append(pytest.mark.skip(reason=f"README line {b['line']}: {b['directive']}"))
        elif kind == "cluster":
            marks.append(pytest.mark.cluster)
        elif kind not in ("", "torchrun"):
            raise ValueError(f"README line {b['line']}: unknown readme-test directive {b['directive']!r}")
        if _is_slow(b):
            marks.append(pytest.mark.slow)
        out.append(pytest.param(b, id=f"{b['lang']}-line{b['line']}", marks=marks))
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", _params())
def test_readme_block(block, tmp_path):
    if block["lang"] == "python":
        script = tmp_path / "snippet.py"
        script.write_text(block["code"])
        words = block["directive"].split()
        if words and words[0] == "torchrun":
            env = dict(w.split("=", 1) for w in words[2:])
            torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not on PATH")
            _run([torchrun, "--nproc-per-node", words[1], str(script)], tmp_path, env)
        else:
            _run([sys.executable, str(script)], tmp_path)
        return
    try:
        for line in block["code"].splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                _run_bash_line(line, tmp_path)
    finally:
        if block["directive"] == "cluster":
            from zpp import cluster

            cluster.down()  # also when a line failed half-way


def test_readme_opening_block():
    """The first block: the CPU-only install, then the two commands (install + zpp bench;
    install + tests), and the test time."""
    first = BLOCKS[0]
    commands = [line for line in first["code"].splitlines() if line and not line.startswith("#")]
    # in the order they must run: the CPU-only torch before anything that would resolve torch
    assert commands[0] == "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert commands[1] == "pip install -e . && zpp bench"
    assert commands[2] == f"pip install -e '.[test]' && {TEST_COMMAND}"
    assert re.search(r"about \d+ minutes", first["code"]), first["code"]
    assert f"{CLUSTER_ENV}=1" in README.read_text()  # how to run the cluster tests
