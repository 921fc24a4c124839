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
    assert "zero_optimization.contiguous_gradients=True accepted" in out.stdout, out.stdout


def _prose() -> str:
    """The README without its generated blocks: the sentences written by hand."""
    return re.sub(r"<!-- BEGIN generated: (\S+) -->.*?<!-- END generated: \1 -->", "", README.read_text(), flags=re.S)


def refusal_claims(text: str) -> list[str]:
    """Config keys the prose says are refused: "`a.b` is refused", "`x` and `y: null` are refused"."""
    keys = []
    for m in re.finditer(r"((?:`[^`]+`(?:,|\s+and|\s+or|/)?\s*)+)(?:is|are)\s+refused", text):
        for token in (re.sub(r"\s+", " ", t) for t in re.findall(r"`([^`]+)`", m.group(1))):
            path = token.split(":", 1)[0].strip()
            if path in KEYS or path.split(".", 1)[0] in {p.split(".", 1)[0] for p in KEYS}:
                keys.append(token if ":" in token else path)
    return keys


def test_readme_refusal_claims_match_the_config_code():
    """What the prose says zpp refuses, the key table refuses (fp16.auto_cast was implemented while
    a sentence still called it refused). A ``key: null`` claim is checked by loading it."""
    from zpp.zero.deepspeed_config import from_deepspeed

    claims = refusal_claims(_prose())
    assert claims, "no refusal claims found: the pattern no longer matches the README"
    for claim in claims:
        if ":" in claim:
            path, value = (part.strip() for part in claim.split(":", 1))
            assert value == "null", claim
            with pytest.raises(ValueError, match=path):
                from_deepspeed({path: None})
            continue
        assert claim in KEYS, f"README says `{claim}` is refused, but it is no DeepSpeed key zpp knows"
        assert KEYS[claim].status == "refused", (
            f"README says `{claim}` is refused, but the key table says {KEYS[claim].status}: {KEYS[claim].note}")


def test_refusal_claims_parser():
    text = "x `fp16.auto_cast` is refused; `zero_optimization:\n  null` and `fp16: null` are refused; `mpu` is refused"
    assert refusal_claims(text) == ["fp16.auto_cast", "zero_optimization: null", "fp16: null"]
