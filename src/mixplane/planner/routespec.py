"""The routing rules written plainly, one instruction at a time (slow): what the planner's compiled routing
(routing.py over routeloop.py) must produce, and the tests hold it to them on random layouts.

Who gets what, for one step:

* every segment of the layout goes, in layout order, to each constructor that serves its DP rank (the DP
  fan-out, in its order); only the last of those copies carries the piece's retire flag;
* an image goes to each constructor of the rank that encodes it (the rank fan-out): the instruction that
  already sends that constructor the image's first span is marked `img`; where there is none, an image-only
  instruction (0 tokens) is added after all the token spans, in image order;
* the instructions are grouped by loader replica (source, replica), replicas in ascending order, each
  replica's in the order above.

A constructor's images are those whose first span lies in its rows or whose encoder rank it serves,
ascending. A constructor's part of the layout is `StepLayout.select_ranks` of its DP ranks.
"""

from __future__ import annotations

import numpy as np

from mixplane.layout import StepLayout
from mixplane.planner.routing import Fanout, Instructions


def _targets(fan: Fanout, i: int) -> list[int]:
    return fan.targets[int(fan.offsets[i]):int(fan.offsets[i + 1])].tolist()


def loader_instructions(layout: StepLayout, piece_source: np.ndarray, piece_key: np.ndarray, piece_start: np.ndarray,
                        piece_replica: np.ndarray, piece_pos: np.ndarray, retired: np.ndarray,
                        dp_fanout: Fanout, rank_fanout: Fanout, piece_of_seg: np.ndarray | None = None,
                        seg_of_img: np.ndarray | None = None) -> dict[tuple[int, int], Instructions]:
    """routing.loader_instructions by the rules above. A segment's piece is `piece_of_seg[segment]`, else the
    piece with the segment's (source, key, start); an image's first span is `seg_of_img[image]`, else the
    segment that starts the image's sample."""
    n = len(layout.seg_row)
    if len(piece_source) != n:
        raise ValueError(f"step {layout.step}: {len(piece_source)} pieces for {n} segments")
    if piece_of_seg is not None and len(piece_of_seg) == n:
        piece = [int(p) for p in piece_of_seg]
    else:
        by_span = {(int(s), int(k), int(a)): i for i, (s, k, a) in enumerate(zip(piece_source, piece_key, piece_start))}
        piece = [by_span[(int(s), int(k), int(a))]
                 for s, k, a in zip(layout.seg_source, layout.seg_key, layout.seg_start)]
    rows = layout.rows_per_rank
    out: list[list[int]] = []  # [source, replica, pos, start, len, dest, retire, img, segment]
    for s in range(n):
        p = piece[s]
        dests = _targets(dp_fanout, int(layout.seg_row[s]) // rows)
        for j, d in enumerate(dests):
            out.append([int(layout.seg_source[s]), int(piece_replica[p]), int(piece_pos[p]), int(layout.seg_start[s]),
                        int(layout.seg_len[s]), d, int(retired[p]) if j == len(dests) - 1 else 0, 0, s])
    if len(layout.img_key):
        if seg_of_img is not None and len(seg_of_img) == len(layout.img_key):
            first = [int(x) for x in seg_of_img]
        else:
            starts: dict[tuple[int, int], int] = {}
            for s in range(n):
                if layout.seg_start[s] == 0:
                    starts.setdefault((int(layout.seg_source[s]), int(layout.seg_key[s])), s)
            try:
                first = [starts[(int(src), int(key))] for src, key in zip(layout.img_source, layout.img_key)]
            except KeyError:
                raise ValueError(f"step {layout.step}: an image has no first span in the layout") from None
        extra = []
        for i, s in enumerate(first):
            p = piece[s]
            for d in _targets(rank_fanout, int(layout.img_rank[i])):
                carrying = [ins for ins in out if ins[8] == s and ins[5] == d]
                for ins in carrying:
                    ins[7] = 1
                if not carrying:
                    extra.append([int(layout.seg_source[s]), int(piece_replica[p]), int(piece_pos[p]), 0, 0, d, 0, 1, s])
        out += extra
    groups: dict[tuple[int, int], list[list[int]]] = {}
    for ins in out:
        groups.setdefault((ins[0], ins[1]), []).append(ins)
    return {key: Instructions(np.array([g[2] for g in groups[key]], np.int64), np.array([g[3] for g in groups[key]], np.int64),
                              np.array([g[4] for g in groups[key]], np.int64), np.array([g[5] for g in groups[key]], np.int32),
                              np.array([g[6] for g in groups[key]], np.uint8), np.array([g[7] for g in groups[key]], np.uint8))
            for key in sorted(groups)}


def constructor_images(layout: StepLayout, seg_of_img: np.ndarray, dp_fanout: Fanout, leader_fanout: Fanout,
                       n_constructors: int) -> list[np.ndarray]:
    """routing.constructor_images: per constructor, the images (ascending) whose first span lies in the rows of a DP
    rank it serves or whose encoder leader rank it serves."""
    mine: list[set[int]] = [set() for _ in range(n_constructors)]
    for i in range(len(layout.img_key)):
        for c in _targets(dp_fanout, int(layout.seg_row[int(seg_of_img[i])]) // layout.rows_per_rank):
            mine[c].add(i)
        for c in _targets(leader_fanout, int(layout.img_rank[i])):
            mine[c].add(i)
    return [np.array(sorted(m), np.int64) for m in mine]


def constructor_layout(layout: StepLayout, dp_ranks: list[int], image_idx: np.ndarray | None = None) -> StepLayout:
    """One constructor's part of the layout: its DP ranks' rows (StepLayout.select_ranks), and of the images the
    ones given (default: every image of the step)."""
    sub = layout.select_ranks(dp_ranks)
    if image_idx is not None:
        for name in ("img_source", "img_key", "img_rank", "img_patches"):
            setattr(sub, name, getattr(layout, name)[image_idx])
    return sub
