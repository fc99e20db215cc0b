"""``im.init`` and the ``Run`` that training processes log rank metrics through."""

from __future__ import annotations

import atexit
import json
import os
import re
import socket
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

from instantml import limits, settings

if TYPE_CHECKING:
    from instantml.monitor.hooks import Lifecycle
    from instantml.upload.sinks import Sink

DEFAULT_SPOOL_DIR = settings.DEFAULT_SPOOL_DIR
UPLOAD_MODES = ("spool", "offline", "thread", "disabled")
#: Launchers' job ids, in order: every rank of one job sees the same value without coordination.
RUN_ID_VARIABLES = (settings.RUN_ID_ENV, "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
#: Where launchers put each process's place, first found wins: torchrun, accelerate and DeepSpeed set
#: RANK...; Open MPI's mpirun its own, ahead of SLURM's, because a job step started by mpirun inside an
#: sbatch script still sees the batch step's SLURM_PROCID (0 on every rank).
LAUNCHER_VARIABLES = {
    "rank": ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"),
    "world_size": ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"),
    "local_rank": ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"),
}


def resolve_run_id(run_id: str | None = None, environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The run id every rank of one job agrees on (contract 2).

    Explicit argument, else ``INSTANTML_RUN_ID``, else the launcher's job id (``TORCHELASTIC_RUN_ID``,
    ``SLURM_JOB_ID``, ...), else a fresh id for a single-process run.

    >>> resolve_run_id(environ={"SLURM_JOB_ID": "4242"})
    '4242'
    """
    if run_id is not None:
        return limits.check_name("run_id", run_id)
    for name in RUN_ID_VARIABLES:
        value = environ.get(name, "").strip()
        if not value or value.lower() == "none":  # torchrun's default --rdzv-id is "none"
            continue
        if name == settings.RUN_ID_ENV:
            return limits.check_name(name, value)
        # A launcher's id is used as it is, made safe for the contract's name rules.
        return re.sub(r"[^A-Za-z0-9._-]", "-", value).lstrip("._-")[: limits.MAX_NAME_LENGTH] or "job"
    return time.strftime("run-%Y%m%d-%H%M%S-", time.gmtime()) + os.urandom(3).hex()


def launcher_placement(
    environ: dict[str, str] | os._Environ[str] = os.environ,
) -> tuple[int | None, int | None, int | None]:
    """This process's ``(rank, world_size, local_rank)`` as its launcher set them (None: not set).

    >>> launcher_placement({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"})
    (3, 8, 3)
    """
    found: list[int | None] = []
    for argument, names in LAUNCHER_VARIABLES.items():
        value = None
        for name in names:
            text = environ.get(name, "").strip()
            if text:
                if not text.isdigit():
                    raise ValueError(f"{argument}: the launcher's {name}={text!r} is not a whole number >= 0")
                value = int(text)
                break
        found.append(value)
    return found[0], found[1], found[2]


def _missing(argument: str) -> ValueError:
    names = " / ".join(LAUNCHER_VARIABLES[argument])
    return ValueError(f"{argument}: pass {argument}= or launch with a launcher that sets {names}")


def _noop(*args: Any) -> None:
    return None


#: How deep ``config`` may nest (a guard against self-referencing structures).
MAX_CONFIG_DEPTH = 32


def _text(value: str) -> str:
    """``value`` as UTF-8 can carry it. A string with lone surrogates, as a path decoded with
    ``surrogateescape`` holds for bytes that are not UTF-8 (a Trainer's ``output_dir``), shows those
    bytes as ``\\xNN`` escapes, and any other lone surrogate as a ``\\uDNNN`` escape.

    >>> _text("/data/caf\\udce9")
    '/data/caf\\\\xe9'
    """
    if limits.is_utf8_text(value):
        return value
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate outside surrogateescape's range
        return value.encode("utf-8", "backslashreplace").decode()


def _config_value(value: Any, where: str, depth: int) -> Any:
    """``value`` as JSON can carry it: dicts (keys made strings), lists and tuples, str, bool, None,
    integers, finite floats; NaN/Infinity as the strings "NaN"/"Infinity"/"-Infinity" (as metric
    values travel); numpy/torch scalars as numbers; strings UTF-8 cannot encode (lone surrogates)
    with their surrogates escaped (:func:`_text`); anything else converted with ``str()``."""
    if isinstance(value, str):
        return _text(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if value - value == 0.0 else limits.wire_value(value)
    if depth >= MAX_CONFIG_DEPTH:
        raise limits.LimitError("config", f"nests deeper than {MAX_CONFIG_DEPTH} levels at {where}")
    if isinstance(value, dict):
        return {
            _text(k if isinstance(k, str) else str(k)): _config_value(v, f"{where}[{k!r}]", depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_config_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    return _foreign_value(value, where, depth)


def _foreign_value(value: Any, where: str, depth: int) -> Any:
    """A config value of no JSON type: a number if it converts to one (numpy and torch scalars),
    else its ``str()``."""
    if hasattr(value, "__index__"):  # numpy integers
        try:
            return int(value.__index__())
        except (TypeError, ValueError):
            pass
    if hasattr(value, "__float__"):  # numpy floats, 0-d tensors, Decimal
        try:
            return _config_value(float(value), where, depth)
        except (TypeError, ValueError, OverflowError):
            pass
    return _text(str(value))


def check_config(config: object) -> dict[str, Any]:
    """``im.init``'s ``config``, JSON-ready and checked against the 64 KiB limit (as compact JSON).

    Raises :class:`~instantml.limits.LimitError` (a ``ValueError``) naming ``config``.

    >>> check_config({"lr": 1e-3, "betas": (0.9, 0.95), "clip": float("inf"), "act": print})
    {'lr': 0.001, 'betas': [0.9, 0.95], 'clip': 'Infinity', 'act': '<built-in function print>'}
    """
    if not isinstance(config, dict):
        raise limits.LimitError(
            "config", f"must be a dict of hyperparameters (a JSON object), got {type(config).__name__}"
        )
    clean: dict[str, Any] = _config_value(config, "config", 0)
    size = len(json.dumps(clean, allow_nan=False, separators=(",", ":")).encode())
    if size > limits.MAX_CONFIG_BYTES:
        raise limits.LimitError(
            "config",
            f"is {size:,} bytes as compact JSON, more than the limit of {limits.MAX_CONFIG_BYTES:,} bytes "
            "(64 KiB); log large things elsewhere",
        )
    return clean


def _finished(*args: Any) -> None:
    raise RuntimeError("this run is finished; call im.init(...) again to log more")


class Run:
    """One training job's handle in this process. Create it with :func:`instantml.init`.

    Example::

        with im.init(project="distributed-job") as run:
            run.log_rank_metrics({"train/loss": loss}, step=step, rank=rank, world_size=world_size)
    """

    def __init__(
        self,
        project: str,
        run_id: str,
        sink: Sink | None,
        api_url: str | None,
        placement: tuple[int | None, int | None, int | None] = (None, None, None),
        system_metrics: bool = True,
    ) -> None:
        self.project = project
        self.run_id = run_id
        self.api_url = api_url
        #: This process's rank, world size and local rank as its launcher set them (None: not set).
        self.rank, self.world_size, self.local_rank = placement
        self._sink = sink
        self._log = _noop if sink is None else self._first_log
        #: This process's records (contract 8): ``started`` at its first rank event, one ``ended``.
        self._lifecycle: Lifecycle | None = None
        if sink is not None:
            from instantml.monitor.hooks import Lifecycle  # (at init: `import instantml` stays light)

            self._lifecycle = Lifecycle(sink, system_metrics)
        self._log_scalars = _noop if sink is None else sink.log_scalars
        #: run.log's rank: the launcher's, else 0 (a single process).
        self._scalars_rank = 0 if self.rank is None else self.rank
        self._given_rank: int | None = None
        self._next_step = 0
        self._finished = False
        if sink is not None:
            # A process that exits without finish() (sys.exit, the end of a script, an exception outside
            # a `with` block) still sends what it logged, as a with-block left by an exception does; the
            # run is not marked finished. Held weakly: a Run nobody keeps is not kept alive by this.
            atexit.register(_close_at_exit, weakref.ref(self))

    def log_rank_metrics(
        self,
        metrics: dict[str, Any],
        step: int,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        weight: float = 1.0,
    ) -> None:
        """Record one rank's metric batch for one global step.

        ``rank``, ``world_size`` and ``local_rank`` default to what the launcher set (read once, at
        ``im.init``: ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, Open MPI's or SLURM's); an explicit
        argument wins. Checks the contract's limits first and raises ``ValueError`` naming the argument
        at fault. Never blocks on the network and never raises because the server is down or rejecting.

        >>> run.log_rank_metrics({"train/loss": 0.12}, step=100, weight=1024)  # under torchrun
        >>> run.log_rank_metrics({"train/loss": 0.12}, step=100, rank=0, world_size=8, weight=1024)
        """
        if rank is None:
            rank = self.rank
            if rank is None:
                raise _missing("rank")
        elif self.rank is None:
            self._given_rank = rank  # no launcher: the rank this process logs as decides finish()
        if world_size is None:
            world_size = self.world_size
            if world_size is None:
                raise _missing("world_size")
        if local_rank is None and self.local_rank is not None and self.local_rank < world_size:
            local_rank = self.local_rank  # (a world of the caller's own, smaller: no launcher's local rank)
        event = limits.check_rank_event(metrics, step, rank, world_size, local_rank, weight)
        lifecycle = self._lifecycle
        if lifecycle is None:
            return
        lifecycle.step = step  # what the monitor thread watches: one store
        self._log(*event)
        if lifecycle.sample is not None:  # the monitor's latest system sample, logged from this thread
            sample, lifecycle.sample = lifecycle.sample, None
            self._log(sample, event[1], event[2], event[3], event[4], 1.0)

    def _first_log(
        self,
        values: dict[str, float],
        step: int,
        rank: int,
        world_size: int,
        local_rank: int | None,
        weight: float,
    ) -> None:
        """The first rank event: this process's ``started`` record goes first, then every event goes
        straight to the sink."""
        assert self._sink is not None and self._lifecycle is not None
        self._lifecycle.start(rank, world_size, local_rank, step)
        self._log = self._sink.log
        self._log(values, step, rank, world_size, local_rank, weight)

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record the run's ordinary scalars (loss, learning rate, eval scores) for one step.

        Logged from one rank by convention (rank 0); other ranks' calls are kept apart by rank (this
        process's launcher rank, else 0). ``step`` defaults to one more than the step of this run's
        previous ``log`` call (0 for the first). The same limits as ``log_rank_metrics`` (``ValueError``
        naming ``metrics`` or ``step``), the same sinks and event ids; never blocks on the network.

        >>> run.log({"train/loss": 0.12, "lr": 3e-4})  # step 0, then 1, ...
        >>> run.log({"eval/acc": 0.91}, step=1000)
        """
        if step is None:
            step = self._next_step
        values, step = limits.check_scalars(metrics, step)
        rank = self._scalars_rank
        if rank >= limits.MAX_WORLD_SIZE:
            raise limits.LimitError(
                "rank",
                f"run.log keeps ranks 0-{limits.MAX_WORLD_SIZE - 1} apart; this process is rank {rank}",
            )
        self._next_step = step + 1
        self._log_scalars(values, step, rank)

    def set_config(self, config: dict[str, Any]) -> None:
        """Record ``config`` as the run's config, replacing any earlier one (from ``im.init(config=...)``
        or an earlier call): the same checks and conversions as ``im.init``'s ``config`` (``ValueError``
        naming ``config``), sent through the same sink, in order with the events. For configs known only
        after ``init``, as a trainer's hyperparameters are. Never blocks on the network.

        >>> run.set_config({"lr": 3e-4, "batch_size": 32})
        """
        update = {"config": check_config(config), "time": time.time()}
        if self._finished:
            _finished()
        if self._sink is not None:
            self._sink.update_run(update)

    def finish(self, timeout: float = 30.0) -> None:
        """Close the run. On rank 0 (the launcher's, else the rank this process logged as; or a single
        process that never said), mark the run finished on
        the server, after everything logged. In the online modes, wait at most ``timeout`` seconds for
        what this process logged to reach the server, and say plainly what is still pending; in offline
        mode, say where the events are and the ``instantml sync`` command that sends them (on stderr
        unless logging is configured: the ``instantml`` logger, WARNING). Never raises because of the
        network."""
        self._close(timeout, mark_finished=True)

    def _close(
        self,
        timeout: float,
        mark_finished: bool,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        if self._finished:
            return
        self._finished = True
        self._log = self._log_scalars = _finished
        if self._lifecycle is not None:
            if exc is not None:
                self._lifecycle.end_by(exc, tb)
            elif mark_finished:
                self._lifecycle.end_how("finished")
            else:  # the interpreter is exiting without finish(): its code is not known here
                self._lifecycle.end_how("exit", code=None)
        if self._sink is not None:
            rank = self.rank if self.rank is not None else self._given_rank
            if mark_finished and not rank:  # rank 0, or a process that never said its rank
                self._sink.update_run({"status": "finished", "time": time.time()})
            self._sink.close(timeout)

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # A block left by an exception closes the run without marking it finished: a crashed job
        # shows as idle, not as finished.
        self._close(30.0, mark_finished=exc_type is None, exc=exc, tb=tb)


#: How long a process exiting without finish() waits for what it logged to be sent.
EXIT_FLUSH_S = 10.0


def _close_at_exit(ref: weakref.ref[Run]) -> None:
    run = ref()
    if run is not None:
        run._close(EXIT_FLUSH_S, mark_finished=False)


def init(
    project: str,
    run_id: str | None = None,
    upload_mode: str = "thread",
    spool_dir: str | os.PathLike[str] | None = None,
    api_url: str | None = None,
    api_key: str | None = None,
    batch_size: int = 500,
    fsync: bool = False,
    config: dict[str, Any] | None = None,
    system_metrics: bool = True,
) -> Run:
    """Start (or join, from another rank) a run of ``project``.

    ``api_url`` and ``api_key`` default to ``INSTANTML_API_URL`` and ``INSTANTML_API_KEY``, ``spool_dir``
    to ``INSTANTML_SPOOL_DIR``, else ``.instantml/spool``. Modes:

    - ``"spool"``: this process only appends to its own file in ``spool_dir`` (``fsync=True`` syncs
      every line); a separate uploader process, started here unless one already serves that spool,
      sends the events. No HTTP call happens in this process.
    - ``"offline"``: spool only; ``instantml sync SPOOL_DIR`` uploads later.
    - ``"thread"``: a background thread of this process uploads (same event ids and retry rules).
    - ``"disabled"``: every call is a cheap no-op (the limits are still checked).

    ``system_metrics`` (on unless ``False``): every ``INSTANTML_SYSTEM_INTERVAL_S`` (10 s) this process's
    memory, CPU and, where it uses a GPU through torch, GPU memory (and with ``nvidia-ml-py`` utilisation,
    power and temperature) are logged as ``system/...`` rank metrics at its latest step, from a thread
    of their own (``instantml.monitor.system`` lists them).

    ``config`` (a dict of hyperparameters, at most 64 KiB as compact JSON) is recorded as the run's
    config, sent through the same sink as the events. Values JSON cannot carry are converted: tuples
    to lists, numpy/torch scalars to numbers, NaN/Infinity to the strings "NaN"/"Infinity"/
    "-Infinity", strings UTF-8 cannot encode (lone surrogates, as in a path decoded with
    ``surrogateescape``) with those characters escaped, anything else with ``str()``. ``run.finish()``
    on rank 0 marks the run finished.

    A spool directory that cannot take events (not writable, nearly full) raises
    :class:`~instantml.upload.spool_writer.SpoolError` here, not in the middle of training.

    >>> run = im.init(project="distributed-job", upload_mode="spool")
    >>> run.run_id  # the same in every rank: from TORCHELASTIC_RUN_ID, SLURM_JOB_ID, ...
    """
    limits.check_name("project", project)
    resolved = resolve_run_id(run_id)
    placement = launcher_placement()
    if upload_mode not in UPLOAD_MODES:
        raise ValueError(f"upload_mode: must be one of {', '.join(UPLOAD_MODES)}, got {upload_mode!r}")
    update = None if config is None else {"config": check_config(config), "time": time.time()}
    if upload_mode == "disabled":
        return Run(project, resolved, None, None, placement)
    url = (api_url or os.environ.get(settings.API_URL_ENV) or "").rstrip("/")
    key = api_key or os.environ.get(settings.API_KEY_ENV) or ""
    if upload_mode != "offline":
        if not url.startswith(("http://", "https://")):
            raise ValueError("api_url: pass api_url= or set INSTANTML_API_URL to the API's http(s) URL")
        if not key:
            raise ValueError("api_key: pass api_key= or set INSTANTML_API_KEY to the project's API token")
    if upload_mode in ("spool", "offline"):
        from instantml.upload.sinks import SpoolSink

        directory = spool_dir or os.environ.get(settings.SPOOL_DIR_ENV) or DEFAULT_SPOOL_DIR
        sink: Sink = SpoolSink(
            directory, project, resolved, url, key if upload_mode == "spool" else None, fsync
        )
        api: str | None = url or None
    else:
        from instantml.upload.uploader import ThreadUploader

        sink, api = ThreadUploader(url, key, project, resolved, batch_size, placement[1]), url
    from instantml.monitor import hooks

    hooks.install()
    if update is not None:
        sink.update_run(update)
    host = _host_update(placement[0])
    if host is not None:
        sink.update_run(host)
    return Run(project, resolved, sink, api, placement, system_metrics)


def _host_update(rank: int | None) -> dict[str, Any] | None:
    """The run update that says which host this process's rank runs on (once, at ``init``: a finding
    about the rank then names its host), or None when the launcher set no rank or the name cannot be
    sent. Sent on its own, not with the config: a server that predates ``hosts`` refuses only it."""
    if rank is None or not 0 <= rank < limits.MAX_WORLD_SIZE:
        return None
    host = socket.gethostname()
    if not limits.is_valid_host(host):
        return None
    return {"hosts": {str(rank): host}, "time": time.time()}
