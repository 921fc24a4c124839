"""Regenerate the README blocks that are generated from code, so they cannot go stale.

    python tools/gen_readme.py            # rewrite README.md's generated blocks in place
    python tools/gen_readme.py --check    # exit 1 if README.md differs from the code

A block sits between ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->``;
``BLOCKS`` maps NAME to the function producing it. tests/test_readme_generated.py runs the
check.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _deepspeed_keys() -> str:
    from zpp.zero.deepspeed_config import keys_markdown

    return keys_markdown()


def _refused_modules() -> str:
    from zpp.unsupported import markdown

    return markdown()


BLOCKS: dict[str, Callable[[], str]] = {
    "deepspeed-config-keys": _deepspeed_keys,
    "deepspeed-refused-modules": _refused_modules,
}
_BLOCK = re.compile(r"(<!-- BEGIN generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END generated: (?P=name) -->)",
                    re.S)


def render(text: str) -> str:
    """``text`` with every generated block replaced by its function's output; a block name
    without a function, or a function without its block, is a ``ValueError``."""
    seen = set()

    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise ValueError(f"README block {name!r} has no generator in tools/gen_readme.py BLOCKS")
        seen.add(name)
        return m.group(1) + BLOCKS[name]() + m.group(4)

    out = _BLOCK.sub(fill, text)
    missing = sorted(set(BLOCKS) - seen)
    if missing:
        raise ValueError(f"README has no block for {missing}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if README.md is stale")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    args = parser.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{path} is stale: run python tools/gen_readme.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
