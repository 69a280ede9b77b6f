"""The eval's per-prompt log (DESIGN §6): each prompt's decodings (the plain one and every
drafter's, per turn) and its lossless mismatches, appended to `eval_sequences.jsonl` beside
the report as the prompt finishes. A killed `eyas eval` rerun with the same workload,
target, heads and settings decodes only the prompts the log lacks; a record made from
anything else (another head, k, temperature, dtype ...) is decoded again. The log stays
after the run: the per-sequence data a later comparison can pair on."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from eyas.core.record_log import digest, read_records
from eyas.eval.speculate import DecodeTrace

log = logging.getLogger(__name__)


def head_identity(head_dir: str | Path) -> dict:
    """What tells one head directory's contents from another's without reading its
    weights: config.json's digest and each weight file's size and modification time."""
    d = Path(head_dir)
    config = d / "config.json"
    weights = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    return {
        "config": digest(config.read_text()) if config.is_file() else None,
        "weights": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights],
    }


def prompt_source(prompt, identity: dict, first_sequence: int | None = None) -> str:
    """What a prompt's record was decoded from: the prompt itself and the run's identity
    (target, heads, settings). Sampled decoding seeds each sequence by its place in the
    run, so there `first_sequence` (the number of turns before the prompt's) is part of
    it; greedy decoding is the same wherever the prompt comes, so a record is reused by
    another subset of the workload holding the same prompt."""
    key = [prompt.id, prompt.category, prompt.turns, identity]
    return digest(key if first_sequence is None else [*key, first_sequence])


def turn_record(plain: DecodeTrace, decoded: dict[str, DecodeTrace], mismatches: list[dict]) -> dict:
    return {
        "plain": asdict(plain),
        "drafters": {name: asdict(tr) for name, tr in decoded.items()},
        "mismatches": mismatches,
    }


def turn_from_record(rec: dict) -> tuple[DecodeTrace, dict[str, DecodeTrace], list[dict]]:
    return (
        DecodeTrace(**rec["plain"]),
        {name: DecodeTrace(**tr) for name, tr in rec["drafters"].items()},
        list(rec["mismatches"]),
    )


def resumed_prompts(path: Path, sources: list[str], drafters) -> dict[int, list[tuple]]:
    """{prompt index: its turns (plain, {drafter: trace}, mismatches)} for the records of
    `path` made from these prompts and settings (matched by `prompt_source`, wherever the
    prompt stood in the run that wrote them). The others are reported, dropped from the
    file (the log describes the report beside it) and decoded again."""
    records, bad = read_records(path)
    index_of = {source: i for i, source in enumerate(sources)}
    done, kept, stale = {}, {}, set()
    for rec in records:
        try:
            i = index_of.get(rec.get("source"))
            if i is None:
                stale.add(rec.get("source"))
                continue
            turns = [turn_from_record(t) for t in rec["turns"]]
            if any(set(d) != set(drafters) for _, d, _ in turns):
                raise KeyError("drafters")
            done[i] = turns
            kept[i] = {**rec, "index": i}
        except (KeyError, TypeError, ValueError):
            bad += 1
    if bad:
        log.warning("%s: %d lines are not records of a decoded prompt; decoding those again", path, bad)
    if stale:
        log.warning(
            "%s: dropping %d records of prompts or settings (target, heads, K, temperature ...) "
            "this eval does not have; its prompts among them are decoded again",
            path,
            len(stale),
        )
    if len(kept) < len(records) + bad:
        tmp = Path(f"{path}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for i in sorted(kept):
                f.write(json.dumps(kept[i], ensure_ascii=False) + "\n")
        tmp.replace(path)
    if done:
        log.info("%s: resuming, %d of %d prompts already decoded", path, len(done), len(sources))
    return done
