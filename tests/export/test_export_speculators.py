"""Our speculators-format export loads in the `speculators` package itself and gives the
same logits. Skipped where `speculators` is not installed: it cannot share eyas's test
environment (it pins transformers<=5.19 and pulls torchvision/torchaudio builds that do
not match torch 2.13); run it in a separate venv with speculators + eyas installed."""

import pytest
import torch

speculators_eagle3 = pytest.importorskip("speculators.models.eagle3")

from support.tiny_heads import random_head  # noqa: E402

from eyas.export.writer import export_head  # noqa: E402


@pytest.fixture
def verifier_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "verifier")  # speculators reads the verifier's weights
    return tmp_path / "verifier"


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(draft_vocab_size=100),
        dict(
            draft_vocab_size=100,
            fc_norm=True,
            norm_output=True,
            num_hidden_layers=2,
            norm_before_residual=True,
        ),
    ],
)
def test_speculators_forward_matches_ours(tmp_path, verifier_dir, options):
    head = random_head(verifier_name_or_path=str(verifier_dir), **options)
    out = export_head(head, tmp_path / "head", dtype=torch.float32)
    model = speculators_eagle3.Eagle3DraftModel.from_pretrained(str(out), attn_implementation="eager").eval()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(head.embed_tokens.weight)  # the frozen embedding is the target's
    g = torch.Generator().manual_seed(1)
    t = 6
    ids, aux = torch.randint(0, 320, (1, t), generator=g), torch.randn(1, t, 192, generator=g)
    with torch.no_grad():
        ours, _ = head.forward_step(ids, head.combine_aux(aux), torch.arange(t)[None], head.new_cache())
    captured = []
    model.lm_head.register_forward_hook(lambda mod, inp, outp: captured.append(outp))
    with torch.no_grad():
        model(
            hidden_states=aux,
            input_ids=ids,
            document_ids=torch.zeros_like(ids),
            position_ids=torch.arange(t)[None],
            ttt_steps=1,
        )
    torch.testing.assert_close(captured[0].float(), ours, atol=1e-5, rtol=1e-5)
