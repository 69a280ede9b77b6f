"""Which processes still hold GPU memory, and a wait for the GPUs an engine used to be
free again: training after regeneration needs the memory the engine's workers held, and
a worker left behind would make the first step run out of memory. Read from `nvidia-smi`
(names the PIDs); without it, from torch.cuda's free-memory query (cannot name them)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time

log = logging.getLogger(__name__)
# Memory a GPU may show in use with nothing of ours on it (the driver's own, a display).
IDLE_USED_MB = 1024


class GpusBusyError(RuntimeError):
    """GPUs an engine used are still held after it stopped; names the PIDs."""


def _smi(query: str, what: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}={what}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_holders(devices: str | None = None) -> dict[int, list[tuple[int, int]]] | None:
    """GPU index -> [(pid, MiB)] of the compute processes on it, for `devices` (a
    CUDA_VISIBLE_DEVICES string of indices; None: every GPU). None when no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        index = {uuid: int(i) for i, uuid in _smi("gpu", "index,uuid")}
        apps = _smi("compute-apps", "pid,gpu_uuid,used_memory")
    except (subprocess.SubprocessError, OSError, ValueError) as err:
        log.warning("nvidia-smi could not be read (%s); not checking that the GPUs are free", err)
        return None
    wanted = {int(d) for d in devices.split(",") if d.strip().isdigit()} if devices else set(index.values())
    held: dict[int, list[tuple[int, int]]] = {}
    for pid, uuid, mib in apps:
        gpu = index.get(uuid)
        if gpu in wanted and pid.isdigit():
            held.setdefault(gpu, []).append((int(pid), int(float(mib or 0))))
    return held


def _torch_busy() -> list[str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        busy = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            if (total - free) / 2**20 > IDLE_USED_MB:
                busy.append(f"GPU {i}: {(total - free) / 2**30:.1f} GiB in use")
        return busy
    except Exception:  # a broken CUDA setup is the training's to report
        return []


def wait_gpus_free(devices: str | None = None, timeout_s: float = 60.0, poll_s: float = 1.0) -> None:
    """Wait until no process holds memory on `devices` (the engine's workers release it as
    they exit); raise GpusBusyError naming the PIDs still there after `timeout_s`. Nothing
    to check on a machine without GPUs."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = gpu_holders(devices)
        if held is None:
            busy = _torch_busy()
            if busy and time.monotonic() > deadline:
                log.warning("the GPUs still show memory in use after the engine stopped: %s", "; ".join(busy))
            if not busy or time.monotonic() > deadline:
                return
        elif not held:
            return
        elif time.monotonic() > deadline:
            pids = "; ".join(
                f"GPU {gpu}: " + ", ".join(f"PID {pid} ({mib} MiB)" for pid, mib in procs)
                for gpu, procs in sorted(held.items())
            )
            raise GpusBusyError(
                f"the engine has stopped but its GPUs are still held: {pids}. Stop those processes, "
                "then rerun (the regenerated replies are kept)"
            )
        time.sleep(poll_s)
