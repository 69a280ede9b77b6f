"""The server backend of regeneration: replies from an OpenAI-compatible chat endpoint
(`vllm serve`, SGLang, any server speaking `/v1/chat/completions`), for targets too big
for eyas's process: tensor-parallel replicas, data-parallel across URLs (DESIGN §2.1).

Each conversation is one task, its turns in order (reply k sees the target's own replies
before it); `concurrency` requests are in flight at once, each sent to the URL with the
fewest in flight. A finished conversation is handed to `write` at once, so a killed run
keeps it and never asks for it again. Transport errors, 429 and 5xx are retried with
exponential backoff; any other answer is an error naming the URL and what it said.

Replies: `reasoning_content` / `reasoning` (vLLM's reasoning parsers) become the turn's
reasoning; raw harmony or think-tagged content is split by data/reasoning.py. A tool
conversation is sent with its `tools`; a reply's calls come from the server's tool parser
(`tool_calls`) or, for a server without one, from the raw text by the parser the hf
backend uses; recorded results are replayed only after the same calls (data/tools.py). Where the
server returns token ids (vLLM's `return_token_ids`), the prompt it built and the reply
it generated are compared with eyas's own rendering, and mismatches are counted.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

from eyas.core.engine_process import server_root
from eyas.data.reasoning import assistant_message, effort_template_kwargs, is_empty_reply, mark_effort
from eyas.data.regenerate_settings import RegenerationSettings
from eyas.data.templates import TemplateError, prompt_ids, render_with_mask, special_strings
from eyas.data.tool_text import as_served, calls_mode
from eyas.data.tools import copy_until_reply, openai_messages

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class ServerError(RuntimeError):
    """The server refused a request for a reason retries cannot fix, or never answered."""


def _strip_end(ids: list[int], ends: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in ends else ids


def compare_reply_tokens(
    tokenizer,
    history: list[dict],
    reply: dict,
    server_prompt: list[int] | None,
    server_reply: list[int] | None,
    ends: set[int],
    own_prompt: list[int] | None = None,
) -> list[str]:
    """Mismatch reasons for one turn: `prompt_tokens_differ` (the server's chat template or
    tokenizer built another prompt than eyas's), `reply_tokens_differ` (the stored reply,
    re-rendered, tokenizes to other ids than the target generated), `reply_not_renderable`."""
    reasons = []
    if own_prompt is None and server_prompt is not None:
        own_prompt = prompt_ids(tokenizer, history)
    if server_prompt is not None and list(server_prompt) != own_prompt:
        reasons.append("prompt_tokens_differ")
    if server_reply is not None:
        try:
            r = render_with_mask(tokenizer, history + [reply], train_on="last")
        except TemplateError:
            return reasons + ["reply_not_renderable"]
        masked = [t for t, m in zip(r.input_ids, r.loss_mask) if m]
        if _strip_end(masked, ends) != _strip_end(list(server_reply), ends):
            reasons.append("reply_tokens_differ")
    return reasons


class ChatClient:
    """Chat completions against one or more replicas, least busy first."""

    def __init__(self, settings: RegenerationSettings):
        import httpx

        self.s, self.sampling = settings.server, settings
        self.in_flight = {server_root(u): 0 for u in self.s.urls}
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.s.timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=self.s.concurrency + 8),
        )
        self.model = self.s.model
        self.token_ids = True  # ask for them until a server refuses the field
        # until a server without a tool parser refuses tools: then `tool_choice: none`, so the
        # tools are still in its prompt and the calls are parsed from the raw text
        self.tool_choice: str | None = None

    async def close(self) -> None:
        await self.http.aclose()

    async def resolve_model(self) -> str:
        if self.model is None:
            url = next(iter(self.in_flight))
            data = await self._request("GET", url, "/v1/models")
            models = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
            if not models:
                raise ServerError(f"{url}/v1/models lists no model; set data.regenerate.server_model")
            self.model = models[0]
            log.info("server model: %s", self.model)
        return self.model

    async def _request(self, method: str, url: str, path: str, body: dict | None = None) -> dict:
        import httpx

        for attempt in range(self.s.max_retries + 1):
            try:
                resp = await self.http.request(method, url + path, json=body)
                if resp.status_code == 200:
                    return resp.json()
                if resp.status_code not in RETRY_STATUS:
                    raise ServerError(f"{url}{path} answered {resp.status_code}: {resp.text[:500]}")
                why = f"status {resp.status_code}"
            except (httpx.TransportError, ValueError) as err:  # ValueError: a body that is not JSON
                why = f"{type(err).__name__}: {err}"
            if attempt == self.s.max_retries:
                raise ServerError(f"{url}{path} failed {attempt + 1} times; last: {why}")
            delay = min(30.0, self.s.backoff_s * 2**attempt) * (0.5 + random.random())
            log.warning("%s%s: %s; retrying in %.1f s", url, path, why, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def chat(self, history: list[dict], effort: str | None = None, seed: int | None = None) -> dict:
        """One reply: the choice's message and, where given, `token_ids` / `prompt_token_ids`.
        `history` is eyas's conversation so far: it goes out as OpenAI messages, with the
        `tools` its first message carries (data/tools.py). `effort`: the reasoning effort,
        sent as vLLM's `reasoning_effort` and as the template arguments it stands for (for
        servers that only pass `chat_template_kwargs`)."""
        url = min(self.in_flight, key=self.in_flight.get)
        messages, tools = openai_messages(history)
        body = {
            "model": await self.resolve_model(),
            "messages": messages,
            "max_tokens": self.sampling.max_new_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "seed": self.sampling.seed if seed is None else seed,
            # raw harmony keeps its channel tokens when no reasoning parser splits them
            "skip_special_tokens": False,
        }
        if effort is not None:
            body["reasoning_effort"] = effort
            body["chat_template_kwargs"] = effort_template_kwargs(effort)
        if tools:
            body["tools"] = tools
            if self.tool_choice:
                body["tool_choice"] = self.tool_choice
        if self.token_ids:
            body["return_token_ids"] = True
        self.in_flight[url] += 1
        try:
            for _ in range(3):  # each refusal below is fixed once, then the request is sent again
                try:
                    data = await self._request("POST", url, "/v1/chat/completions", body)
                    break
                except ServerError as err:
                    if "tools" in body and "tool_choice" not in body and "tool-call-parser" in str(err):
                        log.warning(
                            "%s runs no tool parser (vllm serve --enable-auto-tool-choice "
                            "--tool-call-parser NAME); sending tool_choice=none, calls parsed from the text",
                            url,
                        )
                        self.tool_choice = body["tool_choice"] = "none"
                    elif "return_token_ids" in body and "return_token_ids" in str(err):
                        log.warning(
                            "%s does not return token ids; regenerated turns are not compared with the "
                            "target's tokens",
                            url,
                        )
                        self.token_ids = False
                        body.pop("return_token_ids")
                    else:
                        raise
            else:
                raise ServerError(f"{url}/v1/chat/completions refused the request three times")
        finally:
            self.in_flight[url] -= 1
        try:
            choice = data["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(
                f"{url}/v1/chat/completions: no choices[0].message in {str(data)[:300]}"
            ) from None
        return {
            "message": message,
            "token_ids": choice.get("token_ids"),
            "finish_reason": choice.get("finish_reason"),
            "prompt_token_ids": data.get("prompt_token_ids"),
            "completion_tokens": (data.get("usage") or {}).get("completion_tokens", 0),
        }


async def _regenerate_all(
    settings: RegenerationSettings,
    tokenizer,
    conversations: Sequence[list[dict]],
    todo: Sequence[int],
    efforts: Sequence[str | None],
    write: Callable[[int, list[dict], dict], None],
    bar,
    work: dict[int, int],
) -> None:
    server, max_prompt_tokens = settings.server, settings.max_prompt_tokens
    ends = {int(i) for i in tokenizer.convert_tokens_to_ids(special_strings(tokenizer)) if i is not None}
    client = ChatClient(settings)
    sem = asyncio.Semaphore(server.concurrency)
    start, tokens, replies = time.monotonic(), 0, 0

    async def one(i: int) -> None:
        nonlocal tokens, replies
        history: list[dict] = []
        checks: dict[str, int] = {}
        conv, pos = as_served(tokenizer, conversations[i]), 0
        parse_calls = calls_mode(tokenizer, conv)
        async with sem:
            while True:
                pos, stop = copy_until_reply(conv, pos, history)
                if stop:
                    checks["tool_divergence"] = 1
                if stop or pos >= len(conv):
                    break
                pos += 1
                # rendered once: the length cap and the token check
                own_prompt = prompt_ids(tokenizer, history, efforts[i])
                if max_prompt_tokens is not None and len(own_prompt) > max_prompt_tokens:
                    break
                # a seed per conversation and turn: one seed for all would draw every
                # reply from the same stream of uniforms
                turn_seed = (settings.seed * 1_000_003 + i * 1009 + len(history)) % 2**31
                out = await client.chat(history, efforts[i], turn_seed)
                msg = out["message"]
                reply = assistant_message(
                    msg.get("content") or "",
                    msg.get("reasoning_content") or msg.get("reasoning"),
                    finish_reason=out["finish_reason"],
                    tool_calls=msg.get("tool_calls") if parse_calls else None,
                    parse_calls=parse_calls,
                )
                mark_effort(reply, efforts[i])
                if (
                    out["token_ids"] is not None
                ):  # vLLM's end with the stop token; the template writes its own
                    reply["token_ids"] = list(out["token_ids"])
                    if out["finish_reason"] == "stop":
                        reply["token_ids"] = _strip_end(reply["token_ids"], ends)
                tokens += int(out["completion_tokens"] or 0)
                replies += 1
                if is_empty_reply(reply):  # stopped at once, or cut inside its reasoning
                    break
                if out["token_ids"] is not None or out["prompt_token_ids"] is not None:
                    checks["turns_compared"] = checks.get("turns_compared", 0) + 1
                    for reason in compare_reply_tokens(
                        tokenizer, history, reply, out["prompt_token_ids"], out["token_ids"], ends, own_prompt
                    ):
                        checks[reason] = checks.get(reason, 0) + 1
                history.append(reply)
                if (
                    "finish_reason" in reply
                ):  # cut at max_new_tokens: a next turn would answer unfinished text
                    break
        while history and history[-1]["role"] != "assistant":
            history.pop()
        write(i, history, checks)
        elapsed = max(time.monotonic() - start, 1e-6)
        bar.set_postfix(
            replies_per_s=f"{replies / elapsed:.1f}", tok_per_s=f"{tokens / elapsed:.0f}", refresh=False
        )
        bar.update(work.get(i, 1))

    try:
        tasks = [asyncio.create_task(one(i)) for i in todo]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
    finally:
        await client.close()


def regenerate_with_server(
    conversations: Sequence[list[dict]],
    todo: Sequence[int],
    tokenizer,
    settings: RegenerationSettings,
    write: Callable[[int, list[dict], dict], None],
    bar,
    work: dict[int, int] | None = None,
    efforts: Sequence[str | None] | None = None,
) -> None:
    """Regenerate the conversations at `todo` through `settings.server` (conversation i at
    reasoning effort `efforts[i]`, default none; a turn whose prompt is over
    `settings.max_prompt_tokens` ends its conversation); `write(i, messages,
    token_checks)` is called as each one finishes (`token_checks`: turns compared with the
    server's token ids and the mismatches by reason, see `compare_reply_tokens`). `bar`
    advances by `work[i]` (its expected tokens) as conversation i finishes."""
    if not todo:
        return
    efforts = efforts or [None] * len(conversations)
    server = settings.server
    with server.engine() if server.engine else nullcontext():
        asyncio.run(
            _regenerate_all(settings, tokenizer, conversations, todo, efforts, write, bar, work or {})
        )
