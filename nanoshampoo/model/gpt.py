"""The GPT of the NanoGPT speedrun's optimization track, written as four small modules.

Architecture (per the optimization-track baseline): token embedding -> ``num_layers`` pre-norm
blocks (QK-normed causal attention with rotary embeddings on half the head dims, ReLU^2 MLP)
-> RMSNorm -> untied linear head -> logits soft-capped at 15. Every linear layer has a bias;
every RMSNorm has a learnable gain.

Shapes: B batch, T sequence length, C = ``model_dim``, H heads, D = ``head_dim``, V vocab.

Example:
    >>> config = gpt_preset("tiny", vocab_size=512)
    >>> model = GPT(config)
    >>> idx = torch.randint(0, 512, (2, 16))
    >>> loss = model(idx, targets=idx)  # 0-D float32
    >>> logits = model(idx)  # (2, 16, 512) float32, |logits| < 15
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanoshampoo.validation import check_int

# Softmax scale of the optimization-track baseline (in place of 1/sqrt(head_dim)): QK-norm fixes
# the query and key norms, so the attention temperature is a tuned constant.
ATTENTION_SCALE = 0.12
# Logits are squashed smoothly into (-15, 15): 15 * z / sqrt(z^2 + 15^2).
LOGIT_SOFTCAP = 15.0
# Variance of the non-output weights is 0.33 / fan_in (std sqrt(0.33) / sqrt(fan_in)).
HIDDEN_INIT_VARIANCE = 0.33
ROTARY_MIN_ANGULAR_FREQ = 1.0 / 1024


@torch.compiler.disable
def _embedding_lookup(embed: nn.Embedding, idx: Tensor) -> Tensor:
    """``embed(idx)``, always eager, also inside a ``torch.compile``d model.

    Why: inductor's CPU kernel for the embedding's backward adds the rows of repeated tokens with
    atomic adds in a multi-threaded loop, so their order, and the gradient's rounding, changes
    from run to run; two compiled 2-thread runs of one command ended at different losses. The
    eager backward sums in a fixed order, and the graph break costs one call per forward.
    """
    return embed(idx)


@dataclass
class GPTConfig:
    """Shape of a GPT. ``model_dim`` must be a multiple of ``head_dim``; ``head_dim`` of 4.

    ``combined_linear`` stores each linear layer's weight and bias as one ``(out, in + 1)``
    parameter (``CombinedLinear``) so that a structure-aware optimizer such as Shampoo
    preconditions them together.
    """

    vocab_size: int
    num_layers: int
    model_dim: int
    head_dim: int
    max_seq_len: int
    combined_linear: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "model_dim", "head_dim", "max_seq_len"):
            check_int(f"GPTConfig.{name}", getattr(self, name), at_least=1)
        if self.head_dim % 4 != 0:
            raise ValueError(
                f"GPTConfig.head_dim must be a multiple of 4 (rotary pairs on half the dims), "
                f"got {self.head_dim}"
            )
        if self.model_dim % self.head_dim != 0:
            raise ValueError(
                f"GPTConfig.model_dim ({self.model_dim}) must be a multiple of head_dim "
                f"({self.head_dim})"
            )

    @property
    def num_heads(self) -> int:
        return self.model_dim // self.head_dim


# The ladder of sizes, smallest first (a test keeps that order); the study's sizes are named by
# their parameters outside the embedding and the head (``non_embedding_parameters``), the older
# names by their role.
_PRESETS: dict[str, dict[str, int]] = {
    # 0.22 M parameters outside the embedding and head: the small end of a 2-core study.
    "gpt-0.2m": dict(num_layers=2, model_dim=96, head_dim=32, max_seq_len=256),
    # ~1.5 M parameters at vocab 4096: trains visibly on two CPU cores in a couple of minutes.
    "tiny": dict(num_layers=4, model_dim=128, head_dim=32, max_seq_len=256),
    # 2.7 M parameters outside the embedding and head: between tiny (0.79 M) and small.
    "gpt-2.7m": dict(num_layers=6, model_dim=192, head_dim=32, max_seq_len=256),
    # ~20 M parameters without embeddings: a single-GPU smoke test of the full recipe.
    "small": dict(num_layers=6, model_dim=384, head_dim=64, max_seq_len=1024),
    # The speedrun's GPT-2 small shape.
    "gpt2-124m": dict(num_layers=12, model_dim=768, head_dim=128, max_seq_len=1024),
    # GPT-2 medium (24 layers, 1024 wide, 16 heads of 64).
    "gpt2-350m": dict(num_layers=24, model_dim=1024, head_dim=64, max_seq_len=1024),
}


def gpt_preset(name: str, vocab_size: int, combined_linear: bool = False) -> GPTConfig:
    """Return the ``GPTConfig`` of a named size (one of ``gpt_preset_names()``)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(_PRESETS)}")
    return GPTConfig(vocab_size=vocab_size, combined_linear=combined_linear, **_PRESETS[name])


def gpt_preset_names() -> list[str]:
    """The named sizes, smallest first (the ladder's order)."""
    return list(_PRESETS)


def non_embedding_parameters(config: GPTConfig) -> int:
    """Parameters outside the token embedding and the output head (weight and bias): the size
    that scaling studies compare models by, since the embedding's share shrinks as models grow.
    Independent of ``vocab_size``. Counted on a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(config)
    outside = model.embed.weight.numel() + sum(p.numel() for p in model.lm_head.parameters())
    return sum(p.numel() for p in model.parameters()) - outside


def make_linear(in_features: int, out_features: int, combined: bool) -> nn.Module:
    """A biased linear layer: ``nn.Linear`` or, if ``combined``, ``CombinedLinear``."""
    if combined:
        # Imported here so the plain model has no dependency on the Shampoo package.
        from nanoshampoo.optim.shampoo.utils.shampoo_model_utils import CombinedLinear

        return CombinedLinear(in_features, out_features, bias=True)
    return nn.Linear(in_features, out_features, bias=True)


def linear_weight_and_bias(layer: nn.Module) -> tuple[Tensor, Tensor]:
    """Views ``(out, in)`` and ``(out,)`` of a layer made by ``make_linear``."""
    if isinstance(layer, nn.Linear):
        return layer.weight, layer.bias
    combined = layer.combined_weight  # (out, in + 1): the last column is the bias
    return combined[:, :-1], combined[:, -1]


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` with a learnable gain, run in the input's dtype.

    Under bf16 autocast the inputs arrive in bf16 while the gain stays float32; casting the gain
    keeps the fused kernel (which accumulates in float32) instead of a slow mixed-dtype path.
    """

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class Rotary(nn.Module):
    """Rotary position embedding on half of each head's dims; the other half is position-free.

    Dim ``i < D/2`` is paired with dim ``i + D/2``. Pairs ``i < D/4`` rotate with angular
    frequencies spaced geometrically from 1 down to 1/1024 per position; pairs
    ``D/4 <= i < D/2`` have frequency 0 and pass through unchanged.
    """

    def __init__(self, head_dim: int, max_seq_len: int) -> None:
        super().__init__()
        quarter = head_dim // 4
        angular_freq = torch.cat(
            [
                ROTARY_MIN_ANGULAR_FREQ ** torch.linspace(0, 1, quarter, dtype=torch.float32),
                torch.zeros(quarter, dtype=torch.float32),
            ]
        )  # (D/2,)
        positions = torch.arange(max_seq_len, dtype=torch.float32)  # (T_max,)
        theta = torch.outer(positions, angular_freq)  # (T_max, D/2)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, H, T, D) -> same shape and dtype."""
        seq_len = x.size(-2)
        cos = self.cos[:seq_len].to(x.dtype)  # (T, D/2)
        sin = self.sin[:seq_len].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, D/2) each
        return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        inner = config.num_heads * config.head_dim
        self.qkv = make_linear(config.model_dim, 3 * inner, config.combined_linear)
        self.proj = make_linear(inner, config.model_dim, config.combined_linear)
        self.q_norm = RMSNorm(config.head_dim)
        self.k_norm = RMSNorm(config.head_dim)
        self.rotary = Rotary(config.head_dim, config.max_seq_len)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape  # (B, T, C)
        qkv = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, D) each
        q = self.rotary(self.q_norm(q))
        k = self.rotary(self.k_norm(k))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ATTENTION_SCALE)
        y = y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)  # (B, T, H*D)
        return self.proj(y)  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = 4 * config.model_dim
        self.fc = make_linear(config.model_dim, hidden, config.combined_linear)
        self.proj = make_linear(hidden, config.model_dim, config.combined_linear)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.fc(x)).square()  # (B, T, 4C)
        return self.proj(h)  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.model_dim)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.model_dim)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer; see the module docstring for the architecture.

    ``forward(idx, targets=None)``: ``idx`` int64 (B, T) with T <= ``max_seq_len``. Returns the
    soft-capped logits (B, T, V) in float32, or with ``targets`` (B, T) the mean cross-entropy
    as a 0-D float32 tensor.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.model_dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.model_dim)
        self.lm_head = make_linear(config.model_dim, config.vocab_size, config.combined_linear)
        self.reset_parameters()

    def output_layers(self) -> list[nn.Module]:
        """Layers that write into the residual stream or the logits: zero at init."""
        return [m for b in self.blocks for m in (b.attn.proj, b.mlp.proj)] + [self.lm_head]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.embed.weight, mean=0.0, std=1.0)
        zero_init = {id(m) for m in self.output_layers()}
        for module in self.modules():
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, nn.Linear) or hasattr(module, "combined_weight"):
                weight, bias = linear_weight_and_bias(module)
                bias.zero_()
                if id(module) in zero_init:
                    weight.zero_()
                else:
                    fan_in = weight.size(1)
                    weight.normal_(0.0, math.sqrt(HIDDEN_INIT_VARIANCE / fan_in))

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        T = idx.size(1)
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        x = _embedding_lookup(self.embed, idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        z = self.lm_head(self.final_norm(x)).float()  # (B, T, V)
        logits = LOGIT_SOFTCAP * z / torch.sqrt(z.square() + LOGIT_SOFTCAP**2)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
