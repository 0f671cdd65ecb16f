"""Weighted MinHash (Ioffe, 2010, "Improved Consistent Sampling, Weighted Minhash and L1 Sketching") and LSH
banding: pure, numpy.

A document is a weighted bag of tokens (token id -> weight > 0; poolside's pipeline weighs a token by its frequency in the
document and its rarity in the corpus). For hash i and token k, Ioffe's consistent weighted sampling draws
r, c ~ Gamma(2, 1) and beta ~ U(0, 1) -- here from a counter-based generator keyed by (seed, i, k), so every
process, executor and run draws the same numbers without sharing state -- and takes

    t_k = floor(ln S_k / r + beta),  y_k = exp(r (t_k - beta)),  a_k = c / (y_k exp(r))

The sample of hash i is (k*, t_k*) with k* = argmin_k a_k; two bags agree on it with probability equal to their
weighted Jaccard similarity sum_k min(S, T) / sum_k max(S, T). A signature is the 64-bit hash of each sample.

LSH: a signature of b x r hashes is cut into b bands of r; two documents share a band's bucket with probability
1 - (1 - J^r)^b. :func:`lsh_params` picks (b, r) for a threshold by the integrated false positive and false
negative rates (the standard construction).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np

_M = np.uint64(0xFFFFFFFFFFFFFFFF)
_C1, _C2, _C3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+|[^\sA-Za-z0-9_]")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64 arrays (wrapping arithmetic): a counter-based generator."""
    with np.errstate(over="ignore"):
        z = (x + _C1) & _M
        z = ((z ^ (z >> np.uint64(30))) * _C2) & _M
        z = ((z ^ (z >> np.uint64(27))) * _C3) & _M
        return z ^ (z >> np.uint64(31))


def _uniform(seed: int, stream: int, i: np.ndarray, k: np.ndarray) -> np.ndarray:
    """U(0, 1) (never 0) for every (hash i, token k) pair, the same in every process."""
    with np.errstate(over="ignore"):
        key = (np.uint64(seed) * _C3 + np.uint64(stream) * _C2) & _M
        x = splitmix64((key ^ (i.astype(np.uint64) * _C1) ^ splitmix64(k.astype(np.uint64))) & _M)
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def token_id(token: str) -> int:
    """A stable 63-bit id of a token (the same in every process: not Python's salted hash)."""
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little") >> 1


def tokens(text: str, code: bool = False) -> list[str]:
    """Words (natural language: lower-cased word characters) or code tokens (identifiers, numbers, and each
    punctuation mark -- poolside's language-specific tokenisers keep `;` and `{` from dominating through the
    weights, not by dropping them)."""
    if code:
        return WORD.findall(text)
    return re.findall(r"\w+", text.lower())


def weighted_bag(toks: Iterable[str], df: Mapping[int, int] | None = None, n_docs: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, weights): term frequency x inverse document frequency ln(1 + N / df) (df: documents per token
    id; None: term frequency alone)."""
    tf = Counter(token_id(t) for t in toks)
    ids = np.fromiter(tf.keys(), np.int64, len(tf))
    w = np.fromiter(tf.values(), np.float64, len(tf))
    if df is not None and len(ids):
        w = w * np.log1p(n_docs / np.array([max(1, df.get(int(k), 1)) for k in ids], np.float64))
    return ids, w


def signature(ids: np.ndarray, weights: np.ndarray, num_hashes: int, seed: int = 1) -> np.ndarray:
    """The weighted MinHash signature (uint64[num_hashes]) of a bag; an empty bag gets all zeros."""
    keep = np.asarray(weights, np.float64) > 0
    ids = np.asarray(ids, np.int64)[keep]
    S = np.asarray(weights, np.float64)[keep]
    if not len(ids):
        return np.zeros(num_hashes, np.uint64)
    i = np.repeat(np.arange(num_hashes, dtype=np.int64), len(ids))
    k = np.tile(ids, num_hashes)
    r = -np.log(_uniform(seed, 0, i, k) * _uniform(seed, 1, i, k))  # Gamma(2, 1)
    c = -np.log(_uniform(seed, 2, i, k) * _uniform(seed, 3, i, k))
    beta = _uniform(seed, 4, i, k)
    lnS = np.tile(np.log(S), num_hashes)
    t = np.floor(lnS / r + beta)
    ln_a = np.log(c) - r * (t - beta) - r  # ln(c / (y e^r)): compared in logs, no overflow
    ln_a = ln_a.reshape(num_hashes, len(ids))
    j = np.argmin(ln_a, axis=1)
    kstar = ids[j].astype(np.uint64)
    tstar = t.reshape(num_hashes, len(ids))[np.arange(num_hashes), j].astype(np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        return splitmix64((kstar * _C1) ^ splitmix64(tstar))


def weighted_jaccard(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """The exact weighted Jaccard similarity of two bags (ids, weights)."""
    da = dict(zip(a[0].tolist(), a[1].tolist()))
    db = dict(zip(b[0].tolist(), b[1].tolist()))
    keys = set(da) | set(db)
    num = sum(min(da.get(k, 0.0), db.get(k, 0.0)) for k in keys)
    den = sum(max(da.get(k, 0.0), db.get(k, 0.0)) for k in keys)
    return num / den if den else 0.0


def estimate(sa: np.ndarray, sb: np.ndarray) -> float:
    """The similarity two signatures estimate: the fraction of equal hashes."""
    return float(np.mean(np.asarray(sa) == np.asarray(sb)))


def collision(j: float | np.ndarray, bands: int, rows: int) -> float | np.ndarray:
    """Probability that documents of similarity j share at least one of `bands` buckets of `rows` hashes."""
    return 1.0 - (1.0 - np.power(j, rows)) ** bands


def lsh_params(threshold: float, num_hashes: int, fp_weight: float = 0.5) -> tuple[int, int]:
    """(bands, rows), bands x rows <= num_hashes, minimising fp_weight x the false-positive area below the threshold
    plus (1 - fp_weight) x the false-negative area above it."""
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")
    xs_lo = np.linspace(0.0, threshold, 201)
    xs_hi = np.linspace(threshold, 1.0, 201)
    best: tuple[float, int, int] | None = None
    for b in range(1, num_hashes + 1):
        for r in range(1, num_hashes // b + 1):
            fp = np.trapezoid(collision(xs_lo, b, r), xs_lo)
            fn = np.trapezoid(1.0 - collision(xs_hi, b, r), xs_hi)
            err = fp_weight * fp + (1 - fp_weight) * fn
            if best is None or err < best[0] - 1e-12:
                best = (err, b, r)
    assert best is not None
    return best[1], best[2]


def band_keys(sig: np.ndarray, bands: int, rows: int) -> list[int]:
    """The bucket key of each band (63-bit ints: band index mixed in, so bands never share a bucket)."""
    s = np.asarray(sig, np.uint64)[: bands * rows].reshape(bands, rows)
    out = []
    with np.errstate(over="ignore"):
        for bi in range(bands):
            h = np.uint64(bi + 1) * _C2
            for v in s[bi]:
                h = splitmix64(np.array([(h ^ v) & _M], np.uint64))[0]
            out.append(int(h >> np.uint64(1)))
    return out

