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


def prompt_source(prompt, identity: dict) -> str:
    """What a prompt's record was decoded from: the prompt itself and the run's identity
    (target, heads, settings)."""
    return digest([prompt.id, prompt.category, prompt.turns, identity])


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
    `path` made from these prompts and settings. The others are reported, dropped from the
    file (the log describes the report beside it) and decoded again."""
    records, bad = read_records(path)
    done, kept, stale = {}, {}, set()
    for rec in records:
        try:
            i = int(rec["index"])
            if not (0 <= i < len(sources) and rec.get("source") == sources[i]):
                stale.add(i)
                continue
            turns = [turn_from_record(t) for t in rec["turns"]]
            if any(set(d) != set(drafters) for _, d, _ in turns):
                raise KeyError("drafters")
            done[i], kept[i] = turns, rec
        except (KeyError, TypeError, ValueError):
            bad += 1
    stale -= set(done)
    if bad:
        log.warning("%s: %d lines are not records of a decoded prompt; decoding those again", path, bad)
    if stale:
        log.warning(
            "%s: %d prompts were decoded with another workload, target, head or setting; decoding them again",
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
