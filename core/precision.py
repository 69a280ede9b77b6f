"""Pick bf16 or float32 for `dtype: auto` / `mixed_precision: auto` (DESIGN §2.4).

bf16 halves memory everywhere, but whether it is faster depends on the processor and on
the shape of the work, not on the instruction flags it advertises: a CPU with
AVX512-BF16 and no AMX can multiply a batch in bf16 at half its float32 rate. So on a
CPU `auto` times the model's own matrix multiplies (one MLP projection and the LM head,
at the row count the stage works with) in both dtypes and takes the faster one. The
verdict is cached per machine, torch version, thread count and shape in
`~/.cache/eyas/precision.json` (`EYAS_CACHE_DIR` moves it, `core/cache_dir.py`; delete the
file to measure again) and logged with the figures it rests on. CUDA GPUs with bf16
support and Apple GPUs get bf16 without measuring.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from eyas.core.cache_dir import eyas_cache_dir

log = logging.getLogger(__name__)

CACHE_NAME = "precision.json"
# The LM head is timed over at most this many vocabulary rows: enough to reach the
# memory-bound regime, small enough that a 200k vocabulary costs no gigabytes.
MAX_TIMED_VOCAB = 32768
MAX_TIMED_ROWS = 256
# bf16 this many times slower than float32 in one run decides the verdict at once.
CLEAR_GAP = 10.0
# The rows of the first, screening round are the timed rows divided by this: where bf16 is
# emulated one full-size multiply takes up to a minute, and a screen settles it sooner.
SCREEN_DIVISOR = 16
# Seconds this process spent measuring verdicts (not reading them from the cache): work a
# machine does once, which the time budget's probe keeps out of a stage's start-up.
_measuring_s = 0.0


def measuring_seconds() -> float:
    return _measuring_s


@dataclass(frozen=True)
class MatmulShapes:
    """The multiplies a stage runs most: `rows` x hidden by hidden x intermediate (an MLP
    projection) and `rows` x hidden by hidden x vocab (the LM head)."""

    hidden: int = 576
    intermediate: int = 1536
    vocab: int = 49152
    rows: int = 64

    def timed(self) -> MatmulShapes:
        return MatmulShapes(
            self.hidden,
            self.intermediate,
            min(self.vocab, MAX_TIMED_VOCAB),
            max(1, min(self.rows, MAX_TIMED_ROWS)),
        )


def shapes_of_config(config, rows: int, vocab: int | None = None) -> MatmulShapes:
    """The shapes of a transformers config (multimodal configs nest the text part);
    `vocab` overrides the LM head's width (a draft vocabulary)."""
    text = getattr(config, "text_config", None) or config
    hidden = int(text.hidden_size)
    inter = int(
        getattr(text, "intermediate_size", None) or getattr(text, "moe_intermediate_size", None) or 4 * hidden
    )
    return MatmulShapes(hidden, inter, int(vocab or text.vocab_size), rows)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_id() -> str:
    """What a CPU timing verdict holds for: the processor, torch and the thread count."""
    return f"{cpu_name()}|torch {torch.__version__}|threads {torch.get_num_threads()}"


def _machine_key(shapes: MatmulShapes) -> str:
    s = shapes.timed()
    return f"{machine_id()}|{s.rows}x{s.hidden}x{s.intermediate}+{s.vocab}"


def time_matmuls(
    dtype: torch.dtype, shapes: MatmulShapes, seconds: float = 0.15, give_up_above: float | None = None
) -> float:
    """Seconds for one MLP projection plus one LM-head multiply in `dtype` on the CPU:
    the fastest of repeated runs over about `seconds` (the fastest, so that another
    process's burst does not decide). A first run slower than `give_up_above` is returned
    as it is: on a CPU that emulates bf16 one run takes seconds and already decides."""
    s = shapes.timed()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(s.rows, s.hidden, generator=gen).to(dtype)
    w_mlp = torch.randn(s.hidden, s.intermediate, generator=gen).to(dtype)
    w_head = torch.randn(s.hidden, s.vocab, generator=gen).to(dtype)

    def work() -> None:
        torch.mm(x, w_mlp)
        torch.mm(x, w_head)

    return fastest_seconds(work, seconds, give_up_above)


def fastest_seconds(work: Callable[[], object], seconds: float, give_up_above: float | None = None) -> float:
    """The fastest of repeated calls of `work` over about `seconds`, after one warm-up call
    (first-call dispatch, page faults); a warm-up slower than `give_up_above` is returned
    as it is."""

    def once() -> float:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start

    first = once()
    if give_up_above is not None and first > give_up_above:
        return first
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        t = once()
        best, spent = min(best, t), spent + t
    return best


def read_verdicts(name: str) -> dict:
    """The cached timing verdicts of `eyas_cache_dir() / name` ({} when none or unreadable)."""
    try:
        return json.loads((eyas_cache_dir() / name).read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measure again and rewrite it


def write_verdicts(name: str, verdicts: dict) -> None:
    path = eyas_cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{name}.{os.getpid()}")
        tmp.write_text(json.dumps(verdicts, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as err:  # a read-only home only costs a measurement next time
        log.debug("could not cache the timing verdicts in %s: %s", path, err)


def cpu_bf16_is_faster(shapes: MatmulShapes | None = None) -> bool:
    """Whether bf16 multiplies `shapes` faster than float32 on this CPU: measured once,
    then read from the cache."""
    shapes = shapes or MatmulShapes()
    key = _machine_key(shapes)
    verdicts = read_verdicts(CACHE_NAME)
    known = verdicts.get(key)
    if isinstance(known, dict) and known.get("faster") in ("bfloat16", "float32"):
        log.info(
            "dtype auto: %s on this CPU (cached: bf16 %.2f ms, float32 %.2f ms for %s)",
            known["faster"],
            known["bfloat16_ms"],
            known["float32_ms"],
            known["shapes"],
        )
        return known["faster"] == "bfloat16"
    # A gap of CLEAR_GAP x is no neighbour's doing: a screen on fewer rows settles it (bf16
    # emulated in software costs seconds a run). Otherwise two alternating rounds, the
    # fastest of each dtype: a neighbour's burst in one round slows one dtype's figure
    # once, not the whole verdict.
    global _measuring_s
    began = time.perf_counter()
    timed = shapes.timed()
    screen = replace(timed, rows=max(1, timed.rows // SCREEN_DIVISOR))
    fp32 = time_matmuls(torch.float32, screen, 0.05)
    bf16 = time_matmuls(torch.bfloat16, screen, 0.05, give_up_above=CLEAR_GAP * fp32)
    if bf16 > CLEAR_GAP * fp32:
        timed, rounds = screen, [(bf16, fp32)]
    else:
        timed, rounds = shapes, []
        for _ in range(2):
            fp32 = time_matmuls(torch.float32, shapes, 0.1)
            bf16 = time_matmuls(torch.bfloat16, shapes, 0.1, give_up_above=CLEAR_GAP * fp32)
            rounds.append((bf16, fp32))
            if bf16 > CLEAR_GAP * fp32:
                break
    bf16, fp32 = min(r[0] for r in rounds), min(r[1] for r in rounds)
    _measuring_s += time.perf_counter() - began
    faster = "bfloat16" if bf16 < fp32 else "float32"
    verdicts[key] = {
        "faster": faster,
        "bfloat16_ms": round(bf16 * 1e3, 3),
        "float32_ms": round(fp32 * 1e3, 3),
        "shapes": asdict(timed.timed()),
    }
    write_verdicts(CACHE_NAME, verdicts)
    log.info(
        "dtype auto: %s on this CPU (measured: bf16 %.2f ms, float32 %.2f ms for %s; cached in %s)",
        faster,
        bf16 * 1e3,
        fp32 * 1e3,
        asdict(timed.timed()),
        eyas_cache_dir() / CACHE_NAME,
    )
    return faster == "bfloat16"


def bf16_is_faster(device: torch.device | str, shapes: MatmulShapes | None = None) -> bool:
    """True where bf16 is the faster choice on `device`: a CUDA GPU with bf16 support, an
    Apple GPU, or a CPU where it measured faster for `shapes`."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        return cpu_bf16_is_faster(shapes)
    return kind == "mps"


def resolve_dtype(name: str, device: torch.device | str, shapes: MatmulShapes | None = None) -> str:
    """A recipe dtype (`auto`, `bfloat16`, `float16`, `float32`) -> the one to load in:
    `auto` becomes `bfloat16` where `bf16_is_faster(device, shapes)`, else `float32`."""
    if name != "auto":
        return name
    return "bfloat16" if bf16_is_faster(device, shapes) else "float32"


def resolve_mixed_precision(name: str, device: torch.device | str, shapes: MatmulShapes | None = None) -> str:
    """A recipe `train.mixed_precision` (`auto`, `no`, `bf16`, `fp16`) -> the accelerate
    setting: `auto` becomes `bf16` where `bf16_is_faster(device, shapes)`, else `no`."""
    if name != "auto":
        return name
    return "bf16" if bf16_is_faster(device, shapes) else "no"
