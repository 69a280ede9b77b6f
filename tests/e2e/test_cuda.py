"""The GPU paths, which CPU runs never take: EAGLE-3's blocked SDPA TTT attention and
P-EAGLE's flex-attention block mask (forward and backward) against the CPU / dense
references, and the whole pipeline on a CUDA device in bf16 (regeneration, capture,
training with bf16 autocast, export, eval with the lossless check).

Run on a CUDA machine: `pytest -m cuda tests/e2e/test_cuda.py`; skipped elsewhere."""

import copy
import json

import pytest
import torch
import yaml
from support.tiny_heads import small_head_config

from eyas.cli import main
from eyas.heads.eagle3 import Eagle3Head
from eyas.heads.peagle import PEagleHead
from eyas.train.masks import peagle_block_mask, peagle_dense_mask
from eyas.train.peagle import cod_grid, compact, element_inputs
from eyas.train.reference import ttt_unroll

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

V, AUX = 300, 3 * 48


def _cfg(**kw):
    # head_dim 64: the flex path then runs with eyas's kernel options (flex_kernel_options)
    wider = dict(hidden_size=64, target_hidden_size=48, head_dim=64, intermediate_size=128)
    return small_head_config(**wider, vocab_size=V, draft_vocab_size=V, **kw)


def _grads(module) -> dict:
    return {n: p.grad.detach().cpu() for n, p in module.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    # TF32 would make the fp32 comparisons below differ by ~1e-3 for reasons of its own.
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("padding", ["right", "left"])
def test_eagle3_ttt_on_cuda_matches_cpu(padding):
    """Logits and gradients of a TTT unroll: CUDA (SDPA per 256-slot query block, causal
    step 0) against CPU (explicit attention per 64-slot block), over 300 slots so both
    split the queries into several blocks."""
    torch.manual_seed(0)
    cpu_head = Eagle3Head(_cfg(fc_norm=True, norm_before_residual=True))
    gpu_head = copy.deepcopy(cpu_head).cuda()
    b, t, steps = 2, 300, 4
    ids = torch.randint(0, V, (b, t))
    am = torch.ones(b, t, dtype=torch.long)
    if padding == "right":
        am[1, 260:] = 0
    else:
        am[1, :40] = 0
    aux = torch.randn(b, t, AUX)
    weights = [torch.randn(b, t, V) * am[..., None] for _ in range(steps)]

    def run(head, device):
        logits = [lg for _, lg in ttt_unroll(head, ids.to(device), am.to(device), aux.to(device), steps)]
        sum((lg * w.to(device)).sum() for lg, w in zip(logits, weights)).backward()
        return [lg.detach().cpu() for lg in logits]

    cpu_logits, gpu_logits = run(cpu_head, "cpu"), run(gpu_head, "cuda")
    real = am.bool()
    for k in range(steps):
        torch.testing.assert_close(gpu_logits[k][real], cpu_logits[k][real], rtol=1e-4, atol=1e-4)
    cpu_g, gpu_g = _grads(cpu_head), _grads(gpu_head)
    assert cpu_g.keys() == gpu_g.keys() and "layers.0.self_attn.q_proj.weight" in cpu_g
    for name in cpu_g:
        torch.testing.assert_close(gpu_g[name], cpu_g[name], rtol=1e-3, atol=1e-4, msg=name)


def test_peagle_flex_block_mask_forward_and_backward_match_the_dense_mask():
    """P-EAGLE's training pass on CUDA: the compiled flex attention over the block mask
    gives the logits and gradients of SDPA over the dense mask."""
    torch.manual_seed(0)
    head = PEagleHead(_cfg(algorithm="peagle", mask_token_id=V - 1, num_hidden_layers=2)).cuda()
    b, t = 2, 200
    ids = torch.randint(0, V - 1, (b, t), device="cuda")
    am = torch.ones(b, t, dtype=torch.long, device="cuda")
    am[1, 150:] = 0
    el = compact(cod_grid(am.cpu(), 4, 0.7, 0.1, torch.Generator().manual_seed(1)), t)
    el = type(el)(anchor=el.anchor.cuda(), depth=el.depth.cuda(), real=el.real.cuda())
    aux = torch.randn(b, t, AUX, device="cuda")
    weight = torch.randn(*el.real.shape, V, device="cuda") * el.real[..., None]

    def run(mask):
        head.zero_grad(set_to_none=True)
        tokens, hidden = element_inputs(head, el, ids, aux)
        logits, _ = head.forward_step(tokens, hidden, el.positions, head.new_cache(), mask)
        (logits * weight).sum().backward()
        return logits.detach(), _grads(head)

    dense_logits, dense_g = run(peagle_dense_mask(el.anchor, el.depth, el.real))
    flex_logits, flex_g = run(peagle_block_mask(el.anchor, el.depth, el.real))
    torch.testing.assert_close(flex_logits[el.real], dense_logits[el.real], rtol=1e-4, atol=1e-4)
    assert dense_g.keys() == flex_g.keys()
    for name in dense_g:
        torch.testing.assert_close(flex_g[name], dense_g[name], rtol=1e-3, atol=1e-3, msg=name)


def test_peagle_loss_over_many_batch_shapes_stays_compiled():
    """A P-EAGLE run meets a new element count every batch. Compiled flex attention is
    specialised per shape and, past dynamo's recompile limit, runs eagerly (every score
    materialised: out of memory at GPT-OSS's segments) with only a warning: a dozen
    batches of other lengths and row counts must all run compiled, forward and backward."""
    import warnings

    from eyas.recipe import TrainSection
    from eyas.train.losses import TargetLabels
    from eyas.train.peagle import peagle_loss

    torch.manual_seed(0)
    head = PEagleHead(_cfg(algorithm="peagle", mask_token_id=V - 1, num_hidden_layers=2)).cuda()
    cfg = TrainSection(peagle={"num_depths": 5, "cod_r": 0.8, "cod_r_min": 0.2})
    gen = torch.Generator(device="cuda").manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b, t in [(b, t) for b in (1, 3, 6) for t in (96, 201, 333, 517)]:
            batch = {
                "input_ids": torch.randint(0, V - 1, (b, t), device="cuda"),
                "attention_mask": torch.ones(b, t, dtype=torch.long, device="cuda"),
                "aux": torch.randn(b, t, AUX, device="cuda"),
            }
            logits = torch.randn(b, t, V, device="cuda")
            valid = torch.ones(b, t, dtype=torch.bool, device="cuda")
            valid[:, -1] = False
            labels = TargetLabels(logits=logits, argmax=logits.argmax(-1), valid=valid)
            head.zero_grad(set_to_none=True)
            stats = peagle_loss(head, batch, labels, cfg, gen)
            stats.loss.backward()
            assert torch.isfinite(stats.loss) and head.mask_hidden.grad.abs().sum() > 0, (b, t)
    eager = [str(w.message) for w in caught if "without torch.compile" in str(w.message)]
    assert not eager, eager[0]


@pytest.mark.parametrize(
    "family,algorithm,features",
    [("llama", "eagle3", "offline"), ("gpt_oss", "eagle3", "online"), ("qwen3_moe", "peagle", "offline")],
)
def test_pipeline_on_cuda_in_bf16(family, algorithm, features, tmp_path):
    """prepare (replies regenerated on the GPU) -> capture (or online features, as the
    flagship recipes train) -> train (bf16 autocast) -> export (validated) -> eval on the
    GPU: every stage finishes, the loss falls, and the fp32 lossless check passes."""
    from support.tiny_targets import save_tiny_target
    from support.train_run_fixtures import write_conversations

    target_dir = save_tiny_target(family, tmp_path / "target")
    write_conversations(tmp_path / "conversations.jsonl", n=48)
    workload = tmp_path / "workload.jsonl"
    workload.write_text(
        "\n".join(
            json.dumps({"turns": [f"tell me about the {w} {w}", "and then?"], "category": w})
            for w in ("cat", "tree", "bird")
        )
    )
    run = tmp_path / "run"
    recipe = {
        "name": "cuda-check",
        "run_dir": str(run),
        "target": {"name_or_path": str(target_dir), "dtype": "bfloat16", "device": "cuda"},
        "data": {
            "sources": [str(tmp_path / "conversations.jsonl")],
            "eval_fraction": 0.1,
            "max_length": 256,
            "regenerate": {"enabled": True, "max_new_tokens": 32, "batch_size": 16},
            "features": features,
            "shard_tokens": 2048,
            "capture_batch_tokens": 1024,
        },
        "head": {
            "algorithm": algorithm,
            "draft_vocab_size": 128,
            "speculative_tokens": 3,
            **({"num_layers": 2} if algorithm == "peagle" else {"fc_norm": True}),
        },
        "train": {
            "learning_rate": 3e-3,
            "warmup_steps": 2,
            "max_steps": 30,
            "batch_tokens": 1024,
            "max_batch_size": 16,
            "eagle3": {"ttt_steps": 3},
            "peagle": {"num_depths": 4},
            "eval_every": 15,
            "save_every": 15,
            "log_every": 5,
            "mixed_precision": "bf16",
            "logger": "jsonl",
            "compile_loss": "on",
        },
        "eval": {
            "workload": str(workload),
            "k": 3,
            "max_new_tokens": 24,
            "dtype": "float32",
            "ngram_min": 1,
            "ngram_max": 3,
        },
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    for stage in ("prepare", "capture", "train"):
        assert main([stage, "-r", str(path), "--no-progress"]) == 0, stage
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) >= 5 and all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]
    assert main(["export", "-r", str(path)]) == 0
    assert (run / "export" / "model.safetensors").is_file()
    out = tmp_path / "eval"
    assert main(["eval", "-r", str(path), "--out", str(out), "--no-progress", "--json"]) == 0
    report = json.loads((out / "eval_report.json").read_text())
    assert report["lossless"]["passed"], report["lossless"]
    assert report["drafters"]["head"]["tau"] >= 1.0 and report["plain"]["tokens_per_s"] > 0
