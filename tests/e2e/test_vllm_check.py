"""Serving truth (scripts/vllm_check.py): exported heads run in a real vLLM and eyas's
offline acceptance equals vLLM's. The lens-head construction it relies on is checked here
on the tiny target without vLLM; the vLLM runs need .venv-vllm and take minutes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from vllm_heads import build_lens_head, lens_aux_layer_ids, reference_drafts, replay_oracle  # noqa: E402

HAS_VLLM = (ROOT / ".venv-vllm" / "bin" / "python").is_file()


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    from eyas.target.load import load_target

    return load_target(str(tiny_llama_dir), dtype="float32", device="cpu").model


def _lens_states(model, ids):
    from eyas.target.features import compute_features

    layer = lens_aux_layer_ids(model.config.num_hidden_layers)[-1]
    aux, _ = compute_features(model, torch.tensor([ids]), None, [layer])
    return aux[0]


def _lens_drafts(head, states, ids, k):
    n = len(ids) - 1
    aux = torch.zeros(n, 1, head.config.fc_in_features)
    aux[:, 0, -states.shape[-1] :] = states[:n]
    got, _ = head.draft(head.new_cache(), torch.tensor(ids[1:])[:, None], aux, torch.arange(n)[:, None], k)
    return got


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(fc_norm=True, norm_output=True, norm_before_residual=True),
        dict(algorithm="peagle", num_hidden_layers=2),
        dict(algorithm="peagle", num_hidden_layers=2, fc_norm=True, with_vocab=True),
    ],
)
def test_lens_head_drafts_what_the_reference_math_says(tiny_model, options):
    options = dict(options)
    with_vocab = options.pop("with_vocab", False)
    vt = tiny_model.get_output_embeddings().weight.shape[0]
    ids = [5, 17, 40, 40, 40, 99, 3, 250, 17, 17, 8]
    states = _lens_states(tiny_model, ids)
    kw = {}
    if with_vocab:
        kw["draft_ids"] = torch.arange(0, vt, 2)
    if options.get("algorithm") == "peagle":
        kw["mask_state"] = states[3]
        options["mask_token_id"] = vt - 1
    head = build_lens_head(tiny_model, speculative_tokens=3, **options, **kw)
    got = _lens_drafts(head, states, ids, 3)
    ref_kw = {k: v for k, v in options.items() if k in ("fc_norm", "norm_output", "norm_before_residual")}
    want = reference_drafts(
        tiny_model, states[: len(ids) - 1], 3, algorithm=options.get("algorithm", "eagle3"), **ref_kw, **kw
    )
    assert torch.equal(got, want)
    if with_vocab:
        assert bool((got % 2 == 0).all())  # only draft-vocabulary ids come out


def test_lens_head_acceptance_equals_the_replay_oracle(tiny_model):
    from eyas.eval.speculate import HeadDrafter, greedy_decode, speculative_decode

    k, max_new = 3, 24
    head = build_lens_head(tiny_model, speculative_tokens=k)
    oracle, eyas = {"drafts": 0, "per_pos": [0] * k}, {"drafts": 0, "per_pos": [0] * k}
    for prompt in ([1, 2, 3, 4], [7, 7, 7, 7, 7], [100, 50, 100, 50]):
        plain = greedy_decode(tiny_model, prompt, max_new + k, set()).tokens
        tr = speculative_decode(tiny_model, prompt, HeadDrafter(head), k, max_new, set())
        assert tr.tokens == plain[:max_new]
        seq = prompt + plain
        states = _lens_states(tiny_model, seq)
        guesses = reference_drafts(tiny_model, states[len(prompt) - 1 : len(seq) - 1], k)
        r = replay_oracle(plain, guesses, k, max_new)
        oracle["drafts"] += r["drafts"]
        oracle["per_pos"] = [a + b for a, b in zip(oracle["per_pos"], r["accepted_per_pos"])]
        eyas["drafts"] += len(tr.drafted)
        for acc in tr.accepted:
            for j in range(acc):
                eyas["per_pos"][j] += 1
    assert eyas == oracle
    assert eyas["per_pos"][0] > 0, "the lens head should accept some drafts, or the test proves little"


def test_replay_oracle_counts_accepted_prefixes():
    tokens = [1, 1, 1, 2, 3, 3, 9, 9]
    guesses = torch.tensor([[t, t] for t in tokens])  # "the last token again"
    # After "1": drafts 1,1, both accepted (+ bonus 2); after "2": drafts 2,2, the target
    # says 3: none accepted (+ bonus 3); 5 tokens are out: stop.
    assert replay_oracle(tokens, guesses, 2, 5) == {"drafts": 2, "accepted_per_pos": [1, 1]}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason=".venv-vllm does not exist (scripts/setup_vllm_env.sh)")
def test_vllm_serves_eyas_heads_with_eyas_acceptance(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "vllm_check.py"),
            "--quick",
            "--skip-setup",
            "--num-prompts",
            "4",
            "--max-tokens",
            "32",
            "--work-dir",
            str(tmp_path / "work"),
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert out.is_file(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["checks_failed"] == [], report["checks_failed"]
    for name, entry in report["heads"].items():
        table = entry["acceptance_table"]
        assert [r["eyas_count"] for r in table] == [r["vllm_count"] for r in table], name
    assert proc.returncode == 0


def test_the_norm_output_lens_head_drafts_otherwise_than_without_it(tiny_model):
    """The EAGLE 3.1 lens head (fc_norm, norm_output, norm_before_residual) feeds its normed
    state to the next draft step: where the target's final norm has weights other than 1
    (SmolLM2's, trained), its deeper drafts differ from those of the same head fed the
    pre-norm state, so the served check below tells the two feedbacks apart."""
    import copy

    from eyas.target.features import target_norm_and_lm_head

    model = copy.deepcopy(tiny_model)
    norm, _ = target_norm_and_lm_head(model)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=torch.Generator().manual_seed(0)) * 2)
    ids = [5, 17, 40, 40, 40, 99, 3, 250, 17, 17, 8, 60, 61, 62, 5, 17]
    states = _lens_states(model, ids)[: len(ids) - 1]
    both = [
        reference_drafts(model, states, 3, fc_norm=True, norm_before_residual=True, norm_output=flag)
        for flag in (True, False)
    ]
    assert torch.equal(both[0][:, 0], both[1][:, 0])  # step 0 reads the target's features alike
    assert not torch.equal(both[0][:, 1:], both[1][:, 1:])


def _check_one_head(tmp_path, name: str):
    """`scripts/vllm_check.py` on one head (4 prompts × 32 tokens, no serve check): its
    JSON report and the finished process."""
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "vllm_check.py"), "--heads", name, "--skip-setup",
           "--no-serve", "--num-prompts", "4", "--max-tokens", "32", "--work-dir", str(tmp_path / "work"),
           "--json-out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3000)
    assert out.is_file(), proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason=".venv-vllm does not exist (scripts/setup_vllm_env.sh)")
def test_vllm_feeds_a_norm_output_head_its_normed_state_as_eyas_does(tmp_path):
    """EAGLE 3.1's `norm_output` (issue 53): vLLM's llama EAGLE-3 drafter feeds the normed
    state to the next draft step when the config declares it. The e31 lens head served
    at K = 3 accepts at every position exactly what eyas's offline decoding accepts."""
    report, proc = _check_one_head(tmp_path, "e31")
    assert report["checks_failed"] == [], report["checks_failed"]
    table = report["heads"]["e31"]["acceptance_table"]
    assert [r["eyas_count"] for r in table] == [r["vllm_count"] for r in table]
    assert len(table) == 3 and table[0]["vllm_count"] > 0
    assert proc.returncode == 0
    # The same head fed its pre-norm state would accept deeper drafts on these prompts
    # (it repeats the last token, as SmolLM2 does on them): an engine that ignored
    # norm_output would have counted those, so the equality above tells the two apart.
    from vllm_check import PROMPTS, EyasSide

    from eyas.target.load import materialize_smollm2

    side = EyasSide(materialize_smollm2(), PROMPTS[:4], 3, 32)
    options = dict(fc_norm=True, norm_before_residual=True, norm_output=False)
    pre_norm, bad = side.lens_oracle(build_lens_head(side.model, speculative_tokens=3, **options), options)
    assert bad == 0
    assert pre_norm["accepted_per_pos"][1] > table[1]["vllm_count"]


def test_the_window_head_drafts_depend_on_its_window(tiny_model):
    """The e3-window head's attention adds the mean embedding of the keys its window sees,
    so the same weights under another window draft otherwise once the context outgrows it
    (the lens heads' zero o_proj would draft alike under any window)."""
    from vllm_heads import add_window_attention

    ids = [5, 17, 40, 40, 40, 99, 3, 250, 17, 17, 8, 60, 61, 62, 5, 17]
    states = _lens_states(tiny_model, ids)
    embed = tiny_model.get_input_embeddings().weight.detach()

    def drafts(window, scale=16.0):
        head = build_lens_head(tiny_model, speculative_tokens=3, sliding_window=window)
        add_window_attention(head, embed, scale)
        assert head.config.sliding_window == window
        return _prefix_drafts(head, states, ids, 3)

    four, five = drafts(4), drafts(5)
    # a draft at position t + j reads keys t + j - W + 1 .. t + j: below W both windows see all
    assert torch.equal(four[:4, 0], five[:4, 0]) and torch.equal(four[:2], five[:2])
    assert not torch.equal(four, five)
    assert not torch.equal(four, drafts(3))
    lens = build_lens_head(tiny_model, speculative_tokens=3)
    assert torch.equal(drafts(4, scale=0.0), _prefix_drafts(lens, states, ids, 3))


def _prefix_drafts(head, states, ids, k):
    """[n, k] drafts at every slot after a prefill of the slots before it (the head's
    attention reads its KV cache, unlike the lens heads')."""
    out = []
    n = len(ids) - 1
    for t in range(n):
        cache = head.new_cache()
        aux = torch.zeros(1, t + 1, head.config.fc_in_features)
        aux[0, :, -states.shape[-1] :] = states[: t + 1]
        tokens = torch.tensor([ids[1 : t + 2]])
        got, _ = head.draft(cache, tokens, aux, torch.arange(t + 1)[None], k)
        out.append(got[0])
    return torch.stack(out)


def test_the_window_check_calls_itself_vacuous_when_a_neighbour_counts_alike():
    from vllm_check import window_sensitivity

    counts = {"drafts": 10, "accepted_per_pos": [4, 2, 1]}
    other = {"drafts": 10, "accepted_per_pos": [4, 2, 0]}
    assert window_sensitivity(counts, {3: other, 5: dict(other, drafts=11), None: other})["ok"]
    got = window_sensitivity(counts, {3: other, 5: dict(counts), None: other})
    assert not got["ok"] and "windows [5]" in got["error"]
    assert set(got["neighbours"]) == {"3", "5", "none"}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason=".venv-vllm does not exist (scripts/setup_vllm_env.sh)")
def test_vllm_applies_a_heads_sliding_window_as_eyas_does(tmp_path):
    """Issue 51: the e3-window head (sliding_window 4, an attention that contributes) served
    by vLLM accepts at every position exactly what eyas's offline decoding accepts, and
    eyas counts windows 3, 5 and none otherwise, so an engine that applied the window off
    by one, or not at all, would fail the equality."""
    report, proc = _check_one_head(tmp_path, "e3-window")
    assert report["checks_failed"] == [], report["checks_failed"]
    checks = report["heads"]["e3-window"]["checks"]
    assert checks["acceptance_exact"]["ok"] and checks["window_changes_acceptance"]["ok"]
    assert set(checks["window_changes_acceptance"]["neighbours"]) == {"3", "5", "none"}
    assert "oracle_equals_eyas" not in checks
    table = report["heads"]["e3-window"]["acceptance_table"]
    assert [r["eyas_count"] for r in table] == [r["vllm_count"] for r in table]
    assert table[1]["vllm_count"] > 0  # deeper drafts, read through the window, are accepted
    exported = json.loads((tmp_path / "work" / "heads" / "e3-window" / "config.json").read_text())
    assert exported["transformer_layer_config"]["sliding_window"] == 4
    assert proc.returncode == 0
