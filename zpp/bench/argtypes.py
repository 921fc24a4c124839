"""argparse types shared by ``zpp bench`` and ``zpp tune``: each parses one option's text
or raises ``argparse.ArgumentTypeError`` naming the value and what was expected."""
from __future__ import annotations

import argparse

from zpp.bench.config import parse_sizes


def choice_list(allowed: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        if text == "all":
            return allowed
        values = tuple(v.strip() for v in text.split(","))
        bad = [v for v in values if v not in allowed]
        if bad or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(
                f"{text!r}: {'unknown ' + what + ' ' + ', '.join(map(repr, bad)) if bad else 'repeated'}; "
                f"choose from {', '.join(allowed)}, all (or a comma list)"
            )
        return values
    parse.__name__ = what  # argparse names the type in some messages
    return parse


def sizes_type(text: str) -> tuple[int, ...]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def integer(minimum: int, even: bool = False):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (even and value % 2):
            kind = "a positive even integer" if even else f"an integer >= {minimum}"
            raise argparse.ArgumentTypeError(f"{text!r} must be {kind}")
        return value
    parse.__name__ = "integer"
    return parse


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


