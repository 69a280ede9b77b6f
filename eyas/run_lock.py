"""One writer per run directory: the stage that writes a run dir's data (prepare, capture,
train) holds an exclusive lock on `run_dir/.eyas.lock` (flock, released by the kernel when
the process ends, however it ends), so a second `eyas train` or `capture` on the same run
is refused instead of deleting the first one's temporary files. Under `accelerate launch` rank 0 holds it for
the whole launch."""

from __future__ import annotations

import os
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no lock, as before
    fcntl = None

LOCK_NAME = ".eyas.lock"
_held: dict[str, int] = {}  # resolved run dir -> the locked file descriptor


class RunDirBusy(RuntimeError):
    """Another eyas process writes this run directory."""


def claim_run_dir(run_dir: str | Path, stage: str) -> None:
    """Lock `run_dir` for this process (a no-op when it already holds it, or on ranks > 0)."""
    if fcntl is None or os.environ.get("RANK", "0") not in ("", "0"):
        return
    key = str(Path(run_dir).resolve())
    if key in _held:
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunDirBusy(f"run dir {run_dir} is in use by {holder}; wait for it to end, or stop it") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"PID {os.getpid()} (eyas {stage}) on {socket.gethostname()}\n".encode(), 0)
    _held[key] = fd


def release_run_dirs() -> None:
    """Drop every lock this process holds (the CLI does at the end of each command)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)
