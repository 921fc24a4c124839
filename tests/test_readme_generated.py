"""The README's generated blocks equal what the code generates (tools/gen_readme.py), and the
"Coming from DeepSpeed" snippet runs as written."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import gen_readme
from zpp.unsupported import MODULES
from zpp.zero.deepspeed_config import KEYS

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_blocks_are_current():
    text = README.read_text()
    assert gen_readme.render(text) == text, "README.md is stale: run python tools/gen_readme.py"
    # and the blocks are really there: every key and every refused module is listed
    for path in KEYS:
        assert f"| `{path}` |" in text, path
    for module in MODULES:
        assert f"| `deepspeed.{module}` |" in text, module


def test_render_refuses_unknown_or_missing_blocks():
    with pytest.raises(ValueError, match="no generator"):
        gen_readme.render("<!-- BEGIN generated: nope -->\n<!-- END generated: nope -->")
    with pytest.raises(ValueError, match="no block for"):
        gen_readme.render("nothing generated here")


def test_coming_from_deepspeed_snippet_runs(tmp_path):
    section = README.read_text().split("## Coming from DeepSpeed", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code + "\nprint(cfg.zero.stage, device)"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(README.parent), "ZPP_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("2 cpu"), out.stdout
    assert "zero_optimization.overlap_comm=True accepted" in out.stdout, out.stdout
