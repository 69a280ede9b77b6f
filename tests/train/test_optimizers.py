"""`train.optimizer: muon`: Muon steps the head's hidden matrices, AdamW the rest; a run
resumed from a checkpoint ends where an uninterrupted one does; sharded launches are
refused with the reason."""

import shutil

import pytest
import torch
from safetensors.torch import load_file
from support.train_run_fixtures import prepare_run

from eyas.recipe import recipe_from_dict
from eyas.train.optimizers import (
    Muon,
    MuonWithAdamW,
    build_optimizer,
    muon_parameter,
    refuse_muon_when_sharded,
)


def _tiny_head():
    from eyas.heads.config import DraftHeadConfig
    from eyas.heads.eagle3 import Eagle3Head

    cfg = DraftHeadConfig(
        hidden_size=16,
        target_hidden_size=12,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=40,
        draft_vocab_size=40,
        aux_layer_ids=[0, 1, 2],
        target_num_layers=3,
        fc_norm=True,
    )
    torch.manual_seed(0)
    return Eagle3Head(cfg)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    head = _tiny_head()
    cfg = recipe_from_dict({"train": {"optimizer": "muon", "muon_lr": 0.05, "learning_rate": 1e-3}}).train
    opt = build_optimizer(head.named_parameters(), cfg, "no")
    assert isinstance(opt, MuonWithAdamW)
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    names = {n for n, p in head.named_parameters() if id(p) in muon}
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert "layers.0.mlp.down_proj.weight" in names
    assert not any(n.endswith(("lm_head.weight", "embed_tokens.weight")) or "norm" in n for n in names)
    trainable = {id(p) for p in head.parameters() if p.requires_grad}
    adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    assert muon | adamw == trainable and not muon & adamw
    # one schedule scales both from their own rates
    assert [g["lr"] for g in opt.param_groups] == [0.05, 1e-3]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [0.025, 5e-4]
    # a step moves a Muon matrix and an AdamW vector; zero_grad clears both
    for p in head.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    opt.step()
    sched.step()
    moved = {n for n, p in head.named_parameters() if not torch.equal(p, before[n])}
    assert {"fc.weight", "lm_head.weight", "norm.weight"} <= moved
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in head.parameters())
    state = opt.state_dict()
    assert set(state) == {"muon", "adamw"} and state["muon"]["state"]
    with pytest.raises(ValueError, match="muon and adamw"):
        opt.load_state_dict(torch.optim.AdamW(head.parameters()).state_dict())
    assert muon_parameter("head.fc.weight", torch.empty(2, 2))
    assert not muon_parameter("head.lm_head.weight", torch.empty(2, 2))


def _matrices(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(24, 8), (8, 24), (16, 16)]
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.02) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def test_muon_steps_as_torchs_in_bf16_and_iterates_in_float32_where_the_run_does():
    # in bf16 the step is torch.optim.Muon's, bit for bit, momentum and weight decay included
    ours, torchs = _matrices(0), _matrices(0)
    mine = Muon(ours, lr=0.05, weight_decay=0.1, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(torchs, lr=0.05, weight_decay=0.1)
    for _ in range(3):
        mine.step()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs))
    # a checkpoint of either loads into the other
    ref.load_state_dict(mine.state_dict())
    # a run computing in float32 (a CPU without fast bf16) iterates in float32: the same
    # step up to bf16's rounding, and no bf16 multiply on the way
    cfg = recipe_from_dict({"train": {"optimizer": "muon", "muon_lr": 0.05}}).train
    assert build_optimizer(_tiny_head().named_parameters(), cfg, "bf16").muon.ns_dtype == torch.bfloat16
    fp32, one_step = _matrices(0), _matrices(0)
    vector = torch.nn.Parameter(torch.zeros(4))
    vector.grad = torch.ones(4)
    opt = build_optimizer([*((f"m{i}", p) for i, p in enumerate(fp32)), ("bias", vector)], cfg, "no")
    assert opt.muon.ns_dtype == torch.float32
    bf16_mm = []
    real_addmm = torch.addmm

    def addmm(*a, **k):
        bf16_mm.append(a[0].dtype == torch.bfloat16)
        return real_addmm(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "addmm", addmm)
        opt.step()
    assert bf16_mm and not any(bf16_mm)
    torch.optim.Muon(one_step, lr=0.05, weight_decay=cfg.weight_decay).step()
    for p, q, s in zip(fp32, one_step, _matrices(0)):
        assert p.dtype == torch.float32
        assert torch.linalg.norm((p - q).detach()) < 0.02 * torch.linalg.norm((q - s).detach())


def test_a_torch_without_muon_imports_eyas_and_refuses_muon_with_the_reason(monkeypatch):
    import runpy

    import eyas.train.optimizers as optimizers

    monkeypatch.delattr(torch.optim, "Muon")
    fresh = runpy.run_path(optimizers.__file__)  # the module as torch 2.5-2.8 imports it
    muon = recipe_from_dict({"train": {"optimizer": "muon"}}).train
    with pytest.raises(ValueError, match="needs torch.optim.Muon, which torch .* lacks"):
        fresh["build_optimizer"](_tiny_head().named_parameters(), muon, "no")
    adamw = recipe_from_dict({}).train
    plain = fresh["build_optimizer"](_tiny_head().named_parameters(), adamw, "no")
    assert isinstance(plain, torch.optim.AdamW)


def test_muon_is_refused_where_the_matrices_are_sharded():
    muon = recipe_from_dict({"train": {"optimizer": "muon"}}).train
    for launcher in ("FSDP2", "DeepSpeed"):
        with pytest.raises(ValueError, match=f"muon cannot run under {launcher}: Muon orthogonalises"):
            refuse_muon_when_sharded(muon, launcher)
    refuse_muon_when_sharded(muon, None)
    refuse_muon_when_sharded(recipe_from_dict({}).train, "FSDP2")  # adamw shards fine


def test_a_muon_run_resumed_from_its_checkpoint_ends_as_an_uninterrupted_one(tmp_path, tiny_llama_dir):
    """Train 6 steps with a checkpoint at 3; then delete what came after step 3 (as a kill
    would) and rerun: the final weights are the uninterrupted run's, bit for bit, and the
    checkpoint holds both optimizers' states."""
    from eyas.train.loop import train

    recipe = prepare_run(
        tmp_path,
        tiny_llama_dir,
        "online",
        n=16,
        max_steps=6,
        save_every=3,
        keep_checkpoints=0,
        eval_every=0,
        optimizer="muon",
        muon_lr=0.02,
    )
    train(recipe, progress=False)
    ckpts = recipe.paths.checkpoints
    straight = load_file(str(ckpts / "final" / "head.safetensors"))
    saved = torch.load(ckpts / "step-00000003" / "optimizer.pt", weights_only=True)
    assert set(saved) == {"muon", "adamw"} and saved["muon"]["state"] and saved["adamw"]["state"]
    shutil.rmtree(ckpts / "final")
    shutil.rmtree(ckpts / "step-00000006")
    summary = train(recipe, progress=False)
    assert summary["step"] == 6
    resumed = load_file(str(ckpts / "final" / "head.safetensors"))
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    # and Muon trained differently from AdamW on the same run
    adamw = prepare_run(
        tmp_path / "adamw", tiny_llama_dir, "online", n=16, max_steps=6, save_every=0, eval_every=0
    )
    train(adamw, progress=False)
    other = load_file(str(adamw.paths.checkpoints / "final" / "head.safetensors"))
    assert not torch.equal(
        other["layers.0.self_attn.q_proj.weight"], straight["layers.0.self_attn.q_proj.weight"]
    )
