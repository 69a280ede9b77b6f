"""Chat templates in the shapes of real families, for the mask golden tests (written
for eyas, not copied): Llama-3 headers, Qwen3 ChatML with <think> blocks (earlier turns'
thinking dropped, as Qwen3 does), and GPT-OSS harmony with analysis/final channels
(earlier turns' analysis dropped, the last final message ending in <|return|>)."""

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}"
    "{{ '<think>\n' + m['reasoning_content'] + '\n</think>\n\n' }}"
    "{%- endif -%}"
    "{{ m['content'] + '<|im_end|>\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
QWEN3_SPECIALS = ["<think>", "</think>"]

HARMONY_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- if loop.last and m.get('thinking') -%}"
    "{{ '<|start|>assistant<|channel|>analysis<|message|>' + m['thinking'] + '<|end|>' }}"
    "{%- endif -%}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] }}"
    "{{ '<|return|>' if loop.last else '<|end|>' }}"
    "{%- else -%}"
    "{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}"
)
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!", "reasoning": "greet back"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4.", "reasoning": "add them"},
]


def family_tokenizer(family: str):
    """The tiny byte tokenizer with the family's specials and template."""
    from support.tiny_targets import byte_tokenizer

    tok = byte_tokenizer()
    if family == "llama3":
        tok.add_tokens(LLAMA3_SPECIALS, special_tokens=True)
        tok.chat_template = LLAMA3_TEMPLATE
        tok.bos_token = "<|begin_of_text|>"
    elif family == "qwen3":
        tok.add_tokens(QWEN3_SPECIALS, special_tokens=True)
        tok.chat_template = QWEN3_TEMPLATE
    elif family == "harmony":
        tok.add_tokens(HARMONY_SPECIALS, special_tokens=True)
        tok.chat_template = HARMONY_TEMPLATE
    elif family != "chatml":
        raise ValueError(family)
    return tok
