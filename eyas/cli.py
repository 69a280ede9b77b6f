"""The `eyas` command line: one subcommand per pipeline stage.

Each stage lives in `eyas/commands/<stage>.py` with `add_arguments(parser)` and
`run(args) -> int`; this module only wires them together, so `eyas --help` stays cheap
(no torch import until a stage runs).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

STAGES = {
    "prepare": "read conversations, render with the target's chat template, build loss masks "
    "(optionally regenerate replies with the target)",
    "capture": "run the frozen target over a prepared dataset and cache its hidden states",
    "train": "train a draft head (EAGLE-3 or P-EAGLE) from a recipe",
    "export": "write a trained head in the format vLLM serves (and validate it)",
    "push": "upload an exported head to the Hugging Face Hub",
    "eval": "offline speculative-decoding evaluation (tau, per-position acceptance, TAR)",
    "budget": "size a run (conversations read, epochs) to a time budget on this machine",
    "preflight": "whether a recipe fits its GPUs, per stage and rank, from the target's config alone",
    "plan": "which K to serve, and the concurrency above which speculation stops paying",
    "bench-serve": "serving speed in vLLM: plain, n-gram and each head, per K, concurrency and temperature",
}


def build_parser() -> argparse.ArgumentParser:
    from eyas import __version__

    parser = argparse.ArgumentParser(
        prog="eyas",
        description="Train, export and evaluate speculative-decoding draft heads for vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"eyas {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="stage", metavar="STAGE")
    for stage, summary in STAGES.items():
        module = importlib.import_module(f"eyas.commands.{stage.replace('-', '_')}")
        p = sub.add_parser(
            stage,
            help=summary,
            description=(module.__doc__ or summary).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


# Failures a user can act on, by the module that defines them: printed as one line.
KNOWN_FAILURES = {
    "eyas.budget": ("BudgetError",),
    "eyas.data.conversations": ("NoUsableDataError",),
    "eyas.data.cache": ("CaptureError", "DamagedShardError", "IncompleteCacheError", "StaleCacheError"),
    "eyas.data.capture_engine": ("EngineCaptureError",),
    "eyas.data.vllm_plugin.eyas_states_format": ("HandoverError",),
    "eyas.target.load": ("TargetLoadError",),
    "eyas.target.shapes": ("ShapeError",),
    "eyas.target.quantized": ("QuantizationError",),
    "eyas.preflight_plan": ("PreflightError",),
    "eyas.data.regenerate_server": ("ServerError",),
    "eyas.core.engine_process": ("EngineError",),
    "eyas.core.gpu_holders": ("GpusBusyError",),
    "eyas.eval.evaluate": ("EvalError",),
    "eyas.eval.workloads": ("WorkloadError",),
    "eyas.export.writer": ("ExportFormatError",),
    "eyas.export.hub": ("PushError",),
    "eyas.train.loop": ("TrainingStopped",),
    "eyas.train.engine_feed": ("EngineFeedError",),
    "eyas.train.checkpoint": ("UnsafeCheckpointError", "CheckpointMismatchError"),
    "eyas.train.run_settings": ("RerunRefused",),
}


def known_failure(err: BaseException) -> str | None:
    """The one-line message for a failure a user can act on, or None (a bug: traceback)."""
    import errno

    for module, names in KNOWN_FAILURES.items():
        mod = sys.modules.get(module)  # not imported: the error cannot be one of its classes
        if mod is not None and isinstance(err, tuple(getattr(mod, n) for n in names)):
            return str(err)
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return (
            f"no space left on the device writing {err.filename or 'a file'}: free some space and run again "
            "(a checkpointed stage resumes where it stopped)"
        )
    if isinstance(err, RuntimeError) and "PytorchStreamWriter failed writing file" in str(err):
        return "writing a checkpoint failed (is the disk full?): free some space and run again"
    safetensors = sys.modules.get("safetensors")
    if (
        safetensors is not None
        and isinstance(err, safetensors.SafetensorError)
        and any(s in str(err) for s in ("No space left", "StorageFull", "code: 28"))
    ):  # safetensors' writer reports ENOSPC as its own error, with no file name
        return (
            "no space left on the device writing a safetensors file (a checkpoint, an export or a cache "
            "shard): free some space and run again (a checkpointed stage resumes where it stopped)"
        )
    hub_errors = sys.modules.get("huggingface_hub.errors")
    if hub_errors is not None and isinstance(
        err, (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled)
    ):
        first = next((x.strip() for x in str(err).splitlines() if x.strip()), type(err).__name__)
        return (
            f"the Hugging Face Hub cannot be reached and what it was asked for is not in the local cache "
            f"({first}): download it where the Hub is reachable, or name a local directory"
        )
    if isinstance(err, FileNotFoundError) and err.filename:
        return f"{err.filename}: no such file or directory"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.stage:
        parser.print_help()
        return 2
    setup_logging(args.verbose)
    from eyas.commands._common import CommandError
    from eyas.core.allocator import keep_freed_memory
    from eyas.recipe import RecipeError
    from eyas.run_lock import RunDirBusy, release_run_dirs

    keep_freed_memory()

    try:
        return int(args._run(args) or 0)
    except CommandError as err:
        print(f"eyas {args.stage}: {err}", file=sys.stderr)
        return err.code
    except RecipeError as err:
        print(f"eyas {args.stage}: {err}", file=sys.stderr)
        return 2
    except RunDirBusy as err:
        print(f"eyas {args.stage}: {err}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"eyas {args.stage}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # known failures: one line naming the thing; -v shows the traceback
        message = known_failure(err)
        if message is None or args.verbose:
            raise
        print(f"eyas {args.stage}: {message}", file=sys.stderr)
        return 1
    finally:
        release_run_dirs()


if __name__ == "__main__":
    sys.exit(main())
