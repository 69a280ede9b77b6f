"""One cache directory for what eyas keeps per machine (`core/cache_dir.py`)."""

import json

from eyas.core import precision
from eyas.core.cache_dir import eyas_cache_dir
from eyas.target.load import materialize_smollm2
from eyas.target.shapes import config_file


def test_eyas_cache_dir_moves_the_converted_target_and_the_timing_verdicts_together(monkeypatch, tmp_path):
    root = tmp_path / "elsewhere"
    monkeypatch.setenv("EYAS_CACHE_DIR", str(root))
    converted = root / "SmolLM2-135M-Instruct"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text(json.dumps({"model_type": "llama"}))
    # the demo target is read from its converted copy there, not converted again elsewhere
    assert materialize_smollm2() == converted
    assert config_file("smollm2-135m") == converted / "config.json"
    precision.write_verdicts("verdicts.json", {"shape": "float32"})
    assert precision.read_verdicts("verdicts.json") == {"shape": "float32"}
    assert (root / "verdicts.json").is_file()


def test_without_eyas_cache_dir_the_cache_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("EYAS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert eyas_cache_dir() == tmp_path / "xdg" / "eyas"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert eyas_cache_dir() == tmp_path / "home" / ".cache" / "eyas"
