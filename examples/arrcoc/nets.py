"""The ONNX steps of the ARR-COC pipeline as torch modules (exported by build_repository.py).

Shapes: an image is sRGB FP32 [B, 3, 64, 64] in [0, 1]; the texture array is [B, 13, 64, 64]; patches
are 8x8 pixels, so every score map is [B, 8, 8]. The texture array and the two bottom-up scorers are
fixed math; the text embedding, the participatory scorer and the decoder are trained.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SIZE, PATCH = 64, 8
GRID = SIZE // PATCH
CHANNELS = (  # the texture array, in order (README "ARR-COC" documents each)
    "R", "G", "B", "L", "a", "b", "sobel_x", "sobel_y", "gradient", "entropy", "contrast", "center_surround",
    "eccentricity",
)
EMBED = 16
ENTROPY_BINS, ENTROPY_WINDOW = 8, 7

_XYZ = torch.tensor([[0.4124564, 0.3575761, 0.1804375],
                     [0.2126729, 0.7151522, 0.0721750],
                     [0.0193339, 0.1191920, 0.9503041]]) / torch.tensor([0.95047, 1.0, 1.08883])[:, None]


def _box(x: torch.Tensor, k: int) -> torch.Tensor:
    """Mean over a k x k window around each pixel (the window clipped at the border). Separable: a 1 x k
    mean then a k x 1 one (a clipped window is still a rectangle, so this is the same mean) — 2k reads a
    pixel instead of k²: onnxruntime's AveragePool spent 90% of texture_array's time in the 15 x 15 and
    7 x 7 windows."""
    rows = F.avg_pool2d(x, (1, k), stride=1, padding=(0, k // 2), count_include_pad=False)
    return F.avg_pool2d(rows, (k, 1), stride=1, padding=(k // 2, 0), count_include_pad=False)


def _patches(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, PATCH)


class TextureArray(nn.Module):
    """RGB [B, 3, H, W] -> the 13-channel texture array [B, 13, H, W]."""

    def __init__(self) -> None:
        super().__init__()
        sobel = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 4
        self.register_buffer("sobel", torch.stack([sobel, sobel.T])[:, None])  # [2, 1, 3, 3]: d/dx, d/dy
        self.register_buffer("xyz", _XYZ.clone())
        self.register_buffer("bins", torch.arange(ENTROPY_BINS, dtype=torch.float32)[None, :, None, None])
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, SIZE), torch.linspace(-1, 1, SIZE), indexing="ij")
        self.register_buffer("ecc", ((xs ** 2 + ys ** 2).sqrt() / 2 ** 0.5)[None, None])

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        rgb = image.clamp(0, 1)
        linear = torch.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
        xyz = torch.einsum("ij,bjhw->bihw", self.xyz, linear)
        delta = 6 / 29
        f = torch.where(xyz > delta ** 3, xyz.clamp_min(1e-12) ** (1 / 3), xyz / (3 * delta ** 2) + 4 / 29)
        fx, fy, fz = f[:, 0:1], f[:, 1:2], f[:, 2:3]
        lum = (116 * fy - 16) / 100                                    # L* / 100, in [0, 1]
        a, b = 500 * (fx - fy) / 128, 200 * (fy - fz) / 128            # a*, b* / 128, about [-1, 1]
        grad = F.conv2d(F.pad(lum, (1, 1, 1, 1), mode="replicate"), self.sobel)
        magnitude = (grad.pow(2).sum(1, keepdim=True) + 1e-12).sqrt()
        # local entropy of L* in 8 levels over a 7x7 window, in bits / 3 (so in [0, 1])
        level = (lum * ENTROPY_BINS).floor().clamp(0, ENTROPY_BINS - 1)
        p = _box((level == self.bins).float(), ENTROPY_WINDOW)
        entropy = -(p * p.clamp_min(1e-12).log2()).sum(1, keepdim=True) / 3
        contrast = (_box(lum * lum, 5) - _box(lum, 5) ** 2).clamp_min(0).add(1e-12).sqrt()
        lab = torch.cat([lum, a, b], 1)
        center_surround = ((_box(lab, 3) - _box(lab, 15)).pow(2).sum(1, keepdim=True) + 1e-12).sqrt()
        ecc = self.ecc.expand(rgb.shape[0], 1, SIZE, SIZE)
        return torch.cat([rgb, lab, grad, magnitude, entropy, contrast, center_surround, ecc], 1)


class PropositionalScorer(nn.Module):
    """Information: how much there is to know in a patch — mean local entropy plus mean edge strength."""

    def forward(self, texture: torch.Tensor) -> torch.Tensor:
        entropy, gradient = texture[:, 9:10], texture[:, 8:9].clamp(max=1)
        return (0.5 * (_patches(entropy) + _patches(gradient)))[:, 0]


class PerspectivalScorer(nn.Module):
    """Salience: what pops out for a viewer — centre-surround contrast plus how far a patch's colour
    is from the image's mean colour, damped away from the centre (the viewer's centre bias)."""

    def forward(self, texture: torch.Tensor) -> torch.Tensor:
        lab = _patches(texture[:, 3:6])
        rarity = (lab - lab.mean(dim=(2, 3), keepdim=True)).pow(2).sum(1).add(1e-12).sqrt()
        center_surround = _patches(texture[:, 11:12])[:, 0]
        ecc = _patches(texture[:, 12:13])[:, 0]
        return (center_surround + 0.5 * rarity) * (1 - 0.5 * ecc)


class TextEmbedding(nn.Module):
    """Token ids [B, 8] -> a query embedding [B, 16]: the mean of the words' vectors, projected."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.words = nn.Embedding(vocab_size, EMBED, padding_idx=0)
        self.proj = nn.Linear(EMBED, EMBED)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        mask = (token_ids > 0).float().unsqueeze(-1)
        # index_select, not nn.Embedding's op: the exporter names that node "embedding", our output's name
        vectors = self.words.weight.index_select(0, token_ids.flatten()).view(*token_ids.shape, EMBED)
        mean = (vectors * mask).sum(1) / mask.sum(1).clamp_min(1)
        return torch.tanh(self.proj(mean))


class ParticipatoryScorer(nn.Module):
    """Query-aware relevance: each patch's texture statistics (mean, max and min of the 13 channels: a
    shape covering part of a patch shows in its extremes) mapped into the embedding space, scored by the
    scaled dot product with the query embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.keys = nn.Sequential(nn.Conv2d(39, 32, 1), nn.ReLU(), nn.Conv2d(32, EMBED, 1))

    def forward(self, texture: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        stats = torch.cat([_patches(texture), F.max_pool2d(texture, PATCH), -F.max_pool2d(-texture, PATCH)], 1)
        keys = self.keys(stats)                                            # [B, 16, 8, 8]
        return torch.einsum("bchw,bc->bhw", keys, embedding) / EMBED ** 0.5


class Decoder(nn.Module):
    """(texture, token budget, query embedding) -> answer ids [B, 5], greedily.

    A small CNN gives each patch a feature vector; the token budget is the attention: a patch's weight
    is softmax(beta * (b - 64) / 336), so the patches the opponent processor funds are the ones the
    decoder reads. The attended feature, the attended patch position and the query embedding condition
    a GRU that emits one answer word per step (colour, shape, row, column, <eos>).
    """

    def __init__(self, vocab_size: int, steps: int, hidden: int = 64) -> None:
        super().__init__()
        self.steps = steps
        # three strided 3x3 convolutions, 64 -> 8: each patch's feature sees a 15-pixel square around
        # it, the size of a shape; small enough to train in a minute on one CPU core
        self.cnn = nn.Sequential(
            nn.Conv2d(13, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(),
        )
        self.beta = nn.Parameter(torch.tensor(8.0))
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, GRID), torch.linspace(-1, 1, GRID), indexing="ij")
        self.register_buffer("positions", torch.stack([xs, ys]).reshape(2, -1))  # [2, 64]
        context = 32 + 2 + EMBED
        self.init = nn.Linear(context, hidden)
        self.words = nn.Embedding(vocab_size, 16)
        self.gru = nn.GRUCell(16, hidden)
        self.out = nn.Linear(hidden + context, vocab_size)

    def context(self, texture: torch.Tensor, budget: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        features = self.cnn(texture).flatten(2)                                        # [B, 32, 64]
        weight = torch.softmax(self.beta * (budget.float().flatten(1) - 64) / 336, dim=1)  # [B, 64]
        attended = torch.einsum("bcp,bp->bc", features, weight)
        where = torch.einsum("cp,bp->bc", self.positions, weight)
        return torch.cat([attended, where, embedding], 1)

    def step(self, token: torch.Tensor, h: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.gru(self.words(token), h)
        return self.out(torch.cat([h, ctx], 1)), h

    def forward(self, texture: torch.Tensor, token_budget: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        ctx = self.context(texture, token_budget, embedding)
        h = torch.tanh(self.init(ctx))
        token = torch.ones(texture.shape[0], dtype=torch.long, device=texture.device)  # <bos>
        out = []
        for _ in range(self.steps):  # unrolled at export: the answer has a fixed length
            logits, h = self.step(token, h, ctx)
            token = logits.argmax(1)
            out.append(token)
        return torch.stack(out, 1)

    def teacher_forced(self, texture, token_budget, embedding, targets: torch.Tensor) -> torch.Tensor:
        """Logits [B, steps, V] with the true previous word fed at each step (training)."""
        ctx = self.context(texture, token_budget, embedding)
        h = torch.tanh(self.init(ctx))
        previous = torch.cat([torch.ones_like(targets[:, :1]), targets[:, :-1]], 1)
        logits = []
        for t in range(self.steps):
            step_logits, h = self.step(previous[:, t], h, ctx)
            logits.append(step_logits)
        return torch.stack(logits, 1)
