"""The settings of one offline evaluation (DESIGN §6): built once from the recipe's eval
section and passed whole to the decoding loop (eval/evaluate.py::run_eval), so a new
setting is one field here and one line in `from_section`."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.eval.context_buckets import DEFAULT_EDGES


@dataclass(frozen=True)
class EvalSettings:
    k: int  # draft tokens per step
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0  # the sampling generator of each sequence derives from it
    # A greedy mismatch where the target's top two logits are this close is a near tie;
    # None: the dtype's own (eval/lossless.py::TIE_TOLERANCE).
    tie_tolerance: float | None = None
    # Token-only drafters walked over the plain output instead of decoded (greedy only).
    replay: frozenset[str] = frozenset()
    # Under greedy: the prompts (evenly spaced) every drafter decodes; on the others each is
    # replayed over the plain output. None: all decoded.
    decoded_prompts: int | None = None
    # The sampler at temperature > 0: the target's distribution shaped by top_k (0: off)
    # and top_p; `greedy_drafts`: the drafter proposes its argmax, as vLLM's does.
    top_k: int = 0
    top_p: float = 1.0
    greedy_drafts: bool = False
    # The edges (tokens) of the context buckets acceptance is also summarised in.
    context_buckets: tuple[int, ...] = DEFAULT_EDGES

    @classmethod
    def from_section(cls, ev, replay=frozenset(), tie_tolerance: float | None = None) -> EvalSettings:
        """From the recipe's eval section: vLLM drafts by the drafter's argmax unless its
        `draft_sample_method` is probabilistic."""
        return cls(
            k=ev.k,
            max_new_tokens=ev.max_new_tokens,
            temperature=ev.temperature,
            seed=ev.seed,
            tie_tolerance=tie_tolerance,
            replay=frozenset(replay),
            decoded_prompts=ev.decoded_prompts,
            top_k=ev.top_k,
            top_p=ev.top_p,
            greedy_drafts=ev.sampler == "vllm" and ev.draft_sample_method == "greedy",
            context_buckets=tuple(ev.context_buckets),
        )

    def decoded_at(self, count: int) -> set[int]:
        """The prompts every drafter decodes: all, or under greedy `decoded_prompts` of the
        `count` evenly spaced (the first included)."""
        n = self.decoded_prompts if self.temperature <= 0 else None
        return set(range(count)) if not n or n >= count else {i * count // n for i in range(n)}

    @property
    def sampling(self) -> dict:
        """`speculative_decode`'s sampler keywords."""
        return {"top_k": self.top_k, "top_p": self.top_p, "greedy_drafts": self.greedy_drafts}
