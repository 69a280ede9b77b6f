"""A serving engine started by eyas from a command line (`vllm serve …`, `python -m
sglang.launch_server …`): run in its own process group with its output in a log file,
waited for until each base URL answers, stopped by process group at the end, so its
workers (tensor/data-parallel ranks) go with it, even when the leader died first; then
the GPUs it used are checked free before training needs them (core/gpu_holders.py).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


class EngineError(RuntimeError):
    """The engine did not start, or died; the message carries its log's tail."""


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def server_root(url: str) -> str:
    """A server URL as eyas appends `/v1/...` to it: `http://host:8000/v1` (the OpenAI
    client's base URL, as vLLM's docs write it) and `http://host:8000/` both give
    `http://host:8000`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def answers(base_url: str, timeout: float = 5.0) -> bool:
    """Whether an OpenAI-compatible server at `base_url` lists its models."""
    try:
        with urllib.request.urlopen(server_root(base_url) + "/v1/models", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def repo_vllm_python() -> Path | None:
    """The Python of the repository's own vLLM install (.venv-vllm, made by
    scripts/setup_vllm_env.sh), None when there is none."""
    python = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    return python if python.is_file() else None


def split_command(command: str, setting: str = "data.regenerate.launch") -> tuple[dict[str, str], list[str]]:
    """Leading `NAME=value` words (`CUDA_VISIBLE_DEVICES=0,1 vllm serve …`, as a shell
    reads them) -> the environment they set, and the argv after them. No shell runs."""
    words = shlex.split(command)
    env = {}
    while words and _ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if not words:
        raise EngineError(f"{setting}: {command!r} names no program to run")
    return env, words


@contextmanager
def launched_engine(
    command: str,
    urls: Sequence[str],
    log_path: Path,
    timeout_s: float = 1800.0,
    poll_s: float = 1.0,
    setting: str = "data.regenerate.launch",
) -> Iterator[subprocess.Popen]:
    """Start `command`, wait until every URL in `urls` answers, yield, then stop it
    (SIGTERM to its process group, SIGKILL after 30 s). `setting` names the recipe key
    the command came from in errors."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    busy = [u for u in urls if answers(u, timeout=2.0)]
    if busy:
        raise EngineError(
            f"{setting}: {busy[0]} already answers before the engine was started; "
            "stop that server or drop `launch` to use it as it is"
        )
    env, argv = split_command(command, setting)
    log.info("starting the engine: %s (log: %s)", command, log_path)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **env},
        )
    try:
        deadline = time.monotonic() + timeout_s
        waiting = list(urls)
        while waiting:
            if proc.poll() is not None:
                raise EngineError(
                    f"the engine exited with code {proc.returncode} before answering "
                    f"({command}); last lines of {log_path}:\n{_log_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise EngineError(
                    f"the engine did not answer at {waiting[0]} within {timeout_s:.0f} s; "
                    f"last lines of {log_path}:\n{_log_tail(log_path)}"
                )
            waiting = [u for u in waiting if not answers(u)]
            if waiting:
                time.sleep(poll_s)
        log.info("engine ready after %.0f s", timeout_s - (deadline - time.monotonic()))
        yield proc
    finally:
        stop_process_group(proc)
    # after a finished regeneration only: an engine that failed is reported as it failed
    from eyas.core.gpu_holders import wait_gpus_free

    wait_gpus_free(env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES")))


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process's group, SIGKILL what is left of it after `grace_s`. The group is
    the leader's pid (started with start_new_session), so it is signalled even when the
    leader has died: its orphaned workers (vLLM's TP/DP ranks) would otherwise keep ~90%
    of every GPU they hold."""
    pgid = proc.pid
    proc.poll()  # reap a dead leader, so only live members are left in the group
    if not _group_alive(pgid):
        return
    _signal_group(pgid, signal.SIGTERM)
    if not _wait_group_gone(proc, pgid, grace_s):
        log.warning("the engine's process group %d outlived SIGTERM by %.0f s: SIGKILL", pgid, grace_s)
        _signal_group(pgid, signal.SIGKILL)
        _wait_group_gone(proc, pgid, grace_s)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in group `pgid`."""
    import psutil

    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False


def _wait_group_gone(proc: subprocess.Popen, pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        proc.poll()
        if not _group_alive(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
