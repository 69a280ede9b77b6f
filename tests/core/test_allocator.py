"""glibc malloc tuning for CPU runs: on by default in a Linux process, off on request."""

import os
import subprocess
import sys

import pytest

CODE = "from eyas.core.allocator import keep_freed_memory; print(keep_freed_memory(), keep_freed_memory())"


def _run(env_value):
    env = dict(os.environ)
    env.pop("EYAS_KEEP_FREED_MEMORY", None)
    if env_value is not None:
        env["EYAS_KEEP_FREED_MEMORY"] = env_value
    return subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True
    ).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_applied_on_linux_and_idempotent():
    assert _run(None) == ["True", "True"]


def test_opt_out_by_environment():
    assert _run("0") == ["False", "False"]
