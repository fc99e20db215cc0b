"""System metrics per rank (contract 2, ``instantml.monitor.system``): real processes sample themselves on
the monitor thread and log at their latest step; the torch and NVML paths with fakes, labelled so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest

from instantml.monitor import system

#: A training script: STEPS steps 20 ms apart, each keeping 2 MiB more (a leak), then silent for SILENT
#: seconds (the main thread stuck), then finished.
JOB = textwrap.dedent(
    """
    import os, sys, time
    import instantml as im

    run = im.init(project="p", run_id="r", upload_mode="offline",
                  system_metrics=os.environ.get("SYSTEM") != "off")
    kept = []
    for step in range(int(os.environ["STEPS"])):
        kept.append(bytearray(2 << 20))
        run.log_rank_metrics({"loss": float(step)}, step=step, rank=1, world_size=2)
        time.sleep(0.02)
    time.sleep(float(os.environ.get("SILENT", "0")))
    run.finish()
    """
)


def _job(tmp_path: Path, **env: str) -> list[dict[str, Any]]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    environ = {**os.environ, "INSTANTML_SPOOL_DIR": str(tmp_path / "spool"), **env}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        environ.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(script)], env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    bodies = []
    for path in sorted((tmp_path / "spool").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["path"].endswith("/rank-metrics"):
                bodies.append(event["body"])
    return bodies


def test_a_process_samples_itself_at_its_latest_steps_and_not_while_it_is_silent(tmp_path: Path) -> None:
    bodies = _job(tmp_path, STEPS="60", SILENT="1.5", INSTANTML_SYSTEM_INTERVAL_S="0.2")
    samples = [b for b in bodies if "system/rss_mb" in b["metrics"]]
    trained = {b["step"] for b in bodies if "loss" in b["metrics"]}
    assert len(samples) >= 3, samples
    assert all(set(b["metrics"]).isdisjoint({"loss"}) for b in samples)  # an event of its own
    steps = [b["step"] for b in samples]
    assert steps == sorted(set(steps)) and set(steps) <= trained  # one sample a step at most, at its steps
    # 1.5 s of silence at the last step held at most the one sample of that step: a stuck process does
    # not look alive by its samples.
    assert steps.count(max(trained)) <= 1
    assert all(b["rank"] == 1 and b["world_size"] == 2 and b["weight"] == 1.0 for b in samples)
    first, last = samples[0]["metrics"], samples[-1]["metrics"]
    grown = last["system/rss_mb"] - first["system/rss_mb"]
    expected = 2.0 * (samples[-1]["step"] - samples[0]["step"])  # 2 MiB kept a step
    assert 0.8 * expected <= grown <= 1.3 * expected + 8, (grown, expected)
    assert all(0.0 <= b["metrics"]["system/cpu_percent"] < 400.0 for b in samples)
    assert last["system/memory_limit_mb"] > 0
    assert not any(k.startswith("system/gpu") for b in samples for k in b["metrics"])  # no GPU: absent


def test_system_metrics_false_turns_sampling_off(tmp_path: Path) -> None:
    bodies = _job(tmp_path, STEPS="30", SYSTEM="off", INSTANTML_SYSTEM_INTERVAL_S="0.1")
    assert bodies and not any(k.startswith("system/") for b in bodies for k in b["metrics"])


def test_rss_and_cpu_match_what_the_kernel_says() -> None:
    wall, cpu = time.monotonic(), time.process_time()
    sampler = system.Sampler()
    started = time.process_time()
    while time.process_time() - started < 0.3:  # busy: about one core, less on a loaded machine
        pass
    values = sampler.sample()
    # the share of a core this process had over the sampler's interval, as measured around it
    had = 100 * (time.process_time() - cpu) / (time.monotonic() - wall)
    with open("/proc/self/status") as f:
        vm_rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    assert abs(values["system/rss_mb"] - vm_rss) < 8, (values, vm_rss)
    assert values["system/cpu_percent"] > 5 and abs(values["system/cpu_percent"] - had) < 15, (values, had)


def test_the_memory_limit_is_the_cgroups_where_set_else_the_machines(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       32768000 kB\nMemFree: 1 kB\n")
    (proc / "self" / "cgroup").write_text("0::/job.slice/rank1\n")
    (cgroup / "job.slice" / "rank1").mkdir(parents=True)
    limit = cgroup / "job.slice" / "rank1" / "memory.max"
    limit.write_text("max\n")
    assert system.memory_limit_mb(str(cgroup), str(proc)) == 32768000 / 1024
    limit.write_text(f"{8 << 30}\n")
    assert system.memory_limit_mb(str(cgroup), str(proc)) == 8192.0
    (proc / "self" / "cgroup").write_text("4:memory:/slurm/job_7\n3:cpu:/slurm/job_7\n")
    (cgroup / "memory" / "slurm" / "job_7").mkdir(parents=True)
    (cgroup / "memory" / "slurm" / "job_7" / "memory.limit_in_bytes").write_text(f"{(1 << 63) - 4096}\n")
    assert system.memory_limit_mb(str(cgroup), str(proc)) == 32768000 / 1024  # v1's "no limit"
    (cgroup / "memory" / "slurm" / "job_7" / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    assert system.memory_limit_mb(str(cgroup), str(proc)) == 4096.0


class FakeCuda:
    """A FAKE of ``torch.cuda`` (no GPU here): two devices, torch holding memory on device 1."""

    def __init__(self, initialized: bool) -> None:
        self.initialized = initialized
        self.calls: list[str] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return 2

    def memory_reserved(self, d: int) -> int:
        return [0, 6 << 30][d]

    def memory_allocated(self, d: int) -> int:
        assert d == 1, "read from the device the tensors are on"
        return 5 << 30

    def max_memory_allocated(self, d: int) -> int:
        return 5632 << 20

    def get_device_properties(self, d: int) -> Any:
        return types.SimpleNamespace(total_memory=80 << 30)

    def current_device(self) -> int:
        raise AssertionError("the monitor thread's current device is not the process's")


class FakeNvml(types.ModuleType):
    """A FAKE of ``pynvml`` (nvidia-ml-py): physical GPUs 0-3, one UUID; GPU 1's utilisation refused."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"gpu{i}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return {"GPU-abc": "gpu3"}[uuid]

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        if h == "gpu1":
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return types.SimpleNamespace(gpu={"gpu0": 10, "gpu3": 55}[h])

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return 312_500

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:
        return 71


@pytest.mark.parametrize(
    ("visible", "gpu", "util"),
    [(None, "gpu1", None), ("2,0", "gpu0", 10.0), ("3,GPU-abc", "gpu3", 55.0), ("0", None, None)],
    ids=["all-visible", "indices", "uuid", "not-visible"],
)
def test_gpu_figures_come_from_torchs_device_and_nvmls_same_device(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, gpu: str | None, util: float | None
) -> None:
    """With the FAKE torch and NVML: the device torch holds memory on (1), mapped through
    CUDA_VISIBLE_DEVICES to NVML's device; a figure NVML refuses is absent, never zero."""
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=FakeCuda(True)))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    sampler = system.Sampler(local_rank=1)
    values = sampler.sample()
    assert values["system/gpu_memory_mb"] == 5120.0
    assert values["system/gpu_memory_reserved_mb"] == 6144.0
    assert values["system/gpu_memory_peak_mb"] == 5632.0
    assert values["system/gpu_memory_total_mb"] == 81920.0
    if gpu is None:  # torch's device 1 is not among the one visible device: no NVML figures
        assert not any(k in values for k in ("system/gpu_util_percent", "system/gpu_temp_c"))
        return
    assert values.get("system/gpu_util_percent") == util  # (the fake refuses gpu1's: absent, not 0)
    assert values["system/gpu_power_w"] == 312.5 and values["system/gpu_temp_c"] == 71.0
    sampler.sample()
    assert nvml.inits == 1  # the handle is found once


def test_a_process_that_never_initialised_cuda_has_no_gpu_figures_and_cuda_stays_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = FakeCuda(False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    values = system.Sampler().sample()
    assert not any(k.startswith("system/gpu") for k in values)
    assert set(values) <= set(system.KEYS)
