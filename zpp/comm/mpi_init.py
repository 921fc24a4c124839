"""``MPI_Init`` (importing mpi4py) bounded by the timeout.

[Note: MPI_Init cannot hang forever]
Importing ``mpi4py.MPI`` runs ``MPI_Init``, which waits in the launcher's PMI barrier until
every rank of the job has started MPI. A rank that dies before that point (an import
error, a crash, a node lost) does not end the job: MPICH's hydra keeps the other ranks in
``MPI_Init`` for good (measured: still there after 120 s). ``MPI_Init`` holds the GIL, so
no Python thread can help; zpp imports mpi4py through :func:`mpi`, which arms
``faulthandler.dump_traceback_later(timeout_s, exit=True)``, a C watchdog: if ``MPI_Init``
has not returned after ``timeout_s`` (see :mod:`zpp.comm.timeout`) it prints
"Timeout" and the stack, whose innermost zpp frame is ``_mpi_init_waits_for_every_rank``,
and ends the process with exit code 1. The launcher then sees its ranks exit and ends the
job. The watchdog replaces a ``dump_traceback_later`` the program armed itself (there is
one per process) and is cancelled once MPI is up.
"""
from __future__ import annotations

import faulthandler
import sys
from typing import Any

from zpp.comm.timeout import resolve_timeout

__all__ = ["mpi"]


def mpi(timeout_s: float | None = None) -> Any:
    """The ``mpi4py.MPI`` module, initializing MPI within ``timeout_s`` (Default:
    ``$ZPP_TIMEOUT_S``, else 300) or ending the process; see [Note: MPI_Init cannot hang
    forever]."""
    module = sys.modules.get("mpi4py.MPI")
    if module is not None:
        return module
    limit = resolve_timeout(timeout_s)
    faulthandler.dump_traceback_later(limit, repeat=False, file=sys.__stderr__, exit=True)
    try:
        return _mpi_init_waits_for_every_rank()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _mpi_init_waits_for_every_rank() -> Any:
    """A name for the stack the watchdog prints: this rank is in ``MPI_Init``, waiting for
    the job's other ranks to start MPI."""
    from mpi4py import MPI

    return MPI
