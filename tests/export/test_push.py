"""eyas push against a fake Hub on 127.0.0.1: the right files, the card, retries, no token
anywhere, and --dry-run uploads nothing."""

import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.tiny_heads import random_head

from eyas.cli import main
from eyas.export.hub import PushError, is_transient, model_card, plan_push, push_head, with_retries
from eyas.export.writer import export_head

TOKEN = "hf_eyasTESTtoken0123456789abcdef"


class FakeHub:
    """The four Hub endpoints a push uses; every request is recorded. `fail_commits`
    makes the first N commit requests answer 503."""

    def __init__(self):
        self.requests: list[dict] = []
        self.files: dict[str, bytes] = {}
        self.fail_commits = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, payload):
                body = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.requests.append(
                    {"path": self.path, "auth": self.headers.get("authorization"), "body": body}
                )
                if self.path == "/api/repos/create":
                    req = json.loads(body)
                    return self._reply(200, {"url": f"{hub.url}/{req.get('organization')}/{req['name']}"})
                if "/preupload/" in self.path:
                    files = json.loads(body)["files"]
                    return self._reply(
                        200,
                        {
                            "files": [
                                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                for f in files
                            ]
                        },
                    )
                if "/branch/" in self.path or self.path == "/api/validate-yaml":
                    return self._reply(200, {})
                if "/commit/" in self.path:
                    if hub.fail_commits > 0:
                        hub.fail_commits -= 1
                        return self._reply(503, {"error": "try later"})
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            hub.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    return self._reply(
                        200,
                        {
                            "commitUrl": f"{hub.url}/org/x/commit/" + "a" * 40,
                            "commitOid": "a" * 40,
                            "success": True,
                        },
                    )
                return self._reply(404, {"error": f"unknown {self.path}"})

            def do_GET(self):  # huggingface_hub's own side lookups; not part of the push
                return self._reply(404, {"error": f"unknown {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants as constants

    fake = FakeHub()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", fake.url)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/token")
    yield fake
    fake.close()


@pytest.fixture
def exported(tmp_path):
    d = export_head(
        random_head(algorithm="peagle", draft_vocab_size=100, mask_token_id=3, num_hidden_layers=2),
        tmp_path / "export",
    )
    (d / "training_summary.json").write_text(json.dumps({"data_sources": ["sharegpt.jsonl"], "steps": 1234}))
    (d / "eval_report.json").write_text(
        json.dumps(
            {"workload": "mtbench", "tau": 3.21, "tar": 0.61, "per_position_acceptance": [0.9, 0.7, 0.5, 0.3]}
        )
    )
    (d / "notes.txt").write_text("private notes")
    return d


def _no_token_anywhere(tmp_path, *texts):
    for t in texts:
        assert TOKEN not in t
    for p in tmp_path.rglob("*"):
        if p.is_file():
            assert TOKEN.encode() not in p.read_bytes(), p


def test_push_uploads_head_files_and_card(hub, exported, tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    rc = main(["push", str(exported), "--repo-id", "org/tiny-peagle", "--private"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert sorted(hub.files) == ["README.md", "config.json", "model.safetensors"]
    assert hub.files["model.safetensors"] == (exported / "model.safetensors").read_bytes()
    assert hub.files["config.json"] == (exported / "config.json").read_bytes()
    card = hub.files["README.md"].decode()
    for words in (
        "org/tiny-target",
        "P-EAGLE",
        "| speculative tokens K | 4 |",
        "1, 4, 6",
        "100 of 320",
        "sharegpt.jsonl",
        "optimizer steps: 1234",
        "| tau | 3.21 |",
        "0.700",
        "parallel_drafting",
        "vllm serve org/tiny-target",
    ):
        assert words in card, words
    create = next(r for r in hub.requests if r["path"] == "/api/repos/create")
    assert json.loads(create["body"])["visibility"] == "private"
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in hub.requests)  # the token was used ...
    _no_token_anywhere(tmp_path, out.out, out.err, caplog.text)  # ... and never shown or written


def test_dry_run_uploads_nothing(hub, exported, tmp_path, capsys):
    assert main(["push", str(exported), "--repo-id", "org/x", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert hub.requests == []
    assert "model.safetensors" in out and "README.md" in out and "notes.txt" not in out
    _no_token_anywhere(tmp_path, out)


def test_push_retries_transient_errors(hub, exported):
    hub.fail_commits = 2
    plan = plan_push(exported, "org/x", revision="v1")
    url = push_head(plan, sleep=lambda s: None)
    assert url.endswith("/org/x/commit/" + "a" * 40)
    assert sum("/commit/" in r["path"] for r in hub.requests) == 3
    assert any(r["path"].endswith("/branch/v1") for r in hub.requests)
    assert all(r["path"].endswith("/v1") for r in hub.requests if "/commit/" in r["path"])


def test_push_gives_up_with_a_clear_message(hub, exported, capsys):
    hub.fail_commits = 100
    plan = plan_push(exported, "org/x")
    with pytest.raises(PushError, match=r"uploading to org/x failed after 3 tries: .*503"):
        push_head(plan, attempts=3, sleep=lambda s: None)


def test_push_with_offline_mode_left_on_fails_at_once_naming_it(hub, exported, monkeypatch, capsys, caplog):
    """HF_HUB_OFFLINE=1 is not a transient failure: one line naming it, no request and no
    retry (before: five tries over 30 s, then a line that did not say why)."""
    import huggingface_hub.constants as constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    caplog.set_level(logging.WARNING)
    assert main(["push", str(exported), "--repo-id", "org/x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("eyas push: HF_HUB_OFFLINE is set") and "org/x" in err[0]
    assert hub.requests == [] and "retry" not in caplog.text
    assert not is_transient(OfflineModeIsEnabled("offline mode is enabled"))


def test_invalid_export_is_not_pushed(hub, exported, capsys):
    (exported / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    assert main(["push", str(exported), "--repo-id", "org/x"]) == 1
    assert hub.requests == [] and "not uploading" in capsys.readouterr().err


def test_transient_classification_and_backoff():
    class Resp:
        def __init__(self, code):
            self.status_code = code

    class HTTPErr(Exception):
        def __init__(self, code):
            self.response = Resp(code)

    assert is_transient(HTTPErr(502)) and is_transient(HTTPErr(429)) and is_transient(ConnectionError())
    assert not is_transient(HTTPErr(401)) and not is_transient(ValueError())
    delays, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "ok"

    assert with_retries("x", flaky, base_delay=1.0, sleep=delays.append) == "ok"
    assert delays == [1.0, 2.0]
    with pytest.raises(PushError, match="x failed: HTTPErr"):
        with_retries("x", lambda: (_ for _ in ()).throw(HTTPErr(403)), sleep=delays.append)


def test_card_without_summary_or_report(tmp_path):
    d = export_head(random_head(), tmp_path / "e")
    card = model_card(d, "org/plain")
    assert "EAGLE-3" in card and "## Training" not in card and "## Offline acceptance" not in card
    assert "the full target vocabulary (320)" in card


def test_a_head_naming_a_local_verifier_is_not_pushed(hub, tmp_path, capsys):
    d = export_head(random_head(verifier_name_or_path=str(tmp_path / "my-target")), tmp_path / "e")
    with pytest.raises(PushError, match="not a Hub id.*target.hub_id"):
        plan_push(d, "org/head")
    assert main(["push", str(d), "--repo-id", "org/head", "--dry-run"]) == 1
    assert "target.hub_id" in capsys.readouterr().err
    # the card of such a head links nothing on the Hub
    card = model_card(d, "org/head")
    assert (
        "base_model" not in card
        and "huggingface.co//" not in card
        and "huggingface.co/" + str(tmp_path) not in card
    )


def test_card_names_local_data_by_file_name_and_missing_metrics_as_na(exported):
    (exported / "training_summary.json").write_text(
        json.dumps(
            {"data_sources": ["/home/me/secret/convs.jsonl", "sharegpt", "someorg/chats"], "steps": 10}
        )
    )
    (exported / "eval_report.json").write_text(
        json.dumps({"tau": 2.0, "per_position_acceptance": [0.8, None, None]})
    )
    card = plan_push(exported, "org/head").card
    assert "/home/me" not in card and "local file convs.jsonl, sharegpt, someorg/chats" in card
    assert "| acceptance | 0.800 | n/a | n/a |" in card


def test_recipe_hub_id_is_the_verifier_of_a_head_trained_from_a_local_dir(tmp_path, tiny_llama_dir):
    from support.train_run_fixtures import prepare_run

    from eyas.export.reader import export_config

    recipe = prepare_run(tmp_path, tiny_llama_dir, "online", n=8, max_steps=1)
    run = str(recipe.run_dir)
    overrides = [
        f"run_dir={run}",
        f"target.name_or_path={tiny_llama_dir}",
        "target.hub_id=someorg/tiny-llama",
        "train.max_steps=1",
    ]
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    assert main(["train", "--no-progress", "-r", str(path), *overrides]) == 0
    assert main(["export", "-r", str(path), *overrides]) == 0
    export = recipe.paths.export
    assert export_config(export).verifier_name_or_path == "someorg/tiny-llama"
    assert plan_push(export, "org/head").files  # pushable now


def test_export_with_target_hub_id_corrects_a_head_trained_under_a_local_path(tmp_path, tiny_llama_dir):
    """A head already trained naming a local verifier is made pushable by re-exporting it
    with target.hub_id, without training again."""
    import yaml
    from support.train_run_fixtures import prepare_run

    recipe = prepare_run(tmp_path, tiny_llama_dir, "online", n=8, max_steps=1)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    assert main(["train", "--no-progress", "-r", str(path)]) == 0
    assert main(["export", "-r", str(path)]) == 0
    with pytest.raises(PushError, match="not a Hub id"):
        plan_push(recipe.paths.export, "org/head")
    assert main(["export", "-r", str(path), "target.hub_id=someorg/tiny-llama"]) == 0
    assert plan_push(recipe.paths.export, "org/head").files
