"""Image decode / resize / patch cut, one function for every place it may run (loader, constructor, client), and the rule that picks the place.

An ``image_text`` source's images are decoded where its ``image.decode_at`` says:

* ``loader`` (today's behaviour): the Source Loader decodes, resizes and cuts patches; decoded
  patch pixels travel to the constructor and on to the trainer;
* ``constructor``: the loader reads only the image header (its size gives the patch grid, which the
  planner needs before any payload moves) and ships the raw encoded bytes; the Data Constructor
  decodes them when it builds the encoder batch;
* ``client``: raw bytes travel on to the trainer's client, which decodes them into
  ``pixel_patches`` before handing the batch over;
* ``auto``: chosen per source at admission by :func:`choose_decode_place` from measured costs
  (:func:`ImageCosts`), written into the spec the components and the planner's journal get.

Batches are bit-identical wherever the decode runs: every place calls :func:`image_to_patches`
(the same Pillow calls, same draft, same resize) and the header-only :func:`image_grid` opens the
image the same way, so the grid the planner saw is the grid the pixels have (checked).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mixplane.errors import MixplaneError

PLACES = ("loader", "constructor", "client")
# CPU seconds one byte costs on one hop: serialise, copy, send, receive, and the copies around them (window, merge
# reorder, collation). bench/transform_place.py on the VLM example's images (2 cores, load 4-6): a constructor
# spent ~1.6 ns per byte of decoded pixels it sent and ~2.8 ns per byte it received, so ~4 ns per byte and hop
WIRE_S_PER_BYTE = 4e-9
CLIENT_CPU_WEIGHT = 2.0  # a trainer host's core is worth more than a data-plane core (it feeds the accelerators)
AUTO_MARGIN = 0.9  # auto leaves the loader only for a place at least 10% cheaper


class ImageDecodeError(MixplaneError, ValueError):
    """An image that cannot be decoded (or whose pixels disagree with the grid its header gave)."""


def target_size(w: int, h: int, patch: int, max_side: int, multiple: int = 1) -> tuple[int, int]:
    """Size after resizing: longer side <= max_side (never upscaled past it), both sides multiples of
    patch*multiple, at least one unit each, aspect ratio kept as closely as the grid allows."""
    unit = patch * multiple
    scale = min(1.0, max_side / max(w, h)) if max(w, h) > 0 else 1.0
    cap = max(unit, (max_side // unit) * unit)
    tw = min(cap, max(unit, int(round(w * scale / unit)) * unit))
    th = min(cap, max(unit, int(round(h * scale / unit)) * unit))
    return tw, th


def merge_multiple(merge: int) -> int:
    """Sides are multiples of patch * sqrt(merge) when `merge` is a square (2x2 merging), else of patch."""
    side = int(math.isqrt(merge))
    return side if side * side == merge else 1


def _open(data: bytes, max_side: int) -> Any:
    from PIL import Image

    f = Image.open(io.BytesIO(data))
    f.draft("RGB", (max_side, max_side))  # JPEG: decode at reduced size when much larger (header only here)
    return f


def image_grid(data: bytes, patch: int, max_side: int, multiple: int = 1) -> tuple[int, int]:
    """(h_patches, w_patches) of an image from its header alone (no pixel is decoded): what the
    loader announces when the decode runs elsewhere. Raises what Pillow raises for a bad header."""
    with _open(data, max_side) as f:
        tw, th = target_size(f.width, f.height, patch, max_side, multiple)
    return th // patch, tw // patch


def image_to_patches(data: bytes, patch: int, max_side: int, multiple: int = 1) -> tuple[np.ndarray, int, int]:
    """Decode, resize, cut into patches: (flattened uint8 patches, h_patches, w_patches)."""
    from PIL import Image

    with _open(data, max_side) as f:
        im: Image.Image = f
        if im.mode == "P" and "transparency" in im.info:
            im = im.convert("RGBA")  # palette transparency goes through RGBA (as Pillow asks)
        im = im.convert("RGB")
        tw, th = target_size(im.width, im.height, patch, max_side, multiple)
        if (tw, th) != im.size:
            im = im.resize((tw, th), Image.Resampling.BICUBIC)
        a = np.asarray(im, dtype=np.uint8)
    hp, wp = th // patch, tw // patch
    patches = a.reshape(hp, patch, wp, patch, 3).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(patches).reshape(-1), hp, wp


def rowmajor_to_windows(grid: tuple[int, int], merge: int) -> np.ndarray:
    """Permutation taking row-major patches (as :func:`image_to_patches` cuts them) to merge-window order."""
    gh, gw = grid
    m = int(round(merge ** 0.5))
    if m * m != merge or gh % m or gw % m:
        raise ValueError(f"grid {grid} cannot be merged in {m}x{m} windows")
    idx = np.arange(gh * gw).reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3)
    return idx.reshape(-1)


def decode_planned(data: bytes | np.ndarray, grid: tuple[int, int], *, patch: int, max_side: int, merge: int,
                   where: str) -> np.ndarray:
    """Decode an image shipped raw into its patches [gh*gw, patch*patch*3], row-major, checked against the
    grid the loader announced from its header. ImageDecodeError names `where` (source, column, sample
    key, file and row) and the place that decoded it."""
    try:
        flat, hp, wp = image_to_patches(bytes(data), patch, max_side, merge_multiple(merge))
    except Exception as e:  # noqa: BLE001 - untrusted image bytes: Pillow raises OSError, ValueError, SyntaxError,
        # struct.error, DecompressionBombError, ... for corrupt data; each becomes the ImageDecodeError naming the image
        raise ImageDecodeError(f"{where}: undecodable image ({type(e).__name__}: {e})") from None
    if (hp, wp) != tuple(grid):
        raise ImageDecodeError(f"{where}: decoded to a {hp}x{wp} patch grid, its header announced {grid[0]}x{grid[1]}")
    return flat.reshape(hp * wp, patch * patch * 3)


def blank_patches(grid: tuple[int, int], patch: int) -> np.ndarray:
    """The patches a quarantined image is delivered as: zeros of its planned grid, [gh*gw, patch*patch*3] uint8."""
    return np.zeros((int(grid[0]) * int(grid[1]), patch * patch * 3), np.uint8)


def decode_or_blank(data: bytes | np.ndarray, grid: tuple[int, int], *, patch: int, max_side: int, merge: int,
                    where: str) -> tuple[np.ndarray, str | None]:
    """:func:`decode_planned`, or -- an image whose header read (the step is planned with its grid) but whose pixels
    do not (a truncated file) -- :func:`blank_patches` and the error naming it (the image is quarantined: the
    batch keeps its shapes on every rank, its ``image_quarantined`` flag says so). Every place applies this rule,
    so the batch is the same wherever the decode runs."""
    try:
        return decode_planned(data, grid, patch=patch, max_side=max_side, merge=merge, where=where), None
    except ImageDecodeError as e:
        return blank_patches(grid, patch), str(e)


def decode_encoder_images(data: np.ndarray, offsets: np.ndarray, grids: np.ndarray, max_side: np.ndarray, *,
                          patch: int, merge: int, where: list[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(``pixel_patches``, ``image_quarantined``, the errors) of an encoder batch from its images' raw bytes (the
    client's decode): each image decoded by :func:`decode_or_blank` and put in merge-window order, concatenated in
    batch order, exactly what the constructor sends when it decodes."""
    dim = patch * patch * 3
    n = len(grids)
    if len(offsets) != n + 1 or len(max_side) != n or len(where) != n:
        raise ImageDecodeError(f"encoded images: {n} grids, {len(offsets) - 1} byte ranges, {len(max_side)} sizes, "
                               f"{len(where)} names")
    parts, bad, errors = [], np.zeros(n, np.int8), []
    for i in range(n):
        g = (int(grids[i, 0]), int(grids[i, 1]))
        pix, err = decode_or_blank(data[int(offsets[i]):int(offsets[i + 1])], g, patch=patch, max_side=int(max_side[i]),
                                   merge=merge, where=where[i])
        if err is not None:
            bad[i] = 1
            errors.append(err)
        parts.append(pix[rowmajor_to_windows(g, merge)] if merge > 1 else pix)
    return (np.concatenate(parts) if parts else np.zeros((0, dim), np.uint8)), bad, errors


def decode_encoder_pixels(data: np.ndarray, offsets: np.ndarray, grids: np.ndarray, max_side: np.ndarray, *,
                          patch: int, merge: int, where: list[str]) -> np.ndarray:
    """``pixel_patches`` of an encoder batch from its images' raw bytes, every image decoded (ImageDecodeError
    names the first that does not; :func:`decode_encoder_images` quarantines it instead)."""
    pix, _, errors = decode_encoder_images(data, offsets, grids, max_side, patch=patch, merge=merge, where=where)
    if errors:
        raise ImageDecodeError(errors[0])
    return pix


# ------------------------------------------------------------------------------------------ the rule
@dataclass(frozen=True)
class ImageCosts:
    """A source's measured image costs, per image (means over a sample): CPU seconds of one decode
    (decode + resize + patch cut), raw encoded bytes, decoded patch bytes."""

    decode_s: float
    raw_bytes: float
    decoded_bytes: float
    images: int = 0  # how many images the means come from


def place_costs(c: ImageCosts, consumers: int = 1, *, wire_s_per_byte: float = WIRE_S_PER_BYTE,
                client_cpu_weight: float = CLIENT_CPU_WEIGHT) -> dict[str, float]:
    """Cost per image of each place, in CPU seconds: decodes x decode_s (a client's weighted) plus the bytes
    it puts on the two hops (loader -> constructor, constructor -> client) x wire_s_per_byte.

    ========== ============================ ======================================
    place      decodes                      bytes on the wire
    ========== ============================ ======================================
    loader     1                            decoded + decoded
    constructor 1                           raw + decoded
    client     consumers (x client weight)  raw + raw x consumers
    ========== ============================ ======================================

    `consumers`: the ranks that receive one image's payload from the constructor (1 today: an image goes
    to the lowest rank of its encoder group, which broadcasts the decoded pixels to its TP / PP peers; a
    group that each received the raw bytes would decode them N times)."""
    k = max(1, int(consumers))
    r, d = float(c.raw_bytes), float(c.decoded_bytes)
    return {"loader": c.decode_s + 2 * d * wire_s_per_byte,
            "constructor": c.decode_s + (r + d) * wire_s_per_byte,
            "client": k * c.decode_s * client_cpu_weight + (r + k * r) * wire_s_per_byte}


def choose_decode_place(c: ImageCosts, consumers: int = 1, **weights: float) -> str:
    """The readable rule: the place of least :func:`place_costs`, but the loader (today's behaviour) unless
    another place costs at most AUTO_MARGIN of the loader's; with no measured image, the loader."""
    if c.images <= 0:
        return "loader"
    cost = place_costs(c, consumers, **weights)
    best = min(PLACES, key=lambda p: (cost[p], PLACES.index(p)))
    return best if cost[best] <= AUTO_MARGIN * cost["loader"] else "loader"
