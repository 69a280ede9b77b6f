"""The run-dir lock where the file system has no flock (simulated ENOLCK): an
exclusive-create file naming PID and host, a stale one taken over, a live one refused."""

import errno
import os
import socket
import subprocess
import sys

import pytest

import eyas.run_lock as run_lock
from eyas.run_lock import OWNER_NAME, RunDirBusy, claim_run_dir, release_run_dirs


@pytest.fixture
def no_flock(monkeypatch):
    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", refuse)
    yield
    release_run_dirs()


def test_without_flock_a_lock_file_names_pid_and_host_and_goes_on_release(no_flock, tmp_path, caplog):
    claim_run_dir(tmp_path, "train")
    owner = tmp_path / OWNER_NAME
    assert owner.read_text() == f"PID {os.getpid()} (eyas train) on {socket.gethostname()}\n"
    assert "does not support flock" in caplog.text
    claim_run_dir(tmp_path, "train")  # held already: a no-op
    release_run_dirs()
    assert not owner.exists()


def test_a_live_holder_is_refused_and_a_dead_ones_lock_taken_over(no_flock, tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = tmp_path / OWNER_NAME
        owner.write_text(f"PID {live.pid} (eyas train) on {socket.gethostname()}\n")
        with pytest.raises(RunDirBusy, match=f"PID {live.pid}"):
            claim_run_dir(tmp_path, "capture")
    finally:
        live.kill()
        live.wait()
    claim_run_dir(tmp_path, "capture")  # that PID is gone: stale
    assert owner.read_text().startswith(f"PID {os.getpid()} (eyas capture)")


def test_a_lock_from_another_host_is_refused_naming_the_file_to_delete(no_flock, tmp_path):
    owner = tmp_path / OWNER_NAME
    owner.write_text("PID 1 (eyas train) on some-other-node\n")
    with pytest.raises(RunDirBusy, match=f"some-other-node; once it is gone, delete {owner}"):
        claim_run_dir(tmp_path, "train")
