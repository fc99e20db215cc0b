"""``im.init`` and the ``Run`` that training processes log rank metrics through."""

from __future__ import annotations

import os
import re
import time
from types import TracebackType
from typing import Any, Protocol

from instantml import limits

DEFAULT_SPOOL_DIR = ".instantml/spool"
UPLOAD_MODES = ("spool", "offline", "thread", "disabled")
#: Launchers' job ids, in order: every rank of one job sees the same value without coordination.
RUN_ID_VARIABLES = ("INSTANTML_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
#: Where launchers put each process's place, first found wins: torchrun, accelerate and DeepSpeed set
#: RANK...; Open MPI's mpirun its own, ahead of SLURM's, because a job step started by mpirun inside an
#: sbatch script still sees the batch step's SLURM_PROCID (0 on every rank).
LAUNCHER_VARIABLES = {
    "rank": ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"),
    "world_size": ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"),
    "local_rank": ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"),
}


class Sink(Protocol):
    """Where a run's checked events go: this process's spool file, or the in-process uploader."""

    def log(
        self,
        values: dict[str, float],
        step: int,
        rank: int,
        world_size: int,
        local_rank: int | None,
        weight: float,
    ) -> None: ...

    def close(self, timeout: float) -> None: ...


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
        if name == "INSTANTML_RUN_ID":
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
    ) -> None:
        self.project = project
        self.run_id = run_id
        self.api_url = api_url
        #: This process's rank, world size and local rank as its launcher set them (None: not set).
        self.rank, self.world_size, self.local_rank = placement
        self._sink = sink
        self._log = _noop if sink is None else sink.log
        self._finished = False

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
        if world_size is None:
            world_size = self.world_size
            if world_size is None:
                raise _missing("world_size")
        if local_rank is None and self.local_rank is not None and self.local_rank < world_size:
            local_rank = self.local_rank  # (a world of the caller's own, smaller: no launcher's local rank)
        self._log(*limits.check_rank_event(metrics, step, rank, world_size, local_rank, weight))

    def finish(self, timeout: float = 30.0) -> None:
        """Close the run. In the online modes, wait at most ``timeout`` seconds for what this process
        logged to reach the server, and say plainly what is still pending. Never raises because of
        the network."""
        if self._finished:
            return
        self._finished = True
        self._log = _finished
        if self._sink is not None:
            self._sink.close(timeout)

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish()


def init(
    project: str,
    run_id: str | None = None,
    upload_mode: str = "thread",
    spool_dir: str | os.PathLike[str] | None = None,
    api_url: str | None = None,
    api_key: str | None = None,
    batch_size: int = 500,
    fsync: bool = False,
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

    A spool directory that cannot take events (not writable, nearly full) raises
    :class:`~instantml.spool.SpoolError` here, not in the middle of training.

    >>> run = im.init(project="distributed-job", upload_mode="spool")
    >>> run.run_id  # the same in every rank: from TORCHELASTIC_RUN_ID, SLURM_JOB_ID, ...
    """
    limits.check_name("project", project)
    resolved = resolve_run_id(run_id)
    placement = launcher_placement()
    if upload_mode not in UPLOAD_MODES:
        raise ValueError(f"upload_mode: must be one of {', '.join(UPLOAD_MODES)}, got {upload_mode!r}")
    if upload_mode == "disabled":
        return Run(project, resolved, None, None, placement)
    url = (api_url or os.environ.get("INSTANTML_API_URL") or "").rstrip("/")
    key = api_key or os.environ.get("INSTANTML_API_KEY") or ""
    if upload_mode != "offline":
        if not url.startswith(("http://", "https://")):
            raise ValueError("api_url: pass api_url= or set INSTANTML_API_URL to the API's http(s) URL")
        if not key:
            raise ValueError("api_key: pass api_key= or set INSTANTML_API_KEY to the project's API token")
    if upload_mode in ("spool", "offline"):
        from instantml.spool import SpoolSink

        directory = spool_dir or os.environ.get("INSTANTML_SPOOL_DIR") or DEFAULT_SPOOL_DIR
        sink = SpoolSink(directory, project, resolved, url, key if upload_mode == "spool" else None, fsync)
        return Run(project, resolved, sink, url or None, placement)
    from instantml.uploader import ThreadUploader

    return Run(project, resolved, ThreadUploader(url, key, project, resolved, batch_size), url, placement)
