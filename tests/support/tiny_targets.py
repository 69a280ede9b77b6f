"""Tiny random targets for tests: Llama, Qwen3-MoE (the Qwen3-Coder family) and GPT-OSS,
built from small configs in code, each saved with a byte-level tokenizer and a ChatML
chat template so the whole pipeline (templates, capture, training, eval) runs on them.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
TINY_VOCAB = 320  # 256 bytes + specials, rounded up
TINY_LAYERS = 8
FAMILIES = ("llama", "qwen3_moe", "gpt_oss")


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is a token, plus the
    ChatML specials. Handles any text and reports offsets, like a real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(byte_vocab):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(family: str, tokenizer=None):
    """The family's tiny config; with `tokenizer`, sized to its vocabulary and using its
    special ids (a real tokenizer on a tiny model)."""
    from transformers import GptOssConfig, LlamaConfig, Qwen3MoeConfig

    ids = dict(bos_token_id=0, eos_token_id=2, pad_token_id=3)
    if tokenizer is not None:
        eos = tokenizer.eos_token_id
        ids = dict(
            bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        )
    common = dict(
        vocab_size=len(tokenizer) if tokenizer is not None else TINY_VOCAB,
        hidden_size=64,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **ids,
    )
    if family == "llama":
        return LlamaConfig(intermediate_size=128, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    if family == "gpt_oss":
        return GptOssConfig(
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (TINY_LAYERS // 2),
            **common,
        )
    raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")


def build_tiny_model(family: str, seed: int = 0, tokenizer=None):
    """A randomly initialised tiny causal LM of the family, in eval mode (float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, tokenizer)
    attn = "eager" if family == "gpt_oss" else "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    # Larger random weights than the default init give peaked, input-dependent
    # distributions, so acceptance tests can tell a good head from a bad one.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    return model.eval()


def save_tiny_target(
    family: str, out_dir: Path, seed: int = 0, tokenizer=None, stop_tokens: tuple[str, ...] = ()
) -> Path:
    """Write the tiny model and its tokenizer (default: the byte tokenizer) as an ordinary
    HF directory; `stop_tokens` go into its generation config as end-of-reply ids."""
    out_dir = Path(out_dir)
    model = build_tiny_model(family, seed, tokenizer)
    if stop_tokens:
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(list(stop_tokens))
    model.save_pretrained(out_dir, safe_serialization=True)
    (tokenizer or byte_tokenizer()).save_pretrained(out_dir)
    return out_dir
