"""States kept from regeneration (data/fed_states.py): equal to a forward over the fed
tokens, copied by the capture where the tokens match, and the zero states after the
reply change no training loss."""

import json

import pytest
import torch

from eyas.cli import main
from eyas.data.cache import FeatureCache
from eyas.data.fed_states import FED_STATES_DIR, FedStates, fed_state_layer_ids, write_fed_states
from eyas.heads.algorithms import get_algorithm
from eyas.heads.config import head_config_from_target
from eyas.recipe import TrainSection
from eyas.target.features import compute_features, default_aux_layer_ids, target_norm_and_lm_head
from eyas.target.load import load_target, text_config
from eyas.train.build import build_trainable_head
from eyas.train.losses import target_labels


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_target(str(tiny_llama_dir), dtype="float32", device="cpu")


def test_decoded_states_equal_a_forward_over_the_fed_tokens(llama):
    """Prompt states from the left-padded prefill, reply states from the decode steps
    (rows stopping early, leaving the batch, and rows cut at max_new_tokens, whose last
    token gets one more forward) equal one plain forward over prompt + reply."""
    from eyas.data.decode import decode_replies_hf

    model, tok = llama.model, llama.tokenizer
    prompts = [
        tok(t)["input_ids"] for t in ["a", "hello there", "xyz", "a much longer prompt than the rest", "q"]
    ]
    free = decode_replies_hf(model, tok, prompts, 10, 0.0, 1.0)
    # a token some replies emit mid-way becomes a stop token, so rows stop at different steps
    candidates = [t for r in free for t in r.token_ids[2:6]]
    stop = next(c for c in candidates if sum(c in r.token_ids for r in free) < len(prompts))
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    try:
        layer_ids = fed_state_layer_ids([1, 3, 5], len(model.model.layers))
        decoded = decode_replies_hf(model, tok, prompts, 10, 0.0, 1.0, state_layer_ids=layer_ids)
        texts = [r.text for r in decode_replies_hf(model, tok, prompts, 10, 0.0, 1.0)]
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id
    assert [d.text for d in decoded] == texts
    lengths = {len(d.token_ids) for d in decoded}
    assert 10 in lengths and len(lengths) > 1  # some cut, some stopped
    H = text_config(model.config).hidden_size
    for p, d in zip(prompts, decoded):
        assert d.fed_ids == p + d.token_ids and d.states.shape == (len(d.fed_ids), 4 * H)
        aux, last = compute_features(model, torch.tensor([d.fed_ids]), None, [1, 3, 5])
        want = torch.cat([aux[0], last[0]], dim=-1).to(torch.bfloat16)
        torch.testing.assert_close(d.states, want, rtol=1e-2, atol=1e-2)


def test_fed_states_lookup_checks_tokens_mask_target_and_layers(tmp_path):
    C = 8
    write_fed_states(tmp_path, {3: ([5, 6, 7, 8], torch.arange(4 * C).view(4, C).float())}, [1, 2], "t")
    write_fed_states(tmp_path, {3: ([5, 6, 9], torch.ones(3, C)), 4: ([1, 2], torch.ones(2, C))}, [1, 2], "t")
    write_fed_states(tmp_path, {5: ([1], torch.ones(1, C))}, [1, 2], "other-target")
    fed = FedStates(tmp_path, [1, 2], "t")
    assert len(fed) == 2  # conversations 3 and 4; the other target's file is skipped
    # the later file's entry for 3 wins: states for [5, 6, 9], zero after them
    got = fed.states_for(3, [5, 6, 9, 0, 10], [0, 1, 1, 1, 0])
    assert got.shape == (5, C) and bool((got[:3] == 1).all()) and bool((got[3:] == 0).all())
    assert fed.states_for(3, [5, 6, 7, 0], [0, 1, 1, 1]) is None  # a label two past the shared tokens [5, 6]
    # the tokens part after [5, 6] but the last label (7) sits right after them: read from slot 1
    got = fed.states_for(3, [5, 6, 7, 0], [0, 1, 1, 0])
    assert bool((got[:2] == 1).all()) and bool((got[2:] == 0).all())
    assert fed.states_for(3, [8, 6, 9], [0, 1, 0]) is None  # nothing shared
    assert fed.states_for(3, [5, 6, 9, 0, 10], [0, 1, 1, 1, 1]) is None  # a label two past the fed ids
    assert fed.states_for(4, [1], [1]).shape == (1, C)  # a sample cut shorter than the fed ids
    assert fed.states_for(7, [1], [1]) is None
    assert len(FedStates(tmp_path, [1, 3], "t")) == 0  # other layers


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle"])
def test_zero_states_after_the_fed_tokens_leave_loss_and_gradients_unchanged(llama, algorithm):
    """The capture's zero states after the fed ids (the template's tail after a reply)
    sit where no label reads them: same loss, same gradients as the real states."""
    model = llama.model
    cfg_t = text_config(model.config)
    aux_ids = list(default_aux_layer_ids(cfg_t.num_hidden_layers))
    extra = dict(num_hidden_layers=2, mask_token_id=3) if algorithm == "peagle" else dict(fc_norm=True)
    cfg = head_config_from_target(
        cfg_t,
        aux_layer_ids=aux_ids,
        draft_vocab_size=200,
        algorithm=algorithm,
        speculative_tokens=4,
        verifier_name_or_path="org/tiny",
        **extra,
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 300, (2, 24), generator=g)
    am = torch.ones(2, 24, dtype=torch.long)
    am[1, -4:] = 0
    lm = torch.zeros_like(am)
    fed_len = [21, 17]  # tokens fed per row; the last label (the end-of-turn token) sits at fed_len
    lm[0, 6:22] = 1
    lm[1, 5:18] = 1
    aux, last = compute_features(model, ids, am, aux_ids)
    tail = torch.zeros(2, 24, 1, dtype=torch.bool)
    for r, m in enumerate(fed_len):
        tail[r, m:] = True
    train_cfg = TrainSection(
        compile_loss="off",
        eagle3={"ttt_steps": 3, "ttt_decay": 0.8, "copy_attention_weight": 1.0},
        peagle={"num_depths": 4, "cod_r": 0.8, "cod_r_min": 0.2, "segment_length": None},
    )
    loss_fn = get_algorithm(algorithm).loss_function()
    norm, lm_head = target_norm_and_lm_head(model)
    results = []
    for zero_tail in (False, True):
        batch = {
            "input_ids": ids,
            "attention_mask": am,
            "loss_mask": lm,
            "aux": aux.masked_fill(tail, 0) if zero_tail else aux,
            "last": last.masked_fill(tail, 0) if zero_tail else last,
        }
        torch.manual_seed(0)
        head = build_trainable_head(cfg, model, torch.bincount(ids.flatten(), minlength=cfg.vocab_size))
        labels = target_labels(
            batch["last"],
            norm,
            lm_head.weight,
            head.draft_token_ids(),
            head.t2d,
            batch["loss_mask"],
            batch["attention_mask"],
        )
        stats = loss_fn(head, batch, labels, train_cfg, torch.Generator().manual_seed(1))
        stats.loss.backward()
        results.append(
            (
                stats.loss.detach(),
                {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None},
            )
        )
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert float(loss_a) > 0
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for n in grads_a:
        torch.testing.assert_close(grads_a[n], grads_b[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.fixture(scope="module")
def letters_llama_dir(tmp_path_factory):
    """A tiny Llama whose greedy replies are lowercase letters: its LM head keeps the rows of
    13 letters and their negatives (so some letter always scores >= 0) and zeroes the rest.
    Random weights otherwise pick single bytes that are no valid UTF-8, whose decoded text
    re-encodes to other tokens, so no sample would match its fed tokens."""
    from support.tiny_targets import build_tiny_model, byte_tokenizer

    model, tok = build_tiny_model("llama", 0), byte_tokenizer()
    letters = [tok.convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz"]
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        kept = head[letters[:13]].clone()
        head.zero_()
        head[letters[:13]] = kept
        head[letters[13:]] = -kept
    out = tmp_path_factory.mktemp("letters-llama")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _corpus(path, n=12):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"tell me about item {k} " + "w" * (k % 5)},
                {"from": "gpt", "value": "old"},
            ]
        }
        for k in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_capture_copies_regeneration_states_and_equals_a_full_capture(letters_llama_dir, tmp_path, capsys):
    """prepare (regenerate, keep_states) -> capture copies the matching samples' states,
    removes fed_states, and the cache equals the one a full capture writes wherever a
    label can read it (zero after the fed tokens)."""
    import shutil

    corpus = _corpus(tmp_path / "c.jsonl")
    common = [
        f"target.name_or_path={letters_llama_dir}",
        f"data.sources=[{corpus}]",
        "data.max_length=96",
        "data.eval_fraction=0.2",
        "data.regenerate.enabled=true",
        "data.regenerate.max_new_tokens=12",
        "data.regenerate.batch_size=5",
        "target.dtype=float32",
        "data.aux_layer_ids=[1,3,5]",
    ]
    kept, full = tmp_path / "kept", tmp_path / "full"
    assert (
        main(["prepare", "--no-progress", f"run_dir={kept}", *common, "data.regenerate.keep_states=true"])
        == 0
    )
    assert list((kept / "prepared" / FED_STATES_DIR).glob("batch-*.safetensors"))
    shutil.copytree(kept / "prepared", full / "prepared")
    shutil.rmtree(full / "prepared" / FED_STATES_DIR)
    # a later file whose ids for conversation 0 are not its tokens: that sample runs the target
    write_fed_states(
        kept / "prepared" / FED_STATES_DIR,
        {0: ([1, 2, 3], torch.zeros(3, 4 * 64))},
        fed_state_layer_ids([1, 3, 5], 8),
        str(letters_llama_dir),
    )
    capsys.readouterr()
    assert main(["capture", "--no-progress", f"run_dir={kept}", *common]) == 0
    out = capsys.readouterr().out
    assert "copied from regeneration" in out and not (kept / "prepared" / FED_STATES_DIR).exists()
    assert main(["capture", "--no-progress", f"run_dir={full}", *common]) == 0
    copied_total = 0
    for split in ("train", "eval"):
        a, b = FeatureCache(kept / "cache", split), FeatureCache(full / "cache", split)
        copied_total += sum(s["copied_samples"] for s in a.manifest["shards"])
        assert len(a) == len(b) > 0
        for j in range(len(a)):
            x, y = a[j], b[j]
            assert torch.equal(x["input_ids"], y["input_ids"]) and x["sample_index"] == y["sample_index"]
            m = int(x["loss_mask"].nonzero().max())  # the last label; slots < m are read
            torch.testing.assert_close(x["aux"][:m].float(), y["aux"][:m].float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(x["last"][:m].float(), y["last"][:m].float(), rtol=2e-2, atol=2e-2)
    assert copied_total == 11  # every reply re-encodes to the tokens the target produced; all but 0 copied
