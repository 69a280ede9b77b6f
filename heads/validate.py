"""Check an exported head against the serving contract (DESIGN §5) before vLLM sees it.

vLLM loads a head with missing tensors silently and then serves it with near-zero
acceptance, so this validator is the guard: it checks every config field, every tensor
name, shape and dtype, and the fields against each other, and reports every problem it
finds (not only the first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from eyas.heads.export import CONFIG_NAME, WEIGHTS_NAME, ExportFormatError
from eyas.heads.load_export import read_config, read_tensors

LAYER_CONFIG_KEYS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "num_hidden_layers", "rms_norm_eps", "max_position_embeddings",
                     "vocab_size")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ExportValidationError(ValueError):
    """An export that breaks the serving contract; `.problems` lists every finding."""

    def __init__(self, head_dir, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{head_dir}: {len(problems)} problem(s) with the exported head:\n{lines}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_config(raw: dict, fmt: str, problems: list[str]) -> dict:
    """Config-level checks; returns the fields the tensor checks need (missing ones None)."""
    if fmt == "speculators":
        if "model_type" in raw:
            problems.append("config.json has a top-level model_type; the speculators format must not "
                            "(vLLM would not detect it as a speculators head)")
        algo = raw.get("speculators_model_type")
        if algo not in ("eagle3", "peagle"):
            problems.append(f"speculators_model_type is {algo!r}, expected 'eagle3' or 'peagle'")
        if not raw.get("speculators_version"):
            problems.append("speculators_version is missing")
        if not isinstance(raw.get("architectures"), list) or not raw.get("architectures"):
            problems.append("architectures is missing or not a non-empty list")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            problems.append("transformer_layer_config is missing or not an object")
            layer = {}
        _check_speculators_block(raw.get("speculators_config"), algo, problems)
    else:
        layer = raw
        eyas = raw.get("eyas") or {}
        algo = eyas.get("algorithm", "peagle" if "mask_token_id" in raw else "eagle3")
    for key in LAYER_CONFIG_KEYS:
        if key not in layer:
            problems.append(f"transformer_layer_config.{key} is missing")
    if "rope_theta" not in layer and "rope_parameters" not in layer:
        problems.append("transformer_layer_config has no rope settings (rope_theta / rope_parameters)")
    if layer.get("model_type", "llama") not in ("llama", "qwen3"):
        problems.append(f"transformer_layer_config.model_type is {layer.get('model_type')!r}; vLLM serves llama or qwen3 heads")

    h, vt = layer.get("hidden_size"), layer.get("vocab_size")
    heads, kv, hd = layer.get("num_attention_heads"), layer.get("num_key_value_heads"), layer.get("head_dim")
    vd = raw.get("draft_vocab_size")
    if not _is_int(vd) or vd <= 0:
        problems.append(f"draft_vocab_size is {vd!r}, expected a positive integer")
        vd = None
    elif _is_int(vt) and vd > vt:
        problems.append(f"draft_vocab_size {vd} exceeds the target vocabulary (vocab_size {vt})")
    ht = raw.get("target_hidden_size")
    if not _is_int(ht):
        problems.append(f"target_hidden_size is {ht!r}, expected an integer")
        ht = None
    if not isinstance(raw.get("norm_before_residual"), bool):
        problems.append("norm_before_residual is not written (its default differs between vLLM's eagle3 and peagle readers)")
    fc_norm, before_fc = bool(raw.get("fc_norm") or layer.get("fc_norm")), bool(raw.get("norm_before_fc"))
    if fc_norm and before_fc:
        problems.append("fc_norm and norm_before_fc are both set; they exclude each other")

    aux = raw.get("eagle_aux_hidden_state_layer_ids")
    n_aux = None
    target_layers = (raw.get("eyas") or {}).get("target_num_layers")
    if not isinstance(aux, list) or not aux or not all(_is_int(i) for i in aux):
        problems.append(f"eagle_aux_hidden_state_layer_ids is {aux!r}, expected a non-empty list of integers at the top level")
    else:
        n_aux = len(aux)
        if any(b <= a for a, b in zip(aux, aux[1:])):
            problems.append(f"eagle_aux_hidden_state_layer_ids {aux} are not strictly ascending")
        if aux[0] < 0:
            problems.append(f"eagle_aux_hidden_state_layer_ids {aux} has a negative id")
        if _is_int(target_layers) and aux[-1] >= target_layers:
            problems.append(f"eagle_aux_hidden_state_layer_ids {aux} fall outside the target's {target_layers} layers "
                            f"(ids index decoder layers 0..{target_layers - 1})")
        declared = layer.get("num_aux_hidden_states")
        if declared is None and n_aux != 3:
            problems.append(f"{n_aux} aux layers but transformer_layer_config.num_aux_hidden_states is missing "
                            "(vLLM then assumes 3)")
        elif declared is not None and declared != n_aux:
            problems.append(f"num_aux_hidden_states {declared} != {n_aux} eagle_aux_hidden_state_layer_ids")

    mask_id = None
    if algo == "peagle":
        mask_id = raw.get("mask_token_id")
        if not _is_int(mask_id):
            problems.append(f"P-EAGLE config has mask_token_id {mask_id!r}, expected an integer")
            mask_id = None
        elif _is_int(vt) and not 0 <= mask_id < vt:
            problems.append(f"mask_token_id {mask_id} lies outside the vocabulary [0, {vt})")
        if raw.get("ptd_token_id") != raw.get("mask_token_id"):
            problems.append(f"ptd_token_id {raw.get('ptd_token_id')!r} != mask_token_id {raw.get('mask_token_id')!r} "
                            "(vLLM 0.16 reads only ptd_token_id)")
    return dict(algo=algo, h=h, vt=vt, vd=vd, ht=ht, heads=heads, kv=kv, hd=hd,
                inter=layer.get("intermediate_size"), layers=layer.get("num_hidden_layers"), n_aux=n_aux,
                fc_norm=fc_norm, before_fc=before_fc, mask_id=mask_id,
                embedding_included=(raw.get("eyas") or {}).get("embedding_included"))


def _check_speculators_block(spec, algo, problems: list[str]) -> None:
    if not isinstance(spec, dict):
        problems.append("speculators_config is missing or not an object")
        return
    if spec.get("algorithm") != algo:
        problems.append(f"speculators_config.algorithm {spec.get('algorithm')!r} != speculators_model_type {algo!r}")
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        problems.append("speculators_config.proposal_methods is missing or empty")
    else:
        k = methods[0].get("speculative_tokens")
        if not _is_int(k) or k < 1:
            problems.append(f"proposal_methods[0].speculative_tokens is {k!r}, expected K >= 1")
        types = [m.get("proposal_type") for m in methods if isinstance(m, dict)]
        if spec.get("default_proposal_method") not in types:
            problems.append(f"default_proposal_method {spec.get('default_proposal_method')!r} is not one of {types}")
    verifier = spec.get("verifier")
    if not isinstance(verifier, dict) or not verifier.get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is missing (vllm serve DIR loads this target)")
    elif not isinstance(verifier.get("architectures"), list) or not verifier["architectures"]:
        problems.append("speculators_config.verifier.architectures is missing")


def expected_shapes(f: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the contract requires, from the checked fields."""
    h, ht, n, vd, vt = f["h"], f["ht"], f["n_aux"], f["vd"], f["vt"]
    q, kv = f["heads"] * f["hd"], f["kv"] * f["hd"]
    shapes = {"fc.weight": (h, n * ht), "norm.weight": (h,), "lm_head.weight": (vd, h)}
    for i in range(f["layers"]):
        width = 2 * h if i == 0 else h
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, width), p + "self_attn.k_proj.weight": (kv, width),
            p + "self_attn.v_proj.weight": (kv, width), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f["inter"], h), p + "mlp.up_proj.weight": (f["inter"], h),
            p + "mlp.down_proj.weight": (h, f["inter"]),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if i == 0:
            shapes[p + "hidden_norm.weight"] = (h,)
    if vd != vt:
        shapes.update({"d2t": (vd,), "t2d": (vt,)})
    if f["fc_norm"]:
        shapes.update({f"fc_norm.{i}.weight": (ht,) for i in range(n)})
    if f["before_fc"]:
        shapes["input_norm.weight"] = (n * ht,)
    if f["algo"] == "peagle":
        shapes["mask_hidden"] = (1, n * ht)
    if f["algo"] == "peagle" or h != ht:
        shapes["embed_tokens.weight"] = (vt, h)
    return shapes


def _canonical(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _check_tensors(tensors: dict[str, torch.Tensor], f: dict, problems: list[str]) -> None:
    tensors = {_canonical(k): v for k, v in tensors.items()}
    shapes = expected_shapes(f)
    optional = {"embed_tokens.weight": (f["vt"], f["h"])}  # a shipped embedding when H == Ht
    # vLLM builds hidden_norm in every layer and uses only layer 0's: published heads may ship them.
    optional.update({f"layers.{i}.hidden_norm.weight": (f["h"],) for i in range(1, f["layers"])})
    for name in sorted(tensors):
        if name in shapes or name in optional:
            continue
        if name.startswith("model."):
            problems.append(f"unexpected tensor {name}: names must not carry a 'model.' prefix")
        elif name in ("d2t", "t2d"):
            problems.append(f"unexpected tensor {name}: the draft vocabulary equals the target's "
                            f"(draft_vocab_size = vocab_size = {f['vt']}); vLLM rejects a {name} then")
        elif name.startswith("layers.") and name.split(".")[1].isdigit() and int(name.split(".")[1]) >= f["layers"]:
            problems.append(f"unexpected tensor {name}: the config has num_hidden_layers = {f['layers']}")
        else:
            problems.append(f"unexpected tensor {name}")
    absent_layers = {i for i in range(f["layers"]) if not any(k.startswith(f"layers.{i}.") for k in tensors)}
    for i in sorted(absent_layers):
        problems.append(f"missing every tensor of layers.{i} (num_hidden_layers = {f['layers']})")
    for name, shape in shapes.items():
        if name not in tensors and not (name.startswith("layers.") and int(name.split(".")[1]) in absent_layers):
            problems.append(f"missing tensor {name} {list(shape)}")
    float_dtypes = set()
    for name, t in tensors.items():
        want = shapes.get(name) or optional.get(name)
        if want is None:
            continue
        if tuple(t.shape) != tuple(want):
            hint = f" (fc width must be n·Ht = {f['n_aux']}·{f['ht']})" if name == "fc.weight" else ""
            hint = hint or (f" (rows must equal draft_vocab_size {f['vd']})" if name == "lm_head.weight" else "")
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
        problems.append("d2t target ids (i + d2t[i]) are not strictly ascending (duplicate or unsorted draft rows)")
    if t2d is not None and t2d.dim() == 1 and t2d.numel() == vt:
        t2d = t2d.bool()
        if int(t2d.sum()) != vd:
            problems.append(f"t2d marks {int(t2d.sum())} target ids, expected draft_vocab_size {vd}")
        elif not bool(t2d[ids].all()):
            problems.append("t2d disagrees with d2t: some draft rows map to target ids t2d does not mark")


def validate_export(head_dir: str | Path) -> list[str]:
    """Every problem with an exported head directory (empty list: it is fine)."""
    d = Path(head_dir)
    problems: list[str] = []
    cfg_path = d / CONFIG_NAME
    if not cfg_path.is_file():
        return [f"{cfg_path} is missing"]
    try:
        raw = read_config(cfg_path)
    except ExportFormatError as err:
        return [str(err)]
    fmt = "speculators" if ("speculators_config" in raw or "speculators_model_type" in raw) else "eagle"
    if fmt == "eagle" and not any("Eagle3" in a for a in raw.get("architectures") or []):
        problems.append(f"config.json is neither a speculators config nor an EAGLE-3 config "
                        f"(architectures {raw.get('architectures')})")
    fields = _check_config(raw, fmt, problems)
    try:
        tensors = read_tensors(d)
    except ExportFormatError:
        problems.append(f"{d / WEIGHTS_NAME} is missing")
        return problems
    except Exception as err:  # a damaged file: name it
        problems.append(f"{d / WEIGHTS_NAME} cannot be read: {err}")
        return problems
    needed = ("h", "vt", "vd", "ht", "heads", "kv", "hd", "inter", "layers", "n_aux")
    if all(_is_int(fields[k]) for k in needed):
        _check_tensors(tensors, fields, problems)
    else:
        problems.append("tensor shapes not checked: the config lacks the fields above")
    return problems


def check_export(head_dir: str | Path) -> None:
    """Raise `ExportValidationError` listing every problem, or return quietly."""
    problems = validate_export(head_dir)
    if problems:
        raise ExportValidationError(head_dir, problems)
