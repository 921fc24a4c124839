"""Transports by name: ``get_transport("torch")``, ``get_transport("mpi")``.

The name comes from the argument, else the environment variable ``ZPP_COMM_BACKEND``, else
the backend of the tuning plan in ``ZPP_TUNE_FILE`` (see :mod:`zpp.comm.plan`), else
"torch". A factory is any callable that takes keyword arguments and returns a world
:class:`~zpp.comm.transport.Transport`; the built-in ones are ``TorchTransport.init`` and
``MpiTransport.init`` (which imports mpi4py only when called).
"""
from __future__ import annotations

import os
from collections.abc import Callable

from zpp.comm.mpi_backend import MpiTransport
from zpp.comm.plan import load_plan
from zpp.comm.torch_backend import TorchTransport
from zpp.comm.transport import Transport

BACKEND_ENV = "ZPP_COMM_BACKEND"
DEFAULT_BACKEND = "torch"

_REGISTRY: dict[str, Callable[..., Transport]] = {
    "torch": TorchTransport.init,
    "mpi": MpiTransport.init,
}


def register_transport(name: str, factory: Callable[..., Transport]) -> None:
    """Make ``get_transport(name, **kwargs)`` call ``factory(**kwargs)``; replaces an
    existing entry of that name."""
    if not name or not isinstance(name, str):
        raise ValueError(f"register_transport: name={name!r} must be a non-empty string")
    if not callable(factory):
        raise TypeError(f"register_transport: factory for {name!r} is not callable: {factory!r}")
    _REGISTRY[name] = factory


def get_transport(name: str | None = None, **kwargs) -> Transport:
    """The world transport of backend ``name`` (Default: ``$ZPP_COMM_BACKEND``, else the
    ``$ZPP_TUNE_FILE`` plan's backend, else "torch"), made by its factory with ``kwargs``
    (e.g. ``timeout_s=60``)."""
    from_env = os.environ.get(BACKEND_ENV)
    plan = None if name or from_env else load_plan()
    name = name or from_env or (plan.backend() if plan is not None else DEFAULT_BACKEND)
    try:
        factory = _REGISTRY[name]
    except KeyError:
        source = f" (from ${BACKEND_ENV})" if name == from_env else f" (from {plan.source})" if plan else ""
        raise ValueError(f"unknown transport {name!r}{source}; choices: {sorted(_REGISTRY)}") from None
    return factory(**kwargs)


def transport_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)
