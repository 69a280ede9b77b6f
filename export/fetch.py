"""A head directory from a local path or a Hugging Face Hub id (`org/name`), for import,
`eyas export --check`, `eyas eval --head` and `train.init_from` (DESIGN §5.1).

Only the files a head is read from are downloaded: configs and safetensors weights. A
repo that ships its weights only as a pickle is refused by name (and how to convert it),
as a local pickle-only directory is (`export/head_weights.py`).
"""

from __future__ import annotations

from pathlib import Path

from eyas.core.hub_ids import looks_like_hub_id
from eyas.export.writer import ExportFormatError

HEAD_PATTERNS = ["*.json", "*.safetensors"]


def fetch_head(name_or_path: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The local directory of a head: `name_or_path` itself when it exists, else the
    snapshot of that Hub repo (the Hugging Face cache; HF_HUB_OFFLINE reads only it)."""
    local = Path(name_or_path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ExportFormatError(
                f"{local} is a file; a head is a directory (config.json + model.safetensors)"
            )
        return local
    if not looks_like_hub_id(name_or_path):
        raise ExportFormatError(f"{name_or_path}: no such head directory (a Hub head is named org/name)")
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        path = Path(
            snapshot_download(
                name_or_path, revision=revision, allow_patterns=HEAD_PATTERNS, cache_dir=cache_dir
            )
        )
    except RepositoryNotFoundError:
        raise ExportFormatError(
            f"{name_or_path}: no such model repo on the Hub (or it is private: log in with `hf auth login`)"
        ) from None
    except LocalEntryNotFoundError as err:
        raise ExportFormatError(
            f"{name_or_path}: not in the local Hugging Face cache and the Hub cannot be reached "
            f"({str(err).splitlines()[0]})"
        ) from None
    except HfHubHTTPError as err:
        raise ExportFormatError(
            f"{name_or_path}: the Hub refused the download: {str(err).splitlines()[0]}"
        ) from None
    if not any(path.glob("*.safetensors")):
        try:
            remote = HfApi().list_repo_files(name_or_path, revision=revision)
        except Exception:
            remote = []
        if any(name.endswith(".bin") for name in remote):
            raise ExportFormatError(
                f"{name_or_path} ships its weights only as a pickle (pytorch_model.bin); eyas reads "
                f"safetensors. "
                f"Download it (`hf download {name_or_path} --local-dir DIR`), convert it once with the "
                f"command "
                "`eyas export --check DIR` prints, and pass DIR"
            )
    return path


def fetch_verifier_facts(name_or_path: str):
    """(TargetFacts, None) for the verifier a head names, read from a local directory, the
    Hugging Face cache or the Hub (its config.json alone); (None, why) when it cannot be
    read, so `eyas export --check` can say the check was not made instead of passing."""
    from eyas.export.head_dir import cached_target_facts, target_facts
    from eyas.target.load import SMOLLM2_HUB_ID, converted_smollm2_dir

    facts = cached_target_facts(name_or_path)
    if facts is None and name_or_path == SMOLLM2_HUB_ID:  # the shipped copy, once converted
        facts = cached_target_facts(str(converted_smollm2_dir()))
    if facts is not None:
        return facts, None
    if Path(name_or_path).expanduser().exists() or not looks_like_hub_id(name_or_path):
        return None, f"{name_or_path}: no config.json there (not a model directory, nor a Hub id)"
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(name_or_path, "config.json")
    except Exception as err:  # noqa: BLE001 - offline, missing, gated: all mean "not checked"
        first = next((x.strip() for x in str(err).splitlines() if x.strip()), "")
        return None, f"its config.json could not be read from the Hub ({type(err).__name__}: {first[:200]})"
    import json

    try:
        return target_facts(
            json.loads(Path(path).read_text()), f"{name_or_path} (config.json from the Hub)"
        ), None
    except (OSError, ValueError, TypeError) as err:
        return None, f"its config.json from the Hub is not a model config ({err})"
