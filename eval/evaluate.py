"""The offline evaluation loop: every prompt turn is decoded plainly (greedy, the
reference output and the tokens/s baseline) and by each drafter; the report compares
them (DESIGN §6)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from itertools import accumulate
from pathlib import Path

import torch

from eyas.core.record_log import append_record
from eyas.core.run_paths import RunPaths
from eyas.data.reasoning import decoded_reply
from eyas.eval.context_buckets import summarize_by_context
from eyas.eval.eval_settings import EvalSettings
from eyas.eval.lossless import EXACT_DTYPES, TIE_TOLERANCE, lossless_verdict, mismatch_record
from eyas.eval.sequence_log import head_identity, prompt_source, resumed_prompts, turn_record
from eyas.eval.speculate import greedy_decode, prefill, replay_greedy, speculative_decode
from eyas.eval.trace_summary import paired_against_head, summarize
from eyas.eval.workloads import WorkloadPrompt, render_turn
from eyas.target.load import stop_token_ids

log = logging.getLogger(__name__)


def run_eval(
    model,
    tokenizer,
    prompts: list[WorkloadPrompt],
    drafters: dict,
    settings: EvalSettings,
    progress: bool = True,
    record_path: str | Path | None = None,
    identity: dict | None = None,
) -> dict:
    """Decode every turn of every prompt plainly and with each drafter.

    `drafters`: name -> drafter (`HeadDrafter`, `NgramDrafter`). The drafters named in
    `settings.replay` (token-only ones, greedy only) are walked over the plain output with
    `replay_greedy` instead of decoded: the same acceptance, no decode time, no tok/s.
    Under greedy, with `settings.decoded_prompts`, only that many prompts (evenly spaced)
    are decoded by every drafter; on the others every drafter is replayed, and tok/s and
    the lossless check come from the decoded ones.
    With `record_path`, each prompt's decodings are appended there as it finishes and the
    prompts already recorded from the same prompt and `identity` (target, heads, settings)
    are read back instead of decoded (eval/sequence_log.py): a killed eval resumes.
    Returns the report body: plain / per-drafter summaries, per-category and per-turn
    summaries, the lossless check (greedy, decoded drafters), the names replayed.
    """
    s = settings
    k, max_new_tokens, temperature, seed = s.k, s.max_new_tokens, s.temperature, s.seed
    replay = set(s.replay) if temperature <= 0 else set()
    unknown = replay - set(drafters)
    if unknown:
        raise ValueError(
            f"replay names {sorted(unknown)}, which are not among the drafters {sorted(drafters)}"
        )
    eos = stop_token_ids(model, tokenizer)
    device = model.get_output_embeddings().weight.device
    tol = TIE_TOLERANCE.get(model.dtype, 1e-4) if s.tie_tolerance is None else s.tie_tolerance
    exact = model.dtype in EXACT_DTYPES
    decoded_at = s.decoded_at(len(prompts))
    plain_traces, timed_plain, traces = [], [], {name: [] for name in drafters}
    by_cat: dict[str, dict[str, list]] = {}
    by_turn: dict[int, dict[str, list]] = {}
    mismatches, checked = [], 0
    if record_path:
        run = {
            "target": [model.config._name_or_path, str(model.dtype), str(device)],
            "settings": {key: sorted(v) if isinstance(v, frozenset) else v for key, v in asdict(s).items()},
            "drafters": sorted(drafters),
            **(identity or {}),
        }
    sources = []
    if record_path:
        firsts = list(accumulate((len(q.turns) for q in prompts), initial=0))  # turns before each
        sources = [prompt_source(p, run, f if temperature > 0 else None) for p, f in zip(prompts, firsts)]
    done = resumed_prompts(Path(record_path), sources, drafters) if record_path else {}

    def replayed_at(index: int) -> set[str]:
        return replay if index in decoded_at else set(drafters)

    def collect(index: int, turn: int, plain, decoded: dict, found: list[dict]) -> None:
        nonlocal checked
        prompt = prompts[index]
        plain_traces.append(plain)
        if index in decoded_at:
            timed_plain.append(plain)
        cat = by_cat.setdefault(prompt.category, {name: [] for name in drafters})
        per_turn = by_turn.setdefault(turn + 1, {name: [] for name in drafters})
        for name, tr in decoded.items():
            traces[name].append(tr)
            cat[name].append(tr)
            per_turn[name].append(tr)
            checked += int(temperature <= 0 and name not in replayed_at(index))
        mismatches.extend(found)

    # Warm-up outside the timings (first calls allocate and pick kernels).
    warm = render_turn(tokenizer, prompts[0], [])
    greedy_decode(model, warm, 2, eos)
    for name, d in drafters.items():
        if name not in replay:
            speculative_decode(model, warm, d, k, 2, eos)
    decoded_aux = [tuple(d.aux_layer_ids) for n, d in drafters.items() if n not in replay and d.aux_layer_ids]
    shared_aux = decoded_aux[0] if decoded_aux else ()
    turns_total = sum(len(p.turns) for p in prompts)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=turns_total, desc="eval", unit="turn")
    seq = 0
    for index, prompt in enumerate(prompts):
        if index in done:  # decoded by an earlier, killed run of this eval
            for turn, (plain, decoded, found) in enumerate(done[index]):
                collect(index, turn, plain, decoded, found)
            seq += len(prompt.turns)
            if bar:
                bar.update(len(prompt.turns))
            continue
        replies: list[str] = []
        record_turns = []
        replay_here = replayed_at(index)
        for turn in range(len(prompt.turns)):
            ids = render_turn(tokenizer, prompt, replies)
            # one prefill of the turn for plain decoding and every drafter reading these states
            shared = prefill(model, ids, shared_aux)
            plain = greedy_decode(model, ids, max_new_tokens, eos, shared)
            decoded, found = {}, []
            for name, drafter in drafters.items():
                if name in replay_here:
                    tr = replay_greedy(model, ids, plain.tokens, drafter, k, max_new_tokens, eos, shared)
                else:
                    gen = (
                        torch.Generator(device=device).manual_seed(seed * 1_000_003 + seq)
                        if temperature > 0
                        else None
                    )
                    tr = speculative_decode(
                        model,
                        ids,
                        drafter,
                        k,
                        max_new_tokens,
                        eos,
                        temperature,
                        gen,
                        **s.sampling,
                        shared=shared,
                    )
                decoded[name] = tr
                if temperature <= 0 and name not in replay_here:
                    found.extend(mismatch_record(plain, tr, name, prompt, turn, tol, exact))
            collect(index, turn, plain, decoded, found)
            record_turns.append(turn_record(plain, decoded, found))
            # The history as the model wrote it: its own special tokens decoded and parsed
            # (harmony's analysis / final channels), not stripped into run-on text.
            finished = bool(plain.tokens) and plain.tokens[-1] in eos
            replies.append(
                decoded_reply(tokenizer, plain.tokens[:-1] if finished else plain.tokens, finished)
            )
            seq += 1
            if bar:
                bar.update(1)
        if record_path:
            append_record(
                record_path,
                {"index": index, "source": sources[index], "prompt_id": prompt.id, "turns": record_turns},
            )
    if bar:
        bar.close()
    plain_summary = summarize(plain_traces, k)
    # the speed beside the drafters' is plain decoding's on the prompts they decoded
    plain_summary["tokens_per_s"] = summarize(timed_plain, k)["tokens_per_s"]
    return {
        "num_prompts": len(prompts),
        "num_sequences": seq,
        "decoded_prompts": len(decoded_at),
        "plain": plain_summary,
        "drafters": {name: summarize(t, k) for name, t in traces.items()},
        # what decides a compared head: its τ against the head's on the same sequences
        "paired_vs_head": paired_against_head(traces),
        "per_category": {c: {n: summarize(t, k) for n, t in d.items()} for c, d in by_cat.items()},
        # Later turns read the earlier replies (the target's own, plainly decoded) as context.
        "per_turn": {
            str(t): {n: summarize(tr, k) for n, tr in d.items()} for t, d in sorted(by_turn.items())
        },
        # acceptance by the context each draft step saw (eval/context_buckets.py)
        "context_buckets": list(settings.context_buckets),
        "per_context": {n: summarize_by_context(t, k, settings.context_buckets) for n, t in traces.items()},
        "replayed": sorted(replay),
        "lossless": lossless_verdict(mismatches, checked, tol, exact, model.dtype),
        # the tokens the target wrote here that a head can propose at all (its draft vocabulary)
        "draft_vocab_coverage": _draft_vocab_coverage(drafters, plain_traces, model.config.vocab_size),
    }


def _draft_vocab_coverage(drafters: dict, plain_traces, vocab_size: int) -> dict[str, float]:
    """{head drafter: the share of the plain outputs' tokens its draft vocabulary holds}."""
    from eyas.heads.vocab import draft_vocab_coverage

    written = [t for tr in plain_traces for t in tr.tokens]
    if not written:
        return {}
    counts = torch.bincount(torch.tensor(written, dtype=torch.long), minlength=vocab_size)
    heads = {name: getattr(d, "head", None) for name, d in drafters.items()}
    return {name: draft_vocab_coverage(h, counts) for name, h in heads.items() if h is not None}


# --- the stage: a recipe's evaluation -------------------------------------------------

# Room for the activations and the KV cache beside float32 weights.
FLOAT32_HEADROOM = 1.25


def eval_dtype(section) -> str:
    """The target's dtype for eval when eval.dtype is unset: float32 where its float32
    weights fit the device, so the lossless check is exact; else target.dtype (a quantized
    target stays quantized)."""
    import psutil

    from eyas.target.load import resolve_device
    from eyas.target.shapes import ShapeError, target_shape

    try:
        shape = target_shape(section.name_or_path, section.revision, section.trust_remote_code)
    except (ShapeError, ValueError, OSError) as err:
        log.info("eval in target.dtype %s: the target's size is unknown (%s)", section.dtype, err)
        return section.dtype
    if shape.quant_method:
        return section.dtype
    need = shape.weight_bytes("float32") * FLOAT32_HEADROOM
    device = resolve_device(section.device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    if need <= free:
        return "float32"
    log.info(
        "eval in %s, not float32 (%.1f GB would not fit the %.1f GB free): the lossless check is a rate",
        section.dtype,
        need / 1e9,
        free / 1e9,
    )
    return section.dtype


class EvalError(ValueError):
    """An evaluation that cannot run as asked; the message names the head or setting."""


def compare_heads(specs: list[str]) -> dict[str, str]:
    """`[NAME=]HEAD` -> {name: head}; names must be unique and not a built-in drafter's."""
    out = {}
    for i, spec in enumerate(specs):
        name, sep, head = spec.partition("=")
        if not sep or "/" in name or not name:
            name, head = ("compare" if i == 0 else f"compare{i + 1}"), spec
        if name in out or name in ("head", "ngram", "plain"):
            raise EvalError(f"--compare name {name!r} is taken; pass NAME=HEAD with another NAME")
        out[name] = head
    return out


def load_eval_head(head_dir: str, target):
    """A head from an eyas checkpoint or an export directory, on the target's device and
    in its dtype; checked against the target's config as `eyas export --check --target`
    checks it."""
    from eyas.export.head_dir import target_facts
    from eyas.export.reader import load_any_head
    from eyas.export.validate import ExportValidationError

    embed = target.model.get_input_embeddings().weight.detach()
    try:
        head = load_any_head(
            head_dir, target_embed=embed, target=target_facts(target.model.config, "the target")
        )
    except ExportValidationError as err:
        raise EvalError(str(err)) from None
    cfg = head.config
    if cfg.vocab_size != target.vocab_size or cfg.target_hidden_size != target.hidden_size:
        raise EvalError(
            f"head {head_dir} was built for vocab {cfg.vocab_size} / hidden "
            f"{cfg.target_hidden_size}, but the target has {target.vocab_size} / {target.hidden_size}"
        )
    # The head runs in the target's dtype, as vLLM runs a draft model in the engine's: a
    # bf16 export evaluated beside a float32 target would otherwise round its drafts
    # differently from the engine it predicts (DESIGN §6).
    return head.to(device=embed.device, dtype=embed.dtype).eval()


def _replayed(drafters: dict, decode_baseline: bool) -> set[str]:
    """The baseline is replayed beside a head unless asked to decode; alone, it is what
    is being measured, so it is decoded."""
    if decode_baseline or "head" not in drafters:
        return set()
    return {"ngram"} & set(drafters)


def evaluate(
    recipe,
    head: str | None = None,
    compare: dict[str, str] | None = None,
    target=None,
    out: str | Path | None = None,
    tie_tolerance: float | None = None,
    progress: bool = True,
) -> tuple[dict, dict[str, str]]:
    """The eval stage for a recipe (DESIGN §6): `recipe.eval`'s workload decoded plainly,
    by the head (default run_dir/export when it exists), by every `compare` head
    ({name: head}) and by the n-gram baseline; the report is written under `out` (default
    run_dir/eval) with the per-prompt log a killed eval resumes from (eval/sequence_log.py).
    Returns (report, {"json", "markdown", "png", "sequences": path}).

    Heads are directories or Hub ids. `target` may be passed in (a `LoadedTarget`);
    otherwise it is loaded from `recipe.target` at `eval.dtype`, after the workload and
    the heads' names are checked, so a bad argument fails before the model loads."""
    from eyas.eval.ngram import NgramDrafter
    from eyas.eval.report import verdicts, write_outputs
    from eyas.eval.speculate import HeadDrafter
    from eyas.eval.workloads import load_workload
    from eyas.export.fetch import fetch_head
    from eyas.target.load import load_recipe_target

    ev = recipe.eval
    if head is None and (recipe.paths.export / "config.json").is_file():
        head = str(recipe.paths.export)
    if head is None and ev.baseline is None:
        raise EvalError("nothing to evaluate: pass a head (--head DIR) or the n-gram baseline")
    compare = dict(compare or {})
    if compare and head is None:
        raise EvalError("--compare needs a head to compare with (--head)")
    if head is not None:
        head = str(fetch_head(head))  # a Hub id is downloaded into the HF cache
    compare = {name: str(fetch_head(h)) for name, h in compare.items()}
    prompts = load_workload(ev.workload, ev.max_prompts)
    if target is None:  # work_rows: a verify step's rows
        target = load_recipe_target(
            recipe.target, work_rows=ev.k + 1, dtype=ev.dtype or eval_dtype(recipe.target)
        )
    drafters = {}
    if head is not None:
        drafters["head"] = HeadDrafter(load_eval_head(head, target))
    for name, other in compare.items():
        drafters[name] = HeadDrafter(load_eval_head(other, target))
    if ev.baseline == "ngram":
        drafters["ngram"] = NgramDrafter(ev.ngram_min, ev.ngram_max)
    settings = EvalSettings.from_section(ev, _replayed(drafters, ev.decode_baseline), tie_tolerance)
    out = Path(out or recipe.paths.eval)
    out.mkdir(parents=True, exist_ok=True)
    heads = {"head": head, **compare} if head is not None else {}
    identity = {
        "heads": {name: head_identity(d) for name, d in heads.items()},
        "ngram": [ev.ngram_min, ev.ngram_max] if "ngram" in drafters else None,
    }
    body = run_eval(
        target.model,
        target.tokenizer,
        prompts,
        drafters,
        settings,
        progress=progress,
        record_path=out / RunPaths.EVAL_SEQUENCES,
        identity=identity,
    )
    report = {
        "target": target.hub_id,
        "head": head,
        **({"compared": compare} if compare else {}),
        "algorithm": drafters["head"].head.config.algorithm if "head" in drafters else None,
        "workload": ev.workload,
        "k": ev.k,
        "temperature": ev.temperature,
        **(
            {
                "sampler": ev.sampler,
                "draft_sample_method": ev.draft_sample_method,
                "top_k": ev.top_k,
                "top_p": ev.top_p,
            }
            if ev.temperature > 0
            else {}
        ),
        "max_new_tokens": ev.max_new_tokens,
        "device": str(target.model.device),
        "dtype": str(target.model.dtype).replace("torch.", ""),
        **body,
    }
    head_sum = report["drafters"].get("head")
    if head_sum:  # flat copies for the model card
        report.update({key: head_sum.get(key) for key in ("tau", "tar", "per_position_acceptance")})
    report["warnings"] = verdicts(report)
    return report, {**write_outputs(report, out), "sequences": str(out / RunPaths.EVAL_SEQUENCES)}
