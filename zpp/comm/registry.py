"""Transports by name: ``get_transport("torch")``, ``get_transport("mpi")``.

[Note: which transport]
The backend name is the first of (:func:`resolve_backend`):

1. the explicit choice: the ``name`` argument, which is the config's ``zpp.transport`` when
   :func:`zpp.initialize` calls it;
2. the environment variable ``ZPP_COMM_BACKEND``;
3. the backend of the tuning plan in ``ZPP_TUNE_FILE`` (see :mod:`zpp.comm.plan`);
4. "torch" when ``torch.distributed`` is already initialized (e.g. by
   ``zpp.init_distributed()`` or the script itself): one world, not two;
5. the launcher's natural backend (:func:`zpp.comm.launch.natural_backend`): "mpi" under an
   MPI launcher (mpiexec/mpirun) for a CPU job with mpi4py installed, whose MPI world
   already exists and needs no rendezvous address; otherwise "torch";
6. "torch".

Whatever the backend, the world is the launcher's: a torch transport under mpiexec or srun
builds its world from the launcher's numbering (see :mod:`zpp.comm.launch`), never a world
of one. A factory is any callable that takes keyword arguments and returns a world
:class:`~zpp.comm.transport.Transport`; the built-in ones are ``TorchTransport.init`` and
``MpiTransport.init`` (which imports mpi4py only when called).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from zpp.comm.launch import detect, mpi4py_available, natural_backend
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


def resolve_backend(name: str | None = None, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The backend name [Note: which transport] picks, and where it came from (for messages
    and logs): ``("mpi", "$ZPP_COMM_BACKEND")``, ``("torch", "the default")``, ..."""
    env = os.environ if env is None else env
    if name:
        return name, "the argument (or the config's zpp.transport)"
    from_env = env.get(BACKEND_ENV)
    if from_env:
        return from_env, f"${BACKEND_ENV}"
    plan = load_plan()
    if plan is not None:
        return plan.backend(), str(plan.source)
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "torch", "torch.distributed is already initialized"
    return natural_backend(detect(env), mpi4py=mpi4py_available(), cuda=torch.cuda.is_available())


def get_transport(name: str | None = None, **kwargs) -> Transport:
    """The world transport of backend ``name`` (Default: see [Note: which transport]), made by
    its factory with ``kwargs`` (e.g. ``timeout_s=60``). The transport's ``chosen_by`` says
    where the name came from."""
    name, source = resolve_backend(name)
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r} (from {source}); choices: {sorted(_REGISTRY)}") from None
    world = factory(**kwargs)
    try:
        world.chosen_by = source
    except AttributeError:  # a factory's object that takes no new attributes
        pass
    return world


def transport_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)
