"""The zoo: tiny models, each named for the one edge case it covers. CPU, milliseconds, no downloads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# every float8 dtype this torch build has (e4m3fn, e5m2 and the fnuz variants on 2.13 CPU)
FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                      "float8_e5m2fnuz") if hasattr(torch, n)]


class MlpStack(nn.Module):
    """10-20-5 MLP: the seed example (``fc1`` output is ``(batch, 20)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 20)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(20, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


class LeNet(nn.Module):
    """LeNet-5 on (batch, 3, 32, 32): ``conv2`` gives (batch, 16, 10, 10); ``pool`` runs twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class PosBlock(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Conv2d(d, d, 3, padding=1, groups=d), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class ModuleListBlocks(nn.Module):
    """Twins-like: ``pos_block`` is a ModuleList of 4 blocks, each ``proj = Sequential(Conv2d, GELU)``."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.pos_block = nn.ModuleList([PosBlock(d) for _ in range(4)])
        self.head = nn.Conv2d(d, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.pos_block:
            x = block(x)
        return self.head(x)


class TupleOutput(nn.Module):
    """An LSTM: output ``(output, (h, c))``."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.fc = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, _) = self.lstm(x)
        return self.fc(out[:, -1] + h[0])


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden": self.a(x), "scale": x.abs().mean(dim=-1)}


class DictOutput(nn.Module):
    """A submodule returning a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.block = DictBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out["hidden"] * out["scale"][:, None]


@dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor | None
    note: str = "pair"


class DataclassBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Pair:
        y = self.lin(x)
        return Pair(y, None)


class DataclassOutput(nn.Module):
    """A submodule returning a dataclass with a tensor, a None and a string."""

    def __init__(self) -> None:
        super().__init__()
        self.block = DataclassBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).first.sum(-1)


class DecoderLayer(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.mlp = nn.Linear(d, d)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.mlp(hidden_states)


class KwargsForward(nn.Module):
    """HF-style: layers called with keyword arguments only."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[:2])
        for layer in self.layers:
            x = layer(hidden_states=x, attention_mask=mask, position_ids=None)
        return x


class SharedLinear(nn.Module):
    """One Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class ReusedRelu(nn.Module):
    """CLIP-bottleneck-like: one ReLU applied three times (case 03)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.fc3 = nn.Linear(d, d)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.relu(self.fc1(x))
        b = self.relu(self.fc2(a))
        c = self.relu(self.fc3(b))
        return a, b, c


class TiedWeights(nn.Module):
    """Embedding and output projection share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.out = nn.Linear(8, 12, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


class InplaceRelu(nn.Module):
    """Conv, ReLU(inplace=True), Conv (case 04) and a functional ``+=`` after a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.conv(x))
        z = self.bn(self.conv2(y))
        z += y  # writes the BatchNorm's output in place
        return z


class UnusedBranch(nn.Module):
    """``aux_head`` runs only with ``with_aux=True``; ``relu`` is declared but F.relu is used."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 4)
        self.relu = nn.ReLU()
        self.aux_head = nn.Linear(4, 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor,
                with_aux: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.backbone(x))
        return (self.head(h), self.aux_head(h)) if with_aux else self.head(h)


class Attention(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.out(a @ v)


class DirectForwardCall(nn.Module):
    """The parent calls ``self.attention.forward(x)``, bypassing its hooks (case 12)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.attention = Attention(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention.forward(x)


class ReluMlp(nn.Module):
    """``d -> 2d -> d``; its own forward calls ``F.relu`` (for ``path::relu`` addresses)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class ReluBlocks(nn.Module):
    """``(..., d)`` -> ``(..., out)``: an optional ``embed`` Linear, ``n`` residual ``ReluMlp``
    blocks in ``blocks`` and a ``head`` (copies, pickles, interrupts)."""

    def __init__(self, d: int = 8, n: int = 3, embed: bool = True, out: int = 4) -> None:
        super().__init__()
        if embed:
            self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(ReluMlp(d) for _ in range(n))
        self.head = nn.Linear(d, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if hasattr(self, "embed") else x
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class GeluMlp(nn.Module):
    """shared/cases/37's model: ``(batch, 8)`` -> ``(batch, 2)``, Linear-GELU-Linear-relu-Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.l2 = nn.Linear(8, 8)
        self.l3 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(self.act(self.l1(x)))))


class MaskedTokens(nn.Module):
    """``(input_ids, attention_mask)`` -> logits ``(batch, classes)``: ``embed`` (``vocab`` x 8),
    a per-token ``mix`` Linear (``(batch, seq, 8)``: a token's value does not depend on padding),
    masked and summed over tokens, then ``head``."""

    def __init__(self, vocab: int = 50, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.mix(self.embed(input_ids)) * attention_mask[..., None]
        return self.head(hidden.sum(dim=1))


# name -> (factory, example input builder)
ZOO = {
    "MlpStack": (MlpStack, lambda: (torch.randn(3, 10),)),
    "LeNet": (LeNet, lambda: (torch.randn(2, 3, 32, 32),)),
    "ModuleListBlocks": (ModuleListBlocks, lambda: (torch.randn(2, 8, 6, 6),)),
    "TupleOutput": (TupleOutput, lambda: (torch.randn(2, 5, 4),)),
    "DictOutput": (DictOutput, lambda: (torch.randn(3, 4),)),
    "DataclassOutput": (DataclassOutput, lambda: (torch.randn(3, 4),)),
    "KwargsForward": (KwargsForward, lambda: (torch.randn(1, 3, 8),)),
    "SharedLinear": (SharedLinear, lambda: (torch.randn(2, 6),)),
    "ReusedRelu": (ReusedRelu, lambda: (torch.randn(2, 6),)),
    "TiedWeights": (TiedWeights, lambda: (torch.randint(0, 12, (2, 5)),)),
    "InplaceRelu": (InplaceRelu, lambda: (torch.randn(2, 3, 6, 6),)),
    "UnusedBranch": (UnusedBranch, lambda: (torch.randn(2, 4),)),
    "DirectForwardCall": (DirectForwardCall, lambda: (torch.randn(1, 3, 8),)),
}


def padding_mask(lengths: list[int], seq: int, left: bool) -> torch.Tensor:
    """An attention mask ``(len(lengths), seq)`` int64: row ``i`` has ``lengths[i]`` real tokens
    (1), padded on the left or the right with 0."""
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for row, n in enumerate(lengths):
        if left:
            mask[row, seq - n:] = 1
        else:
            mask[row, :n] = 1
    return mask


class Residual(nn.Module):
    """``x + inner(x)``: wraps any module in a residual connection (generated trees)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def tiny_gpt2(n_layer: int = 2, n_head: int = 4, pad: bool = True) -> nn.Module:
    """GPT-2 built from a config (random weights, seed 0): 32-wide, vocabulary 60, 32 positions, eval mode."""
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=n_head, vocab_size=60, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, **({"pad_token_id": 0} if pad else {}))
    return transformers.GPT2LMHeadModel(config).eval()


class Temperature(nn.Module):
    """Divides its input by a temperature the loop sets: a division that can reach zero."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.temperature
