"""Model card and Hub upload of an exported head.

`push_head` uploads only the serving files (config.json, model.safetensors) and a
generated README.md, in one commit. The token comes from HF_TOKEN or the login cache,
through `huggingface_hub` itself: this module never reads, prints or writes it.
Transient failures (HTTP 5xx / 429, connection errors, timeouts) are retried with
exponential backoff; the final error says what failed and after how many tries.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eyas.core.hub_ids import looks_like_hub_id
from eyas.core.run_paths import RunPaths
from eyas.export.head_dir import detect_format
from eyas.export.reader import export_config
from eyas.export.writer import CONFIG_NAME, WEIGHTS_NAME, serve_command
from eyas.heads.algorithms import get_algorithm

log = logging.getLogger(__name__)

HEAD_FILES = (CONFIG_NAME, WEIGHTS_NAME)
CARD_NAME = "README.md"
TRAINING_SUMMARY = "training_summary.json"
EVAL_REPORT = RunPaths.EVAL_REPORT


class PushError(RuntimeError):
    """An upload that failed for good; the message names the step and the cause."""


# --- training summary -----------------------------------------------------------------


def write_training_summary(checkpoint_dir: str | Path, out_dir: str | Path) -> Path | None:
    """Record what the head was trained on next to the export (read by the model card).

    Uses `training_summary.json` beside the checkpoint when the trainer wrote one;
    otherwise the run's `recipe.yaml` (checkpoint = run_dir/checkpoints/final) and the
    newest `step-N` checkpoint name. Returns the written path, or None when nothing is
    known."""
    import yaml

    ckpt = Path(checkpoint_dir)
    for cand in (ckpt / TRAINING_SUMMARY, ckpt.parent / TRAINING_SUMMARY):
        if cand.is_file():
            summary = json.loads(cand.read_text())
            break
    else:
        run_dir = ckpt.parent.parent
        recipe_path = run_dir / RunPaths.RECIPE
        if not recipe_path.is_file():
            return None
        recipe = yaml.safe_load(recipe_path.read_text()) or {}
        data, train = recipe.get("data") or {}, recipe.get("train") or {}
        steps = [
            int(p.name.split("-")[1]) for p in ckpt.parent.glob("step-*") if p.name.split("-")[1].isdigit()
        ]
        summary = {
            "run": recipe.get("name"),
            "data_sources": data.get("sources") or [],
            "regenerated": bool((data.get("regenerate") or {}).get("enabled")),
            "max_length": data.get("max_length"),
            "steps": max(steps) if steps else train.get("max_steps"),
            "learning_rate": train.get("learning_rate"),
            # recipe.yaml of an older run holds it flat, a current one in train.eagle3
            "ttt_steps": (train.get("eagle3") or {}).get("ttt_steps", train.get("ttt_steps")),
        }
    out = Path(out_dir) / TRAINING_SUMMARY
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return out


# --- model card -----------------------------------------------------------------------


def _eval_section(report: dict) -> list[str]:
    """A table of the scalar results and, when present, per-position acceptance."""
    lines = ["## Offline acceptance", ""]
    scalars = {
        k: v for k, v in report.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)
    }
    if scalars:
        lines += ["| metric | value |", "|---|---|"]
        for k, v in scalars.items():
            lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
        lines.append("")
    per_pos = next(
        (
            report[k]
            for k in ("per_position_acceptance", "acceptance_per_position", "per_position")
            if isinstance(report.get(k), list)
        ),
        None,
    )
    if per_pos:
        lines += [
            "| draft position | " + " | ".join(str(i + 1) for i in range(len(per_pos))) + " |",
            "|---|" + "---|" * len(per_pos),
            "| acceptance | " + " | ".join("n/a" if a is None else f"{float(a):.3f}" for a in per_pos) + " |",
            "",
        ]
    return lines


def model_card(head_dir: str | Path, repo_id: str, eval_report: str | Path | None = None) -> str:
    """README.md for an exported head: target, algorithm, K, aux layers, draft vocabulary,
    training data and steps (training_summary.json), the offline acceptance table
    (eval_report.json in the dir, or `eval_report`), and the vLLM command."""
    d = Path(head_dir)
    fmt = detect_format(d)
    cfg = export_config(d)
    target = cfg.verifier_name_or_path or "unknown"
    algorithm = get_algorithm(cfg.algorithm)
    algo = algorithm.title
    vocab = (
        f"{cfg.draft_vocab_size} of {cfg.vocab_size} target tokens (d2t/t2d map)"
        if cfg.uses_vocab_map
        else f"the full target vocabulary ({cfg.vocab_size})"
    )
    options = [
        k for k in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual") if getattr(cfg, k)
    ]
    on_hub = looks_like_hub_id(target)
    lines = [
        "---",
        *([f"base_model: {target}"] if on_hub else []),
        "library_name: vllm",
        "tags:",
        "- speculative-decoding",
        f"- {algorithm.tag}",
        "- eyas",
        "---",
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"A {algo} draft head for "
        + (f"[{target}](https://huggingface.co/{target})" if on_hub else f"`{target}`")
        + ", trained with eyas "
        f"and exported in the {fmt} format that vLLM serves as-is.",
        "",
        "| field | value |",
        "|---|---|",
        f"| target (verifier) | `{target}` |",
        f"| algorithm | {algo} |",
        f"| speculative tokens K | {cfg.speculative_tokens} |",
        f"| target aux layers | {', '.join(map(str, cfg.aux_layer_ids))} |",
        f"| draft vocabulary | {vocab} |",
        f"| head layers | {cfg.num_hidden_layers} (hidden {cfg.hidden_size}, intermediate "
        f"{cfg.intermediate_size}) |",
        f"| options | {', '.join(options) or 'none'} |",
    ]
    if algorithm.needs_mask_token:
        lines.append(f"| mask token id | {cfg.mask_token_id} |")
    lines.append("")
    summary_path = d / TRAINING_SUMMARY
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        lines += ["## Training", ""]
        sources = summary.get("data_sources") or []
        if sources:  # a local file is named by its file name: its path means nothing on the Hub
            shown = [
                s if looks_like_hub_id(str(s)) or "/" not in str(s) else f"local file {Path(str(s)).name}"
                for s in sources
            ]
            lines.append(f"- data: {', '.join(shown)}")
        for key, label in (
            ("steps", "optimizer steps"),
            ("regenerated", "replies regenerated by the target"),
            ("max_length", "max sequence length"),
            ("learning_rate", "learning rate"),
            ("ttt_steps", "TTT steps"),
        ):
            if summary.get(key) is not None:
                lines.append(f"- {label}: {summary[key]}")
        lines.append("")
    report_path = Path(eval_report) if eval_report else d / EVAL_REPORT
    if report_path.is_file():
        lines += _eval_section(json.loads(report_path.read_text()))
    lines += [
        "## Serve with vLLM",
        "",
        "```bash",
        serve_command(repo_id, cfg),
        "```",
        "",
    ]
    if fmt == "speculators":
        lines += ["or simply `vllm serve " + repo_id + "` (the verifier is named in config.json).", ""]
    return "\n".join(lines)


# --- upload ---------------------------------------------------------------------------


def is_transient(err: BaseException) -> bool:
    """Worth retrying: HTTP 5xx / 429, connection resets, timeouts; never offline mode
    (huggingface_hub's OfflineModeIsEnabled is a ConnectionError, but it does not pass)."""
    if "OfflineModeIsEnabled" in {c.__name__ for c in type(err).__mro__}:
        return False
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        return status >= 500 or status == 429
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    names = {c.__name__ for c in type(err).__mro__}
    return bool(
        names
        & {
            "TransportError",
            "ConnectError",
            "ReadError",
            "WriteError",
            "TimeoutException",
            "RemoteProtocolError",
            "NetworkError",
            "ProtocolError",
        }
    )


def with_retries(
    what: str,
    fn: Callable,
    attempts: int = 5,
    base_delay: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
):
    """fn() retried on transient errors with delays base, 2·base, 4·base, ..."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - classified below
            if not is_transient(err) or attempt == attempts:
                tries = f" after {attempt} tries" if attempt > 1 else ""
                raise PushError(f"{what} failed{tries}: {type(err).__name__}: {_brief(err)}") from err
            delay = base_delay * 2 ** (attempt - 1)
            log.warning(
                "%s: transient error (%s); retry %d/%d in %.0fs",
                what,
                type(err).__name__,
                attempt,
                attempts - 1,
                delay,
            )
            sleep(delay)


def _brief(err: BaseException) -> str:
    return str(err).splitlines()[0][:300] if str(err) else ""


@dataclass
class PushPlan:
    """What a push uploads: (path in repo, local path or None for the card)."""

    repo_id: str
    revision: str | None
    private: bool
    files: list[tuple[str, Path | None]] = field(default_factory=list)
    card: str = ""

    def describe(self) -> str:
        rows = [
            f"repo {self.repo_id}{' (private)' if self.private else ''}"
            f"{' revision ' + self.revision if self.revision else ''}:"
        ]
        for name, path in self.files:
            size = path.stat().st_size if path else len(self.card.encode())
            rows.append(f"  {name}  ({size:,} bytes)")
        return "\n".join(rows)


def plan_push(
    head_dir: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    eval_report: str | Path | None = None,
) -> PushPlan:
    """The files of a push: the head files and a generated README.md."""
    d = Path(head_dir)
    if "/" not in repo_id or repo_id.count("/") != 1:
        raise PushError(f"repo id {repo_id!r} must look like ORG/NAME")
    files = []
    for name in HEAD_FILES:
        if not (d / name).is_file():
            raise PushError(f"{d / name} is missing; push an exported head (eyas export)")
        files.append((name, d / name))
    verifier = export_config(d).verifier_name_or_path
    if not verifier or not looks_like_hub_id(verifier):
        raise PushError(
            f"{d / CONFIG_NAME} names the verifier {verifier!r}, not a Hub id: `vllm serve {repo_id}` "
            "could not find the target. Set target.hub_id in the recipe to the target's Hub id "
            "(ORG/NAME) and run `eyas export` again"
        )
    card = model_card(d, repo_id, eval_report)
    files.append((CARD_NAME, None))
    return PushPlan(repo_id=repo_id, revision=revision, private=private, files=files, card=card)


def push_head(
    plan: PushPlan,
    api=None,
    endpoint: str | None = None,
    attempts: int = 5,
    base_delay: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Create the repo (if needed), the branch `plan.revision` (if given) and upload the
    planned files in one commit. Returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise PushError(
            f"HF_HUB_OFFLINE is set, so the Hub is never asked: unset it (or set HF_HUB_OFFLINE=0) "
            f"to push to {plan.repo_id}"
        )
    api = api or HfApi(endpoint=endpoint)
    retry = dict(attempts=attempts, base_delay=base_delay, sleep=sleep)
    with_retries(
        f"creating repo {plan.repo_id}",
        lambda: api.create_repo(
            plan.repo_id, private=True if plan.private else None, exist_ok=True, repo_type="model"
        ),
        **retry,
    )
    if plan.revision and plan.revision != "main":
        with_retries(
            f"creating branch {plan.revision}",
            lambda: api.create_branch(plan.repo_id, branch=plan.revision, exist_ok=True),
            **retry,
        )
    ops = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path) if path else plan.card.encode())
        for name, path in plan.files
    ]
    info = with_retries(
        f"uploading to {plan.repo_id}",
        lambda: api.create_commit(
            plan.repo_id,
            operations=ops,
            commit_message="Upload draft head (eyas)",
            revision=plan.revision,
            repo_type="model",
        ),
        **retry,
    )
    return str(getattr(info, "commit_url", info))
