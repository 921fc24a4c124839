"""``zpp tune``: pick the transport and the compression for this job, per collective and
message size, from a short ``zpp bench`` sweep on each backend.

* :mod:`zpp.tune.planner`: pure functions from bench rows to a
  :class:`~zpp.comm.plan.TunePlan` and the plan as a table (no ranks needed);
* :mod:`zpp.tune.command`: the command line (``zpp tune``), which runs the sweeps.

The plan is read by :func:`zpp.comm.plan.load_plan` (``$ZPP_TUNE_FILE``),
:func:`zpp.comm.registry.get_transport` and :mod:`zpp.comm.tuned`.
"""
