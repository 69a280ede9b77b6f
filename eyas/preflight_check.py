"""Preflight's reports and checks (DESIGN §2.9): the plan as text, the one-line refusal,
the hardware a recipe's header states, the "what fits where" table of
docs/distributed.md, and the check `eyas prepare` / `eyas train` run on the GPUs they
find before loading anything. The sizing itself: eyas/preflight.py.
"""

from __future__ import annotations

import logging
import re
import shlex

from eyas.eval.sizes import HARDWARE
from eyas.preflight import preflight
from eyas.preflight_plan import GB, Preflight, PreflightError

log = logging.getLogger(__name__)


def format_preflight(p: Preflight) -> str:
    lines = [
        f"preflight {p.recipe}: {p.nodes} x {p.gpus} {p.gpu} ({p.strategy}); target {p.weights}; "
        f"attention {p.attention}"
    ]
    for s in p.stages:
        verdict = "fits" if s.fits else "DOES NOT FIT"
        lines.append(f"  {s.stage}: {s.peak / GB:.1f} GB of {s.budget / GB:.1f} GB per rank: {verdict}")
        for k, v in s.per_rank.items():
            lines.append(f"    {k:<45} {v / GB:8.2f} GB")
        if s.seconds_per_mtok is not None:
            lines.append(f"    time: {s.seconds_per_mtok:.0f} s per million tokens (roofline estimate)")
        lines.extend(f"    {n}" for n in s.notes)
        if s.problem:
            lines.append(f"    problem: {s.problem}")
        if s.knob:
            lines.append(f"    fix: {s.knob}")
    for k, v in p.disk.items():
        lines.append(f"  disk: {v / GB:.1f} GB {k.removeprefix('feature cache bytes')}")
    return "\n".join(lines)


def refusal(p: Preflight) -> str:
    """One line per stage that does not fit, for the CLI and the stages' check."""
    bad = [s for s in p.stages if not s.fits]
    return "; ".join(
        f"{p.recipe or 'recipe'} does not fit {p.nodes} x {p.gpus} {p.gpu}: stage {s.stage} needs "
        f"{s.peak / GB:.1f} GB per rank of {s.budget / GB:.1f} GB"
        + (f" ({s.problem})" if s.problem else "")
        + f"; fix: {s.knob}"
        for s in bad
    )


HEADER = re.compile(r"^#\s*preflight:((?:\s+--\w+\s+[\w-]+)+)", re.M)


def header_hardware(text: str) -> dict | None:
    """The hardware a recipe's header states (`# preflight: --gpu H200 --gpus 8`), or None."""
    m = HEADER.search(text)
    if not m:
        return None
    words = shlex.split(m.group(1))
    out = {"gpu": "H100-80", "gpus": 8, "nodes": 1, "strategy": "ddp"}
    for key, value in zip(words[::2], words[1::2]):
        out[key.lstrip("-")] = value if key in ("--gpu", "--strategy") else int(value)
    return out


def fits_table(paths) -> str:
    """docs/distributed.md's "what fits where": each recipe on the hardware its header
    states, as preflight sizes it (a test holds the doc to this output)."""
    from pathlib import Path

    from eyas.recipe import load_recipe

    rows = [
        "| recipe | hardware (header) | target weights per GPU | train peak per GPU "
        "| regeneration engine | fits |",
        "|---|---|---|---|---|---|",
    ]
    for path in paths:
        hw = header_hardware(Path(path).read_text())
        if hw is None:
            continue
        p = preflight(load_recipe(path), recipe_name=str(path), **hw)
        train = next(s for s in p.stages if s.stage == "train")
        regen = next((s for s in p.stages if s.stage == "regenerate"), None)
        engine = regen.notes[0].split(";")[0].removeprefix("engine ") if regen and regen.notes else "none"
        rows.append(
            f"| `{Path(path).name}` | {p.nodes} x {p.gpus} {p.gpu} ({p.strategy}) | {p.weights} | "
            f"{train.peak / GB:.0f} of {train.budget / GB:.0f} GB | {engine} | {'yes' if p.fits else 'NO'} |"
        )
    return "\n".join(rows)


def local_gpus() -> tuple[str, int, int] | None:
    """(GPU profile spec, GPUs per node, nodes) of the GPUs this process sees, or None on a
    machine without CUDA. The profile is the planner's by name (H100, H200, ...), with the
    device's own memory."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    name = next((n for n in HARDWARE if n in props.name.replace(" ", "")), "H100")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or torch.cuda.device_count())
    nodes = max(1, int(os.environ.get("WORLD_SIZE", per_node)) // per_node)
    return f"{name}-{int(props.total_memory // GB)}", per_node, nodes


def launch_strategy() -> str:
    """The head's strategy under `accelerate launch`, from the environment it sets."""
    import os

    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "zero3" if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3" else "zero2"
    return "ddp"


def check_stage(recipe, stage: str, recipe_name: str = "") -> Preflight | None:
    """`eyas prepare` / `eyas train`'s check before loading anything: `stage` sized on the
    GPUs found here; raises PreflightError with preflight's message when it cannot fit.
    None where there is no GPU to size (a CPU run)."""
    found = local_gpus()
    if found is None:
        return None
    from eyas.target.shapes import ShapeError

    gpu, per_node, nodes = found
    try:
        p = preflight(recipe, gpu, per_node, nodes, launch_strategy(), recipe_name)
    except ShapeError as err:  # the stage loads the target itself and says what is missing
        log.warning("preflight skipped: %s", err)
        return None
    p.stages = [s for s in p.stages if s.stage == stage]
    if not p.fits:
        raise PreflightError(
            f"{refusal(p)} (eyas preflight -r RECIPE shows the plan; --no-preflight skips it)"
        )
    return p
