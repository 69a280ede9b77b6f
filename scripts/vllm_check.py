"""Serving truth: every head eyas exports runs in a real vLLM, and eyas's offline
acceptance predicts vLLM's.

  python scripts/vllm_check.py                      # every head, report on stdout
  python scripts/vllm_check.py --quick --json-out runs/vllm_check/report.json
  python scripts/vllm_check.py --heads e3-vocab,pe --no-serve
  python scripts/vllm_check.py --trained-head runs/smollm2-135m-eagle3/export

For each head: build it (see HEADS), export it with eyas (speculators or original EAGLE
layout), validate the export, serve it in vLLM (a separate venv, made by
scripts/setup_vllm_env.sh; one engine per head, one at a time) with the SmolLM2 target on a
prompt set, and check
  1. vLLM loads it and its speculative greedy output equals plain vLLM greedy output;
  2. vLLM's per-position acceptance equals eyas's offline acceptance (eyas.eval.speculate on
     the same prompt token ids) within --tolerance, and exactly (counts) for the lens heads,
     whose acceptance is also predicted from the plain greedy tokens alone (vllm_heads.py),
     and for the sliding-window head, whose counts eyas must tell apart from those of
     its neighbouring windows;
  3. `vllm serve DIR` starts from a speculators export and answers one completion on
     127.0.0.1.
Everything runs in float32: bf16 greedy outputs of vLLM and transformers drift apart after a
few dozen tokens from rounding alone, fp32 ones agree. Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_heads import (  # noqa: E402
    add_window_attention,
    build_lens_head,
    reference_drafts,
    replay_oracle,
)

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = ROOT / "scripts" / "vllm_runner.py"

PROMPTS = [
    "ha ha ha ha ha ha ha ha",
    "1 1 1 1 1 1 1 1 1 1",
    "The capital of France is",
    "def fibonacci(n):",
    "Repeat the word yes ten times: yes yes yes",
    "Once upon a time",
    "A B C D E F G",
    "Write a list of colors:\n-",
]


@dataclass
class HeadSpec:
    """One head to check. `kind`: "lens" (built here, acceptance known from the plain greedy
    tokens), "window" (a lens head whose attention adds the mean embedding of the keys its
    sliding window sees: acceptance compared exactly, but no oracle, as attention over the
    prefix matters) or "trained"."""

    name: str
    algorithm: str = "eagle3"
    fmt: str = "speculators"
    kind: str = "lens"
    draft_vocab: bool = False  # Vd < Vt with a d2t map
    options: dict = field(default_factory=dict)  # fc_norm / norm_output / norm_before_residual
    num_hidden_layers: int = 1
    sliding_window: int | None = None  # "window" heads: the window served and checked
    attention_scale: float = 0.0  # "window" heads: what the attention adds (vllm_heads.py)
    description: str = ""


HEADS = {
    "e3-vocab": HeadSpec(
        "e3-vocab", draft_vocab=True, description="EAGLE-3 lens head, draft vocabulary (d2t/t2d), speculators"
    ),
    "e31": HeadSpec(
        "e31",
        options=dict(fc_norm=True, norm_output=True, norm_before_residual=True),
        description="EAGLE-3 lens head, full vocabulary, EAGLE 3.1 fc_norm + norm_output, "
        "norm_before_residual, speculators",
    ),
    "pe": HeadSpec(
        "pe",
        algorithm="peagle",
        num_hidden_layers=2,
        description="P-EAGLE lens head, 2 layers, full vocabulary, speculators",
    ),
    "pe31": HeadSpec(
        "pe31",
        algorithm="peagle",
        num_hidden_layers=2,
        draft_vocab=True,
        options=dict(fc_norm=True, norm_output=True),
        description="P-EAGLE lens head, 2 layers, draft vocabulary, fc_norm + norm_output, speculators",
    ),
    "e3-eagle": HeadSpec(
        "e3-eagle",
        fmt="eagle",
        draft_vocab=True,
        options=dict(fc_norm=True),
        description="EAGLE-3 lens head, draft vocabulary, fc_norm, original EAGLE layout (midlayer.*)",
    ),
    "pe-eagle": HeadSpec(
        "pe-eagle",
        algorithm="peagle",
        fmt="eagle",
        num_hidden_layers=2,
        description="P-EAGLE lens head, 2 layers, original EAGLE layout",
    ),
    # Scale 16 leaves the lens winning often enough that positions 2 and 3 are accepted;
    # on 4 prompts x 32 tokens windows 3 and 5 (and none) count otherwise than 4 (docs/benchmarks.md).
    "e3-window": HeadSpec(
        "e3-window",
        kind="window",
        sliding_window=4,
        attention_scale=16.0,
        description="EAGLE-3 lens head whose layer-0 attention adds the mean embedding of the last 4 "
        "tokens (sliding_window 4), speculators; acceptance exact, and windows 3, 5 and none must "
        "count otherwise in eyas (no oracle replay: attention over the prefix matters)",
    ),
    "trained": HeadSpec(
        "trained", kind="trained", description="a trained SmolLM2 head (bf16 export, served in fp32)"
    ),
}
QUICK = ["e3-vocab", "pe"]
SERVE_HEAD = "e3-vocab"


def log(msg: str) -> None:
    print(f"[vllm_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the vLLM side ----------------------------------------------------------------------


def run_vllm(job: dict, work: Path, name: str, timeout: float) -> dict:
    """One engine in its own process (vLLM spawns workers; two never run at once)."""
    job_path, out_path, log_path = (
        work / f"job_{name}.json",
        work / f"out_{name}.json",
        work / f"vllm_{name}.log",
    )
    job_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("PYTHONPATH", None)
    start = time.time()
    with open(log_path, "w") as logf:
        try:
            subprocess.run(
                [str(VLLM_PYTHON), str(RUNNER), str(job_path), str(out_path)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(work),
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f}s (log {log_path})"}
    if not out_path.is_file():
        tail = log_path.read_text()[-3000:]
        return {"ok": False, "error": f"the runner wrote no result (log {log_path})", "log_tail": tail}
    result = json.loads(out_path.read_text())
    result["wall_s"] = round(time.time() - start, 1)
    result["log"] = str(log_path)
    return result


def speculative_config(spec: HeadSpec, head_dir: Path, k: int) -> dict:
    cfg = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": k}
    # a trained head's algorithm is its export's, not the spec's default
    exported = json.loads((Path(head_dir) / "config.json").read_text()).get("speculators_model_type")
    if spec.algorithm == "peagle" or exported == "peagle":
        cfg["parallel_drafting"] = True  # not implied by the draft config (DESIGN §5)
    return cfg


# --- the eyas side ----------------------------------------------------------------------


def counts_from_traces(traces, k: int) -> dict:
    """vLLM's counters from eyas decode traces: drafts (verify steps) and, per draft
    position j, the steps whose position j was accepted."""
    per_pos = [0] * k
    for tr in traces:
        for acc in tr.accepted:
            for j in range(acc):
                per_pos[j] += 1
    return {"drafts": sum(len(tr.drafted) for tr in traces), "accepted_per_pos": per_pos}


def acceptance_table(eyas_counts: dict, vllm_counts: dict | None, oracle: dict | None, k: int) -> list[dict]:
    """Per draft position: the rate each side accepted it (count / drafts) and the
    conditional rate a_k (given positions < k were accepted), eyas and vLLM side by side."""

    def rates(c):
        if not c or not c.get("drafts"):
            return [None] * k, [None] * k
        pp, d = c["accepted_per_pos"], c["drafts"]
        uncond = [x / d for x in pp]
        cond = [pp[j] / (pp[j - 1] if j else d) if (pp[j - 1] if j else d) else None for j in range(k)]
        return uncond, cond

    (eu, ec), (vu, vc) = rates(eyas_counts), rates(vllm_counts)
    rows = []
    for j in range(k):
        row = {
            "position": j + 1,
            "eyas_count": eyas_counts["accepted_per_pos"][j],
            "vllm_count": vllm_counts["accepted_per_pos"][j] if vllm_counts else None,
            "eyas_rate": eu[j],
            "vllm_rate": vu[j],
            "eyas_conditional": ec[j],
            "vllm_conditional": vc[j],
        }
        if oracle:
            row["oracle_count"] = oracle["accepted_per_pos"][j]
        rows.append(row)
    return rows


class EyasSide:
    """The float32 target in transformers, the prompts, and eyas's own decoding of them."""

    def __init__(self, target_dir: Path, prompts: list[str], k: int, max_tokens: int):
        from eyas.eval.speculate import greedy_decode
        from eyas.target.load import load_target

        self.k, self.max_tokens = k, max_tokens
        self.target = load_target(str(target_dir), dtype="float32", device="cpu")
        self.model, tok = self.target.model, self.target.tokenizer
        self.prompt_ids = [tok(p)["input_ids"] for p in prompts]
        # K extra tokens: the verify of the last speculative step sees them.
        self.plain = [greedy_decode(self.model, ids, max_tokens + k, set()).tokens for ids in self.prompt_ids]
        self.embed = self.model.get_input_embeddings().weight.detach()

    def draft_ids(self, size: int = 4096) -> torch.Tensor:
        """A draft vocabulary [size], ascending: every prompt and output token plus the
        lowest other ids."""
        used = {t for seq in self.prompt_ids + self.plain for t in seq}
        rest = (i for i in range(self.embed.shape[0]) if i not in used)
        ids = sorted(used) + [next(rest) for _ in range(size - len(used))]
        return torch.tensor(sorted(ids), dtype=torch.long)

    @torch.no_grad()
    def lens_states(self, ids: list[int]) -> torch.Tensor:
        """[T, Ht] the input of the target's last decoder layer over a token sequence."""
        from eyas.target.features import compute_features

        layer = self.target.num_layers - 1
        aux, _ = compute_features(self.model, torch.tensor([ids]), None, [layer])
        return aux[0]

    def mask_state(self) -> torch.Tensor:
        """The state whose lens a P-EAGLE lens head drafts at its mask slots: one whose lens
        is the token the first (repetitive) output repeats most, so mask-slot drafts are
        accepted too and a wrong mask slot shows up as missing acceptance."""
        ids, out = self.prompt_ids[0], self.plain[0][: self.max_tokens]
        states = self.lens_states(ids + out)
        slots = torch.arange(len(ids) - 1, len(ids) + len(out) - 1)
        lens = reference_drafts(self.model, states[slots], 1)[:, 0]
        common = max(set(out), key=out.count)
        hits = (lens == common).nonzero()
        return states[slots[int(hits[0, 0])] if len(hits) else slots[0]]

    def speculate(self, head) -> dict:
        """eyas's offline speculative decoding of every prompt (greedy, no EOS stop, like
        the vLLM runs): traces summarised with eyas.eval.report plus vLLM-style counts."""
        from eyas.eval.speculate import HeadDrafter, speculative_decode
        from eyas.eval.trace_summary import summarize

        drafter = HeadDrafter(head.float().eval())
        traces = [
            speculative_decode(self.model, ids, drafter, self.k, self.max_tokens, set())
            for ids in self.prompt_ids
        ]
        return {
            "traces": traces,
            "summary": summarize(traces, self.k),
            "counts": counts_from_traces(traces, self.k),
            "outputs": [tr.tokens for tr in traces],
        }

    @torch.no_grad()
    def lens_oracle(self, head, build_kwargs: dict) -> tuple[dict, int]:
        """(oracle counts, slots where the eyas head's drafts differ from the hand-written
        math). For every generated token the drafts are computed from the target's states
        at its slot, by `reference_drafts` and by the head (each slot alone: its layers add
        nothing, so no prefix matters), then replayed on the plain greedy output."""
        oracle = {"drafts": 0, "accepted_per_pos": [0] * self.k}
        bad = 0
        n_aux = len(head.config.aux_layer_ids)
        for ids, out in zip(self.prompt_ids, self.plain):
            seq = ids + out
            states = self.lens_states(seq)
            slots = torch.arange(len(ids) - 1, len(seq) - 1)  # slot of out[i] = len(ids) - 1 + i
            guesses = reference_drafts(
                self.model, states[slots], self.k, algorithm=head.config.algorithm, **build_kwargs
            )
            ht = states.shape[-1]
            aux = torch.zeros(len(slots), 1, n_aux * ht)
            aux[:, 0, -ht:] = states[slots]
            tokens = torch.tensor(seq)[slots + 1][:, None]
            got, _ = head.draft(head.new_cache(), tokens, aux, slots[:, None], self.k)
            bad += int((got != guesses).any(-1).sum())
            r = replay_oracle(out, guesses, self.k, self.max_tokens)
            oracle["drafts"] += r["drafts"]
            oracle["accepted_per_pos"] = [
                a + b for a, b in zip(oracle["accepted_per_pos"], r["accepted_per_pos"])
            ]
        return oracle, bad


def export_with_eyas(
    head, spec: HeadSpec, work: Path, verifier: str, dtype=torch.float32
) -> tuple[Path, list[str]]:
    """save_head -> export_checkpoint (what `eyas export` runs) -> validate_export."""
    from eyas.export.validate import validate_export
    from eyas.export.writer import export_checkpoint
    from eyas.heads.io import save_head

    ckpt = save_head(head, work / "checkpoints" / spec.name)
    out = export_checkpoint(ckpt, work / "heads" / spec.name, fmt=spec.fmt, dtype=dtype, verifier=verifier)
    return out, validate_export(out)


def lens_build_kwargs(spec: HeadSpec, side: EyasSide) -> dict:
    kw = dict(spec.options)
    if spec.draft_vocab:
        kw["draft_ids"] = side.draft_ids()
    if spec.algorithm == "peagle":
        kw["mask_state"] = side.mask_state()
    return kw


@dataclass
class BuiltHead:
    export_dir: Path
    problems: list[str]
    ref_bad: int | None = None  # lens heads: slots where the head differs from the hand math
    oracle: dict | None = None  # lens heads: counts replayed on the plain greedy output
    neighbours: dict | None = None  # window heads: {window: eyas counts}, W ± 1 and None


def build_window_head(spec: HeadSpec, side: EyasSide, target_dir: Path, window: int):
    head = build_lens_head(
        side.model, speculative_tokens=side.k, verifier=str(target_dir), sliding_window=window
    )
    return add_window_attention(head, side.embed, spec.attention_scale)


def build_spec_head(
    spec: HeadSpec, side: EyasSide, work: Path, target_dir: Path, trained_dir: Path | None
) -> BuiltHead:
    from eyas.heads.peagle import choose_mask_token_id

    if spec.kind == "trained":
        from eyas.export.reader import load_any_head
        from eyas.export.validate import validate_export
        from eyas.export.writer import export_head

        if trained_dir is None:
            raise FileNotFoundError("no trained head: pass --trained-head DIR (or run scripts/quickstart.sh)")
        head = load_any_head(trained_dir, target_embed=side.embed)
        head.config = head.config.model_copy(
            update={"speculative_tokens": side.k, "verifier_name_or_path": str(target_dir)}
        )
        out = export_head(
            head, work / "heads" / spec.name, fmt=spec.fmt, dtype=torch.bfloat16, verifier=str(target_dir)
        )
        return BuiltHead(out, validate_export(out))
    if spec.kind == "window":
        # The same weights under windows W - 1, W + 1 and none: were their counts W's, an
        # engine applying the window off by one, or not at all, would pass the exact
        # comparison unseen.
        w = spec.sliding_window
        neighbours = {
            n: side.speculate(build_window_head(spec, side, target_dir, n))["counts"]
            for n in (w - 1, w + 1, None)
        }
        head = build_window_head(spec, side, target_dir, w)
        out, problems = export_with_eyas(head, spec, work, str(target_dir))
        return BuiltHead(out, problems, neighbours=neighbours)
    kw = lens_build_kwargs(spec, side)
    mask_id = None
    if spec.algorithm == "peagle":
        mask_id = choose_mask_token_id(side.target.tokenizer, side.embed.shape[0])
    head = build_lens_head(
        side.model,
        algorithm=spec.algorithm,
        num_hidden_layers=spec.num_hidden_layers,
        speculative_tokens=side.k,
        verifier=str(target_dir),
        mask_token_id=mask_id,
        **kw,
    )
    oracle, ref_bad = side.lens_oracle(head, kw)
    out, problems = export_with_eyas(head, spec, work, str(target_dir))
    return BuiltHead(out, problems, ref_bad, oracle)


def compare(
    spec: HeadSpec,
    eyas: dict,
    vllm: dict,
    plain_vllm: dict | None,
    oracle: dict | None,
    neighbours: dict | None,
    k: int,
    max_tokens: int,
    tolerance: float,
) -> dict:
    """The checks of one head; every entry is {"ok": bool, ...}."""
    checks = {"vllm_loads": {"ok": bool(vllm.get("ok")), "error": vllm.get("error")}}
    if not vllm.get("ok"):
        return checks
    outs = vllm["outputs"]
    if plain_vllm and plain_vllm.get("ok"):
        ref = [o[:max_tokens] for o in plain_vllm["outputs"]]
        diff = [i for i, (a, b) in enumerate(zip(outs, ref)) if a != b]
        checks["greedy_equals_plain_vllm"] = {"ok": not diff, "differing_prompts": diff}
    diff = [i for i, (a, b) in enumerate(zip(outs, eyas["outputs"])) if a != b]
    checks["vllm_output_equals_eyas_output"] = {"ok": not diff, "differing_prompts": diff}
    ec, vc = eyas["counts"], vllm["metrics"]
    exact = spec.kind in ("lens", "window")
    if exact:
        same = ec["drafts"] == vc["drafts"] and ec["accepted_per_pos"] == vc["accepted_per_pos"]
        checks["acceptance_exact"] = {
            "ok": same,
            "eyas": ec,
            "vllm": {k_: vc[k_] for k_ in ("drafts", "accepted_per_pos")},
        }
    else:
        gaps = []
        for j in range(k):
            e = ec["accepted_per_pos"][j] / ec["drafts"] if ec["drafts"] else 0.0
            v = vc["accepted_per_pos"][j] / vc["drafts"] if vc["drafts"] else 0.0
            gaps.append(round(abs(e - v), 4))
        checks["acceptance_within_tolerance"] = {
            "ok": max(gaps) <= tolerance,
            "max_gap": max(gaps),
            "tolerance": tolerance,
            "gaps": gaps,
        }
    if oracle is not None:
        checks["oracle_equals_eyas"] = {"ok": oracle == ec, "oracle": oracle}
    if neighbours is not None:
        checks["window_changes_acceptance"] = window_sensitivity(ec, neighbours)
    return checks


def window_sensitivity(counts: dict, neighbours: dict) -> dict:
    """The window head's check is vacuous unless eyas counts every neighbouring window
    (None: no window) otherwise than the served one (drafts or any position)."""
    same = [w for w, c in neighbours.items() if c == counts]
    return {
        "ok": not same,
        "eyas": counts,
        "neighbours": {str(w or "none"): c for w, c in neighbours.items()},
        "error": f"vacuous: windows {same} give the same counts" if same else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="heads: " + "; ".join(f"{n}: {h.description}" for n, h in HEADS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--heads", help=f"comma-separated subset of: {', '.join(HEADS)} (default: all)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"only {', '.join(QUICK)} and no serve check (3 engine starts instead of ~9)",
    )
    parser.add_argument(
        "--trained-head",
        help="a trained head (eyas checkpoint or export) for the 'trained' check "
        "(default: runs/smollm2-135m-eagle3/export when it exists; otherwise that check is skipped and "
        "reported)",
    )
    parser.add_argument("--no-serve", action="store_true", help="skip the `vllm serve DIR` check")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step (default 3)")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt (default 48)")
    parser.add_argument(
        "--num-prompts", type=int, default=len(PROMPTS), help=f"prompts used (default {len(PROMPTS)})"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="allowed gap between eyas and vLLM per-position acceptance for trained heads (default 0.05)",
    )
    parser.add_argument(
        "--work-dir",
        default=str(ROOT / "runs" / "vllm_check"),
        help="exports, runner jobs and vLLM logs (default runs/vllm_check)",
    )
    parser.add_argument("--json-out", help="also write the JSON report here")
    parser.add_argument("--skip-setup", action="store_true", help="do not run scripts/setup_vllm_env.sh")
    parser.add_argument("--engine-timeout", type=float, default=1500, help="seconds one vLLM engine may take")
    parser.add_argument("--port", type=int, default=18123, help="localhost port for the serve check")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for eyas's side (default 1: on a shared CPU two spinning OpenMP "
        "threads are slower than one)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    names = QUICK if args.quick else list(HEADS)
    if args.heads:
        names = [n.strip() for n in args.heads.split(",") if n.strip()]
        unknown = [n for n in names if n not in HEADS]
        if unknown:
            parser.error(f"unknown head(s) {unknown}; choose from {list(HEADS)}")
    serve = not (args.no_serve or args.quick)
    trained_dir = Path(args.trained_head) if args.trained_head else None
    if trained_dir is None and (ROOT / "runs" / "smollm2-135m-eagle3" / "export" / "config.json").is_file():
        trained_dir = ROOT / "runs" / "smollm2-135m-eagle3" / "export"
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)

    if not args.skip_setup:
        log("setting up .venv-vllm (scripts/setup_vllm_env.sh)")
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_vllm_env.sh")], check=True)
    if not VLLM_PYTHON.is_file():
        print(f"vllm_check: {VLLM_PYTHON} is missing; run scripts/setup_vllm_env.sh", file=sys.stderr)
        return 2

    from eyas.target.load import materialize_smollm2

    target_dir = materialize_smollm2()
    prompts = PROMPTS[: args.num_prompts]
    log(f"eyas: float32 target, plain greedy on {len(prompts)} prompts")
    side = EyasSide(target_dir, prompts, args.k, args.max_tokens)
    base_job = {
        "model": str(target_dir),
        "dtype": "float32",
        "max_model_len": 1024,
        "prompts": side.prompt_ids,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
    }

    report = {
        "target": str(target_dir),
        "dtype": "float32",
        "k": args.k,
        "max_tokens": args.max_tokens,
        "prompts": prompts,
        "heads": {},
        "checks_failed": [],
        "skipped": [],
    }
    log("vLLM: plain greedy (no speculation)")
    plain = run_vllm({**base_job, "max_tokens": args.max_tokens + args.k}, work, "plain", args.engine_timeout)
    report["plain"] = {
        "ok": plain.get("ok"),
        "error": plain.get("error"),
        "startup_s": plain.get("startup_s"),
        "vllm_equals_transformers_fp32": plain.get("ok") and plain["outputs"] == side.plain,
    }
    if not plain.get("ok"):
        report["checks_failed"].append("plain: vLLM failed to run the target")

    for name in names:
        spec = HEADS[name]
        entry = {"description": spec.description, "format": spec.fmt, "algorithm": spec.algorithm}
        report["heads"][name] = entry
        try:
            log(f"{name}: build + export with eyas")
            built = build_spec_head(spec, side, work, target_dir, trained_dir)
        except FileNotFoundError as err:  # no trained head on this machine: said, not hidden
            entry["skipped"] = str(err)
            report["skipped"].append(f"{name}: {err}")
            log(f"{name}: SKIPPED: {err}")
            continue
        head_dir, problems, oracle = built.export_dir, built.problems, built.oracle
        entry.update(export_dir=str(head_dir), validator_problems=problems)
        checks = {"export_validates": {"ok": not problems, "problems": problems}}
        if built.ref_bad is not None:
            checks["head_equals_reference_math"] = {
                "ok": built.ref_bad == 0,
                "mismatching_slots": built.ref_bad,
            }
        from eyas.export.reader import load_any_head

        head = load_any_head(head_dir, target_embed=side.embed, dtype=torch.float32)
        log(f"{name}: eyas offline speculative decoding")
        ey = side.speculate(head)
        lossless = [i for i, (a, b) in enumerate(zip(ey["outputs"], side.plain)) if a != b[: args.max_tokens]]
        checks["eyas_greedy_lossless"] = {"ok": not lossless, "differing_prompts": lossless}
        log(f"{name}: vLLM speculative decoding ({spec.algorithm}, {spec.fmt})")
        vl = run_vllm(
            {**base_job, "speculative_config": speculative_config(spec, head_dir, args.k)},
            work,
            name,
            args.engine_timeout,
        )
        checks.update(
            compare(spec, ey, vl, plain, oracle, built.neighbours, args.k, args.max_tokens, args.tolerance)
        )
        entry["vllm_startup_s"] = vl.get("startup_s")
        entry["eyas_summary"] = {
            key: ey["summary"].get(key) for key in ("tau", "tar", "per_position_acceptance")
        }
        entry["acceptance_table"] = acceptance_table(
            ey["counts"], vl.get("metrics") if vl.get("ok") else None, oracle, args.k
        )
        entry["checks"] = checks
        for cname, c in checks.items():
            if not c["ok"]:
                report["checks_failed"].append(f"{name}: {cname}")
        log(f"{name}: " + ", ".join(f"{c}={'ok' if v['ok'] else 'FAIL'}" for c, v in checks.items()))

    if serve:
        spec = HEADS[SERVE_HEAD]
        head_dir = work / "heads" / SERVE_HEAD
        if not (head_dir / "config.json").is_file():
            head_dir = build_spec_head(spec, side, work, target_dir, trained_dir).export_dir
        log(f"vllm serve {head_dir} on 127.0.0.1:{args.port}")
        prompt = prompts[2 % len(prompts)]
        sv = run_vllm(
            {
                "mode": "serve",
                "model": str(head_dir),
                "dtype": "float32",
                "max_model_len": 1024,
                "port": args.port,
                "prompt": prompt,
                "max_tokens": 16,
                "log": str(work / "serve.log"),
                "timeout_s": args.engine_timeout - 60,
            },
            work,
            "serve",
            args.engine_timeout,
        )
        expected = side.target.tokenizer.decode(side.plain[2 % len(prompts)][:16], skip_special_tokens=True)
        ok = bool(sv.get("ok")) and sv.get("completion") == expected
        report["serve"] = {
            "ok": ok,
            "head": str(head_dir),
            "completion": sv.get("completion"),
            "expected_plain_greedy": expected,
            "error": sv.get("error"),
            "startup_s": sv.get("startup_s"),
        }
        if not ok:
            report["checks_failed"].append(
                "serve: `vllm serve DIR` did not answer the plain greedy completion"
            )

    report["passed"] = not report["checks_failed"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
