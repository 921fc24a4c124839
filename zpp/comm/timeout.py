"""One timeout for every wait on a peer.

``timeout_s`` bounds the rendezvous (joining the world), every collective and every
``Work.wait()``, on both transports. Its value, first that says:

1. an explicit argument (``get_transport(timeout_s=...)``, ``TorchTransport.init``,
   ``MpiTransport.init``) or the config key ``zpp.timeout_s`` (which ``zpp.initialize``
   passes as the argument),
2. the environment variable ``ZPP_TIMEOUT_S`` (seconds),
3. ``DEFAULT_TIMEOUT_S`` (300 s).
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "resolve_timeout"]

TIMEOUT_ENV = "ZPP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


def resolve_timeout(timeout_s: float | None = None, env: Mapping[str, str] | None = None) -> float:
    """``timeout_s`` if given, else ``$ZPP_TIMEOUT_S``, else 300; ``ValueError`` naming the
    source unless it is a finite number of seconds > 0."""
    env = os.environ if env is None else env
    source = "timeout_s"
    if timeout_s is None:
        text = env.get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT_S
        source = f"${TIMEOUT_ENV}"
        try:
            timeout_s = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={env.get(TIMEOUT_ENV)!r} is not a number of seconds") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{source}={timeout_s!r} must be a number of seconds")
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"{source}={timeout_s!r} must be a finite number of seconds > 0")
    return float(timeout_s)
