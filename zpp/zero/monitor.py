"""DeepSpeed's monitors: the config's ``tensorboard``, ``csv_monitor``, ``wandb`` and
``comet`` sections (:class:`MonitorConfig`) and ``engine.monitor`` (:class:`MonitorMaster`).

    engine.monitor.enabled                                        # a section is enabled
    engine.monitor.write_events([("Eval/loss", 0.25, engine.global_samples)])

[Note: monitors]
zpp writes what DeepSpeed 0.19.8's engine writes, when, where and on which rank:

* An event is a ``(name, value, step)`` tuple. After each optimizer step at the
  accumulation boundary (a skipped one too) the engine writes ``("Train/Samples/lr",
  get_lr()[0], global_samples)`` and, under fp16, ``("Train/Samples/loss_scale", the scale
  after the step's update, global_samples)``; ``global_samples`` already counts the step's
  batch. Nothing is written at backward: DeepSpeed's data-parallel engine logs no loss
  (its pipeline engine does); a script logs its own through ``engine.monitor.write_events``.
  DeepSpeed's ``elapsed_time_ms_*`` events come from its wall-clock timers, which zpp has not.
* ``enabled`` (any section enabled) is the same on every rank; only global rank 0 builds
  writers and writes.
* ``csv_monitor``: the directory ``os.path.join(output_path, job_name)`` (by default
  ``./DeepSpeedJobName``) is made when the engine is built. Each event name has its file,
  the name with "/" and " " replaced by "_" plus ".csv", appended to; the first time a
  monitor writes a file it adds the header ``step,<the name's last "/" part>`` (a rerun
  into the same directory appends a second header). Rows are ``step,value`` as
  :mod:`csv` writes them (``\\r\\n`` line ends, ``str`` of the value).
* ``tensorboard``: a ``torch.utils.tensorboard.SummaryWriter`` on that same directory,
  ``add_scalar(name, value, step)`` per event, flushed after each ``write_events``.
* ``wandb``: ``wandb.init(project=, group=, entity=team)``, then ``wandb.log({name:
  value}, step=step)`` per event.
* ``comet``: ``comet_ml.start(api_key=, project=, workspace=, experiment_key=, mode=,
  online=)``, named ``experiment_name`` when given; an event is logged when its name is
  new or its step is ``samples_log_interval`` or more past the last one logged under it.

Where zpp differs: DeepSpeed stops with an ``ImportError`` when a switched-on monitor's
package is missing; zpp warns once (naming the package and its ``pip install``) and trains
on without that writer. A writer that raises while built or writing is treated the same
way (one warning; a failed write is retried at the next event): a monitor never stops a run.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from zpp.zero.checks import check_bool, check_choice, check_int, check_str, fail, from_section

__all__ = ["COMET_MODES", "FIELD_CHECKS", "SECTIONS", "WRITERS", "CSVConfig", "CometConfig", "MonitorConfig",
           "MonitorMaster", "TensorBoardConfig", "WandbConfig"]

COMET_MODES = ("get", "create", "get_or_create")


# ---------------------------------------------------------------------- config
def _text(where: str, name: str, value: Any) -> str:
    """Any string, "" included (DeepSpeed's default ``output_path``)."""
    if not isinstance(value, str):
        raise fail(where, name, value, "a string")
    return value


#: The check of each field name (the same in every section); a field whose default is None
#: may also be None.
FIELD_CHECKS: dict[str, Callable[[str, str, Any], Any]] = {
    "enabled": check_bool, "output_path": _text, "job_name": _text,
    "group": check_str, "team": check_str, "project": check_str, "workspace": check_str, "api_key": check_str,
    "experiment_name": check_str, "experiment_key": check_str, "online": check_bool,
    "samples_log_interval": lambda w, n, v: check_int(w, n, v, lo=0),
    "mode": lambda w, n, v: check_choice(w, n, v, COMET_MODES),
}


def _validate(section: Any) -> None:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if value is not None or f.default is not None:
            FIELD_CHECKS[f.name](type(section).__name__, f.name, value)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class _DirectoryConfig:
    """A monitor that writes files into ``output_path/job_name``."""

    enabled: bool = False
    """Write the files on rank 0 (Default: False)."""
    output_path: str = ""
    """The directory holding ``job_name``; "" is the working directory (Default: "")."""
    job_name: str = "DeepSpeedJobName"
    """The run's directory inside ``output_path`` (Default: "DeepSpeedJobName")."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TensorBoardConfig(_DirectoryConfig):
    """DeepSpeed's ``"tensorboard"`` section (needs the ``tensorboard`` package): TensorBoard
    event files."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CSVConfig(_DirectoryConfig):
    """DeepSpeed's ``"csv_monitor"`` section: one CSV file per event name, no package needed."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class WandbConfig:
    """DeepSpeed's ``"wandb"`` section (needs the ``wandb`` package; its own settings, such
    as ``WANDB_MODE=offline``, come from the environment)."""

    enabled: bool = False
    """Log to Weights & Biases on rank 0 (Default: False)."""
    group: str | None = None
    """The run's group (Default: None)."""
    team: str | None = None
    """The entity (team) the run belongs to (Default: None)."""
    project: str = "deepspeed"
    """The project (Default: "deepspeed")."""

    def __post_init__(self) -> None:
        _validate(self)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CometConfig:
    """DeepSpeed's ``"comet"`` section (needs ``comet_ml`` 3.41 or later); None leaves a
    setting to Comet (its config file and ``COMET_*`` environment variables)."""

    enabled: bool = False
    """Log to Comet on rank 0 (Default: False)."""
    samples_log_interval: int = 100
    """Log an event name again only once its step (samples) moved this far (Default: 100)."""
    project: str | None = None
    """Comet project (Default: None)."""
    workspace: str | None = None
    """Comet workspace (Default: None)."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """Comet API key; not shown in the config's repr (Default: None)."""
    experiment_name: str | None = None
    """The experiment's name (Default: None)."""
    experiment_key: str | None = None
    """The key of the experiment to log to (Default: None)."""
    online: bool | None = None
    """Log to the server (True) or to an offline experiment (False) (Default: None)."""
    mode: str | None = None
    """"get", "create" or "get_or_create" (Comet's default) (Default: None)."""

    def __post_init__(self) -> None:
        _validate(self)


#: The config's monitor sections, in the order DeepSpeed builds and writes them.
SECTIONS: dict[str, type] = {"tensorboard": TensorBoardConfig, "wandb": WandbConfig, "csv_monitor": CSVConfig,
                             "comet": CometConfig}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class MonitorConfig:
    """The four monitor sections; each may be given as its config class or as a dict."""

    tensorboard: TensorBoardConfig = dataclasses.field(default_factory=TensorBoardConfig)
    """TensorBoard event files (Default: off)."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases (Default: off)."""
    csv_monitor: CSVConfig = dataclasses.field(default_factory=CSVConfig)
    """CSV files (Default: off)."""
    comet: CometConfig = dataclasses.field(default_factory=CometConfig)
    """Comet (Default: off)."""

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, from_section(cls, "MonitorConfig", name, value))
            elif not isinstance(value, cls):
                raise fail("MonitorConfig", name, value, f"a {cls.__name__} or a dict")

    @property
    def enabled(self) -> bool:
        """Whether any section is enabled."""
        return any(getattr(self, name).enabled for name in SECTIONS)


# ---------------------------------------------------------------------- writers
def _run_dir(cfg: TensorBoardConfig | CSVConfig) -> str:
    path = os.path.join(cfg.output_path, cfg.job_name)
    os.makedirs(path or ".", exist_ok=True)
    return path


class _Csv:
    package = pip = None

    def __init__(self, cfg: CSVConfig) -> None:
        self.log_dir = _run_dir(cfg)
        self._headed: set[str] = set()  # files this monitor has written its header to

    def write(self, events) -> None:
        for event in events:
            name, value, step = event[0], event[1], event[2]
            stem = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, stem + ".csv"), "a", newline="") as f:
                out = csv.writer(f)
                if stem not in self._headed:
                    self._headed.add(stem)
                    out.writerow(["step", name.rsplit("/", 1)[-1]])
                out.writerow([step, value])


class _TensorBoard:
    package, pip = "tensorboard", "pip install tensorboard"

    def __init__(self, cfg: TensorBoardConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ImportError without the tensorboard package

        self.summary_writer = SummaryWriter(log_dir=_run_dir(cfg))

    def write(self, events) -> None:
        for event in events:
            self.summary_writer.add_scalar(*event)
        self.summary_writer.flush()


class _Wandb:
    package, pip = "wandb", "pip install wandb"

    def __init__(self, cfg: WandbConfig) -> None:
        import wandb

        self._wandb = wandb
        wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team)

    def write(self, events) -> None:
        for event in events:
            self._wandb.log({event[0]: event[1]}, step=event[2])


class _Comet:
    package, pip = "comet_ml", 'pip install "comet_ml>=3.41.0"'

    def __init__(self, cfg: CometConfig) -> None:
        import comet_ml

        version = tuple(int(x) for x in re.findall(r"\d+", comet_ml.__version__)[:2])
        if version < (3, 41):
            raise ImportError(f"comet_ml {comet_ml.__version__} is older than 3.41.0")
        self.experiment = comet_ml.start(api_key=cfg.api_key, project=cfg.project, workspace=cfg.workspace,
                                         experiment_key=cfg.experiment_key, mode=cfg.mode, online=cfg.online)
        if cfg.experiment_name is not None:
            self.experiment.set_name(cfg.experiment_name)
        self.interval = cfg.samples_log_interval
        self._last: dict[str, int] = {}  # event name -> step last logged

    def write(self, events) -> None:
        for event in events:
            name, value, step = event[0], event[1], event[2]
            if name not in self._last or step - self._last[name] >= self.interval:
                self._last[name] = step
                self.experiment.log_metric(name, value, step=step)


#: Section name -> its writer: ``cls(section_config)`` builds it (raising ``ImportError``
#: when its package is missing), ``write(events)`` writes; ``package``/``pip`` name what to install.
WRITERS: dict[str, type] = {"tensorboard": _TensorBoard, "wandb": _Wandb, "csv_monitor": _Csv, "comet": _Comet}
_WARNED: set[tuple[str, str]] = set()


def _warn_once(section: str, what: str, error: BaseException) -> None:
    if (section, what) in _WARNED:
        return
    _WARNED.add((section, what))
    writer = WRITERS[section]
    if what == "missing":
        msg = (f"zpp: the config's {section!r} monitor is enabled but the {writer.package!r} package is not "
               f"usable ({error}); `{writer.pip}` to get its logs. Training goes on without it")
    else:
        msg = (f"zpp: the {section!r} monitor failed {what} ({type(error).__name__}: {error}); training goes "
               "on (this warning is shown once)")
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------- the engine's monitor
class MonitorMaster:
    """``engine.monitor``: every enabled writer of a :class:`MonitorConfig`, on rank 0; see
    [Note: monitors].

    Attributes:
        enabled: any section is enabled (on every rank, as DeepSpeed's).
        writers: section name -> writer, built on rank 0 only (the usable ones).
    """

    def __init__(self, config: MonitorConfig, rank: int) -> None:
        self.config = config
        self.enabled = config.enabled
        self.writers: dict[str, Any] = {}
        if rank != 0:
            return
        for name, cls in WRITERS.items():
            if getattr(config, name).enabled:
                try:
                    self.writers[name] = cls(getattr(config, name))
                except ImportError as e:
                    _warn_once(name, "missing", e)
                except Exception as e:  # noqa: BLE001 - a monitor never stops a run
                    _warn_once(name, "to start", e)

    def write_events(self, events) -> None:
        """Write ``(name, value, step)`` events to every writer (rank 0; elsewhere nothing)."""
        for name, writer in self.writers.items():
            try:
                writer.write(events)
            except Exception as e:  # noqa: BLE001 - a monitor never stops a run
                _warn_once(name, "to write", e)

    def write_step(self, engine: Any) -> None:
        """The events of an optimizer step at the accumulation boundary, called by the
        engine after the step (skipped or not) and the loss scale's update."""
        if not self.writers:
            return
        samples = engine.global_samples
        events = [("Train/Samples/lr", engine.get_lr()[0], samples)]
        if engine.fp16_enabled():
            events.append(("Train/Samples/loss_scale", engine.loss_scaler.cur_scale, samples))
        self.write_events(events)
