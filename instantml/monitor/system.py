"""System metrics per rank (contract 2): what this process holds and uses, sampled on the monitor thread
and logged as rank metrics at the process's latest step.

Each figure comes from the cheapest source that gives it exactly, and a figure the machine cannot give
is left out, never sent as zero:

- ``system/rss_mb``: the process's resident memory, from ``/proc/self/statm`` on Linux (one small read);
  elsewhere from psutil when it is installed (``pip install instantml[system]``).
- ``system/cpu_percent``: the process's CPU time (every thread, ``time.process_time``) over the wall
  time since the last sample, in percent of one core (8 busy cores: 800).
- ``system/memory_limit_mb``: what this process's memory can reach: the cgroup's ``memory.max`` (v2, or
  v1's ``memory.limit_in_bytes``) where it is set, else the machine's ``MemTotal``. The findings forecast
  a growing memory against it.
- Where the process uses a GPU through torch and has already initialised CUDA (sampling never does it:
  ``torch.cuda.is_initialized()`` decides), the memory torch holds on its current device:
  ``system/gpu_memory_mb`` (allocated by tensors), ``system/gpu_memory_reserved_mb`` (held by torch's
  caching allocator), ``system/gpu_memory_peak_mb`` (the most allocated since the start or torch's last
  reset), and ``system/gpu_memory_total_mb``, the device's.
- With NVML (``nvidia-ml-py``, the ``pynvml`` module), for that same device, found through
  ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs): ``system/gpu_util_percent``, ``system/gpu_power_w``,
  ``system/gpu_temp_c``.

Megabytes are MiB (2^20 bytes), as ``nvidia-smi`` and torch's memory summary count them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from instantml import settings

MIB = float(1 << 20)
#: Every key a sample may hold (the server's findings judge these, and only these, as system metrics).
KEYS = (
    "system/rss_mb",
    "system/cpu_percent",
    "system/memory_limit_mb",
    "system/gpu_memory_mb",
    "system/gpu_memory_reserved_mb",
    "system/gpu_memory_peak_mb",
    "system/gpu_memory_total_mb",
    "system/gpu_util_percent",
    "system/gpu_power_w",
    "system/gpu_temp_c",
)
#: A cgroup limit at or above this is "no limit" (cgroup v1 writes 2^63 rounded down to a page).
_NO_LIMIT = 1 << 60


def interval_s() -> float | None:
    """Seconds between samples (``INSTANTML_SYSTEM_INTERVAL_S``, default 10); None: sampling is off
    (``0``)."""
    raw = os.environ.get(settings.SYSTEM_INTERVAL_ENV)
    try:
        every = settings.DEFAULT_SYSTEM_INTERVAL_S if raw is None else float(raw)
    except ValueError:
        every = settings.DEFAULT_SYSTEM_INTERVAL_S
    return None if every <= 0 else max(0.1, every)


class Sampler:
    """One process's system figures, one :meth:`sample` at a time (from one thread: the monitor's)."""

    def __init__(self, local_rank: int | None = None) -> None:
        self.local_rank = local_rank
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._statm = "/proc/self/statm" if os.path.exists("/proc/self/statm") else None
        self._psutil: Any = None
        if self._statm is None:
            try:
                import psutil

                self._psutil = psutil.Process()
            except Exception:  # noqa: BLE001 - (absent or refused: no RSS, as the contract says)
                self._psutil = None
        self._limit_mb = memory_limit_mb()
        self._cpu, self._wall = time.process_time(), time.monotonic()
        self._nvml: Any = None  # the device's NVML handle, once found; False: none to be had
        self._gpu_total: float | None = None

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        rss = self._rss_bytes()
        if rss is not None:
            out["system/rss_mb"] = rss / MIB
        cpu, wall = time.process_time(), time.monotonic()
        if wall > self._wall:
            out["system/cpu_percent"] = 100.0 * (cpu - self._cpu) / (wall - self._wall)
        self._cpu, self._wall = cpu, wall
        if self._limit_mb is not None:
            out["system/memory_limit_mb"] = self._limit_mb
        self._gpu(out)
        return out

    def _rss_bytes(self) -> int | None:
        if self._statm is not None:
            try:
                with open(self._statm, "rb") as f:
                    return int(f.read().split()[1]) * self._page
            except (OSError, ValueError, IndexError):
                return None
        if self._psutil is not None:
            try:
                return int(self._psutil.memory_info().rss)
            except Exception:  # noqa: BLE001 - (the process table refused: absent this time)
                return None
        return None

    def _gpu(self, out: dict[str, float]) -> None:
        """torch's figures for its current device, and NVML's for the same device, when this process
        has initialised CUDA itself (a process that never touched the GPU has none of them)."""
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        try:
            if cuda is None or not cuda.is_initialized():
                return
            device = self._device(cuda)
            out["system/gpu_memory_mb"] = cuda.memory_allocated(device) / MIB
            out["system/gpu_memory_reserved_mb"] = cuda.memory_reserved(device) / MIB
            out["system/gpu_memory_peak_mb"] = cuda.max_memory_allocated(device) / MIB
            if self._gpu_total is None:
                self._gpu_total = cuda.get_device_properties(device).total_memory / MIB
            out["system/gpu_memory_total_mb"] = self._gpu_total
        except Exception:  # noqa: BLE001 - (a torch without these, a device gone: what was read stays)
            return
        handle = self._nvml_handle(device)
        if handle:
            nvml(handle, out)

    def _device(self, cuda: Any) -> int:
        """The device this process's tensors are on: the one where torch holds the most memory (the
        current device is the calling thread's, and this is the monitor's thread), else the local rank's."""
        count = int(cuda.device_count())
        preferred = (self.local_rank or 0) % max(1, count)
        held = {d: cuda.memory_reserved(d) for d in range(count)}
        return max(held, key=lambda d: (held[d], d == preferred), default=preferred)

    def _nvml_handle(self, device: int) -> Any:
        if self._nvml is None:
            self._nvml = nvml_handle(device, os.environ.get("CUDA_VISIBLE_DEVICES")) or False
        return self._nvml


def nvml_handle(device: int, visible: str | None) -> Any:
    """NVML's handle of torch's device ``device`` (an index among ``CUDA_VISIBLE_DEVICES``, whose entries
    are indices or UUIDs), or None (no NVML, no such device)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else None
        if entries is None:
            return pynvml.nvmlDeviceGetHandleByIndex(device)
        if device >= len(entries):
            return None
        entry = entries[device]
        if entry.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    except Exception:  # noqa: BLE001 - (no pynvml, no driver, a MIG name NVML does not take)
        return None


def nvml(handle: Any, out: dict[str, float]) -> None:
    """NVML's utilisation, power and temperature of the device, each left out if NVML refuses it."""
    import pynvml

    reads: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("system/gpu_util_percent", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        ("system/gpu_power_w", lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
        ("system/gpu_temp_c", lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
    )
    for key, read in reads:
        try:
            out[key] = float(read())
        except Exception:  # noqa: BLE001, S112 - (not supported on this device: absent)
            continue


def memory_limit_mb(root: str = "/sys/fs/cgroup", proc: str = "/proc") -> float | None:
    """The cgroup's memory limit of this process where one is set, else the machine's memory (MiB);
    None where neither can be read."""
    for path in _cgroup_limit_files(root, proc):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _NO_LIMIT:
            return int(text) / MIB
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / MIB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_limit_files(root: str, proc: str) -> list[str]:
    """The limit files of this process's cgroup (v2's ``memory.max``, v1's ``memory.limit_in_bytes``),
    from ``/proc/self/cgroup``, then the root's."""
    files = []
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    files.append(os.path.join(root, path.lstrip("/"), "memory.max"))
                elif "memory" in controllers.split(","):
                    files.append(os.path.join(root, "memory", path.lstrip("/"), "memory.limit_in_bytes"))
    except (OSError, ValueError):
        pass
    files += [os.path.join(root, "memory.max"), os.path.join(root, "memory", "memory.limit_in_bytes")]
    return files
