"""Leaving cleanly: process groups torn down before the interpreter, broken MPI jobs aborted.

[Note: clean exit]
torch (gloo). Each gloo process group runs worker threads that execute the collectives.
When a collective completes, the worker drops its reference to the work object *after*
the caller's ``wait()`` has returned, and releasing the work's tensors needs the GIL (torch
keeps a tensor's Python object alive while C++ holds a reference). If the main thread has
meanwhile reached interpreter shutdown, the worker's attempt to take the GIL ends its
thread through ``pthread_exit``, whose unwinding through C++ code calls
``std::terminate``: "terminate called without an active exception", SIGABRT, exit code -6,
after a run that computed everything right (seen in about half of the 4-rank torchrun runs
of a quantized all-gather; a core dump shows the worker in ``~AsyncAllgatherWork`` ->
``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``). Destroying a process group joins
its workers, but ``destroy_process_group()`` does not destroy groups that Python objects
(zpp's transports, the topology's sub-transports, their reverse groups) still reference, so
those groups die in the interpreter's final garbage collection, too late.

So the first torch transport (or ``zpp.init_distributed``) registers an ``atexit`` handler that runs while threads may
still take the GIL: it destroys torch.distributed's groups and drops every reference that
zpp's transports hold to a process group or a work in flight, which destroys the groups
(torch releases the GIL in a group's destructor) and joins their workers. Works still in
flight complete first (every rank exits the same way; after a failure they fail within the
timeout). This happens whether or not the program called ``destroy_process_group`` itself.
It is not always enough: with torch 2.13 the world's gloo group can outlive the handler
(its worker threads were still there after it, in a 2-rank ZeRO-3 save/load under torchrun;
no Python object held the group), and a worker that had just finished the last all-gather
then reached its decref at the final garbage collection: the same abort, in 2 of 12 runs
of the README's checkpoint snippet. So the handler then gives the GIL up for
``GIL_YIELD_S`` (a sleep): a worker's pending decref takes microseconds once it has the
GIL, and after the sleep no collective is left to finish (0 aborts in 40 runs).
A group the program itself still holds (e.g. from ``zpp.comm.new_group``) lives on to the
end, as it would without zpp.

MPI. A communicator whose collective timed out cannot be used or finalized (``MPI_Finalize``
would wait for the silent peer forever, and the job would never exit); the same holds for
a torch world started by mpiexec, whose rendezvous initialized MPI (mpi4py finalizes it at
exit). The first transport registers an ``atexit`` handler: if a world of this process is
broken and MPI is initialized, it tells the other ranks over the fault channel that it is
exiting, waits until every rank that reported the fault has done the same (at most
``EXIT_GRACE_S``), so each has printed its error, and calls ``MPI_Abort(COMM_WORLD, 1)``:
the launcher ends every rank, stopped ones included, and the job exits with a non-zero
code.
"""
from __future__ import annotations

import atexit
import contextlib
import sys
import time
import weakref
from typing import Any

__all__ = ["close_torch_groups", "track_default_group", "track_mpi", "track_torch"]

#: Seconds the exit handler gives up the GIL after tearing the groups down (see [Note: clean exit]).
GIL_YIELD_S = 0.05

_TORCH: weakref.WeakSet = weakref.WeakSet()
_MPI: weakref.WeakSet = weakref.WeakSet()
_REGISTERED: set[str] = set()


def _register(key: str, handler) -> None:
    if key not in _REGISTERED:
        _REGISTERED.add(key)
        atexit.register(handler)


def track_torch(transport: Any) -> None:
    """Tear ``transport``'s process groups down at exit; see [Note: clean exit]."""
    _TORCH.add(transport)
    _register("torch", close_torch_groups)
    _register("abort", _abort_broken_mpi)  # atexit is last-in first-out: this runs first


def track_default_group() -> None:
    """Tear torch.distributed's groups down at exit (a world ``zpp.init_distributed`` built,
    used through ``zpp.comm``'s functions without a zpp transport); see [Note: clean exit]."""
    _register("torch", close_torch_groups)


def track_mpi(transport: Any) -> None:
    """Abort the job at exit if ``transport``'s world broke; see [Note: clean exit]."""
    _MPI.add(transport)
    _register("abort", _abort_broken_mpi)


def close_torch_groups() -> None:
    """Destroy torch.distributed's process groups and zpp's references to them, joining
    the groups' worker threads. Every zpp torch transport is unusable afterwards. Safe to
    call more than once."""
    import torch.distributed as dist

    live = list(_TORCH)
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    for t in live:  # the groups' last references: each is destroyed here, joining its workers
        t.release()
    if live:
        time.sleep(GIL_YIELD_S)  # see [Note: clean exit]: a worker's last decref of a finished work


def _abort_broken_mpi() -> None:
    live = [t for t in list(_MPI) + list(_TORCH) if t.broken is not None]
    if not live or "mpi4py.MPI" not in sys.modules:
        return
    MPI = sys.modules["mpi4py.MPI"]
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    for chan in {id(t.faults): t.faults for t in live if t.faults is not None}.values():
        chan.announce_exit()
    MPI.COMM_WORLD.Abort(1)
