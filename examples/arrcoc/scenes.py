"""Synthetic scenes, queries and answers: the data the example trains on and the images it ships.

A scene is 2-3 flat-coloured shapes (circle, square, triangle; each a different colour) on a low-saturation
noisy background, one shape per cell of a 3x3 grid. A query names one shape's colour in free words
("where is the crimson thing"); the answer is that shape's colour, kind and cell ("red circle top left").
Everything is drawn here from a seed: no data set is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RENDER = 128  # pixels: images are drawn (and shipped) at this size; the served pipeline works at 64

COLORS = {  # sRGB in [0, 1]; saturated, so they stand out of the greyish background
    "red": (0.86, 0.14, 0.12),
    "green": (0.16, 0.68, 0.22),
    "blue": (0.14, 0.30, 0.86),
    "yellow": (0.92, 0.84, 0.14),
}
SYNONYMS = {  # the words a query may use for each colour: the text embedding must learn they agree
    "red": ("red", "crimson", "scarlet"),
    "green": ("green", "emerald", "lime"),
    "blue": ("blue", "azure", "navy"),
    "yellow": ("yellow", "golden", "amber"),
}
SHAPES = ("circle", "square", "triangle")
ROWS = ("top", "middle", "bottom")
COLUMNS = ("left", "center", "right")
NOUNS = ("object", "shape", "thing", "item", "one")
TEMPLATES = (
    "where is the {c} {n}",
    "find the {c} {n}",
    "{c}",
    "show me the {c} {n} please",
    "what is {c} here",
    "is there a {c} {n}",
    "describe the {c} {n}",
    "look at the {c} {n} in this picture",
)

# The decoder's words, in id order: 0 pads, 1 starts, 2 ends an answer.
ANSWER_WORDS = ("<pad>", "<bos>", "<eos>", *COLORS, *SHAPES, *ROWS, *COLUMNS)
ANSWER_LENGTH = 5  # colour, shape, row, column, <eos>


def query_words() -> list[str]:
    """Every word a generated query can contain (the tokenizer's vocabulary, after <pad> and <unk>)."""
    words: set[str] = set(NOUNS)
    for template in TEMPLATES:
        words.update(w for w in template.replace("{c}", "").replace("{n}", "").split())
    for names in SYNONYMS.values():
        words.update(names)
    return sorted(words)


@dataclass(frozen=True)
class Shape:
    color: str
    kind: str
    row: int
    column: int
    cx: float  # centre and radius in pixels of the RENDER x RENDER image
    cy: float
    radius: float

    def answer(self) -> str:
        return f"{self.color} {self.kind} {ROWS[self.row]} {COLUMNS[self.column]}"


def _mask(shape: Shape, ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    dx, dy, r = xs - shape.cx, ys - shape.cy, shape.radius
    if shape.kind == "circle":
        return dx * dx + dy * dy <= r * r
    if shape.kind == "square":
        return (np.abs(dx) <= 0.85 * r) & (np.abs(dy) <= 0.85 * r)
    # an upright triangle: apex at the top, base at the bottom
    return (dy >= -r) & (dy <= 0.8 * r) & (np.abs(dx) <= 0.62 * (dy + r))


def render(rng: np.random.Generator, size: int = RENDER) -> tuple[np.ndarray, list[Shape]]:
    """One scene: an sRGB uint8 image [size, size, 3] and its shapes."""
    # background: a smooth low-saturation colour field (a 4x4 grid upsampled) plus pixel noise
    grey = rng.uniform(0.25, 0.7, size=(4, 4, 1))
    tint = rng.uniform(-0.06, 0.06, size=(4, 4, 3))
    coarse = grey + tint
    idx = np.linspace(0, 3, size)
    i0 = np.floor(idx).astype(int).clip(0, 2)
    f = (idx - i0)[:, None]
    rows = coarse[i0] * (1 - f[..., None]) + coarse[i0 + 1] * f[..., None]          # [size, 4, 3]
    image = rows[:, i0] * (1 - f.T[..., None]) + rows[:, i0 + 1] * f.T[..., None]    # [size, size, 3]
    image = image + rng.normal(0, 0.04, size=image.shape)

    count = int(rng.integers(2, 4))
    colors = rng.choice(list(COLORS), size=count, replace=False)
    cells = rng.choice(9, size=count, replace=False)
    cell = size / 3
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    shapes = []
    for color, where in zip(colors, cells):
        row, column = divmod(int(where), 3)
        radius = rng.uniform(0.26, 0.38) * cell
        shape = Shape(str(color), str(rng.choice(SHAPES)), row, column,
                      cx=(column + 0.5) * cell + rng.uniform(-0.12, 0.12) * cell,
                      cy=(row + 0.5) * cell + rng.uniform(-0.12, 0.12) * cell, radius=radius)
        rgb = np.asarray(COLORS[shape.color]) + rng.uniform(-0.06, 0.06, size=3)
        mask = _mask(shape, ys, xs)
        image[mask] = rgb + rng.normal(0, 0.02, size=(int(mask.sum()), 3))
        shapes.append(shape)
    return (image.clip(0, 1) * 255 + 0.5).astype(np.uint8), shapes


def query(rng: np.random.Generator, color: str) -> str:
    template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    return template.format(c=rng.choice(SYNONYMS[color]), n=rng.choice(NOUNS))


def patch_mask(shape: Shape, grid: int = 8, size: int = RENDER) -> np.ndarray:
    """Fraction of each of the grid x grid patches that the shape covers: [grid, grid] in [0, 1]."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    mask = _mask(shape, ys, xs).astype(np.float32)
    step = size // grid
    return mask.reshape(grid, step, grid, step).mean(axis=(1, 3))


def sample(rng: np.random.Generator) -> tuple[np.ndarray, str, Shape]:
    """A scene, a query about one of its shapes, and that shape (whose ``answer()`` is the target)."""
    image, shapes = render(rng)
    target = shapes[int(rng.integers(len(shapes)))]
    return image, query(rng, target.color), target
