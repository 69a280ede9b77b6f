"""Regeneration through a real `vllm serve` (the .venv-vllm engine, launched by `eyas
prepare` itself): the replies stored for 64 ShareGPT conversations are the ones vLLM's own
greedy decoding gives for the prompts eyas renders, and the server's token ids agree with
eyas's re-rendering of every stored turn. Slow: the CPU engine starts in about a minute."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = ROOT / "scripts" / "vllm_runner.py"
N_CONVERSATIONS, MAX_NEW_TOKENS = 64, 32
sys.path.insert(0, str(ROOT / "scripts"))

from vllm_runner import local_serve_command  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PY.is_file(), reason=".venv-vllm does not exist (scripts/setup_vllm_env.sh)"),
]


def test_prepare_through_vllm_serve_stores_vllm_greedy_replies(tmp_path):
    from transformers import AutoTokenizer

    from eyas.cli import main
    from eyas.data.regenerate import before_first_reply
    from eyas.data.templates import prompt_ids
    from eyas.target.load import resolve_target_path

    model_dir = resolve_target_path("smollm2-135m")
    port = free_port()
    launch = local_serve_command(model_dir, port)
    run = tmp_path / "run"
    overrides = [
        f"run_dir={run}",
        "target.dtype=float32",
        f"data.max_samples={N_CONVERSATIONS}",
        "data.max_turns=1",
        "data.max_length=512",
        "data.eval_fraction=0.1",
        f"data.regenerate.max_new_tokens={MAX_NEW_TOKENS}",
        "data.regenerate.backend=server",
        f"data.regenerate.launch='{launch}'",
        f"data.regenerate.server_urls=[http://127.0.0.1:{port}]",
        "data.regenerate.concurrency=16",
        "data.regenerate.keep_states=false",
        "data.features=online",
    ]
    assert (
        main(
            ["prepare", "--no-progress", "-r", str(ROOT / "recipes" / "smollm2-135m-eagle3.yaml"), *overrides]
        )
        == 0
    )
    prepared = run / "prepared"
    assert (
        "Uvicorn running" in (prepared / "engine.log").read_text()
        or "Application startup" in (prepared / "engine.log").read_text()
    ), "the engine log does not show vllm serve starting"
    records = [json.loads(line) for line in (prepared / "regenerated.jsonl").read_text().splitlines()]
    assert len(records) == N_CONVERSATIONS
    replied = [r for r in records if r["messages"]]
    # the prompts over max_length - max_new_tokens are skipped before any request
    assert len(replied) >= N_CONVERSATIONS // 2, "most ShareGPT first prompts fit max_length and get a reply"

    # the server is stopped once prepare returns
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "eyas left the launched engine running"

    # what the server's token ids said of each stored turn (data/regenerate_server.py)
    report = json.loads((prepared / "drop_report.json").read_text())
    checks = report["token_checks"]
    assert checks["turns_compared"] == len(replied)
    assert checks.get("prompt_tokens_differ", 0) == 0, checks
    # Every stored turn renders to the target's own ids: the reply is stored with vLLM's
    # token ids and rendered from them (before, from its text, 6 of 52 turns differed by a
    # non-canonical split the target sampled, "\n" "\n" where the tokenizer merges "\n\n").
    assert checks.get("reply_tokens_differ", 0) == 0, checks
    assert all(r["messages"][-1]["token_ids"] for r in replied)
    assert any(r["messages"][-1].get("finish_reason") == "length" for r in replied)

    # vLLM's greedy output for the prompts eyas renders, from the engine's offline API
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [prompt_ids(tokenizer, before_first_reply(r["messages"])) for r in replied]
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(
        json.dumps(
            {
                "mode": "generate",
                "model": model_dir,
                "dtype": "float32",
                "max_model_len": 1024,
                "prompts": prompts,
                "max_tokens": MAX_NEW_TOKENS,
                "ignore_eos": False,
            }
        )
    )
    proc = subprocess.run(
        [str(VLLM_PY), str(RUNNER), str(job), str(out)], capture_output=True, text=True, timeout=1200
    )
    result = json.loads(out.read_text()) if out.is_file() else {"ok": False, "error": proc.stderr[-3000:]}
    assert result["ok"], result.get("error")
    want = [tokenizer.decode(ids, skip_special_tokens=True) for ids in result["outputs"]]
    got = [r["messages"][-1]["content"] for r in replied]
    same = sum(a == b for a, b in zip(got, want))
    assert same == len(replied), [(a, b) for a, b in zip(got, want) if a != b][:3]

    # what is trained is what vLLM generated, token for token: each prepared sample's
    # reply span starts with vLLM's own ids (its stop token is the template's end-of-turn)
    ends = {tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
    vllm_ids = {r["index"]: [t for t in ids if t not in ends] for r, ids in zip(replied, result["outputs"])}
    from eyas.data.prepare import load_prepared

    rows = [row for split in load_prepared(prepared).values() for row in split]
    assert rows
    for row in rows:
        trained = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        want_ids = vllm_ids[row["conversation"]]
        assert trained[: len(want_ids)] == want_ids
