"""A small stand-in for `vllm serve` with `extract_hidden_states` and eyas's connector, for
the fast tier: `/v1/models`, and `/v1/completions` with token-id prompts whose
`kv_transfer_params` name an `eyas_key`; it runs a tiny target (transformers) over the
prompt and writes the states in the handover format (data/vllm_plugin/eyas_states_format.py),
as the connector does after the request ends (so the response comes before the record).

Faults for tests: `no_connector` answers without `kv_transfer_params` (an engine started
without eyas's flags); `silent` answers but never writes; `die_on` (a substring of a key)
drops that request's connection and every later one's, as an engine that died; `damage`
(a substring of a key) flips a byte of that request's tensor file after writing it.

Also a script taking the flags eyas adds to a launch line (`--speculative-config`,
`--kv-transfer-config`): `python tests/support/fake_states_engine.py --target DIR --port N ...`
serves until killed (what `data.capture.launch` starts in tests).
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeStatesEngine:
    def __init__(
        self,
        model,
        layer_ids,
        handover_dir,
        port=0,
        no_connector=False,
        silent=False,
        die_on=None,
        damage=None,
    ):
        self.model, self.layer_ids, self.dir = model, sorted(layer_ids), handover_dir
        self.no_connector, self.silent, self.die_on = no_connector, silent, die_on
        self.dead, self.damage = False, damage
        self.keys: list[str] = []  # the keys asked for, in arrival order
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeStatesEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _write(self, key: str, ids: list[int]) -> None:
        import torch

        from eyas.data.vllm_plugin.eyas_states_format import write_states
        from eyas.target.features import compute_features

        L = len(self.model.model.layers)
        x = torch.tensor([ids])
        inner = [i for i in self.layer_ids if i < L]
        aux, last = compute_features(self.model, x, torch.ones_like(x), inner)
        H = last.shape[-1]
        states = torch.cat([aux[0].reshape(len(ids), len(inner), H), last[0][:, None]], dim=1)
        write_states(self.dir, key, states, x[0], self.layer_ids, "fake")
        if self.damage is not None and self.damage in key:
            from pathlib import Path

            path = Path(self.dir) / f"{key}.safetensors"
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))

    def complete(self, body: dict) -> tuple[int, dict]:
        key = (body.get("kv_transfer_params") or {}).get("eyas_key")
        ids = body["prompt"]
        with self.lock:
            self.keys.append(key)
            if key is not None and not (self.no_connector or self.silent):
                self._write(key, ids)
        out = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        if key is not None and not self.no_connector:
            out["kv_transfer_params"] = {"eyas_key": key}
        return 200, out

    def _handler(self):
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "target"}]})
                else:
                    self._send(404, {"error": self.path})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self._send(404, {"error": self.path})
                    return
                key = (body.get("kv_transfer_params") or {}).get("eyas_key") or ""
                if engine.die_on is not None and (engine.dead or engine.die_on in key):
                    engine.dead = True
                    self.close_connection = True  # no answer: the client sees the connection drop
                    return
                self._send(*engine.complete(body))

        return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speculative-config", required=True)
    ap.add_argument("--kv-transfer-config", required=True)
    args, _ = ap.parse_known_args()
    from eyas.target.load import load_target

    spec, transfer = json.loads(args.speculative_config), json.loads(args.kv_transfer_config)
    assert spec["method"] == "extract_hidden_states", spec
    layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    model = load_target(args.target, dtype="float32", device="cpu").model
    engine = FakeStatesEngine(model, layer_ids, transfer["kv_connector_extra_config"]["eyas_dir"], args.port)
    engine.httpd.serve_forever()


if __name__ == "__main__":
    main()
