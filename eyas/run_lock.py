"""One writer per run directory: the stage that writes a run dir's data (prepare, capture,
train) holds an exclusive lock on `run_dir/.eyas.lock` (flock, released by the kernel when
the process ends, however it ends), so a second `eyas train` or `capture` on the same run
is refused instead of deleting the first one's temporary files. Under `accelerate launch` rank 0 holds it for
the whole launch.

Where the file system has no flock (Lustre mounted without `-o flock`, NFS with `nolock`:
ENOLCK, ENOSYS, EOPNOTSUPP), the lock is a file created exclusively,
`run_dir/.eyas.lock.owner`, holding PID, host and stage, removed when the process lets go.
Nothing releases it if the process is killed, so a stale one is taken over when it names
this host and a PID no longer running; one naming another host is refused, naming the file
to delete once that host's run is known to be gone.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no lock, as before
    fcntl = None

log = logging.getLogger(__name__)
LOCK_NAME = ".eyas.lock"
OWNER_NAME = ".eyas.lock.owner"  # the lock where flock is unsupported
NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_held: dict[str, int] = {}  # resolved run dir -> the locked file descriptor
_owned: dict[str, Path] = {}  # resolved run dir -> the lock file this process created


class RunDirBusy(RuntimeError):
    """Another eyas process writes this run directory."""


def _holder_line(stage: str) -> str:
    return f"PID {os.getpid()} (eyas {stage}) on {socket.gethostname()}\n"


def claim_run_dir(run_dir: str | Path, stage: str) -> None:
    """Lock `run_dir` for this process (a no-op when it already holds it, or on ranks > 0)."""
    if fcntl is None or os.environ.get("RANK", "0") not in ("", "0"):
        return
    key = str(Path(run_dir).resolve())
    if key in _held or key in _owned:
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunDirBusy(f"run dir {run_dir} is in use by {holder}; wait for it to end, or stop it") from None
    except OSError as err:
        os.close(fd)
        if err.errno not in NO_FLOCK:
            raise
        log.warning(
            "%s: the file system does not support flock (%s); locking with an exclusive-create file "
            "instead (a killed run's lock is taken over on this host, named for deletion on another)",
            run_dir,
            errno.errorcode.get(err.errno, err.errno),
        )
        _owned[key] = _claim_by_file(Path(run_dir), stage)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, _holder_line(stage).encode(), 0)
    _held[key] = fd


def _claim_by_file(run_dir: Path, stage: str) -> Path:
    path = run_dir / OWNER_NAME
    for _ in range(2):  # a stale file is removed once, then created again
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read(path)
            if not _is_stale(holder):
                where = (
                    "" if _host_of(holder) == socket.gethostname() else f"; once it is gone, delete {path}"
                )
                raise RunDirBusy(
                    f"run dir {run_dir} is in use by {holder or 'another process'}{where}"
                ) from None
            log.warning("%s: taking over the lock of %s, which is no longer running", run_dir, holder)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(_holder_line(stage))
        return path
    raise RunDirBusy(f"run dir {run_dir}: another process took its lock file {path} at the same time")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _host_of(holder: str) -> str:
    return holder.rsplit(" on ", 1)[-1] if " on " in holder else ""


def _is_stale(holder: str) -> bool:
    """A lock naming this host and a PID that no longer runs (an empty or unreadable file is
    a writer caught between create and write: not stale)."""
    if _host_of(holder) != socket.gethostname():
        return False
    try:
        pid = int(holder.split()[1])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def release_run_dirs() -> None:
    """Drop every lock this process holds (the CLI does at the end of each command)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)
    while _owned:
        _, path = _owned.popitem()
        path.unlink(missing_ok=True)
