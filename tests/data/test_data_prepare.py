"""The prepare stage end to end on a tiny target (CLI), regeneration and its resume."""

import json
from dataclasses import replace

import pytest
import torch

from eyas.cli import main
from eyas.data.prepare import load_prepared, load_token_frequencies
from eyas.data.regenerate_settings import RegenerationSettings
from eyas.data.samples import split_indices


def _write_corpus(path, n=30):
    rows = []
    for k in range(n):
        rows.append(
            {
                "conversations": [
                    {"from": "human", "value": f"question {k}?"},
                    {"from": "gpt", "value": f"answer number {k}."},
                    {"from": "human", "value": "more"},
                    {"from": "gpt", "value": "x" * (5 if k % 10 else 400)},
                ]
            }
        )
    rows.append({"conversations": [{"from": "robot", "value": "?"}, {"from": "gpt", "value": "y"}]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    return path


def test_split_is_deterministic_and_disjoint():
    a = split_indices(100, 0.1, seed=3)
    assert a == split_indices(100, 0.1, seed=3) and len(a[1]) == 10
    assert not set(a[0]) & set(a[1]) and sorted(a[0] + a[1]) == list(range(100))
    assert split_indices(100, 0.1, seed=4) != a
    assert len(split_indices(5, 0.01, 0)[1]) == 1 and split_indices(5, 0.0, 0)[1] == []


def test_prepare_cli_writes_dataset_freqs_and_drop_report(tiny_llama_dir, tmp_path, capsys):
    corpus = _write_corpus(tmp_path / "c.jsonl")
    run = tmp_path / "run"
    args = [
        f"run_dir={run}",
        f"target.name_or_path={tiny_llama_dir}",
        f"data.sources=[{corpus}]",
        "data.max_length=300",
        "data.eval_fraction=0.1",
        "data.train_on=last",
    ]
    assert main(["prepare", "--no-progress", *args]) == 0
    report = json.loads((run / "prepared" / "drop_report.json").read_text())
    assert report["dropped"] == {"bad_json": 1, "over_length": 3, "unknown_role": 1}
    # the rows the reader dropped are named by their line
    # every dropped row is named by its line, the over-long ones the renderer dropped too
    assert report["dropped_rows"] == {
        "bad_json": [f"{corpus}:32"],
        "over_length": [f"{corpus}:1", f"{corpus}:11", f"{corpus}:21"],
        "unknown_role": [f"{corpus}:31"],
    }
    assert report["kept"] == 27 and "over_length" in capsys.readouterr().out
    dd = load_prepared(run / "prepared")
    assert len(dd["train"]) == 24 and len(dd["eval"]) == 3
    # data.over_length=truncate keeps the 3 long rows, cut to max_length and counted.
    cut = tmp_path / "cut"
    assert main(["prepare", "--no-progress", *args, f"run_dir={cut}", "data.over_length=truncate"]) == 0
    report = json.loads((cut / "prepared" / "drop_report.json").read_text())
    assert report["dropped"] == {"bad_json": 1, "unknown_role": 1}
    assert report["kept"] == 30 and report["repaired"]["truncated_to_max_length"] == 3
    cut_dd = load_prepared(cut / "prepared")
    assert max(len(r["input_ids"]) for r in [*cut_dd["train"], *cut_dd["eval"]]) == 300
    freqs = load_token_frequencies(run / "prepared")
    assert freqs.shape == (320,)
    # Frequencies count exactly the masked train tokens; with train_on=last only the last reply.
    n_masked = sum(sum(m) for m in dd["train"]["loss_mask"])
    assert int(freqs.sum()) == n_masked == 24 * (5 + 1)  # "xxxxx" + <|im_end|>
    from support.tiny_targets import byte_tokenizer

    tok = byte_tokenizer()
    assert (
        freqs[tok.convert_tokens_to_ids("x")] == 24 * 5
        and freqs[tok.convert_tokens_to_ids("<|im_end|>")] == 24
    )

    # The held-out conversations double as an eval workload, in the eval split's order.
    from eyas.eval.workloads import load_workload

    prompts = load_workload(str(run / "prepared" / "eval_prompts.jsonl"))
    assert len(prompts) == len(dd["eval"]) == 3
    for prompt, row in zip(prompts, dd["eval"]):
        assert prompt.turns and all(turn in tok.decode(row["input_ids"]) for turn in prompt.turns)

    # The captured cache lines up with the prepared data.
    assert main(["capture", "--no-progress", *args, "data.shard_tokens=2000"]) == 0
    from eyas.data.cache import FeatureCache

    cache = FeatureCache(run / "cache", "train")
    assert len(cache) == 24 and cache.aux_layer_ids == [2, 4, 5]
    s = cache[3]
    assert s["input_ids"].tolist() == dd["train"][s["sample_index"]]["input_ids"]
    assert main(["capture", *args, "--verify"]) == 0


def test_nothing_usable_is_an_error(tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n")
    assert (
        main(
            [
                "prepare",
                f"run_dir={tmp_path}/r",
                f"target.name_or_path={tiny_llama_dir}",
                f"data.sources=[{bad}]",
            ]
        )
        == 1
    )


def test_regeneration_turn_by_turn_and_resume(tiny_llama_dir, tmp_path, caplog):
    from eyas.data.regenerate import regenerate
    from eyas.target.load import load_target

    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    convs = [
        [
            {"role": "user", "content": f"q{k}"},
            {"role": "assistant", "content": "old"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "old2"},
        ]
        for k in range(5)
    ]
    out = tmp_path / "regen.jsonl"
    settings = RegenerationSettings(batch_size=2, max_new_tokens=6, progress=False)
    model = target.model
    full = regenerate(convs, target.tokenizer, out, settings, model=model)
    assert len(full) == 5
    for conv in full:
        assert conv[0]["content"].startswith("q") and all(m["content"] not in ("old", "old2") for m in conv)
    # Greedy batched replies equal unbatched ones (left padding is right).
    single = regenerate(
        convs[:1], target.tokenizer, tmp_path / "one.jsonl", replace(settings, batch_size=1), model=model
    )
    assert single[0] == full[0]
    # Simulate a kill: keep the first 3 records and half a line, then resume.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])
    resumed = regenerate(convs, target.tokenizer, out, settings, model=model)
    assert resumed == full
    records = [json.loads(line) for line in out.read_text().splitlines()]  # the cut line was removed
    assert sorted(r["index"] for r in records) == list(range(5))
    # fewer conversations over the same file: the records past them are not called stale
    with caplog.at_level("WARNING"):
        assert regenerate(convs[:2], target.tokenizer, out, settings, model=model) == full[:2]
    assert "generated from other" not in caplog.text
    # The same file read for other conversations (another max_samples, dedupe, ...):
    # records generated from other prompts are generated again, not paired with these.
    shifted = convs[1:] + [[{"role": "user", "content": "new"}, {"role": "assistant", "content": "old"}]]
    again = regenerate(shifted, target.tokenizer, out, settings, model=model)
    fresh = regenerate(shifted, target.tokenizer, tmp_path / "fresh.jsonl", settings, model=model)
    assert again == fresh and again[0] == full[1]


def test_records_of_another_prompt_cap_or_reply_length_are_generated_again(tiny_llama_dir, tmp_path):
    from eyas.data.regenerate import regenerate
    from eyas.target.load import load_target

    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    convs = [
        [{"role": "user", "content": f"question {k}"}, {"role": "assistant", "content": "old"}]
        for k in range(3)
    ]
    out = tmp_path / "regen.jsonl"
    model = target.model

    def settings(**changes) -> RegenerationSettings:
        return RegenerationSettings(**{"batch_size": 3, "max_new_tokens": 4, "progress": False, **changes})

    # A recipe whose prompt cap left no room: every conversation ends before its first reply.
    assert regenerate(convs, target.tokenizer, out, settings(max_prompt_tokens=1), model=model) == [
        [],
        [],
        [],
    ]
    # The fixed recipe must not reuse those empty records.
    fixed = regenerate(convs, target.tokenizer, out, settings(max_prompt_tokens=100), model=model)
    assert all(c and c[-1]["role"] == "assistant" for c in fixed)
    assert fixed == regenerate(
        convs, target.tokenizer, tmp_path / "fresh.jsonl", settings(max_prompt_tokens=100), model=model
    )
    # Another reply length is another record too.
    longer = regenerate(
        convs, target.tokenizer, out, settings(max_prompt_tokens=100, max_new_tokens=8), model=model
    )
    assert longer == regenerate(
        convs,
        target.tokenizer,
        tmp_path / "fresh8.jsonl",
        settings(max_prompt_tokens=100, max_new_tokens=8),
        model=model,
    )


def test_max_turns_and_prompt_cap_limit_regeneration(tiny_llama_dir, tmp_path):
    from eyas.data.regenerate import regenerate
    from eyas.data.samples import keep_first_turns
    from eyas.target.load import load_target

    conv = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    assert keep_first_turns(conv, 1) == conv[:3]
    assert keep_first_turns(conv, 5) == conv
    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    long_first = [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "old"}]
    short = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "y" * 200},
        {"role": "assistant", "content": "old"},
    ]
    out = regenerate(
        [long_first, short],
        target.tokenizer,
        tmp_path / "r.jsonl",
        RegenerationSettings(batch_size=2, max_new_tokens=4, progress=False, max_prompt_tokens=100),
        model=target.model,
    )
    assert out[0] == []  # its only prompt is too long: nothing to train on
    assert [m["role"] for m in out[1]] == ["user", "assistant"]  # stopped before the long second turn
    assert out[1][1]["content"] != "old"


def test_regeneration_batches_by_first_prompt_length(tiny_llama_dir, tmp_path, monkeypatch):
    """Batches hold prompts of similar token length (whatever the dataset's own reply
    length), and a prompt over the cap never takes a batch slot."""
    import eyas.data.regenerate as regen
    from eyas.data.decode import DecodedReply
    from eyas.target.load import load_target

    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    calls = []

    def fake_decode(model, tokenizer, prompts, *args, **kwargs):
        calls.append(sorted(len(p) for p in prompts))
        ok = tokenizer("ok", add_special_tokens=False)["input_ids"]  # replies are built from their tokens
        return [DecodedReply(token_ids=ok, text="ok") for _ in prompts]

    monkeypatch.setattr(regen, "decode_replies_hf", fake_decode)
    # Long prompts carry short dataset replies and short prompts long ones, so sorting by
    # the first two messages' characters would pair a long prompt with a short one.
    words = [3, 40, 5, 38, 4, 39, 200]
    convs = [
        [
            {"role": "user", "content": " ".join(["w"] * n)},
            {"role": "assistant", "content": "r" * (2000 // n)},
        ]
        for n in words
    ]
    out = regen.regenerate(
        convs,
        target.tokenizer,
        tmp_path / "r.jsonl",
        RegenerationSettings(batch_size=3, max_new_tokens=4, progress=False, max_prompt_tokens=120),
        model=target.model,
    )
    assert len(calls) == 2 and [len(c) for c in calls] == [3, 3]
    assert max(calls[0]) < min(calls[1])  # the three short prompts, then the three long ones
    assert out[6] == [] and all(c[1]["content"] == "ok" for c in out[:6])
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in records) == list(range(7))


class _BarSpy:
    """Stands in for tqdm: what the bar was told to count."""

    made = []

    def __init__(self, total=None, initial=0, unit="it", **kwargs):
        self.total, self.n, self.unit = total, initial, unit
        self.initial = initial
        _BarSpy.made.append(self)

    def update(self, k=1):
        self.n += k

    def set_postfix(self, *a, **k):
        pass

    def close(self):
        pass


def test_regeneration_progress_counts_tokens_and_resumes_its_count(tiny_llama_dir, tmp_path, monkeypatch):
    """The ETA counts prompt tokens and reply slots: the prompts run shortest first, so a
    conversation count would read the long tail at the short head's rate."""
    import tqdm.auto

    from eyas.data.regenerate import before_first_reply, prompt_ids, regenerate
    from eyas.target.load import load_target

    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    monkeypatch.setattr(tqdm.auto, "tqdm", _BarSpy)
    convs = [
        [{"role": "user", "content": " ".join(["w"] * n)}, {"role": "assistant", "content": "old"}]
        for n in (2, 30, 4, 60)
    ]
    prompt_tokens = [len(prompt_ids(target.tokenizer, before_first_reply(c))) for c in convs]
    out = tmp_path / "r.jsonl"
    regenerate(
        convs, target.tokenizer, out, RegenerationSettings(batch_size=2, max_new_tokens=5), model=target.model
    )
    bar = _BarSpy.made[-1]
    assert bar.unit == "tok" and bar.total == sum(prompt_tokens) + 4 * 5 and bar.n == bar.total
    # resumed with two records kept: the bar starts at their reply slots, ends at its total
    out.write_text("\n".join(out.read_text().splitlines()[:2]) + "\n")
    regenerate(
        convs, target.tokenizer, out, RegenerationSettings(batch_size=2, max_new_tokens=5), model=target.model
    )
    bar = _BarSpy.made[-1]
    kept = [json.loads(line)["index"] for line in out.read_text().splitlines()[:2]]
    left = [i for i in range(4) if i not in kept]
    assert bar.initial == 2 * 5 and bar.total == bar.initial + sum(prompt_tokens[i] for i in left) + 2 * 5
    assert bar.n == bar.total


def test_no_eval_split_when_eval_fraction_is_zero(tiny_llama_dir, tmp_path):
    corpus = _write_corpus(tmp_path / "c.jsonl", n=6)
    run = tmp_path / "run"
    assert (
        main(
            [
                "prepare",
                "--no-progress",
                f"run_dir={run}",
                f"target.name_or_path={tiny_llama_dir}",
                f"data.sources=[{corpus}]",
                "data.max_length=300",
                "data.eval_fraction=0",
            ]
        )
        == 0
    )
    dd = load_prepared(run / "prepared")
    assert list(dd) == ["train"] and len(dd["train"]) == 5


def test_prompts_too_long_to_regenerate_are_counted(tiny_llama_dir, tmp_path):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "q" * (400 if k == 0 else 5 + k)},
                {"from": "gpt", "value": "a"},
            ]
        }
        for k in range(4)
    ]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run = tmp_path / "run"
    assert (
        main(
            [
                "prepare",
                "--no-progress",
                f"run_dir={run}",
                f"target.name_or_path={tiny_llama_dir}",
                f"data.sources=[{corpus}]",
                "data.max_length=100",
                "data.eval_fraction=0",
                "data.regenerate.enabled=true",
                "data.regenerate.max_new_tokens=8",
                "target.dtype=float32",
            ]
        )
        == 0
    )
    report = json.loads((run / "prepared" / "drop_report.json").read_text())
    assert report["dropped"] == {"regenerated_nothing_to_train": 1} and report["kept"] == 3
    assert report["dropped_rows"] == {"regenerated_nothing_to_train": [f"{corpus}:1"]}


def test_capture_skips_online_features_and_missing_eval_split(tiny_llama_dir, tmp_path, capsys):
    corpus = _write_corpus(tmp_path / "c.jsonl", n=6)
    run = tmp_path / "run"
    args = [
        f"run_dir={run}",
        f"target.name_or_path={tiny_llama_dir}",
        f"data.sources=[{corpus}]",
        "data.max_length=300",
        "data.eval_fraction=0",
    ]
    assert main(["prepare", "--no-progress", *args]) == 0
    assert main(["capture", "--no-progress", *args, "data.features=online"]) == 0
    assert "nothing to capture" in capsys.readouterr().out and not (run / "cache").exists()
    assert main(["capture", "--no-progress", *args]) == 0  # train only: no eval split to capture
    from eyas.data.cache import FeatureCache

    assert len(FeatureCache(run / "cache", "train")) == 5


PROMPTS = ["a", "hello there", "xyz", "a much longer prompt than the rest"]
MORE_PROMPTS = PROMPTS + ["b c", "the cat", "one two three", "zz", "q"]


@pytest.mark.parametrize("texts", [PROMPTS, MORE_PROMPTS], ids=["4-rows", "9-rows"])
def test_batched_greedy_replies_equal_model_generate_when_rows_stop_early(tiny_llama_dir, texts):
    """Rows leave the batch once stopped rows are a quarter of it (at once with 4 rows;
    with 9, a stopped row first rides along); the others' replies must not move."""
    from eyas.data.decode import _takes_additive_decode_mask, decode_replies_hf
    from eyas.target.load import load_target

    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    model, tok = target.model, target.tokenizer
    assert _takes_additive_decode_mask(model)  # decode steps take our own 4D mask
    prompts = [tok(t)["input_ids"] for t in texts]
    free = [r.text for r in decode_replies_hf(model, tok, prompts, 12, 0.0, 1.0)]
    # Make a token that some (not all) replies emit mid-way the stop token.
    first_ids = [tok(r)["input_ids"] for r in free]
    candidates = [i for ids in first_ids for i in ids[2:8]]
    stop = next(c for c in candidates if sum(c in ids for ids in first_ids) < len(prompts))
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    ours = [r.text for r in decode_replies_hf(model, tok, prompts, 12, 0.0, 1.0)]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id or 0)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :], mask[b, width - len(p) :] = torch.tensor(p), 1
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=tok.pad_token_id or 0,
    )
    # HF pads a finished row with pad ids after its stop token; cut at the first stop instead.
    expected = []
    for row in ref[:, width:].tolist():
        cut = next((j for j, t in enumerate(row) if t in (stop, tok.eos_token_id)), len(row))
        expected.append(tok.decode(row[:cut], skip_special_tokens=True).strip())
    assert ours == expected
    assert any(len(a) < len(b) for a, b in zip(ours, free))  # some row really stopped early


def test_preallocated_kv_cache_gives_the_logits_of_the_growing_cache(tiny_llama_dir):
    """Prefill, decode steps, a row dropped mid-way and a buffer outgrown (capacity 3):
    the same logits as transformers' own DynamicCache."""
    from transformers import DynamicCache

    from eyas.data.decode import _preallocated_cache
    from eyas.target.load import load_target

    model = load_target(str(tiny_llama_dir), dtype="float32", device="cpu").model
    torch.manual_seed(0)
    ids, later = torch.randint(3, 50, (3, 5)), torch.randint(3, 50, (3, 7))
    results = []
    for cache in (DynamicCache(config=model.config), _preallocated_cache(model, 3)):
        steps = [model(input_ids=ids, cache=cache, use_cache=True).logits]
        rows = torch.arange(3)
        for step in range(7):  # 12 positions: past the first buffer of 2 x 5
            if step == 2:  # row 1 leaves the batch
                rows = torch.tensor([0, 2])
                cache.batch_select_indices(rows)
            tok = later[rows, step : step + 1]
            pos = torch.full((len(rows), 1), 5 + step)
            steps.append(model(input_ids=tok, position_ids=pos, cache=cache, use_cache=True).logits)
        results.append(steps)
    for want, got in zip(*results):
        torch.testing.assert_close(got, want)


def test_sliding_window_targets_keep_the_masks_transformers_builds(tiny_llama_dir):
    """A ready 4D mask is used as is by every layer; a sliding-window layer given one would
    attend to its whole cache, so such targets (GPT-OSS) keep the 2D mask path."""
    from eyas.data.decode import _takes_additive_decode_mask
    from eyas.target.load import load_target

    model = load_target(str(tiny_llama_dir), dtype="float32", device="cpu").model
    assert _takes_additive_decode_mask(model)
    model.config.layer_types = ["sliding_attention"] + ["full_attention"] * (
        model.config.num_hidden_layers - 1
    )
    assert not _takes_additive_decode_mask(model)


def test_repeated_conversations_are_dropped_and_counted(tiny_llama_dir, tmp_path):
    """The same prompt twice (with different dataset replies, as ShareGPT repeats
    questions) is regenerated once; without regeneration only exact repeats go."""
    from eyas.data.samples import duplicate_indices

    def conv(q, a):
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    convs = [conv("hi", "a"), conv("hi ", "b"), conv("other", "a"), conv("hi", "a")]
    assert duplicate_indices(convs, prompts_only=True) == [1, 3]
    assert duplicate_indices(convs, prompts_only=False) == [3]

    rows = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "x"}]}
        for q in ["what is 2+2?", "hello there", "what is 2+2?", "tell me more"]
    ]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run = tmp_path / "run"
    args = [
        "prepare",
        "--no-progress",
        f"run_dir={run}",
        f"target.name_or_path={tiny_llama_dir}",
        f"data.sources=[{corpus}]",
        "data.max_length=300",
        "data.eval_fraction=0",
        "data.regenerate.enabled=true",
        "data.regenerate.max_new_tokens=4",
        "target.dtype=float32",
    ]
    assert main(args) == 0
    report = json.loads((run / "prepared" / "drop_report.json").read_text())
    assert report["dropped"].get("duplicate") == 1 and report["read"] == 4
    assert report["dropped_rows"] == {"duplicate": [f"{corpus}:3"]}  # named by its line
    assert len((run / "prepared" / "regenerated.jsonl").read_text().splitlines()) == 3
    assert main([*args, f"run_dir={tmp_path}/r2", "data.dedupe=false"]) == 0
    assert len((tmp_path / "r2" / "prepared" / "regenerated.jsonl").read_text().splitlines()) == 4


def test_regeneration_batch_tokens_decodes_long_prompts_a_few_at_a_time(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """`data.regenerate.batch_tokens`: long prompts decode in small batches and short ones
    fill batch_size, every batch within its padded budget, every conversation once, and the
    replies the same as with count batches."""
    import eyas.data.regenerate as regen
    from eyas.data.regenerate import before_first_reply, prompt_ids, regenerate
    from eyas.target.load import load_target

    target = load_target(str(tiny_llama_dir), dtype="float32", device="cpu")
    lengths = (3, 4, 5, 6, 80, 90)
    convs = [
        [{"role": "user", "content": " ".join(["w"] * n)}, {"role": "assistant", "content": "old"}]
        for n in lengths
    ]
    tokens = [len(prompt_ids(target.tokenizer, before_first_reply(c))) for c in convs]
    seen: list[list[int]] = []
    decode = regen.decode_replies_hf
    monkeypatch.setattr(
        regen,
        "decode_replies_hf",
        lambda m, t, prompts, *a, **k: (
            seen.append([len(p) for p in prompts]) or decode(m, t, prompts, *a, **k)
        ),
    )
    budget, new = 2 * (max(tokens) + 4), 4
    out = tmp_path / "budget.jsonl"
    regenerate(
        convs,
        target.tokenizer,
        out,
        RegenerationSettings(batch_size=4, batch_tokens=budget, max_new_tokens=new, progress=False),
        model=target.model,
    )
    assert sorted(n for batch in seen for n in batch) == sorted(tokens)
    assert all(len(b) == 1 or len(b) * (max(b) + new) <= budget for b in seen), seen
    assert len(seen[0]) == 2 and max(seen[0]) == max(tokens)  # the long pair first, together
    assert max(len(b) for b in seen) == 4  # the short ones fill batch_size
    by_count = tmp_path / "count.jsonl"
    regenerate(
        convs,
        target.tokenizer,
        by_count,
        RegenerationSettings(batch_size=4, max_new_tokens=new, progress=False),
        model=target.model,
    )

    def replies(path):
        return {
            json.loads(line)["index"]: json.loads(line)["messages"] for line in path.read_text().splitlines()
        }

    assert replies(out) == replies(by_count)
