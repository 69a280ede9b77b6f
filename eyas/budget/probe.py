"""The time budget's probe (DESIGN §2.7): the stages' own code run on a few batches of the
recipe's work on this machine, returned as `Rates` (eyas/budget/rates.py) for the estimates."""

from __future__ import annotations

import time
from pathlib import Path

from eyas.budget.rates import BudgetError, Rates
from eyas.core.run_paths import RunPaths

# a stage's process before its work: the interpreter, torch's and transformers' imports
PROCESS_START_S = 5.0


def measure(recipe, progress: bool = True) -> Rates:
    """Run the probe (module docstring) and return what it measured."""
    import torch

    from eyas.data.conversations import DropReport
    from eyas.data.prepare import gather_conversations, regeneration_settings, render_all
    from eyas.data.regenerate import before_first_reply, done_records, regenerate
    from eyas.data.templates import prompt_ids
    from eyas.target.load import resolve_target_path
    from eyas.train.batching import group_batches
    from eyas.train.step_timing import build_head_step, time_head_steps

    cfg, rg, t = recipe.data, recipe.data.regenerate, recipe.target
    if cfg.from_run:
        return _measure_training_only(recipe)
    if cfg.max_samples is None:
        raise BudgetError("the time budget sizes data.max_samples: set it in the recipe (the most to read)")
    if rg.enabled and rg.backend != "hf":
        raise BudgetError(
            "the time budget measures in-process regeneration (data.regenerate.backend=hf); "
            "with a serving engine, size data.max_samples yourself"
        )
    resolve_target_path(t.name_or_path)  # a once-per-machine conversion is no stage's start-up cost
    t0 = time.perf_counter()
    conversations, report = gather_conversations(cfg)
    read = len(conversations) + report.dropped["duplicate"]  # data.max_samples counts repeats
    read_s = time.perf_counter() - t0
    target, load_s = _timed_load(t, rg.batch_size if rg.enabled else cfg.capture_batch_tokens)
    tok = target.tokenizer
    cap = max(1, cfg.max_length - rg.max_new_tokens) if rg.enabled else cfg.max_length
    # the share whose first prompt fits is counted over the first quarter read; the probe
    # batch comes from the first two batches' worth, since a choice can go down to the
    # probe's batch and replies beyond what it reads would be wasted
    batch = rg.batch_size if rg.enabled else 256
    counted = min(len(conversations), max(batch * 2, len(conversations) // 4))
    first = {i: len(prompt_ids(tok, before_first_reply(conversations[i]))) for i in range(counted)}
    regen_path = Path(recipe.paths.prepared) / RunPaths.REGENERATED
    done = set(done_records(regen_path)) if rg.enabled else set()
    pool_n = min(counted, batch * 2)
    fitting = (i for i in range(pool_n) if first[i] <= cap and i not in done)
    pool = sorted(fitting, key=lambda i: (first[i], i))
    if not pool:
        raise BudgetError(
            f"no conversation among the first {pool_n} read has a prompt of at most {cap} tokens"
        )
    mid = max(0, len(pool) // 2 - batch // 2)
    probe = pool[mid : mid + batch]
    fits_share = sum(first[i] <= cap for i in first) / len(first)
    regen_s = 0.0
    if rg.enabled:
        out_dir = Path(recipe.paths.prepared)
        settings = regeneration_settings(recipe, target, out_dir, progress)
        start = time.perf_counter()
        regenerated = regenerate(
            conversations,
            tok,
            regen_path,
            settings,
            model=target.model,
            only=probe,
        )
        regen_s = time.perf_counter() - start
        sample_conversations = [i for i in probe if any(m["role"] == "assistant" for m in regenerated[i])]
        samples = [regenerated[i] for i in sample_conversations]
    else:
        samples = [conversations[i] for i in probe]
    ids, masks, kept = render_all(
        tok,
        samples,
        cfg.max_length,
        cfg.train_on,
        DropReport(),
        progress=False,
        truncate=cfg.over_length == "truncate",
    )
    if not ids:
        raise BudgetError(f"none of the probe's {len(probe)} conversations rendered to a sample")
    uncopied = 1.0
    if rg.enabled and settings.states_dir is not None:
        uncopied = _uncopied_share(settings, [sample_conversations[k] for k in kept], ids, masks)
    lengths = [len(x) for x in ids]
    tr = recipe.train
    packed = group_batches(range(len(ids)), lengths, tr.batch_tokens, tr.max_batch_size, tr.packing)
    typical = sorted(packed, key=len)[len(packed) // 2]
    seq = max(lengths[i] for i in typical)
    device = target.model.get_output_embeddings().weight.device
    # one forward at the capture's batch (warm first)
    rows = max(1, cfg.capture_batch_tokens // seq)
    x = torch.randint(0, target.config.vocab_size, (rows, seq), device=device)
    with torch.no_grad():
        target.model(input_ids=x, output_hidden_states=True, use_cache=False)  # warm
        start = time.perf_counter()
        target.model(input_ids=x, output_hidden_states=True, use_cache=False)
    capture_s_per_token = (time.perf_counter() - start) / (rows * seq)
    step = build_head_step(recipe, target.config, t.name_or_path, device, rows=recipe.train.batch_tokens)
    times = time_head_steps(
        step, target.config, [lengths[i] for i in typical], device, steps=3, warmup=2, packed=tr.packing
    )
    step_s, later_step_s = sorted(times.first_epoch)[1], sorted(times.later_epoch)[1]
    train_warmup_s = max(0.0, sum(times.warmup) - len(times.warmup) * step_s)
    del step
    decode_s, spec_s, replay_s = _decode_seconds_per_token(recipe, target, tok, samples[0])
    return Rates(
        conversations_read=read,
        deduped=len(conversations),
        regenerable=round(fits_share * len(conversations)),
        probe_positions=tuple(sorted(probe)) if rg.enabled else (),
        regen_batch_s=regen_s,
        samples_per_conversation=len(ids) / len(probe),
        sample_tokens=sum(lengths) / len(lengths),
        samples_per_step=len(ids) / len(packed),
        step_s=step_s,
        later_step_s=later_step_s,
        train_warmup_s=train_warmup_s,
        capture_s_per_token=capture_s_per_token,
        uncopied_share=uncopied,
        decode_s_per_token=decode_s,
        untrained_spec_s_per_token=spec_s,
        untrained_replay_s_per_token=replay_s,
        stage_start_s=PROCESS_START_S,
        read_s=read_s,
        target_load_s=load_s,
    )


def _measure_training_only(recipe) -> Rates:
    """The probe for a recipe that reads another run's data (data.from_run): nothing to
    regenerate or capture, so the training steps at the batches the reused samples pack
    into, and the eval's decoding. Counts are train samples (one per "conversation"), of
    the other run's first data.max_samples conversations where that is set."""
    from eyas.data.from_run import first_conversations
    from eyas.data.prepare import load_prepared, read_prepared_meta
    from eyas.train.batching import group_batches
    from eyas.train.step_timing import build_head_step, time_head_steps

    read_prepared_meta(recipe.paths.prepared, made_by=recipe.data.from_run)
    t0 = time.perf_counter()
    train = load_prepared(recipe.paths.prepared)["train"]
    data_s = time.perf_counter() - t0
    target, load_s = _timed_load(recipe.target, recipe.train.batch_tokens)
    load_s += data_s  # the trainer loads the data and the target
    lengths = [len(x) for x in train["input_ids"]]
    keep = first_conversations(recipe, train)  # data.max_samples of the other run's conversations
    lengths = lengths if keep is None else [lengths[i] for i in keep]
    tr = recipe.train
    packed = group_batches(range(len(lengths)), lengths, tr.batch_tokens, tr.max_batch_size, tr.packing)
    typical = sorted(packed, key=len)[len(packed) // 2]
    device = target.model.get_output_embeddings().weight.device
    step = build_head_step(
        recipe, target.config, recipe.target.name_or_path, device, rows=recipe.train.batch_tokens
    )
    times = time_head_steps(
        step, target.config, [lengths[i] for i in typical], device, steps=3, warmup=2, packed=tr.packing
    )
    step_s, later_step_s = sorted(times.first_epoch)[1], sorted(times.later_epoch)[1]
    del step
    prompt = [{"role": "user", "content": "Write a short note about the sea."}]
    decode_s, spec_s, replay_s = _decode_seconds_per_token(recipe, target, target.tokenizer, prompt)
    return Rates(
        conversations_read=len(lengths),
        deduped=len(lengths),
        regenerable=len(lengths),
        probe_positions=(),
        regen_batch_s=0.0,
        samples_per_conversation=1.0,
        sample_tokens=sum(lengths) / len(lengths),
        samples_per_step=len(lengths) / len(packed),
        step_s=step_s,
        later_step_s=later_step_s,
        train_warmup_s=max(0.0, sum(times.warmup) - len(times.warmup) * step_s),
        capture_s_per_token=0.0,
        uncopied_share=1.0,
        decode_s_per_token=decode_s,
        untrained_spec_s_per_token=spec_s,
        untrained_replay_s_per_token=replay_s,
        stage_start_s=PROCESS_START_S,
        read_s=0.0,
        target_load_s=load_s,
    )


def _timed_load(section, work_rows: int):
    """The target and the seconds a stage's load of it takes: the load's, less what it spent
    on work a machine does once (`dtype: auto` timing bf16 against float32, then cached)."""
    from eyas.core.precision import measuring_seconds
    from eyas.target.load import load_recipe_target

    once, start = measuring_seconds(), time.perf_counter()
    target = load_recipe_target(section, work_rows=work_rows)
    return target, time.perf_counter() - start - (measuring_seconds() - once)


def _uncopied_share(settings, conversations, ids, masks) -> float:
    """The share of the probe's samples whose states the capture would compute rather than
    copy from those the probe's regeneration kept: the capture's own test
    (`FedStates.states_for`) on each sample."""
    from eyas.data.fed_states import FedStates

    fed = FedStates(settings.states_dir, settings.state_layer_ids, settings.target_name)
    missed = sum(fed.states_for(c, x, m) is None for c, x, m in zip(conversations, ids, masks))
    return missed / max(1, len(ids))


def _decode_seconds_per_token(recipe, target, tokenizer, conversation) -> tuple[float, float, float]:
    """Batch-1 decoding of 24 tokens at the eval's dtype, per token: plain greedy; then an
    untrained head of the recipe's shape decoding speculatively (its drafts are rarely
    accepted, so each verify yields about one token: what a weak head costs the eval; a
    better head costs less) and replayed over the plain tokens (a draft step per token,
    whatever the head: its chain stops at the first rejected draft). The target is cast in
    place to that dtype: this is the probe's last use of it."""
    import torch

    from eyas.core.precision import resolve_dtype, shapes_of_config
    from eyas.data.regenerate import before_first_reply
    from eyas.data.templates import prompt_ids
    from eyas.eval.speculate import HeadDrafter, greedy_decode, replay_greedy, speculative_decode
    from eyas.train.build import build_trainable_head, head_config_for

    model = target.model
    device = model.get_output_embeddings().weight.device
    name = recipe.eval.dtype or recipe.target.dtype
    shapes = shapes_of_config(target.config, recipe.eval.k + 1) if name == "auto" else None
    dtype = getattr(torch, resolve_dtype(name, device, shapes))
    model.to(dtype)
    prompt = prompt_ids(tokenizer, before_first_reply(conversation))[-64:]

    def per_token(decode):  # (seconds a token, the trace) over 24 tokens after 2 of warm-up
        decode(2)
        start = time.perf_counter()
        trace = decode(24)
        return (time.perf_counter() - start) / max(1, len(trace.tokens)), trace

    freqs = torch.ones(target.config.vocab_size)
    config = head_config_for(
        recipe, target.config, verifier=recipe.target.name_or_path, tokenizer=tokenizer, token_freqs=freqs
    )
    head = build_trainable_head(config, model, freqs).to(device=device, dtype=dtype).eval()
    plain, timed = per_token(lambda n: greedy_decode(model, prompt, n, set()))
    reference = timed.tokens  # the replay walks plain decoding's own tokens
    k = recipe.eval.k
    spec, _ = per_token(lambda n: speculative_decode(model, prompt, HeadDrafter(head), k, n, set()))
    replay, _ = per_token(
        lambda n: replay_greedy(model, prompt, reference[:n], HeadDrafter(head), k, n, set())
    )
    return plain, spec, replay
