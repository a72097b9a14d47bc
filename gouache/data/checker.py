"""Say whether an image shows a shapes scene: per asked shape, is its colour there, is it the
right shape, in the right cell. Analytic, so a wrong answer can be explained:

1. a 3x3 median filter removes pixel noise;
2. each pixel takes the nearest named colour (shape colours and backgrounds), if within TOLERANCE;
3. the largest 8-connected blob of the asked colour is the shape (ignores specks and blur halos);
4. its cell is the one holding its centroid; its kind comes from blur-invariant cumulants of the
   colour's coverage around the blob (see `_kind`).

`check_edit` says the same of an instruction edit's output: was the instruction carried out, and
was the rest of the scene kept. `python -m gouache.data.checker [--edits]` measures either on
clean and degraded dataset renders."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from gouache.cli_flags import parse_size
from gouache.data.edits import EDIT_KINDS, Edit, EditDataset
from gouache.data.shapes import (
    BACKGROUNDS,
    COLOURS,
    KINDS,
    POSITIONS,
    Scene,
    Shape,
    ShapesDataset,
    cell_box,
    cell_of,
    render,
)

NAMES = tuple(COLOURS) + tuple(BACKGROUNDS)
PALETTE = np.array([*COLOURS.values(), *BACKGROUNDS.values()], dtype=np.float32)  # [colours, 3]
TOLERANCE = 110.0  # RGB distance beyond which a pixel is no named colour (model colour drift)
OFF_LINE = 20.0  # RGB distance from the background-colour line past which a pixel is another colour..
OFF_ANGLE = 0.3  # ..plus this fraction of its distance along the line (tan of the angle allowed)
TRIANGLE_SKEW = -0.006  # y skew cumulant / area^1.5: upright triangle -0.021 (blurred, 32 px: -0.008), others ~0
SQUARE_RATIO = 0.93  # diagonal / axial 4th cumulant: square 0.5 (blurred, 32 px: <= 0.89), circle 1.0
MIN_AREA = 0.02  # smallest blob, as a fraction of a cell's smaller side squared (~1/6 of the smallest triangle)


@dataclass(frozen=True)
class ShapeCheck:
    """What the checker found for one asked shape."""

    asked: Shape  # the shape the scene asks for
    found_kind: str | None  # kind of the largest blob of the asked colour; None if no blob
    found_position: str | None  # grid cell of that blob's centroid; None if no blob
    area: int  # pixels in that blob (0 if none)

    @property
    def colour_ok(self) -> bool:
        return self.found_kind is not None

    @property
    def shape_ok(self) -> bool:
        return self.found_kind == self.asked.kind

    @property
    def position_ok(self) -> bool:
        return self.found_position == self.asked.position


@dataclass(frozen=True)
class Check:
    """The checker's verdict on one image against one scene."""

    shapes: tuple[ShapeCheck, ...]  # one per asked shape, in scene order

    @property
    def colour_ok(self) -> bool:
        return all(s.colour_ok for s in self.shapes)

    @property
    def shape_ok(self) -> bool:
        return all(s.shape_ok for s in self.shapes)

    @property
    def position_ok(self) -> bool:
        return all(s.position_ok for s in self.shapes)

    @property
    def all_ok(self) -> bool:
        return self.colour_ok and self.shape_ok and self.position_ok


def _labels(smooth: np.ndarray) -> np.ndarray:
    """[H, W] index into NAMES of each (median-filtered) pixel's nearest named colour, -1 if none
    is near enough."""
    dist = np.linalg.norm(smooth[:, :, None, :] - PALETTE[None, None], axis=-1)  # [H, W, colours]
    labels = dist.argmin(axis=-1)
    labels[dist.min(axis=-1) > TOLERANCE] = -1
    return labels


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def largest_blob(mask: np.ndarray) -> np.ndarray:
    """The largest 8-connected component of a [H, W] bool mask, by union-find over row runs."""
    padded = np.pad(mask.astype(np.int8), ((0, 0), (1, 1)))
    edges = np.diff(padded, axis=1)
    ys, starts = np.nonzero(edges == 1)
    ends = np.nonzero(edges == -1)[1]  # exclusive; same row-major order as starts
    if len(ys) == 0:
        return np.zeros_like(mask, dtype=bool)
    parent = list(range(len(ys)))
    row_first = np.searchsorted(ys, np.arange(mask.shape[0] + 1))  # runs of row y: [row_first[y], row_first[y+1])
    for y in range(1, mask.shape[0]):
        above = range(row_first[y - 1], row_first[y])
        for j in range(row_first[y], row_first[y + 1]):
            for i in above:  # 8-connected: runs touch if they overlap after widening by one pixel
                if starts[i] <= ends[j] and starts[j] <= ends[i]:
                    parent[_find(parent, i)] = _find(parent, j)
    roots = np.array([_find(parent, i) for i in range(len(ys))])
    best = np.bincount(roots, weights=ends - starts).argmax()
    blob = np.zeros_like(mask, dtype=bool)
    for y, s, e in zip(ys[roots == best], starts[roots == best], ends[roots == best]):
        blob[y, s:e] = True
    return blob


def _alpha(smooth: np.ndarray, blob: np.ndarray, colour: str, background: str) -> np.ndarray:
    """[h, w] coverage in 0..1 of the asked colour over the background, in a window the size of a
    cell (plus blur halo) around the blob's centroid: a blurred small shape's blob is only its core.
    Pixels off the background-colour line (other shapes) count 0."""
    ys, xs = np.nonzero(blob)
    half = round(min(smooth.shape[:2]) / 6) + 2  # shapes span at most 0.8 of a cell
    cy, cx = round(ys.mean()), round(xs.mean())
    crop = smooth[max(cy - half, 0) : cy + half + 1, max(cx - half, 0) : cx + half + 1]
    bg = np.array(BACKGROUNDS[background], np.float32)
    direction = np.array(COLOURS[colour], np.float32) - bg
    alpha = (crop - bg) @ direction / (direction @ direction)
    # A blend of another shape's colour with the background leaves the line at an angle; noise
    # leaves it by a constant: so the tolerance grows with the distance along the line.
    off = np.linalg.norm(crop - bg - alpha[..., None] * direction, axis=-1)
    off_line = off > OFF_LINE + OFF_ANGLE * np.abs(alpha) * np.linalg.norm(direction)
    return np.where(off_line, 0.0, np.clip((alpha - 0.15) / 0.7, 0.0, 1.0))  # 0.15: ignore residual noise


def _cumulants(alpha: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """Third and fourth cumulants of coordinate p under the coverage alpha."""
    mass = alpha.sum()
    c = p - (alpha * p).sum() / mass
    m2, m3, m4 = ((alpha * c**k).sum() / mass for k in (2, 3, 4))
    return m3, m4 - 3 * m2**2


def _kind(alpha: np.ndarray) -> str:
    """Kind from blur-invariant cumulants (a Gaussian blur adds only to the second cumulant):
    an upright triangle is skewed in y; a square's diagonal kurtosis cumulant is half its axial
    one (triangular vs uniform marginals), a circle's the same in every direction."""
    v, u = np.mgrid[0 : alpha.shape[0], 0 : alpha.shape[1]].astype(np.float64)
    k3_y, k4_y = _cumulants(alpha, v)
    k4_x = _cumulants(alpha, u)[1]
    k4_diagonals = _cumulants(alpha, (u + v) / np.sqrt(2))[1] + _cumulants(alpha, (u - v) / np.sqrt(2))[1]
    if k3_y / alpha.sum() ** 1.5 < TRIANGLE_SKEW:  # mass sits low: apex up
        return "triangle"
    return "square" if k4_diagonals / (k4_x + k4_y) < SQUARE_RATIO else "circle"


def check(image: np.ndarray, scene: Scene) -> Check:
    """Check a [H, W, 3] uint8 image against a scene."""
    height, width = image.shape[:2]
    smooth = np.asarray(Image.fromarray(image).filter(ImageFilter.MedianFilter(3)), dtype=np.float32)
    labels = _labels(smooth)
    min_area = MIN_AREA * min(width, height) ** 2 / 9
    results = []
    for shape in scene.shapes:
        blob = largest_blob(labels == NAMES.index(shape.colour))
        area = int(blob.sum())
        if area < min_area:
            results.append(ShapeCheck(shape, None, None, area))
            continue
        ys, xs = np.nonzero(blob)
        position = cell_of(xs.mean() + 0.5, ys.mean() + 0.5, width, height)
        results.append(ShapeCheck(shape, _kind(_alpha(smooth, blob, shape.colour, scene.background)), position, area))
    return Check(tuple(results))


@dataclass(frozen=True)
class EditCheck:
    """The checker's verdict on an edit model's output: was the instruction carried out, and was
    the rest left as it was (`check_edit`)."""

    carried_out: bool  # the changed shape (or background) is as the instruction asks
    rest_kept: bool  # every other shape of the scene, and the background, is as the source had it
    found: Check  # the output checked against the target scene

    @property
    def all_ok(self) -> bool:
        return self.carried_out and self.rest_kept


def _absent(labels: np.ndarray, colour: str, min_area: float, cell: str | None = None) -> bool:
    """No blob of `colour` of `min_area` pixels (within grid cell `cell` only, if given)."""
    mask = labels == NAMES.index(colour)
    if cell is not None:
        height, width = labels.shape
        left, top, right, bottom = (round(v) for v in cell_box(cell, width, height))
        inside = np.zeros_like(mask)
        inside[top:bottom, left:right] = True
        mask &= inside
    return largest_blob(mask).sum() < min_area


def _background(labels: np.ndarray) -> str | None:
    """The named colour most pixels take (shapes cover a sixth of an image at most)."""
    counts = np.bincount(labels[labels >= 0].ravel(), minlength=len(NAMES))
    return NAMES[int(counts.argmax())] if counts.any() else None


def check_edit(image: np.ndarray, edit: Edit) -> EditCheck:
    """Check an edit model's [H, W, 3] uint8 output against the edit asked of it: carried out when
    the shape it made or changed is found as asked (colour, kind, cell), a recoloured shape's old
    colour is gone, a moved shape's old cell is empty of its colour, a removed shape's colour
    is gone, or the background is the asked one; the rest kept when every other shape is found
    as it was and the background is the source's (or, for a background edit, the new one)."""
    found = check(image, edit.target)
    labels = _labels(np.asarray(Image.fromarray(image).filter(ImageFilter.MedianFilter(3)), dtype=np.float32))
    min_area = MIN_AREA * min(image.shape[:2]) ** 2 / 9
    shown = _background(labels)
    if edit.kind == "background":
        done = shown == edit.target.background
    elif edit.kind == "remove":
        done = _absent(labels, edit.removed.colour, min_area)
    else:
        changed = found.shapes[edit.shape]
        done = changed.colour_ok and changed.shape_ok and changed.position_ok
        source = edit.source.shapes[edit.shape] if edit.kind != "add" else None
        if edit.kind == "recolour":
            done = done and _absent(labels, source.colour, min_area)
        elif edit.kind == "move":
            done = done and _absent(labels, source.colour, min_area, source.position)
    others = [c for i, c in enumerate(found.shapes) if i != edit.shape]
    kept = all(c.colour_ok and c.shape_ok and c.position_ok for c in others)
    if edit.kind != "background":
        kept = kept and shown == edit.source.background
    return EditCheck(bool(done), bool(kept), found)


@dataclass(frozen=True)
class Degrade:
    """What generated images look like: blurred, then noisy."""

    blur_radius: float = 1.5  # Gaussian blur radius in px (Pillow ImageFilter.GaussianBlur)
    noise_sigma: float = 12.0  # std of additive Gaussian noise, in 0..255 units
    seed: int = 0  # noise seed; the noise of item i depends on (seed, i) alone

    def apply(self, image: np.ndarray, index: int) -> np.ndarray:
        blurred = np.asarray(Image.fromarray(image).filter(ImageFilter.GaussianBlur(self.blur_radius)),
                             dtype=np.float32)
        noise = np.random.default_rng([self.seed, index]).normal(0.0, self.noise_sigma, blurred.shape)
        return np.clip(blurred + noise, 0, 255).round().astype(np.uint8)


def mutate(scene: Scene, rng: random.Random, attribute: str, index: int | None = None) -> Scene:
    """A different valid scene: one shape's (the `index`th, or one drawn) colour, kind or position
    changed."""
    i = rng.randrange(len(scene.shapes)) if index is None else index
    shape = scene.shapes[i]
    used = {"colour": {s.colour for s in scene.shapes}, "position": {s.position for s in scene.shapes}}
    choices = {
        "colour": [c for c in COLOURS if c not in used["colour"]],
        "kind": [k for k in KINDS if k != shape.kind],
        "position": [p for p in POSITIONS if p not in used["position"]],
    }[attribute]
    changed = Shape(**{**asdict(shape), attribute: rng.choice(choices)})
    return Scene(scene.shapes[:i] + (changed,) + scene.shapes[i + 1 :], scene.background)


def accuracy(n: int, seed: int, sizes: list[tuple[int, int]], degrade: Degrade | None = None) -> dict:
    """Fractions of n dataset images the checker accepts (per attribute and all), and of renders
    checked against a mutated scene that it wrongly accepts (false accepts, per changed attribute)."""
    data, rng = ShapesDataset(seed, sizes), random.Random(f"mutate:{seed}")
    ok = {"colour": 0, "shape": 0, "position": 0, "all": 0}
    false_accepts = {"colour": 0, "kind": 0, "position": 0}
    start = time.perf_counter()
    for index in range(n):
        image, _, scene, _ = data.item(index)
        image = degrade.apply(image, index) if degrade else image
        result = check(image, scene)
        for key, value in zip(ok, (result.colour_ok, result.shape_ok, result.position_ok, result.all_ok)):
            ok[key] += value
        attribute = tuple(false_accepts)[index % 3]
        false_accepts[attribute] += check(image, mutate(scene, rng, attribute)).all_ok
    seconds = time.perf_counter() - start
    mutated = {a: len(range(i, n, 3)) for i, a in enumerate(false_accepts)}
    return {
        "n": n,
        **{key: value / n for key, value in ok.items()},
        "false_accept": sum(false_accepts.values()) / n,
        "false_accept_by_change": {a: false_accepts[a] / max(mutated[a], 1) for a in false_accepts},
        "ms_per_check": 1000 * seconds / (2 * n),
    }


def edit_accuracy(n: int, seed: int, sizes: list[tuple[int, int]], degrade: Degrade | None = None) -> dict:
    """`check_edit` on n edit pairs: how often it finds exact target renders carried out and kept
    (overall and per edit kind), and how often it wrongly finds an edit carried out in the
    unedited source, or the rest kept in a target where another shape (or the background) changed."""
    data, rng = EditDataset(seed, sizes), random.Random(f"mutate-edit:{seed}")
    kinds = {kind: {"n": 0, "carried_out": 0, "rest_kept": 0} for kind in EDIT_KINDS}
    wrong = {"carried_out": 0, "rest_kept": 0}
    start = time.perf_counter()
    for index in range(n):
        edit, (height, width), render_seed = data.drawn(index)
        others = [i for i in range(len(edit.target.shapes)) if i != edit.shape]
        if others:
            changed = mutate(edit.target, rng, ("colour", "kind", "position")[index % 3], rng.choice(others))
        else:  # a lone shape recoloured or moved: the rest is the background
            changed = Scene(edit.target.shapes,
                            rng.choice([b for b in sorted(BACKGROUNDS) if b != edit.target.background]))
        images = [render(scene, width, height, render_seed) for scene in (edit.target, edit.source, changed)]
        if degrade:
            images = [degrade.apply(image, index) for image in images]
        verdict = check_edit(images[0], edit)
        row = kinds[edit.kind]
        row["n"] += 1
        row["carried_out"] += verdict.carried_out
        row["rest_kept"] += verdict.rest_kept
        wrong["carried_out"] += check_edit(images[1], edit).carried_out
        wrong["rest_kept"] += check_edit(images[2], edit).rest_kept
    seconds = time.perf_counter() - start
    return {
        "n": n,
        **{key: sum(row[key] for row in kinds.values()) / n for key in ("carried_out", "rest_kept")},
        "by_kind": {kind: {k: row[k] / max(row["n"], 1) if k != "n" else row["n"] for k in row}
                    for kind, row in kinds.items()},
        "false_accept": {"carried_out (source unedited)": wrong["carried_out"] / n,
                         "rest_kept (another change)": wrong["rest_kept"] / n},
        "ms_per_check": 1000 * seconds / (3 * n),
    }


def _table(rows: dict) -> list[str]:
    lines = ["| images | colour ok (%) | shape ok (%) | position ok (%) | all ok (%) | false accept (%) | check (ms) |",
             "|" + "---|" * 7]
    for name, r in rows.items():
        cells = [r[k] * 100 for k in ("colour", "shape", "position", "all", "false_accept")]
        lines.append(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {r['ms_per_check']:.1f} |")
    return lines


def _edit_table(rows: dict) -> list[str]:
    lines = ["| target renders | carried out (%) | rest kept (%) | "
             + " | ".join(f"{kind}: carried out / kept (%)" for kind in EDIT_KINDS)
             + " | false: carried out in the source (%) | false: kept after another change (%) | check (ms) |",
             "|" + "---|" * (6 + len(EDIT_KINDS))]
    for name, r in rows.items():
        kinds = [f"{r['by_kind'][k]['carried_out'] * 100:.1f} / {r['by_kind'][k]['rest_kept'] * 100:.1f}"
                 for k in EDIT_KINDS]
        wrong = [v * 100 for v in r["false_accept"].values()]
        lines.append(f"| {name} | {r['carried_out'] * 100:.1f} | {r['rest_kept'] * 100:.1f} | " + " | ".join(kinds)
                     + f" | {wrong[0]:.1f} | {wrong[1]:.1f} | {r['ms_per_check']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gouache.data.checker", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=500, help="images per condition")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sizes", default="64x64,96x64,64x128,128x128,192x128,256x256", help="comma-separated WxH")
    p.add_argument("--blur", type=float, default=1.5, help="degraded: Gaussian blur radius, px")
    p.add_argument("--noise", type=float, default=12.0, help="degraded: noise std, 0..255 units")
    p.add_argument("--out", type=Path, help="write JSON here, and a .md table beside it")
    p.add_argument("--edits", action="store_true",
                   help="measure the edit checker (`check_edit`) on edit pairs instead of the generation checker")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    measure = edit_accuracy if args.edits else accuracy
    rows = {
        "clean": measure(args.n, args.seed, sizes),
        "degraded": measure(args.n, args.seed, sizes, Degrade(args.blur, args.noise, args.seed)),
    }
    lines = _edit_table(rows) if args.edits else _table(rows)
    table = "\n".join(lines)
    print(table)
    if args.out:
        command = "python -m gouache.data.checker " + " ".join(argv if argv is not None else sys.argv[1:])
        report = {"command": command, "sizes": sizes, "degrade": asdict(Degrade(args.blur, args.noise, args.seed)),
                  **rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(f"`{command}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
