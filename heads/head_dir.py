"""What a head directory holds, read once for everyone (DESIGN §5.1): `eyas export
--check`, `eyas push`, import (`heads/load_export.py`) and `train.init_from` all go
through `read_head_dir`, so a head one of them accepts the others accept too.

Layouts: eyas checkpoints (`head_config.json`), the speculators layout (EAGLE-3 and
P-EAGLE, as eyas, RedHatAI and amazon publish it) and the original EAGLE-3 layout (a flat
llama config with an `Eagle3` architecture, as EAGLE, SpecForge and NVIDIA ModelOpt
publish it). Published configs leave fields out that vLLM then defaults; the reading
applies vLLM's default and records it in `notes`, and reports in `problems` what vLLM
could not serve or what contradicts the verifier's own config when that is at hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eyas.heads.export import CONFIG_NAME, ExportFormatError
from eyas.heads.io import CONFIG_NAME as EYAS_CONFIG

Layout = Literal["eyas", "speculators", "eagle"]
ALGORITHMS = ("eagle3", "peagle")
# HF LlamaConfig's defaults, which vLLM applies to a head config that leaves them out.
LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0}
REQUIRED_LAYER_KEYS = (
    "model_type",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "num_hidden_layers",
    "vocab_size",
)


@dataclass(frozen=True)
class TargetFacts:
    """What a head must agree with in its verifier's config."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    model_type: str
    architectures: tuple[str, ...]
    source: str  # where the facts were read, for messages


@dataclass
class HeadDir:
    """A head directory as read: its layout, the normalised fields (None where unknown),
    what was assumed (`notes`) and what is wrong (`problems`)."""

    path: Path
    layout: Layout
    raw: dict
    fields: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    target: TargetFacts | None = None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_config(path: str | Path) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ExportFormatError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ExportFormatError(f"{path}: a config must be a JSON object")
    return raw


def layout_of(raw: dict) -> Layout | None:
    if raw.get("speculators_config") is not None or "speculators_model_type" in raw:
        return "speculators"
    if any("Eagle3" in str(a) for a in raw.get("architectures") or []):
        return "eagle"
    return None


def detect_format(head_dir: str | Path) -> Layout:
    """Which layout a head directory holds (ExportFormatError when none)."""
    d = Path(head_dir)
    if (d / EYAS_CONFIG).is_file():
        return "eyas"
    cfg_path = d / CONFIG_NAME
    if not cfg_path.is_file():
        raise ExportFormatError(f"{d}: no {EYAS_CONFIG} or {CONFIG_NAME}; not a head directory")
    raw = read_config(cfg_path)
    fmt = layout_of(raw)
    if fmt is None:
        raise ExportFormatError(
            f"{cfg_path}: neither a speculators config nor an EAGLE-3 config "
            f"(architectures {raw.get('architectures')})"
        )
    return fmt


# --- the verifier ----------------------------------------------------------------------


def target_facts(config: Any, source: str) -> TargetFacts:
    """Facts from a target's HF config (object or dict; a nested text_config is used)."""
    get = (lambda c, k: c.get(k)) if isinstance(config, dict) else (lambda c, k: getattr(c, k, None))
    text = get(config, "text_config") or config
    return TargetFacts(
        num_layers=int(get(text, "num_hidden_layers")),
        hidden_size=int(get(text, "hidden_size")),
        vocab_size=int(get(text, "vocab_size")),
        model_type=str(get(text, "model_type") or "llama"),
        architectures=tuple(get(config, "architectures") or ()),
        source=source,
    )


def cached_target_facts(name_or_path: str | None) -> TargetFacts | None:
    """The verifier's facts when its config.json is on this machine (a local directory, or
    the Hugging Face cache); never asks the Hub."""
    if not name_or_path:
        return None
    path = Path(name_or_path) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(name_or_path, "config.json")
        except Exception:  # not a repo id
            return None
        if not isinstance(hit, str):
            return None
        path = Path(hit)
    try:
        return target_facts(json.loads(path.read_text()), str(path))
    except (OSError, ValueError, TypeError):
        return None


def vllm_default_aux_ids(num_layers: int) -> list[int]:
    """The aux layers vLLM uses for a head that names none: (2, L//2, L-3)."""
    return [2, num_layers // 2, num_layers - 3]


# --- the config ------------------------------------------------------------------------


def _speculators_block(raw: dict, algo, problems: list[str]) -> tuple[int | None, str | None, list[str]]:
    spec = raw.get("speculators_config")
    if not isinstance(spec, dict):
        problems.append("speculators_config is missing or not an object")
        return None, None, []
    if spec.get("algorithm") != algo:
        problems.append(
            f"speculators_config.algorithm {spec.get('algorithm')!r} != speculators_model_type {algo!r}"
        )
    k = None
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], dict):
        problems.append("speculators_config.proposal_methods is missing or empty")
    else:
        k = methods[0].get("speculative_tokens")
        if not _is_int(k) or k < 1:
            problems.append(f"proposal_methods[0].speculative_tokens is {k!r}, expected K >= 1")
            k = None
        types = [m.get("proposal_type") for m in methods if isinstance(m, dict)]
        if spec.get("default_proposal_method") not in types:
            problems.append(
                f"default_proposal_method {spec.get('default_proposal_method')!r} is not one of {types}"
            )
    verifier = spec.get("verifier")
    path, archs = None, []
    if not isinstance(verifier, dict) or not verifier.get("name_or_path"):
        problems.append(
            "speculators_config.verifier.name_or_path is missing (vllm serve DIR loads this target)"
        )
    else:
        path = verifier["name_or_path"]
        archs = verifier.get("architectures")
        if not isinstance(archs, list) or not archs:
            problems.append("speculators_config.verifier.architectures is missing")
            archs = []
    return k, path, list(archs)


def read_fields(
    raw: dict,
    fmt: Literal["speculators", "eagle"],
    target: TargetFacts | None,
    problems: list[str],
    notes: list[str],
) -> dict[str, Any]:
    """The head's fields from a serving config, vLLM's defaults applied where published
    configs leave a field out. Unknown values are None (their checks are then skipped)."""
    eyas = raw.get("eyas") if isinstance(raw.get("eyas"), dict) else {}
    eagle_cfg = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    k, verifier, archs = None, eyas.get("verifier_name_or_path"), list(eyas.get("target_architectures") or [])
    if fmt == "speculators":
        if "model_type" in raw:
            problems.append(
                "config.json has a top-level model_type; the speculators format must not "
                "(vLLM would not detect it as a speculators head)"
            )
        algo = raw.get("speculators_model_type")
        if algo not in ALGORITHMS:
            problems.append(f"speculators_model_type is {algo!r}, expected 'eagle3' or 'peagle'")
        if not raw.get("speculators_version"):
            problems.append("speculators_version is missing")
        if not isinstance(raw.get("architectures"), list) or not raw.get("architectures"):
            problems.append("architectures is missing or not a non-empty list")
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            problems.append("transformer_layer_config is missing or not an object")
            layer = {}
        k, verifier, archs = _speculators_block(raw, algo, problems)
        where = "transformer_layer_config."
    else:
        layer, where = raw, ""
        has_mask = "mask_token_id" in raw or "ptd_token_id" in raw
        algo = eyas.get("algorithm", "peagle" if has_mask else "eagle3")
        k = eyas.get("speculative_tokens", 5)

    for key in REQUIRED_LAYER_KEYS:
        if key not in layer:
            problems.append(f"{where}{key} is missing")
    if layer.get("model_type", "llama") not in ("llama", "qwen3"):
        problems.append(f"{where}model_type is {layer.get('model_type')!r}; vLLM serves llama or qwen3 heads")
    h, vt, heads = layer.get("hidden_size"), layer.get("vocab_size"), layer.get("num_attention_heads")
    defaulted = []
    kv = layer.get("num_key_value_heads")
    if kv is None and _is_int(heads):
        kv = heads
        defaulted.append(f"num_key_value_heads={heads}")
    hd = layer.get("head_dim")
    if hd is None and _is_int(h) and _is_int(heads) and heads:
        hd = h // heads
        defaulted.append(f"head_dim={hd}")
    values = {}
    for key, default in LLAMA_DEFAULTS.items():
        if key == "rope_theta":
            params = layer.get("rope_parameters") if isinstance(layer.get("rope_parameters"), dict) else {}
            value = params.get("rope_theta", layer.get("rope_theta"))
        else:
            value = layer.get(key)
        if value is None:
            value = default
            defaulted.append(f"{key}={default}")
        values[key] = value
    scaling = layer.get("rope_scaling") or (layer.get("rope_parameters") or {})
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind and kind != "default":
        notes.append(
            f"{where}rope_scaling {kind!r}: eyas's head applies plain rope (theta "
            f"{values['rope_theta']}), so "
            "its training and offline eval differ from vLLM's serving of this config at long positions; "
            "an export from eyas writes plain rope"
        )
    if defaulted:
        notes.append(
            f"{where or 'config.json: '}absent, the llama defaults vLLM applies: {', '.join(defaulted)}"
        )

    vd = raw.get("draft_vocab_size", vt)
    if not _is_int(vd) or vd <= 0:
        problems.append(f"draft_vocab_size is {vd!r}, expected a positive integer")
        vd = None
    elif _is_int(vt) and vd > vt:
        problems.append(f"draft_vocab_size {vd} exceeds the target vocabulary (vocab_size {vt})")
    ht = raw.get("target_hidden_size")
    if ht is None and _is_int(h):
        ht = h  # speculators and vLLM: null means the head's own width
    elif not _is_int(ht):
        problems.append(f"target_hidden_size is {ht!r}, expected an integer or null")
        ht = None

    nbr = raw.get("norm_before_residual")
    if not isinstance(nbr, bool):
        if algo == "eagle3" and nbr is None:
            nbr = False
            notes.append("norm_before_residual absent: False, vLLM's EAGLE-3 default")
        else:
            problems.append(
                "norm_before_residual is not written (its default differs between vLLM's eagle3 and "
                "peagle readers)"
            )
            nbr = None
    fc_norm = bool(raw.get("fc_norm") or layer.get("fc_norm"))
    before_fc = bool(raw.get("norm_before_fc") or eagle_cfg.get("norm_before_fc"))
    if fc_norm and before_fc:
        problems.append("fc_norm and norm_before_fc are both set; they exclude each other")

    target_layers = eyas.get("target_num_layers")
    if target is not None:
        if _is_int(target_layers) and target_layers != target.num_layers:
            problems.append(
                f"the head was built for a {target_layers}-layer target; {target.source} has "
                f"{target.num_layers} layers"
            )
        target_layers = target.num_layers
        if _is_int(ht) and ht != target.hidden_size:
            problems.append(
                f"target_hidden_size {ht} != the verifier's hidden_size {target.hidden_size} "
                f"({target.source})"
            )
        if _is_int(vt) and vt != target.vocab_size:
            problems.append(
                f"{where}vocab_size {vt} != the verifier's vocab_size {target.vocab_size} ({target.source})"
            )

    aux = raw.get("eagle_aux_hidden_state_layer_ids", eagle_cfg.get("eagle_aux_hidden_state_layer_ids"))
    aux_declared = aux is not None
    if aux is None:
        if _is_int(target_layers):
            aux = vllm_default_aux_ids(target_layers)
            notes.append(
                f"eagle_aux_hidden_state_layer_ids absent: {aux}, vLLM's default (2, L//2, L-3) for the "
                f"verifier's {target_layers} layers; a head trained on other layers drafts badly"
            )
        else:
            problems.append(
                "eagle_aux_hidden_state_layer_ids absent and the verifier's config is not at hand: the "
                "target layers feeding the head are unknown (pass the target, e.g. --target, so vLLM's "
                "default (2, L//2, L-3) can be applied)"
            )
    n_aux = None
    if aux is not None:
        if not isinstance(aux, list) or not aux or not all(_is_int(i) for i in aux):
            problems.append(
                f"eagle_aux_hidden_state_layer_ids is {aux!r}, expected a non-empty list of integers"
            )
            aux = None
        else:
            n_aux = len(aux)
            if any(b <= a for a, b in zip(aux, aux[1:])):
                problems.append(f"eagle_aux_hidden_state_layer_ids {aux} are not strictly ascending")
            if aux[0] < 0:
                problems.append(f"eagle_aux_hidden_state_layer_ids {aux} has a negative id")
            if _is_int(target_layers) and aux[-1] >= target_layers:
                problems.append(
                    f"eagle_aux_hidden_state_layer_ids {aux} fall outside the target's {target_layers} "
                    f"layers (ids index decoder layers 0..{target_layers - 1})"
                )
            declared = layer.get("num_aux_hidden_states")
            fc_width_known = "eagle_aux_hidden_state_layer_ids" in eagle_cfg
            if declared is None and n_aux != 3 and not fc_width_known:
                problems.append(
                    f"{n_aux} aux layers but transformer_layer_config.num_aux_hidden_states is missing "
                    "(vLLM then assumes 3)"
                )
            elif declared is not None and declared != n_aux:
                problems.append(
                    f"num_aux_hidden_states {declared} != {n_aux} eagle_aux_hidden_state_layer_ids"
                )
    if not _is_int(target_layers) and aux:
        target_layers = max(aux) + 1  # the least a target must have

    mask_id = None
    if algo == "peagle":
        names = {n: raw[n] for n in ("mask_token_id", "ptd_token_id") if n in raw}
        if len(set(map(str, names.values()))) > 1:
            problems.append(f"ptd_token_id {raw['ptd_token_id']!r} != mask_token_id {raw['mask_token_id']!r}")
        mask_id = next(iter(names.values()), None)
        if not _is_int(mask_id):
            problems.append(
                f"P-EAGLE config has mask token {mask_id!r} (mask_token_id / ptd_token_id), "
                "expected an integer"
            )
            mask_id = None
        elif _is_int(vt) and not 0 <= mask_id < vt:
            problems.append(f"mask_token_id {mask_id} lies outside the vocabulary [0, {vt})")

    if target is not None:
        archs = archs or list(target.architectures)
    model_type = eyas.get("target_model_type") or (target.model_type if target is not None else "llama")
    return dict(
        algo=algo,
        h=h,
        vt=vt,
        vd=vd,
        ht=ht,
        heads=heads,
        kv=kv,
        hd=hd,
        inter=layer.get("intermediate_size"),
        layers=layer.get("num_hidden_layers"),
        n_aux=n_aux,
        aux=aux,
        aux_declared=aux_declared,
        fc_norm=fc_norm,
        before_fc=before_fc,
        norm_before_residual=nbr,
        norm_output=bool(raw.get("norm_output") or layer.get("norm_output")),
        mask_id=mask_id,
        k=k,
        rms_norm_eps=values["rms_norm_eps"],
        rope_theta=float(values["rope_theta"]),
        max_position_embeddings=values["max_position_embeddings"],
        target_num_layers=target_layers,
        target_model_type=model_type,
        target_architectures=archs,
        verifier=verifier,
        embedding_included=eyas.get("embedding_included"),
    )


# --- the directory ---------------------------------------------------------------------


def read_head_dir(head_dir: str | Path, target: TargetFacts | None = None) -> HeadDir:
    """Read a serving-layout head directory: its config normalised against `target` (or
    the verifier's config when it is on this machine). Tensors are not read here."""
    d = Path(head_dir)
    cfg_path = d / CONFIG_NAME
    if not cfg_path.is_file():
        if (d / EYAS_CONFIG).is_file():
            return HeadDir(
                d,
                "eyas",
                {},
                problems=[
                    f"{d} is an eyas checkpoint, not an export: run `eyas export --checkpoint {d}` first"
                ],
            )
        return HeadDir(d, "speculators", {}, problems=[f"{cfg_path} is missing"])
    try:
        raw = read_config(cfg_path)
    except ExportFormatError as err:
        return HeadDir(d, "speculators", {}, problems=[str(err)])
    fmt = layout_of(raw)
    problems: list[str] = []
    if fmt is None:
        problems.append(
            f"config.json is neither a speculators config nor an EAGLE-3 config "
            f"(architectures {raw.get('architectures')})"
        )
        fmt = "eagle"
    if target is None:
        spec = raw.get("speculators_config") if isinstance(raw.get("speculators_config"), dict) else {}
        verifier = (
            (spec.get("verifier") or {}).get("name_or_path")
            if isinstance(spec.get("verifier"), dict)
            else None
        )
        target = cached_target_facts(verifier or (raw.get("eyas") or {}).get("verifier_name_or_path"))
    out = HeadDir(d, fmt, raw, problems=problems, target=target)
    out.fields = read_fields(raw, fmt, target, out.problems, out.notes)
    return out
