"""What a head directory holds, read once for everyone (DESIGN §5.1): `eyas export
--check`, `eyas push`, import (`export/reader.py`) and `train.init_from` all go
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

from eyas.core.problems import given
from eyas.export.attention_config import read_attention
from eyas.export.layer_shape import layer_shape
from eyas.export.serving_config import (
    EagleBlock,
    EyasBlock,
    EyasEagleBlock,
    SpeculatorsBlock,
    SpeculatorsServingConfig,
    parse_serving_config,
)
from eyas.export.writer import CONFIG_NAME, ExportFormatError
from eyas.heads.algorithms import eagle_layout_algorithm, find_algorithm
from eyas.heads.io import CONFIG_NAME as EYAS_CONFIG

Layout = Literal["eyas", "speculators", "eagle"]


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
    archs = raw.get("architectures")
    if isinstance(archs, list) and any("Eagle3" in str(a) for a in archs):
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
    if not isinstance(name_or_path, str) or not name_or_path:
        return None  # a wrong type is the schema's problem to report
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
# Field presence and types are the schema's (export/serving_config.py); what follows checks
# the fields against each other and against the verifier, and applies vLLM's defaults.


def _speculators_block(
    spec: SpeculatorsBlock, algo, problems: list[str]
) -> tuple[int | None, str | None, list[str]]:
    if None not in (spec.algorithm, algo) and spec.algorithm != algo:
        problems.append(f"speculators_config.algorithm {spec.algorithm!r} != speculators_model_type {algo!r}")
    k = None
    methods = spec.proposal_methods
    if methods:
        k = methods[0].speculative_tokens
        types = [m.proposal_type for m in methods]
        default = spec.default_proposal_method
        if default is not None and default not in types:
            problems.append(f"default_proposal_method {default!r} is not one of {types}")
    verifier = spec.verifier
    return k, verifier.name_or_path, list(verifier.architectures or [])


def _read_aux(top, eagle_cfg: EagleBlock | None, invalid: set[str]) -> tuple[list[int] | None, bool]:
    """The aux ids the config gives (top level, else `eagle_config`), and whether any were given."""
    key = "eagle_aux_hidden_state_layer_ids"
    if given(top, key) or key in invalid:  # a top-level null is not read from eagle_config
        return getattr(top, key), getattr(top, key) is not None or key in invalid
    if eagle_cfg is not None and eagle_cfg.eagle_aux_hidden_state_layer_ids is not None:
        return eagle_cfg.eagle_aux_hidden_state_layer_ids, True
    return None, f"eagle_config.{key}" in invalid  # refused: the schema reported it


def _check_aux(aux: list[int], layer, eagle_cfg, target_layers, problems: list[str]) -> None:
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
    declared = layer.num_aux_hidden_states
    fc_width_known = given(eagle_cfg, "eagle_aux_hidden_state_layer_ids")
    if declared is None and n_aux != 3 and not fc_width_known:
        problems.append(
            f"{n_aux} aux layers but transformer_layer_config.num_aux_hidden_states is missing "
            "(vLLM then assumes 3)"
        )
    elif declared is not None and declared != n_aux:
        problems.append(f"num_aux_hidden_states {declared} != {n_aux} eagle_aux_hidden_state_layer_ids")


def _read_mask(top, vt, invalid: set[str], problems: list[str]) -> int | None:
    """P-EAGLE's mask token: `mask_token_id`, or `ptd_token_id` (older vLLM's name)."""
    names = {n: getattr(top, n) for n in ("mask_token_id", "ptd_token_id") if given(top, n)}
    if any(n in invalid for n in ("mask_token_id", "ptd_token_id")):
        return None  # the schema reported it
    if len(set(map(str, names.values()))) > 1:
        problems.append(f"ptd_token_id {names['ptd_token_id']!r} != mask_token_id {names['mask_token_id']!r}")
    mask_id = next(iter(names.values()), None)
    if mask_id is None:
        problems.append(
            f"P-EAGLE config has mask token {mask_id!r} (mask_token_id / ptd_token_id), expected an integer"
        )
    elif _is_int(vt) and not 0 <= mask_id < vt:
        problems.append(f"mask_token_id {mask_id} lies outside the vocabulary [0, {vt})")
    return mask_id


def _check_target(target: TargetFacts, target_layers, ht, vt, where: str, problems: list[str]) -> None:
    if _is_int(target_layers) and target_layers != target.num_layers:
        problems.append(
            f"the head was built for a {target_layers}-layer target; {target.source} has "
            f"{target.num_layers} layers"
        )
    if _is_int(ht) and ht != target.hidden_size:
        problems.append(
            f"target_hidden_size {ht} != the verifier's hidden_size {target.hidden_size} ({target.source})"
        )
    if _is_int(vt) and vt != target.vocab_size:
        problems.append(
            f"{where}vocab_size {vt} != the verifier's vocab_size {target.vocab_size} ({target.source})"
        )


def read_fields(
    raw: dict,
    fmt: Literal["speculators", "eagle"],
    target: TargetFacts | None,
    problems: list[str],
    notes: list[str],
) -> dict[str, Any]:
    """The head's fields from a serving config, vLLM's defaults applied where published
    configs leave a field out. Unknown values are None (their checks are then skipped)."""
    parsed = parse_serving_config(raw, fmt)
    problems.extend(parsed.problems)
    invalid = parsed.invalid
    config = parsed.config
    if isinstance(config, SpeculatorsServingConfig):
        top, layer, eagle_cfg = config, config.transformer_layer_config, config.eagle_config
        eyas = config.eyas or EyasBlock()
        algo = config.speculators_model_type
        k, verifier, archs = _speculators_block(config.speculators_config, algo, problems)
        where = "transformer_layer_config."
    else:
        top, layer, eagle_cfg = config.head, config.layer, config.head.eagle_config
        eyas = config.head.eyas or EyasEagleBlock()
        has_mask = given(top, "mask_token_id") or given(top, "ptd_token_id")
        algo = eyas.algorithm or eagle_layout_algorithm(has_mask)
        k = eyas.speculative_tokens if given(eyas, "speculative_tokens") else 5
        verifier, archs = eyas.verifier_name_or_path, list(eyas.target_architectures or [])
        where = ""

    shape, layer_notes = layer_shape(layer, where, invalid)
    notes.extend(layer_notes)
    attention = read_attention(layer, shape, where, notes, problems)
    h, vt = layer.hidden_size, layer.vocab_size
    vd = top.draft_vocab_size if given(top, "draft_vocab_size") else vt
    if _is_int(vd) and _is_int(vt) and vd > vt:
        problems.append(f"draft_vocab_size {vd} exceeds the target vocabulary (vocab_size {vt})")
    ht = top.target_hidden_size
    if ht is None and "target_hidden_size" not in invalid:
        ht = h  # speculators and vLLM: null means the head's own width

    nbr = top.norm_before_residual
    if nbr is None and "norm_before_residual" not in invalid:
        known = find_algorithm(algo)
        if known is not None and known.norm_before_residual_default is not None:
            nbr = known.norm_before_residual_default
            notes.append(f"norm_before_residual absent: {nbr}, vLLM's {known.title} default")
        else:
            problems.append(
                "norm_before_residual is not written (its default differs between vLLM's eagle3 and "
                "peagle readers)"
            )
    fc_norm = bool(top.fc_norm or layer.fc_norm)
    before_fc = bool(top.norm_before_fc or (eagle_cfg is not None and eagle_cfg.norm_before_fc))
    if fc_norm and before_fc:
        problems.append("fc_norm and norm_before_fc are both set; they exclude each other")

    target_layers = eyas.target_num_layers
    if target is not None:
        _check_target(target, target_layers, ht, vt, where, problems)
        target_layers = target.num_layers

    aux, aux_declared = _read_aux(top, eagle_cfg, invalid)
    if aux is None and not aux_declared:
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
    if aux:
        _check_aux(aux, layer, eagle_cfg, target_layers, problems)
    if not _is_int(target_layers) and aux:
        target_layers = max(aux) + 1  # the least a target must have

    mask_id = _read_mask(top, vt, invalid, problems) if _needs_mask(algo) else None
    if target is not None:
        archs = archs or list(target.architectures)
    model_type = eyas.target_model_type or (target.model_type if target is not None else "llama")
    return dict(
        algo=algo,
        h=h,
        vt=vt,
        vd=vd,
        ht=ht,
        heads=layer.num_attention_heads,
        kv=shape.num_key_value_heads,
        hd=shape.head_dim,
        inter=layer.intermediate_size,
        layers=layer.num_hidden_layers,
        n_aux=len(aux) if aux else None,
        aux=aux,
        aux_declared=aux_declared,
        fc_norm=fc_norm,
        before_fc=before_fc,
        norm_before_residual=nbr,
        norm_output=bool(top.norm_output or layer.norm_output),
        mask_id=mask_id,
        k=k,
        rms_norm_eps=shape.rms_norm_eps,
        rope_theta=shape.rope_theta,
        **attention,
        max_position_embeddings=shape.max_position_embeddings,
        target_num_layers=target_layers,
        target_model_type=model_type,
        target_architectures=archs,
        verifier=verifier,
        embedding_included=eyas.embedding_included,
    )


# --- the directory ---------------------------------------------------------------------


def _needs_mask(algo) -> bool:
    known = find_algorithm(algo)
    return known is not None and known.needs_mask_token


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
        eyas = raw.get("eyas") if isinstance(raw.get("eyas"), dict) else {}
        target = cached_target_facts(verifier or eyas.get("verifier_name_or_path"))
    out = HeadDir(d, fmt, raw, problems=problems, target=target)
    out.fields = read_fields(raw, fmt, target, out.problems, out.notes)
    return out
