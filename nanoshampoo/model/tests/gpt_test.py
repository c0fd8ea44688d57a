"""Specification of the speedrun GPT: shapes, causality, soft-cap, init, rotary, presets."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nanoshampoo.model.gpt import (
    GPT,
    GPTConfig,
    Rotary,
    gpt_preset,
    gpt_preset_names,
    linear_weight_and_bias,
    non_embedding_parameters,
)
from nanoshampoo.optim.shampoo.utils.shampoo_model_utils import CombinedLinear

VOCAB = 97


def small_config(**overrides: object) -> GPTConfig:
    fields = dict(vocab_size=VOCAB, num_layers=2, model_dim=32, head_dim=16, max_seq_len=24)
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


pytestmark = pytest.mark.usefixtures("one_thread")


def test_output_shapes_and_loss_matches_cross_entropy_of_logits() -> None:
    torch.manual_seed(0)
    model = GPT(small_config())
    torch.nn.init.normal_(model.lm_head.weight, std=1.0)  # non-zero head: non-trivial logits
    idx = torch.randint(0, VOCAB, (3, 20))
    targets = torch.randint(0, VOCAB, (3, 20))
    logits = model(idx)
    assert logits.shape == (3, 20, VOCAB) and logits.dtype == torch.float32
    loss = model(idx, targets)
    assert loss.shape == ()
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    expected = -log_probs.gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)


def test_zero_head_gives_uniform_loss_at_init() -> None:
    model = GPT(small_config())
    idx = torch.randint(0, VOCAB, (2, 8))
    torch.testing.assert_close(model(idx, idx), torch.tensor(math.log(VOCAB)))


def test_future_tokens_do_not_change_past_logits() -> None:
    torch.manual_seed(1)
    model = GPT(small_config())
    with torch.no_grad():  # zero-init outputs would hide any leak: randomize every parameter
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    idx = torch.randint(0, VOCAB, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % VOCAB
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def soft_cap_reference(z: float) -> float:
    """The optimization track's logit cap, 15 z / sqrt(z^2 + 15^2), in float64."""
    return 15.0 * z / math.sqrt(z * z + 225.0)


def test_logits_are_the_head_outputs_soft_capped_at_15() -> None:
    # A zero head weight makes every position's pre-cap logits equal the head bias, so chosen
    # values (the cap's knee at +-15, the far tails, zero) go through the model's own cap.
    model = GPT(small_config())
    chosen = [-1e4, -100.0, -15.0, -1.0, 0.0, 1e-3, 3.0, 15.0, 100.0, 1e4]
    bias = torch.cat([torch.tensor(chosen), torch.linspace(-60.0, 60.0, VOCAB - len(chosen))])
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.copy_(bias)
    logits = model(torch.randint(0, VOCAB, (2, 8)))  # (2, 8, V)
    expected = torch.tensor([soft_cap_reference(z) for z in bias.tolist()])
    torch.testing.assert_close(logits, expected.expand(2, 8, VOCAB), rtol=1e-6, atol=1e-6)
    assert logits[0, 0, chosen.index(15.0)].item() == pytest.approx(15.0 / math.sqrt(2.0))
    assert logits.abs().max() < 15.0


def test_soft_cap_is_applied_to_what_the_head_computes() -> None:
    torch.manual_seed(4)
    model = GPT(small_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 1.0)
        model.lm_head.weight.mul_(20.0)  # pre-cap logits of tens: the cap is far from linear
    head_outputs: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: head_outputs.append(out.detach()))
    logits = model(torch.randint(0, VOCAB, (2, 8)))
    (z,) = head_outputs
    assert z.abs().max() > 30.0
    expected = z.double().apply_(soft_cap_reference)
    torch.testing.assert_close(logits.double(), expected, rtol=1e-6, atol=1e-6)


def test_init_zero_outputs_unit_embedding_and_scaled_hidden_weights() -> None:
    torch.manual_seed(2)
    config = GPTConfig(vocab_size=1000, num_layers=2, model_dim=256, head_dim=64, max_seq_len=8)
    model = GPT(config)
    for layer in model.output_layers():
        assert torch.count_nonzero(layer.weight) == 0 and torch.count_nonzero(layer.bias) == 0
    assert abs(model.embed.weight.std().item() - 1.0) < 0.01
    for block in model.blocks:
        for layer in (block.attn.qkv, block.mlp.fc):
            fan_in = layer.weight.size(1)
            expected = math.sqrt(0.33 / fan_in)
            assert abs(layer.weight.std().item() / expected - 1.0) < 0.02
            assert torch.count_nonzero(layer.bias) == 0
    for name, p in model.named_parameters():
        if "norm" in name:
            assert p.ndim == 1 and torch.equal(p, torch.ones_like(p)), name


def test_rotary_rotates_exactly_half_of_the_head_dims() -> None:
    head_dim, seq = 16, 6
    rotary = Rotary(head_dim, max_seq_len=seq)
    x = torch.randn(1, 1, seq, head_dim, dtype=torch.float32)
    y = rotary(x)
    # Reference: pair i with i + D/2; pairs i < D/4 turn by angle t * (1/1024)^(i / (D/4 - 1)).
    quarter, half = head_dim // 4, head_dim // 2
    expected = x.clone()
    for t in range(seq):
        for i in range(quarter):
            angle = t * (1 / 1024) ** (i / (quarter - 1))
            a, b = x[0, 0, t, i].item(), x[0, 0, t, i + half].item()
            expected[0, 0, t, i] = a * math.cos(angle) + b * math.sin(angle)
            expected[0, 0, t, i + half] = b * math.cos(angle) - a * math.sin(angle)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    untouched = torch.cat([torch.arange(quarter, half), torch.arange(half + quarter, head_dim)])
    torch.testing.assert_close(y[..., untouched], x[..., untouched], rtol=0, atol=0)
    assert not torch.allclose(y[0, 0, 1:, :quarter], x[0, 0, 1:, :quarter])


def test_combined_linear_variant_equals_linear_variant() -> None:
    torch.manual_seed(3)
    plain = GPT(small_config())
    combined = GPT(small_config(combined_linear=True))
    # 2 layers x (qkv, proj, fc, proj) + the head
    assert sum(isinstance(m, CombinedLinear) for m in combined.modules()) == 9
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0.0, 0.2)
        plain_modules = dict(plain.named_modules())
        for name, module in combined.named_modules():
            if hasattr(module, "combined_weight"):
                weight, bias = linear_weight_and_bias(plain_modules[name])
                module.combined_weight.copy_(torch.cat([weight, bias.unsqueeze(1)], dim=1))
            elif isinstance(module, (torch.nn.RMSNorm, torch.nn.Embedding)):
                module.weight.copy_(plain_modules[name].weight)
    idx = torch.randint(0, VOCAB, (2, 12))
    torch.testing.assert_close(combined(idx), plain(idx))
    assert sum(p.numel() for p in combined.parameters()) == sum(
        p.numel() for p in plain.parameters()
    )


def test_gpt2_124m_parameter_count_matches_formula() -> None:
    vocab = 50304
    config = gpt_preset("gpt2-124m", vocab_size=vocab)
    C, L, D = 768, 12, 128
    assert (config.model_dim, config.num_layers, config.head_dim) == (C, L, D)
    per_block = (
        (C * 3 * C + 3 * C)  # qkv
        + (C * C + C)  # attention output projection
        + (C * 4 * C + 4 * C)  # mlp fc
        + (4 * C * C + C)  # mlp projection
        + 2 * C  # attention and mlp norm gains
        + 2 * D  # q and k norm gains
    )
    expected = vocab * C + L * per_block + C + (C * vocab + vocab)
    with torch.device("meta"):
        model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == expected


def _non_embedding_formula(C: int, L: int, D: int) -> int:
    """Blocks plus the final norm, from the architecture: every linear biased, every norm gained."""
    per_block = (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    return L * (per_block + 2 * C + 2 * D) + C


@pytest.mark.parametrize("name", gpt_preset_names())
def test_non_embedding_parameters_match_the_formula_for_every_size(name: str) -> None:
    config = gpt_preset(name, vocab_size=VOCAB)
    expected = _non_embedding_formula(config.model_dim, config.num_layers, config.head_dim)
    assert non_embedding_parameters(config) == expected
    assert non_embedding_parameters(gpt_preset(name, vocab_size=50304)) == expected


def test_the_size_ladder_runs_smallest_first_with_a_size_below_and_above_tiny() -> None:
    sizes = [non_embedding_parameters(gpt_preset(n, VOCAB)) for n in gpt_preset_names()]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    names = gpt_preset_names()
    assert (
        names.index("gpt-0.2m")
        < names.index("tiny")
        < names.index("gpt-2.7m")
        < names.index("small")
    )
    # Named by size: the name's figure is the count in millions, to its shown digits.
    assert round(non_embedding_parameters(gpt_preset("gpt-0.2m", VOCAB)) / 1e6, 1) == 0.2
    assert round(non_embedding_parameters(gpt_preset("gpt-2.7m", VOCAB)) / 1e6, 1) == 2.7


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(vocab_size=0), "vocab_size"),
        (dict(model_dim=40), "model_dim"),
        (dict(head_dim=6, model_dim=36), "head_dim"),
        (dict(num_layers=-1), "num_layers"),
    ],
)
def test_invalid_config_names_the_field(overrides: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        small_config(**overrides)


def test_unknown_preset_and_too_long_sequence_raise() -> None:
    with pytest.raises(ValueError, match="unknown GPT preset"):
        gpt_preset("huge", vocab_size=10)
    model = GPT(small_config())
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 25, dtype=torch.long))


def test_the_embedding_lookup_stays_out_of_the_compiled_graphs() -> None:
    # Inductor's CPU embedding backward adds rows with atomic adds on several threads, so a
    # compiled run's losses changed from run to run; the lookup must run eagerly.
    import torch._dynamo

    torch._dynamo.reset()
    captured: list[torch.fx.GraphModule] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        captured.append(gm)
        return gm.forward

    model = GPT(small_config())
    idx = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend=recording_backend)
    compiled(idx, targets=idx).backward()
    targets = [str(node.target) for gm in captured for node in gm.graph.nodes]
    assert captured and any("lm_head" in t or "linear" in t for t in targets)
    assert not [t for t in targets if "embedding" in t], targets
    eager_grad = model.embed.weight.grad.clone()
    model.zero_grad()
    model(idx, targets=idx).backward()
    assert torch.equal(model.embed.weight.grad, eager_grad)
    torch._dynamo.reset()
