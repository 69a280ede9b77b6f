"""The on-disk feature cache: manifest, shard format, fp8 packing, reader and verify.

Layout (one directory per split, e.g. `run_dir/cache/train/`):

  manifest.json           {"format": "eyas-feature-cache", "version": 1, "aux_layer_ids": [...],
                           "hidden_size": Ht, "aux_dtype": "bf16"|"fp8", "num_samples", "num_tokens",
                           "plan": sha256 of the shard plan, "complete": bool,
                           "prepared_digest": the digest of the prepared data it was captured from,
                           "shards": [{"file", "sha256", "bytes", "num_samples", "num_tokens",
                                       "lengths": [...]}]}
  shard-00000.safetensors  per shard, all samples' tokens concatenated (N tokens, S samples):
      input_ids   [N] int32        loss_mask [N] uint8
      aux         [N, n*Ht] bf16   (or float8_e4m3fn with aux_scale [N, n] float32: one scale per
                                    token and aux layer, x = aux * scale)
      last        [N, Ht] bf16     (target hidden state before the final norm)
      offsets     [S+1] int64      sample s is tokens offsets[s]:offsets[s+1]
      sample_index [S] int64       row of the sample in the prepared split

fp8 cost (scripts/bench_capture.py, SmolLM2-135M): the aux part shrinks by half (4613 ->
2897 bytes/token in all), the dequantized aux states keep cosine 0.9998 / relative error
0.6% to bf16, and the recomputed target distribution is exact, because `last` (the input
of lm_head(norm(.))) is never quantized; quantizing it too would cost KL 0.005 nats and
3% top-1 disagreement, which is why it is not offered.

The reader checks a shard's sha256 against the manifest before using it and raises
`DamagedShardError` naming the file on a mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

MANIFEST = "manifest.json"
FORMAT = "eyas-feature-cache"
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class CaptureError(RuntimeError):
    """The capture cannot start or continue (disk space, a mismatching old cache, ...).
    Here, beside the cache's other errors, so the capture and the reuse of another run's
    cache (data/from_run.py) raise it without importing each other."""


class DamagedShardError(RuntimeError):
    """A shard is missing or its checksum does not match the manifest."""


class IncompleteCacheError(RuntimeError):
    """The capture of a split was started but never finished (killed, or still running)."""


class StaleCacheError(ValueError):
    """The cache was captured from other prepared data than the run holds now."""


def bytes_per_token(num_aux: int, hidden_size: int, aux_dtype: str = "bf16") -> int:
    """Disk bytes per cached token: aux + last (bf16) + input id (int32) + mask (uint8)."""
    aux = num_aux * hidden_size * 2 if aux_dtype == "bf16" else num_aux * (hidden_size + 4)
    return aux + hidden_size * 2 + 4 + 1


def quantize_fp8(aux: torch.Tensor, num_aux: int) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [N, n*H] -> (q [N, n*H] float8_e4m3fn, scale [N, n] float32), one scale per
    token and layer: the aux layers' magnitudes differ by orders, so a shared scale would
    flush the early layers to zero."""
    x = aux.float().reshape(aux.shape[0], num_aux, -1)
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)
    q = (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.reshape(aux.shape), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """(q [N, n*H], scale [N, n]) -> [N, n*H] in `dtype`."""
    n = scale.shape[-1]
    x = q.float().reshape(q.shape[0], n, -1) * scale.unsqueeze(-1)
    return x.reshape(q.shape).to(dtype)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary name, fsync, rename: a kill never leaves a half file under `path`.
    A failed write (a full disk) removes the half temporary file and names `path`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.filename is None:  # write() and fsync() errors carry no file name
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    os.replace(tmp, path)


def read_manifest(split_dir: Path) -> dict | None:
    """The split's manifest, None when there is none; a manifest cut off or not JSON is a
    damaged cache, named (its shards cannot be trusted without it)."""
    path = Path(split_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedShardError(
            f"{path}: the cache manifest is damaged ({err}); remove {Path(split_dir)} "
            "and run `eyas capture` again"
        ) from None
    if not isinstance(manifest, dict):
        raise DamagedShardError(
            f"{path}: the cache manifest is not a JSON object; remove {Path(split_dir)} "
            "and run `eyas capture` again"
        )
    return manifest


def write_manifest(split_dir: Path, manifest: dict) -> None:
    atomic_write(Path(split_dir) / MANIFEST, json.dumps(manifest, indent=1).encode())


def resolve_split_dir(path: str | Path, split: str = "train") -> Path:
    """Accept either a split directory (holding manifest.json) or the cache root."""
    path = Path(path)
    return path if (path / MANIFEST).is_file() else path / split


def stale_cache_problem(
    split_dir: Path, cached_digest: str | None, prepared_digest: str | None
) -> str | None:
    """The line that says a cache was captured from other prepared data than the run's
    prepared directory holds now, or None (they match, or one side predates digests)."""
    if cached_digest is None or prepared_digest is None or cached_digest == prepared_digest:
        return None
    return (
        f"{split_dir}: captured from other prepared data than the run's prepared/ holds now (prepared "
        f"again since?); rerun `eyas capture --overwrite` to capture the new data"
    )


def verify_cache(path: str | Path, split: str = "train", prepared_digest: str | None = None) -> list[str]:
    """Check every shard against the manifest, and (given `prepared_digest`, from
    prepared/meta.json) that the cache is of that data; one line per problem (empty: intact)."""
    split_dir = resolve_split_dir(path, split)
    manifest = read_manifest(split_dir)
    if manifest is None:
        return [f"{split_dir / MANIFEST}: missing"]
    problems = []
    stale = stale_cache_problem(split_dir, manifest.get("prepared_digest"), prepared_digest)
    if stale:
        problems.append(stale)
    if not manifest.get("complete"):
        problems.append(f"{split_dir}: capture incomplete ({len(manifest['shards'])} shards written)")
    for shard in manifest["shards"]:
        f = split_dir / shard["file"]
        if not f.is_file():
            problems.append(f"{f}: missing")
        elif sha256_bytes(f.read_bytes()) != shard["sha256"]:
            problems.append(f"{f}: checksum mismatch (damaged)")
    return problems


class FeatureCache:
    """Random access to cached samples of one split.

    `cache[i]` -> {"input_ids": LongTensor[T], "loss_mask": Tensor[T] (uint8),
    "aux": Tensor[T, n*Ht] bf16 (fp8 dequantized), "last": Tensor[T, Ht] bf16,
    "sample_index": int}. Samples are ordered shard by shard (shards hold length-sorted
    samples); one shard is kept in memory, so iterate in index order or group a sampler
    by `shard_of(i)` to avoid re-reading shards. Each shard is checksummed on first load.
    """

    def __init__(self, path: str | Path, split: str = "train", allow_incomplete: bool = False):
        self.dir = resolve_split_dir(path, split)
        manifest = read_manifest(self.dir)
        if manifest is None or manifest.get("format") != FORMAT:
            raise FileNotFoundError(f"no feature cache at {self.dir} (run `eyas capture`)")
        if not manifest.get("complete") and not allow_incomplete:
            raise IncompleteCacheError(f"{self.dir}: capture incomplete; rerun `eyas capture` to resume it")
        self.manifest = manifest
        self.aux_layer_ids: list[int] = list(manifest["aux_layer_ids"])
        self.hidden_size: int = manifest["hidden_size"]
        self.aux_dtype: str = manifest["aux_dtype"]
        self.prepared_digest: str | None = manifest.get("prepared_digest")
        self.lengths: list[int] = [n for s in manifest["shards"] for n in s["lengths"]]
        self._shard_start: list[int] = []
        start = 0
        for s in manifest["shards"]:
            self._shard_start.append(start)
            start += s["num_samples"]
        self._loaded: tuple[int, dict] | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def shard_of(self, i: int) -> int:
        import bisect

        return bisect.bisect_right(self._shard_start, i) - 1

    def _shard(self, k: int) -> dict:
        if self._loaded is not None and self._loaded[0] == k:
            return self._loaded[1]
        from safetensors.torch import load

        meta = self.manifest["shards"][k]
        f = self.dir / meta["file"]
        if not f.is_file():
            raise DamagedShardError(f"{f}: missing")
        data = f.read_bytes()
        if sha256_bytes(data) != meta["sha256"]:
            raise DamagedShardError(
                f"{f}: checksum mismatch; the shard is damaged. Delete it and "
                "rerun `eyas capture` to recompute it"
            )
        tensors = load(data)
        self._loaded = (k, tensors)
        return tensors

    def verify(self) -> list[str]:
        return verify_cache(self.dir)

    def sample_rows(self) -> list[int]:
        """The prepared-split row of every cached sample, in cache order, read from each
        shard's `sample_index` alone (the shards' checksums are checked when they are read)."""
        from safetensors import safe_open

        rows: list[int] = []
        for meta in self.manifest["shards"]:
            f = self.dir / meta["file"]
            if not f.is_file():
                raise DamagedShardError(f"{f}: missing")
            with safe_open(str(f), "pt") as shard:
                rows += shard.get_tensor("sample_index").tolist()
        return rows

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = self.shard_of(i)
        t = self._shard(k)
        j = i - self._shard_start[k]
        a, b = int(t["offsets"][j]), int(t["offsets"][j + 1])
        if self.aux_dtype == "fp8":
            aux = dequantize_fp8(t["aux"][a:b], t["aux_scale"][a:b])
        else:
            aux = t["aux"][a:b]
        return {
            "input_ids": t["input_ids"][a:b].long(),
            "loss_mask": t["loss_mask"][a:b],
            "aux": aux,
            "last": t["last"][a:b],
            "sample_index": int(t["sample_index"][j]),
        }
