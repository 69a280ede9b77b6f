"""What the training benchmarks share (scripts/bench_train.py and the modules it hands its
modes to): the ShareGPT batches, the recipes, and a head's trainer-built step."""

from __future__ import annotations

import os
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sharegpt_batches(tokenizer, n_batches: int, batch: int, seq: int):
    """Rendered ShareGPT conversations cut to `seq` tokens, `batch` per micro-batch."""
    from eyas.data.conversations import read_conversations
    from eyas.data.templates import TemplateError, render_with_mask
    from eyas.train.batching import collate

    convs, _ = read_conversations(["sharegpt"], max_samples=n_batches * batch * 4)
    samples = []
    for c in convs:
        try:
            r = render_with_mask(tokenizer, c, "all", 1 << 16)
        except TemplateError:
            continue
        if len(r.input_ids) >= seq and sum(r.loss_mask[:seq]) > seq // 4:
            samples.append({"input_ids": r.input_ids[:seq], "loss_mask": r.loss_mask[:seq]})
        if len(samples) == n_batches * batch:
            break
    return [collate(samples[i : i + batch]) for i in range(0, len(samples), batch)]


def load_bench_data(args):
    """The target, the ShareGPT batches (one warm-up + `args.steps`), their masked-token
    counts and whether the head runs under bf16 autocast."""
    from eyas.core.precision import resolve_mixed_precision
    from eyas.data.samples import token_frequencies
    from eyas.target.load import load_target

    target = load_target("smollm2-135m", args.dtype, "cpu")
    bf16_autocast = resolve_mixed_precision(args.mixed_precision, "cpu") == "bf16"
    batches = sharegpt_batches(target.tokenizer, args.steps + 1, args.batch, args.seq)
    freqs = token_frequencies(
        [b.tolist() for x in batches for b in x["input_ids"]],
        [m.tolist() for x in batches for m in x["loss_mask"]],
        target.vocab_size,
    )
    return target, batches, freqs, bf16_autocast


def recipe_of(algorithm: str, overrides: list[str]):
    """The shipped SmolLM2 recipe of `algorithm` with `overrides`."""
    from eyas.recipe import load_recipe

    return load_recipe(os.path.join(ROOT, "recipes", f"smollm2-135m-{algorithm}.yaml"), overrides)


def trainable(recipe, target, freqs, bf16_autocast: bool) -> dict:
    """The recipe's head on `target` as the trainer builds it: its feature source (labels on
    the slots the trainer labels), loss, parameters and optimizer (Muon's step is part of a
    step's time, iterating in the dtype the run would)."""
    from eyas.heads.algorithms import get_algorithm
    from eyas.train.build import HeadWithLoss, build_trainable_head, frozen_output, head_config_for
    from eyas.train.feed import FeatureSource
    from eyas.train.optimizers import build_optimizer

    torch.manual_seed(0)
    # the tokenizer and counts choose a P-EAGLE head's mask token, as the trainer does
    cfg = head_config_for(recipe, target.config, tokenizer=target.tokenizer, token_freqs=freqs)
    head = build_trainable_head(cfg, target.model, freqs)
    features = FeatureSource(
        target.model,
        list(cfg.aux_layer_ids),
        frozen_output(target.model),
        head,
        label_prompts=recipe.train.label_prompts,
    )
    model = HeadWithLoss(head, get_algorithm(cfg.algorithm).loss_function(), recipe.train)
    return dict(
        recipe=recipe,
        head=head,
        features=features,
        model=model,
        params=[p for p in model.parameters() if p.requires_grad],
        opt=build_optimizer(model.named_parameters(), recipe.train, "bf16" if bf16_autocast else "no"),
        generator=torch.Generator().manual_seed(0),
        bf16_autocast=bf16_autocast,
    )


def train_step(run: dict, batch: dict) -> float:
    """One optimizer step of a `trainable` on `batch` (features completed as the trainer
    does: labels, and the target's states where the batch has none); its seconds."""
    t0 = time.perf_counter()
    full, labels = run["features"].complete(dict(batch))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run["bf16_autocast"]):
        stats = run["model"](full, labels, run["generator"])
    stats.loss.backward()
    torch.nn.utils.clip_grad_norm_(run["params"], run["recipe"].train.max_grad_norm)
    run["opt"].step()
    run["opt"].zero_grad(set_to_none=True)
    return time.perf_counter() - t0
