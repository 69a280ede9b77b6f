"""The target's hidden states kept from regeneration, so the capture copies them instead of
running the target over the same tokens again.

Regenerating a reply already runs the target over every token of the sample it becomes
(the prompt in the prefill, each reply token in a decode step). With
`data.regenerate.keep_states`, `prepare` keeps the states of those tokens: one
safetensors file per regenerated batch in `prepared/fed_states/`, holding for each
conversation the ids the target was fed in the call that made its last kept reply (that
prompt, then the reply) and their states `[n, (len(aux_layer_ids) + 1) * Ht]` in bf16
(the aux layers in order, then the last state before the final norm).

`eyas capture` copies them for a prepared sample when no loss-masked token lies more
than one position past the tokens the sample shares with the fed ids from the start
(the state of a token depends only on it and the tokens before it). Re-encoding the
reply text can tokenise it differently, and the reply is stripped of surrounding
whitespace, so a reply that ended in a newline still qualifies while one that differs
earlier runs the target as usual. The positions after the shared tokens (the template's
tail after the reply, e.g. `<|im_end|>\\n`) get zero states: a state at slot t only
serves the labels at t+1 and later (the target logits of slot t, the head's query at t
and the keys it reads, all causal), and the last label, the end-of-turn token, is
predicted from the last reply token, which was fed. The trainer's loss is therefore the
same as with a full capture up to bf16 rounding of the decode kernels
(tests/data/test_fed_states.py compares them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from eyas.data.cache import atomic_write

log = logging.getLogger(__name__)

FED_STATES_DIR = "fed_states"
FORMAT = "eyas-fed-states"


def fed_state_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The layer ids to hook (as `capture_aux`): the aux layers, then the final norm's input."""
    return [*aux_layer_ids, num_layers]


def write_fed_states(
    out_dir: str | Path,
    fed: dict[int, tuple[Sequence[int], torch.Tensor]],
    layer_ids: Sequence[int],
    target: str,
) -> Path | None:
    """Write one batch's states: fed = {conversation index: (fed ids [n], states [n, C])}.
    Returns the file written (the next free `batch-NNNNNN.safetensors`), None when empty."""
    from safetensors.torch import save

    if not fed:
        return None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(fed)
    lengths = [len(fed[i][0]) for i in order]
    tensors = {
        "conversation": torch.tensor(order, dtype=torch.int64),
        "offsets": torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0),
        "fed_ids": torch.tensor([t for i in order for t in fed[i][0]], dtype=torch.int32),
        "states": torch.cat([fed[i][1].to(torch.bfloat16) for i in order]).contiguous(),
    }
    taken = sorted(out_dir.glob("batch-*.safetensors"))
    k = int(taken[-1].stem.split("-")[1]) + 1 if taken else 0
    path = out_dir / f"batch-{k:06d}.safetensors"
    meta = {"format": FORMAT, "layer_ids": ",".join(map(str, layer_ids)), "target": target}
    atomic_write(path, save(tensors, metadata=meta))
    return path


class FedStates:
    """The states of a `fed_states` directory, looked up by conversation index. Files written
    for another target or other layers are skipped (with a warning); where two files hold
    the same conversation (a rerun regenerated it), the later file's entry is used."""

    def __init__(self, directory: str | Path, layer_ids: Sequence[int], target: str):
        from safetensors import safe_open

        self.dir = Path(directory)
        self._where: dict[int, tuple[Path, int]] = {}
        self._open_files: dict[Path, tuple] = {}
        want = ",".join(map(str, layer_ids))
        for path in sorted(self.dir.glob("batch-*.safetensors")):
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                    conversations = f.get_tensor("conversation").tolist()
            except Exception as err:  # a damaged file costs its samples a forward, nothing else
                log.warning("%s: unreadable (%s); its samples are captured by running the target", path, err)
                continue
            if meta.get("format") != FORMAT or meta.get("layer_ids") != want or meta.get("target") != target:
                log.warning(
                    "%s: states of target %r, layers %s, not %r, %s; not used",
                    path,
                    meta.get("target"),
                    meta.get("layer_ids"),
                    target,
                    want,
                )
                continue
            for slot, c in enumerate(conversations):
                self._where[c] = (path, slot)

    def __len__(self) -> int:
        return len(self._where)

    def _open(self, path: Path):
        """An open file with its offsets and ids; at most 32 kept open (the capture's length
        order visits the files in no order, and a large run writes thousands)."""
        from safetensors import safe_open

        if path not in self._open_files:
            if len(self._open_files) >= 32:
                self._open_files.pop(next(iter(self._open_files)))
            f = safe_open(str(path), framework="pt")
            self._open_files[path] = (f, f.get_tensor("offsets"), f.get_tensor("fed_ids"))
        return self._open_files[path]

    def states_for(
        self, conversation: int, input_ids: Sequence[int], loss_mask: Sequence[int]
    ) -> torch.Tensor | None:
        """The states `[len(input_ids), C]` of a prepared sample from `conversation`, zero
        after the tokens it shares with the fed ids; None when they cannot stand in for a
        capture (module docstring)."""
        hit = self._where.get(int(conversation))
        if hit is None:
            return None
        path, slot = hit
        f, offsets, fed_ids = self._open(path)
        a, b = int(offsets[slot]), int(offsets[slot + 1])
        n = len(input_ids)
        m = min(b - a, n)
        differ = (fed_ids[a : a + m] != torch.as_tensor(list(input_ids[:m]), dtype=fed_ids.dtype)).nonzero()
        m = int(differ[0, 0]) if differ.numel() else m  # the tokens both share from the start
        if m == 0 or any(loss_mask[m + 1 :]):
            return None
        fed = f.get_slice("states")[a : a + m]
        if m == n:
            return fed
        out = fed.new_zeros(n, fed.shape[1])
        out[:m] = fed
        return out
