"""Bad files among 100,000: a source of bench/startup.py's corpus (every file of it, one source) with four bad files,
read cold through one whole epoch by the loader's stream at its defaults (read block by block, docs/loader.md).

The files are hard links into a scratch directory (the cached corpus is never written); a bad file is unlinked and
written anew there. Which files: members of the first blocks of epoch 0's read order (so the stream meets them
early), one per kind:
* ``corrupt``: its footer's length damaged before the listing;
* ``missing``: removed after the listing;
* ``truncated``: cut to half its size after the listing, before its block is indexed;
* ``changed``: rewritten with other content after its block was indexed (the stream has read at most a first
  shuffle buffer by then).
Asserted (the run exits 1 otherwise): each is quarantined with its name; every row of the other 99,996 files is
delivered exactly once in epoch 0 (keys unique, counted per file through the stream's where_key on a sample), the
changed file's rows at most once; and the stream goes on into epoch 1.

    python bench/bad_files_scale.py [--files 100000] [--lazy-index-files N]
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

from startup import ROWS_PER_GROUP, ROW_GROUPS, ensure_corpus  # noqa: E402 - the corpus of bench/startup.py


def _rewrite(path: str, data: bytes) -> None:
    """Replace a hard link by a file of its own (the cached corpus keeps its bytes)."""
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(data)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100000)
    ap.add_argument("--lazy-index-files", type=int, default=None,
                    help="sources[].lazy_index_files (default: the spec's; a smaller corpus needs a smaller one to be read by block)")
    args = ap.parse_args()
    os.environ["MIXPLANE_INDEX_CACHE"] = ""  # cold: no page-index cache
    import numpy as np

    from mixplane.loader.blocks import BlockLayout
    from mixplane.loader.blockstream import BlockStream
    from mixplane.loader.files import list_source_files
    from mixplane.loader.stream import open_stream
    from mixplane.samples import key_epoch
    from mixplane.spec import SourceSpec

    corpus = ensure_corpus(args.files)
    rows_per_file = ROW_GROUPS * ROWS_PER_GROUP
    with tempfile.TemporaryDirectory(prefix="mixplane-badfiles-") as tmp:
        root = Path(tmp) / "src"
        t0 = time.perf_counter()
        for dirpath, _dirs, names in os.walk(corpus):
            rel = Path(dirpath).relative_to(corpus)
            (root / rel).mkdir(parents=True, exist_ok=True)
            for n in names:
                if n.endswith(".parquet"):
                    os.link(Path(dirpath) / n, root / rel / n)
        link_s = time.perf_counter() - t0
        src = SourceSpec(name="corpus", uri=str(root), kind="tokens", columns=["ids"],
                         **({"lazy_index_files": args.lazy_index_files} if args.lazy_index_files is not None else {}))
        before = list_source_files(str(root))
        n = len(before.paths)
        layout = BlockLayout(n, src.block_files, 0, src.name)
        first = layout.order(0, 0, 1)[:3]
        pick = [before.paths[int(layout.members(int(b))[7])] for b in first] + \
               [before.paths[int(layout.members(int(first[0]))[11])]]
        corrupt, missing, truncated, changed = pick
        data = Path(corrupt).read_bytes()
        _rewrite(corrupt, data[:-8] + b"\xff\xff\xff\x7fPAR1")
        listing = list_source_files(str(root))
        os.remove(missing)
        _rewrite(truncated, Path(truncated).read_bytes()[: os.path.getsize(truncated) // 2])
        t1 = time.perf_counter()
        s = open_stream(src, seed=0, cache_dir=None, files=listing)
        problems: list[str] = []
        try:
            if not isinstance(s, BlockStream):
                raise SystemExit(f"the source of {n} files is not read block by block: {type(s).__name__}")
            r = s.take(1)
            first_row_s = time.perf_counter() - t1
            # the first block is indexed now: rewrite one of its files (another template's bytes, a new mtime)
            other = next(p for p in listing.paths if Path(p).read_bytes() != Path(changed).read_bytes())
            time.sleep(0.01)
            _rewrite(changed, Path(other).read_bytes())
            keys = [r.keys]
            rows_changed = 0
            sample_where: dict[str, int] = {}
            while True:
                r = s.take(65536)
                ep = np.asarray(key_epoch(r.keys))
                keys.append(r.keys[ep == 0])
                for k in r.keys[ep == 0][:: 997]:  # a sample of rows: the files they come from
                    w = s.where_key(int(k))
                    if w is not None:
                        sample_where[w[0]] = sample_where.get(w[0], 0) + 1
                if (ep > 0).any():
                    break
            epoch_s = time.perf_counter() - t1
            went_on = len(s.take(1000)) == 1000 and s.epoch >= 1
            allk = np.concatenate(keys)
            uniq = len(np.unique(allk))
            quarantined = sorted({e.file for e in s.quarantine.entries if e.file})
        finally:
            s.close()
        good_rows = (n - 4) * rows_per_file
        rows_changed = len(allk) - good_rows
        if uniq != len(allk):
            problems.append(f"{len(allk) - uniq} rows delivered twice")
        if not 0 <= rows_changed <= rows_per_file:
            problems.append(f"{len(allk)} rows in epoch 0, expected {good_rows} plus at most {rows_per_file} of the changed file")
        for name, p in (("corrupt", corrupt), ("missing", missing), ("truncated", truncated), ("changed", changed)):
            if p not in quarantined:
                problems.append(f"{name} file {p} not quarantined by name")
            if p in sample_where and name != "changed":
                problems.append(f"{name} file {p} delivered rows")
        if not went_on:
            problems.append("the stream did not go on into epoch 1")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    out = {"files": n, "rows_per_file": rows_per_file, "link_s": round(link_s, 2), "first_row_s": round(first_row_s, 2),
           "epoch_s": round(epoch_s, 2), "rows_epoch0": int(len(allk)), "rows_expected_good": good_rows,
           "rows_of_changed_file": int(rows_changed), "duplicates": int(len(allk) - uniq),
           "quarantined": [os.path.relpath(p, root) for p in quarantined],
           "bad": {k: os.path.relpath(v, root) for k, v in zip(("corrupt", "missing", "truncated", "changed"), pick)},
           "went_on_into_epoch_1": went_on, "problems": problems, "load": load}
    print(json.dumps(out))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
