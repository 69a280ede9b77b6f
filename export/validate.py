"""Check an exported head against the serving contract (DESIGN §5) before vLLM sees it.

vLLM loads a head with missing tensors silently and then serves it with near-zero
acceptance, so this validator is the guard: it checks every config field, every tensor
name, shape and dtype, and the fields against each other, and reports every problem it
finds (not only the first).
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.export.head_dir import HeadDir, TargetFacts, _is_int, read_head_dir
from eyas.export.head_weights import canonical_tensors, read_tensors
from eyas.export.writer import ExportFormatError
from eyas.heads.algorithms import algorithm_names, get_algorithm

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ExportValidationError(ValueError):
    """An export that breaks the serving contract; `.problems` lists every finding."""

    def __init__(self, head_dir, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{head_dir}: {len(problems)} problem(s) with the exported head:\n{lines}")


def expected_shapes(f: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the contract requires, from the checked fields."""
    h, ht, n, vd, vt = f["h"], f["ht"], f["n_aux"], f["vd"], f["vt"]
    q, kv = f["heads"] * f["hd"], f["kv"] * f["hd"]
    shapes = {"fc.weight": (h, n * ht), "norm.weight": (h,), "lm_head.weight": (vd, h)}
    for i in range(f["layers"]):
        width = 2 * h if i == 0 else h
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, width),
                p + "self_attn.k_proj.weight": (kv, width),
                p + "self_attn.v_proj.weight": (kv, width),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (f["inter"], h),
                p + "mlp.up_proj.weight": (f["inter"], h),
                p + "mlp.down_proj.weight": (h, f["inter"]),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if i == 0:
            shapes[p + "hidden_norm.weight"] = (h,)
    if vd != vt:
        shapes["d2t"] = (vd,)  # vLLM reads only d2t; a t2d, when shipped, is checked (optional below)
    if f["fc_norm"]:
        shapes.update({f"fc_norm.{i}.weight": (ht,) for i in range(n)})
    if f["before_fc"]:
        shapes["input_norm.weight"] = (n * ht,)
    algo = get_algorithm(f["algo"]) if f["algo"] in algorithm_names() else None
    if algo is not None and algo.needs_mask_token:
        shapes["mask_hidden"] = (1, n * ht)
    if (algo is not None and algo.trains_embedding) or h != ht:
        shapes["embed_tokens.weight"] = (vt, h)
    return shapes


def _check_tensors(tensors: dict[str, torch.Tensor], f: dict, problems: list[str]) -> None:
    tensors = canonical_tensors(tensors)
    shapes = expected_shapes(f)
    optional = {"embed_tokens.weight": (f["vt"], f["h"])}  # a shipped embedding when H == Ht
    # vLLM builds hidden_norm in every layer and uses only layer 0's: published heads may ship them.
    optional.update({f"layers.{i}.hidden_norm.weight": (f["h"],) for i in range(1, f["layers"])})
    if f["vd"] != f["vt"]:
        optional["t2d"] = (f["vt"],)
    for name in sorted(tensors):
        if name in shapes or name in optional:
            continue
        if name.startswith("model."):
            problems.append(f"unexpected tensor {name}: names must not carry a 'model.' prefix")
        elif name in ("d2t", "t2d") and f["vd"] == f["vt"]:
            problems.append(
                f"unexpected tensor {name}: the draft vocabulary equals the target's "
                f"(draft_vocab_size = vocab_size = {f['vt']}); vLLM rejects a {name} then"
            )
        elif (
            name.startswith("layers.")
            and name.split(".")[1].isdigit()
            and int(name.split(".")[1]) >= f["layers"]
        ):
            problems.append(f"unexpected tensor {name}: the config has num_hidden_layers = {f['layers']}")
        else:
            problems.append(f"unexpected tensor {name}")
    absent_layers = {i for i in range(f["layers"]) if not any(k.startswith(f"layers.{i}.") for k in tensors)}
    for i in sorted(absent_layers):
        problems.append(f"missing every tensor of layers.{i} (num_hidden_layers = {f['layers']})")
    for name, shape in shapes.items():
        if name not in tensors and not (
            name.startswith("layers.") and int(name.split(".")[1]) in absent_layers
        ):
            problems.append(f"missing tensor {name} {list(shape)}")
    float_dtypes = set()
    for name, t in tensors.items():
        want = shapes.get(name) or optional.get(name)
        if want is None:
            continue
        if tuple(t.shape) != tuple(want):
            hint = f" (fc width must be n·Ht = {f['n_aux']}·{f['ht']})" if name == "fc.weight" else ""
            hint = hint or (
                f" (rows must equal draft_vocab_size {f['vd']})" if name == "lm_head.weight" else ""
            )
            problems.append(f"{name} has shape {list(t.shape)}, expected {list(want)}{hint}")
        if name == "d2t":
            if t.dtype != torch.int64:
                problems.append(f"d2t has dtype {t.dtype}, expected torch.int64")
        elif name == "t2d":
            if t.dtype != torch.bool:
                problems.append(f"t2d has dtype {t.dtype}, expected torch.bool")
        elif t.dtype not in FLOAT_DTYPES:
            problems.append(f"{name} has dtype {t.dtype}, expected a float dtype (bfloat16/float16/float32)")
        else:
            float_dtypes.add(t.dtype)
            if not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                problems.append(f"{name} has {bad} non-finite value(s)")
    if len(float_dtypes) > 1:
        problems.append(f"weights mix dtypes {sorted(str(d) for d in float_dtypes)}; vLLM loads one dtype")
    _check_vocab_map(tensors, f, problems)


def _check_vocab_map(tensors: dict, f: dict, problems: list[str]) -> None:
    d2t, t2d, vd, vt = tensors.get("d2t"), tensors.get("t2d"), f["vd"], f["vt"]
    if d2t is None or vd == vt or d2t.dim() != 1:
        return
    ids = torch.arange(d2t.numel()) + d2t.long()
    outside = int(((ids < 0) | (ids >= vt)).sum())
    if outside:
        problems.append(f"d2t maps {outside} draft row(s) outside the target vocabulary [0, {vt})")
        return
    if bool((ids[1:] <= ids[:-1]).any()):
        problems.append(
            "d2t target ids (i + d2t[i]) are not strictly ascending (duplicate or unsorted draft rows)"
        )
    if t2d is not None and t2d.dim() == 1 and t2d.numel() == vt:
        t2d = t2d.bool()
        if int(t2d.sum()) != vd:
            problems.append(f"t2d marks {int(t2d.sum())} target ids, expected draft_vocab_size {vd}")
        elif not bool(t2d[ids].all()):
            problems.append("t2d disagrees with d2t: some draft rows map to target ids t2d does not mark")


def inspect_export(head_dir: str | Path, target: TargetFacts | None = None) -> tuple[HeadDir, dict]:
    """The directory as read (`HeadDir`, every problem listed) and its tensors ({} when
    they cannot be read). The one reading behind `--check`, push and import."""
    hd = read_head_dir(head_dir, target)
    if hd.layout == "eyas" or not hd.raw:
        return hd, {}
    try:
        tensors = read_tensors(hd.path)
    except ExportFormatError as err:
        hd.problems.append(str(err))
        return hd, {}
    needed = ("h", "vt", "vd", "ht", "heads", "kv", "hd", "inter", "layers", "n_aux")
    if all(_is_int(hd.fields.get(k)) for k in needed):
        _check_tensors(tensors, hd.fields, hd.problems)
    else:
        hd.problems.append("tensor shapes not checked: the config lacks the fields above")
    return hd, tensors


def validate_export(head_dir: str | Path, target: TargetFacts | None = None) -> list[str]:
    """Every problem with an exported head directory (empty list: it is fine)."""
    return inspect_export(head_dir, target)[0].problems


def check_export(head_dir: str | Path, target: TargetFacts | None = None) -> None:
    """Raise `ExportValidationError` listing every problem, or return quietly."""
    problems = validate_export(head_dir, target)
    if problems:
        raise ExportValidationError(head_dir, problems)
