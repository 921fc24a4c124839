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

A plan is advice measured for the job, so rules 1 and 2 may override it, loudly: when a plan
is in force and the argument or ``ZPP_COMM_BACKEND`` names another backend,
:func:`get_transport` warns once on rank 0, naming both and the winner, and ``chosen_by``
says so (``"$ZPP_COMM_BACKEND (overrides the plan zpp_tune.json, which chose mpi)"``).
``zpp cluster run --backend B`` sets ``ZPP_COMM_BACKEND``; without ``--backend`` it does not.
Rules 4-6 never override a plan. :func:`zpp.initialize` passes the plan of its config
(``zpp.tune_plan``, else ``$ZPP_TUNE_FILE``) and applies the same rule to a transport
passed to it (:func:`note_override`).

Whatever the backend, the world is the launcher's: a torch transport under mpiexec or srun
builds its world from the launcher's numbering (see :mod:`zpp.comm.launch`), never a world
of one. A factory is any callable that takes keyword arguments and returns a world
:class:`~zpp.comm.transport.Transport`; the built-in ones are ``TorchTransport.init`` and
``MpiTransport.init`` (which imports mpi4py only when called).
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping

from zpp.comm.launch import detect, mpi4py_available, natural_backend
from zpp.comm.mpi_backend import MpiTransport
from zpp.comm.plan import TunePlan, load_plan
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


class _FromEnv:
    def __repr__(self) -> str:
        return "FROM_ENV"


#: ``plan=`` default of :func:`resolve_backend` and :func:`get_transport`: ``$ZPP_TUNE_FILE``'s plan.
FROM_ENV = _FromEnv()
_WARNED: set[str] = set()


def resolve_backend(name: str | None = None, env: Mapping[str, str] | None = None, *,
                    plan: TunePlan | str | os.PathLike | None | _FromEnv = FROM_ENV) -> tuple[str, str]:
    """The backend name [Note: which transport] picks, and where it came from (for messages
    and logs): ``("mpi", "$ZPP_COMM_BACKEND")``, ``("torch", "the default")``, ...
    ``plan``: the tune plan in force, or its file (Default: ``$ZPP_TUNE_FILE``'s; None: no
    plan)."""
    env = os.environ if env is None else env
    if name:
        return name, "the argument (or the config's zpp.transport)"
    from_env = env.get(BACKEND_ENV)
    if from_env:
        return from_env, f"${BACKEND_ENV}"
    plan = _plan(plan)
    if plan is not None:
        return plan.backend(), str(plan.source)
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "torch", "torch.distributed is already initialized"
    return natural_backend(detect(env), mpi4py=mpi4py_available(), cuda=torch.cuda.is_available())


def _plan(plan: TunePlan | str | os.PathLike | None | _FromEnv) -> TunePlan | None:
    if plan is FROM_ENV:
        return load_plan()
    if plan is None or isinstance(plan, TunePlan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    raise TypeError(f"plan must be a TunePlan, a path or None, not {type(plan).__name__}: {plan!r}")


def override_note(backend: str, source: str, plan: TunePlan | None) -> str | None:
    """When ``source`` chose ``backend`` against ``plan``'s backend: the sentence that says
    so (for the warning and ``chosen_by``); else None."""
    if plan is None or source == str(plan.source) or backend == plan.backend():
        return None
    return (f"{backend!r} from {source} overrides the tune plan {plan.source}, which chose "
            f"{plan.backend()!r}; the job runs on {backend!r}")


def note_override(world: Transport, backend: str, source: str, plan: TunePlan | None) -> bool:
    """When ``source`` chose ``world``'s backend ``backend`` against ``plan``'s, say so in
    ``world.chosen_by`` and warn (once per process, on rank 0; see [Note: which
    transport]). Returns whether it did."""
    note = override_note(backend, source, plan)
    if note is None:
        return False
    try:
        world.chosen_by = f"{source} (overrides the plan {plan.source}, which chose {plan.backend()})"
    except AttributeError:  # a factory's object that takes no new attributes
        pass
    if getattr(world, "rank", 0) == 0 and note not in _WARNED:
        _WARNED.add(note)
        warnings.warn(f"zpp: {note}", UserWarning, stacklevel=3)
    return True


def get_transport(name: str | None = None, *, plan: TunePlan | str | os.PathLike | None | _FromEnv = FROM_ENV,
                  **kwargs) -> Transport:
    """The world transport of backend ``name`` (Default: see [Note: which transport]), made by
    its factory with ``kwargs`` (e.g. ``timeout_s=60``). The transport's ``chosen_by`` says
    where the name came from, and whether that overrode the tune plan ``plan`` (Default:
    ``$ZPP_TUNE_FILE``'s; None: no plan), which also warns on rank 0."""
    plan = _plan(plan)
    name, source = resolve_backend(name, plan=plan)
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r} (from {source}); choices: {sorted(_REGISTRY)}") from None
    world = factory(**kwargs)
    try:
        world.chosen_by = source
    except AttributeError:  # a factory's object that takes no new attributes
        pass
    note_override(world, name, source, plan)
    return world


def transport_names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)
