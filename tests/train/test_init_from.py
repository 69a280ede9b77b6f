"""train.init_from: a run continues from an existing head (an eyas export or a published
head) with the head's architecture and draft vocabulary, or starts a P-EAGLE head from an
EAGLE-3 one (DESIGN §5.2)."""

from __future__ import annotations

import pytest
import torch
from support.train_run_fixtures import prepare_run


@pytest.fixture(scope="module")
def exported_head(tmp_path_factory, tiny_llama_dir):
    """A tiny EAGLE-3 head trained 4 steps and exported (bf16, speculators layout)."""
    from eyas.export.writer import export_checkpoint
    from eyas.train.loop import train

    tmp = tmp_path_factory.mktemp("source")
    recipe = prepare_run(tmp, tiny_llama_dir, max_steps=4)
    summary = train(recipe, progress=False)
    return export_checkpoint(summary["final_dir"], tmp / "export", verifier=str(tiny_llama_dir))


def _target(tiny_llama_dir):
    from eyas.target.load import load_target

    return load_target(str(tiny_llama_dir), "float32", "cpu")


def _source(exported_head, target):
    from eyas.export.reader import load_any_head

    return load_any_head(
        exported_head, target_embed=target.model.get_input_embeddings().weight.detach(), dtype=torch.float32
    )


def test_continued_run_starts_from_the_heads_weights_and_vocabulary(tmp_path, tiny_llama_dir, exported_head):
    from eyas.recipe import recipe_from_dict
    from eyas.train.build import initial_head

    # other conversations: a draft vocabulary built from them would differ from the head's
    recipe = prepare_run(tmp_path, tiny_llama_dir, n=40, init_from=str(exported_head), max_steps=2)
    target = _target(tiny_llama_dir)
    source = _source(exported_head, target)
    freqs = torch.bincount(torch.arange(target.vocab_size), minlength=target.vocab_size).float()
    head, cfg = initial_head(recipe, target, freqs, verifier="org/tiny")
    assert cfg.aux_layer_ids == source.config.aux_layer_ids and cfg.verifier_name_or_path == "org/tiny"
    theirs = source.state_dict()
    for name, t in head.state_dict().items():
        assert torch.equal(t, theirs[name].to(t.dtype)), name
    fresh, _ = initial_head(
        recipe_from_dict({**recipe.model_dump(), "train": {**recipe.train.model_dump(), "init_from": None}}),
        target,
        freqs,
        verifier=None,
    )
    assert not torch.equal(fresh.d2t, head.d2t)  # the head's d2t won over the data's


def test_a_run_from_init_from_trains_and_keeps_the_head_shape(
    tmp_path, tiny_llama_dir, exported_head, caplog
):
    from eyas.heads.io import load_head
    from eyas.train.loop import train

    recipe = prepare_run(tmp_path, tiny_llama_dir, n=40, init_from=str(exported_head), max_steps=3)
    with caplog.at_level("INFO", logger="eyas.train.build"):
        summary = train(recipe, progress=False)
    assert summary["step"] == 3
    assert "draft vocabulary holds" in caplog.text
    target = _target(tiny_llama_dir)
    tuned = load_head(summary["final_dir"], target.model.get_input_embeddings().weight.detach())
    source = _source(exported_head, target)
    assert tuned.config.draft_vocab_size == source.config.draft_vocab_size
    assert torch.equal(tuned.d2t, source.d2t)
    assert not torch.equal(tuned.fc.weight, source.fc.weight)  # it trained


def test_recipe_fields_that_contradict_the_head_are_refused_naming_both(
    tmp_path, tiny_llama_dir, exported_head
):
    from eyas.recipe import recipe_from_dict
    from eyas.train.build import InitFromError, init_from_config

    target = _target(tiny_llama_dir)
    source = _source(exported_head, target)
    recipe = recipe_from_dict(
        {
            "head": {"draft_vocab_size": 32, "fc_norm": True},
            "data": {"aux_layer_ids": [0, 1, 2]},
            "train": {"init_from": "x"},
        }
    )
    with pytest.raises(InitFromError) as err:
        init_from_config(recipe, source.config, target.config, "HEAD")
    msg = str(err.value)
    assert "head.draft_vocab_size = 32, but HEAD has draft_vocab_size = 64" in msg
    assert "head.fc_norm = True" in msg and "data.aux_layer_ids = [0, 1, 2]" in msg
    # the recipe's defaults are not contradictions: only keys it sets
    init_from_config(recipe_from_dict({"train": {"init_from": "x"}}), source.config, target.config, "HEAD")


def test_peagle_head_starts_from_an_eagle3_head(tiny_llama_dir, exported_head):
    from eyas.heads.peagle import PEagleHead
    from eyas.recipe import recipe_from_dict
    from eyas.train.build import head_from_checkpoint, init_from_config

    target = _target(tiny_llama_dir)
    source = _source(exported_head, target)
    recipe = recipe_from_dict(
        {"head": {"algorithm": "peagle", "mask_token_id": 5}, "train": {"init_from": "x"}}
    )
    cfg = init_from_config(recipe, source.config, target.config, "HEAD", tokenizer=target.tokenizer)
    head, fresh = head_from_checkpoint(cfg, source, target.model)
    assert isinstance(head, PEagleHead) and cfg.mask_token_id == 5
    assert fresh == ["mask_hidden", "mask_embedding"]
    theirs = source.state_dict()
    for name, t in head.state_dict().items():
        if name not in fresh + ["embed_tokens.weight"]:
            assert torch.equal(t, theirs[name]), name
    embed = target.model.get_input_embeddings().weight.detach()
    assert torch.equal(head.embed_tokens.weight, embed)  # the target's table ...
    assert not head.embed_tokens.weight.requires_grad  # ... frozen, as for EAGLE-3
    assert torch.allclose(head.mask_embedding, embed.mean(0))  # the mask row starts neutral
    assert head.mask_embedding.requires_grad
    torch.testing.assert_close(head.embed(torch.tensor([[4, 5]]))[0], torch.stack([embed[4], embed.mean(0)]))


def test_a_head_grown_by_a_layer_drafts_as_its_source_until_trained(tiny_llama_dir, exported_head):
    from eyas.recipe import recipe_from_dict
    from eyas.train.build import InitFromError, head_from_checkpoint, init_from_config

    target = _target(tiny_llama_dir)
    source = _source(exported_head, target)
    layers = source.config.num_hidden_layers
    recipe = recipe_from_dict(
        {
            "head": {"algorithm": "peagle", "mask_token_id": 5, "num_layers": layers + 1},
            "train": {"init_from": "x"},
        }
    )
    cfg = init_from_config(recipe, source.config, target.config, "HEAD", tokenizer=target.tokenizer)
    assert cfg.num_hidden_layers == layers + 1
    head, fresh = head_from_checkpoint(cfg, source, target.model)
    assert fresh == ["mask_hidden", "mask_embedding", f"layers.{layers}"]
    # the appended layer adds nothing yet: every real slot's logits are the source's
    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 7))
    aux = torch.randn(2, 7, source.config.fc_in_features)
    pos = torch.arange(7).expand(2, -1)
    mine, _ = head.forward_step(ids, head.combine_aux(aux), pos, head.new_cache())
    theirs, _ = source.forward_step(ids, source.combine_aux(aux), pos, source.new_cache())
    torch.testing.assert_close(mine, theirs)
    # ... and training moves it: its other weights are not zero, so gradients reach them
    added = head.layers[layers]
    assert added.self_attn.q_proj.weight.abs().sum() > 0 and added.mlp.up_proj.weight.abs().sum() > 0
    mine.sum().backward()
    assert (
        added.self_attn.o_proj.weight.grad.abs().sum() > 0 and added.mlp.down_proj.weight.grad.abs().sum() > 0
    )

    # fewer layers than the head has would drop trained ones
    deeper = source.config.model_copy(update={"num_hidden_layers": 3})
    fewer = recipe_from_dict({"head": {"num_layers": 2}, "train": {"init_from": "x"}})
    with pytest.raises(InitFromError, match="head.num_layers = 2, but HEAD has num_hidden_layers = 3"):
        init_from_config(fewer, deeper, target.config, "HEAD")


def test_a_peagle_head_grown_to_two_layers_drafts_every_depth_as_before(tiny_llama_dir, exported_head):
    """A 1-layer P-EAGLE head (its mask parameters trained away from their start) grown to
    2 layers by `train.init_from`: at init every COD element, mask slots included, has the
    1-layer head's logits; the added layer is the identity until training moves it."""
    from eyas.recipe import recipe_from_dict
    from eyas.train.build import head_from_checkpoint, init_from_config
    from eyas.train.peagle import cod_grid, compact, peagle_forward

    target = _target(tiny_llama_dir)
    eagle3 = _source(exported_head, target)
    one = recipe_from_dict({"head": {"algorithm": "peagle", "mask_token_id": 5}, "train": {"init_from": "x"}})
    cfg1 = init_from_config(one, eagle3.config, target.config, "HEAD", tokenizer=target.tokenizer)
    source, _ = head_from_checkpoint(cfg1, eagle3, target.model)
    torch.manual_seed(1)
    with torch.no_grad():  # as if trained: the mask slots no longer start neutral
        source.mask_hidden.add_(torch.randn_like(source.mask_hidden))
        source.mask_embedding.add_(torch.randn_like(source.mask_embedding))
    two = recipe_from_dict({"head": {"algorithm": "peagle", "num_layers": 2}, "train": {"init_from": "x"}})
    cfg2 = init_from_config(two, source.config, target.config, "HEAD", tokenizer=target.tokenizer)
    assert cfg2.num_hidden_layers == 2 and cfg2.mask_token_id == 5
    grown, fresh = head_from_checkpoint(cfg2, source, target.model)
    assert fresh == ["layers.1"]
    torch.testing.assert_close(grown.mask_hidden, source.mask_hidden)
    ids = torch.randint(0, target.vocab_size, (2, 9))
    aux = torch.randn(2, 9, source.config.fc_in_features)
    elements = compact(cod_grid(torch.ones(2, 9), 4, 1.0, 1.0), 9)
    assert int(elements.depth.max()) == 3
    torch.testing.assert_close(
        peagle_forward(grown, elements, ids, aux), peagle_forward(source, elements, ids, aux)
    )


def test_eval_compare_reports_both_heads_on_the_same_prompts(tmp_path, tiny_llama_dir, exported_head, capsys):
    import json

    from eyas.cli import main
    from eyas.export.reader import load_any_head
    from eyas.export.writer import export_head

    target = _target(tiny_llama_dir)
    other = load_any_head(exported_head, target_embed=target.model.get_input_embeddings().weight.detach())
    with torch.no_grad():
        other.fc.weight.mul_(-1)  # a different head of the same shape
    other_dir = export_head(other, tmp_path / "other", verifier=str(tiny_llama_dir))
    workload = tmp_path / "prompts.jsonl"
    workload.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ("the cat sat", "two dogs ran past"))
    )
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "--target",
                str(tiny_llama_dir),
                "--dtype",
                "float32",
                "--head",
                str(exported_head),
                "--compare",
                f"before={other_dir}",
                "--workload",
                str(workload),
                "--k",
                "3",
                "--max-new-tokens",
                "8",
                "--baseline",
                "none",
                "--out",
                str(out),
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert set(report["drafters"]) == {"head", "before"}
    assert report["compared"] == {"before": str(other_dir)}
    assert report["lossless"]["passed"]
    assert all(report["drafters"][n]["per_position_acceptance"] for n in ("head", "before"))
    assert (out / "eval_report.png").stat().st_size > 0
    assert "before" in (out / "eval_report.md").read_text()
    # the compared head's τ against the head's on the same two sequences
    pair = report["paired_vs_head"]["before"]
    tau = {n: report["drafters"][n]["tau"] for n in ("head", "before")}
    assert pair["difference"] == pytest.approx(tau["before"] - tau["head"]) and pair["se"] >= 0
    assert "paired over the same sequences" in (out / "eval_report.md").read_text()


def test_a_fresh_head_trained_on_tv_alone_is_warned_and_kl_is_not(tmp_path, tiny_llama_dir, caplog):
    from eyas.recipe import recipe_from_dict
    from eyas.train.build import initial_head

    recipe = prepare_run(tmp_path, tiny_llama_dir, n=8, max_steps=1)
    target = _target(tiny_llama_dir)
    freqs = torch.ones(target.vocab_size)
    for loss in ("kl", "lk", "tv"):
        caplog.clear()
        train_cfg = {**recipe.train.model_dump(), "loss": loss}
        with caplog.at_level("WARNING", logger="eyas.train.build"):
            initial_head(
                recipe_from_dict({**recipe.model_dump(), "train": train_cfg}),
                target,
                freqs,
                verifier=None,
            )
        assert ("train.loss tv on a fresh head" in caplog.text) == (loss == "tv"), loss
