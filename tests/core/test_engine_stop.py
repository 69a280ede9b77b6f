"""An engine eyas launched is stopped with its whole process tree, even when its leader
died first (a real process tree), and the GPUs it used are checked free afterwards (a
fake nvidia-smi on PATH)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from eyas.core.engine_process import EngineError, launched_engine, stop_process_group
from eyas.core.gpu_holders import GpusBusyError, gpu_holders, wait_gpus_free

# A leader that starts a worker in its own process group, writes the worker's pid, and
# then exits (or sleeps until killed), as vLLM's API server and its engine cores.
LEADER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(worker.pid))
if sys.argv[2] == "exit":
    sys.exit(3)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _worker_pid(path, timeout=30.0) -> int:
    deadline = time.monotonic() + timeout
    while not (path.is_file() and path.read_text()):
        assert time.monotonic() < deadline, "the leader never started its worker"
        time.sleep(0.05)
    return int(path.read_text())


def test_orphaned_workers_die_with_the_engine_whose_leader_exited(tmp_path):
    (tmp_path / "leader.py").write_text(LEADER)
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(EngineError, match="exited with code 3"):
        with launched_engine(
            f"{sys.executable} {tmp_path / 'leader.py'} {pid_file} exit",
            ["http://127.0.0.1:9"],
            tmp_path / "engine.log",
            timeout_s=60,
            poll_s=0.05,
        ):
            pass
    worker = _worker_pid(pid_file)
    assert not _alive(worker)


def test_a_killed_leaders_workers_are_stopped(tmp_path):
    (tmp_path / "leader.py").write_text(LEADER)
    pid_file = tmp_path / "worker.pid"
    leader = subprocess.Popen(
        [sys.executable, str(tmp_path / "leader.py"), str(pid_file), "sleep"], start_new_session=True
    )
    worker = _worker_pid(pid_file)
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait(timeout=30)
    assert _alive(worker)  # orphaned, still holding what it held
    stop_process_group(leader, grace_s=10)
    assert not _alive(worker)


FAKE_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*) printf '0, GPU-aaa\\n1, GPU-bbb\\n' ;;
  --query-compute-apps=*) printf '4242, GPU-aaa, 70000\\n' ;;
esac
"""


def test_gpus_still_held_after_the_engine_are_named_with_their_pids(tmp_path, monkeypatch):
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    assert gpu_holders() == {0: [(4242, 70000)]}
    with pytest.raises(GpusBusyError, match=r"GPU 0: PID 4242 \(70000 MiB\)"):
        wait_gpus_free("0,1", timeout_s=0.2, poll_s=0.05)
    wait_gpus_free("1", timeout_s=0.2, poll_s=0.05)  # the engine's GPU 1 is free: no error
