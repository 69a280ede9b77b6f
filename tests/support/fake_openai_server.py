"""A small OpenAI-compatible chat server on 127.0.0.1 for the fast tier, backed by a
tiny target (greedy replies through eyas's own decoder) or by a script of raw completions
(text, or the token ids to return).

It answers as vLLM does where eyas relies on it: `/v1/models`, `/v1/chat/completions`
with `reasoning_content` (harmony targets, `reasoning: "parsed"`) or raw text,
`return_token_ids` (`token_ids` on the choice, `prompt_token_ids` on the response),
`reasoning_effort` / `chat_template_kwargs`, and `skip_special_tokens`. Faults for tests:
the first `fail_first` requests answer 503; `token_ids_unsupported` answers 400 to
`return_token_ids`; `no_auto_tools` answers 400 to tools without `tool_choice: none`, as
vLLM without a tool parser does. Tools: the request's `tools` go to the chat template (call
arguments decoded from their JSON text, as vLLM does); with `tool_parser`, calls in the raw
completion come back as `tool_calls` (parsed by eyas's parser, standing in for the
engine's), else the text is returned raw.

Also a script: `python tests/support/fake_openai_server.py --target DIR --port N` serves until killed
(what `data.regenerate.launch` starts in tests).
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeChatServer:
    def __init__(
        self,
        tokenizer,
        model=None,
        script: Callable[[list], str] | None = None,
        name: str = "tiny-target",
        reasoning: str = "parsed",
        fail_first: int = 0,
        token_ids_unsupported: bool = False,
        port: int = 0,
        tool_parser: bool = False,
        no_auto_tools: bool = False,
        reply_tokens: int | None = None,
    ):
        self.tool_parser, self.no_auto_tools = tool_parser, no_auto_tools
        # a target that ends its replies itself after this many tokens (a random tiny model
        # never stops, and the recipes' own max_tokens run to thousands)
        self.reply_tokens = reply_tokens
        self.tokenizer, self.model, self.script, self.name = tokenizer, model, script, name
        self.reasoning, self.fail_left, self.token_ids_unsupported = (
            reasoning,
            fail_first,
            token_ids_unsupported,
        )
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeChatServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def complete(self, body: dict) -> tuple[int, dict]:
        from eyas.data.decode import decode_replies_hf
        from eyas.data.reasoning import is_harmony_tokenizer, parse_harmony

        with self.lock:
            self.requests.append(body)
            if self.fail_left > 0:
                self.fail_left -= 1
                return 503, {"error": "warming up"}
            if body.get("return_token_ids") and self.token_ids_unsupported:
                return 400, {"error": "unknown field: return_token_ids"}
            if self.no_auto_tools and body.get("tools") and body.get("tool_choice") != "none":
                return 400, {
                    "error": '"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set"
                }
            if body.get("model") != self.name:
                return 404, {"error": f"model {body.get('model')!r} does not exist"}
            tok = self.tokenizer
            # as vLLM builds the template arguments from `reasoning_effort`
            kwargs = dict(body.get("chat_template_kwargs") or {})
            if body.get("reasoning_effort") is not None:
                kwargs.setdefault("reasoning_effort", body["reasoning_effort"])
                kwargs.setdefault("enable_thinking", body["reasoning_effort"] != "none")
            prompt_text = tok.apply_chat_template(
                _template_messages(body["messages"]),
                tools=body.get("tools"),
                tokenize=False,
                add_generation_prompt=True,
                **kwargs,
            )
            prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
            finish, ended_by = "stop", []
            if self.script is not None:
                raw = self.script(body["messages"])
                if isinstance(raw, list):  # token ids, e.g. a split the tokenizer would not make
                    ids, raw, ended_by = raw, tok.decode(raw, skip_special_tokens=False), [tok.eos_token_id]
                else:
                    ids = tok(raw, add_special_tokens=False)["input_ids"]
            else:
                max_tokens = int(body.get("max_tokens", 16))
                stops_itself = self.reply_tokens is not None and self.reply_tokens < max_tokens
                reply = decode_replies_hf(
                    self.model,
                    tok,
                    [prompt],
                    self.reply_tokens if stops_itself else max_tokens,
                    float(body.get("temperature", 0.0)),
                    float(body.get("top_p", 1.0)),
                )[0]
                ids = reply.token_ids
                raw = tok.decode(ids, skip_special_tokens=False)
                # vLLM's token_ids end with the stop token; its text does not
                if reply.finished or stops_itself:
                    eos = self.model.generation_config.eos_token_id
                    ended_by = [eos[0] if isinstance(eos, list) else eos]
                else:
                    finish = "length"
            message = {
                "role": "assistant",
                "content": tok.decode(
                    ids, skip_special_tokens=body.get("skip_special_tokens", True) is not False
                ),
            }
            if self.reasoning == "parsed" and is_harmony_tokenizer(tok):
                reasoning, content = parse_harmony(raw)
                message = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
            if self.tool_parser and body.get("tools"):
                message = _parsed_calls(message, raw, tok)
            out = {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "model": self.name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)},
            }
            if body.get("return_token_ids"):
                out["choices"][0]["token_ids"] = list(ids) + ended_by
                out["prompt_token_ids"] = list(prompt)
            return 200, out

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.name, "object": "model"}]})
                elif self.path == "/health":
                    self._send(200, {})
                else:
                    self._send(404, {"error": self.path})

            def do_POST(self):
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": self.path})
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._send(*server.complete(body))

        return Handler


def _template_messages(messages: list[dict]) -> list[dict]:
    """What the engine hands its template: call arguments as dicts, reasoning as `thinking`."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        if m.get("reasoning"):
            m.setdefault("thinking", m["reasoning"])
            m.setdefault("reasoning_content", m["reasoning"])
        out.append(m)
    return out


def _parsed_calls(message: dict, raw: str, tok) -> dict:
    """The engine's tool parser: calls out of the completion, arguments as JSON text."""
    from eyas.data.reasoning import assistant_message, is_harmony_tokenizer

    text = raw if is_harmony_tokenizer(tok) else message["content"]
    parsed = assistant_message(text, message.get("reasoning_content"), parse_calls="json")
    if not parsed.get("tool_calls"):
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in parsed["tool_calls"]
    ]
    return {**message, "content": parsed["content"] or None, "tool_calls": calls}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="tiny-target")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target).eval()
    server = FakeChatServer(tok, model, name=args.name, port=args.port)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
