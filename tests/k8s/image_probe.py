"""Run inside a pod of the project's image (tests/k8s/test_node_image.py): what every component needs from the
image works as uid 10001 under a read-only root filesystem with /tmp an emptyDir. Prints one JSON line.

- every entrypoint starts (`mixplane planner|loader|constructor|operator|profile --help`)
- numba: the planner's loops compile, their cache lands in a writable directory, a second process loads them
- tokenizers: a BPE tokenizer trained, saved, loaded back, encoding
- pyarrow: Parquet with a page index written and read
- `mixplane profile` of a text source (the loader's own stream: page index, page reader, tokenizer)
- the loader's page-index cache (MIXPLANE_INDEX_CACHE): a source's index built, kept there, loaded back
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

out: dict = {"uid": os.getuid(), "gid": os.getgid()}
for c in ("planner", "loader", "constructor", "operator", "profile"):
    r = subprocess.run(["mixplane", c, "--help"], capture_output=True, text=True)
    out[f"entry_{c}"] = r.returncode
try:
    open("/opt/mixplane/probe", "w").close()
    out["rootfs"] = "writable"
except OSError as e:
    out["rootfs"] = type(e).__name__

NUMBA = ("import os, time; t = time.perf_counter(); from mixplane.planner import selectloop, layoutloop, routeloop; "
         "selectloop.warm(); layoutloop.warm(); routeloop.warm(); print(time.perf_counter() - t, os.environ.get('NUMBA_CACHE_DIR'))")
cold = subprocess.run([sys.executable, "-c", NUMBA], capture_output=True, text=True)
warm = subprocess.run([sys.executable, "-c", NUMBA], capture_output=True, text=True)
out["numba_errors"] = (cold.stderr + warm.stderr)[-2000:] if cold.returncode or warm.returncode else ""
if not cold.returncode and not warm.returncode:
    out["numba_cold_s"], out["numba_cache_dir"] = float(cold.stdout.split()[0]), cold.stdout.split()[1]
    out["numba_warm_s"] = float(warm.stdout.split()[0])
    out["numba_cache_files"] = sum(len(f) for _, _, f in os.walk(out["numba_cache_dir"]))

from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

words = "the quick brown fox jumps over the lazy dog while mixplane feeds the trainer".split()
texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(40)) for i in range(400)]
tok = Tokenizer(models.BPE(unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"]))
os.makedirs("/tmp/data/docs", exist_ok=True)
tok.save("/tmp/data/tokenizer.json")
out["tokens"] = len(Tokenizer.from_file("/tmp/data/tokenizer.json").encode(texts[0]).ids)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

for i in range(2):
    pq.write_table(pa.table({"text": texts[i::2]}), f"/tmp/data/docs/part-{i}.parquet", row_group_size=50,
                   data_page_size=2048, write_page_index=True)
out["parquet_rows"] = pq.read_table("/tmp/data/docs").num_rows

spec = {"name": "probe", "sources": [{"name": "docs", "uri": "/tmp/data/docs", "tokenizer": "/tmp/data/tokenizer.json"}],
        "batch": {"sequences": 4, "seq_len": 64}, "topology": {"modules": {"backbone": {"dp": 1}}}}
with open("/tmp/data/spec.json", "w") as f:
    json.dump(spec, f)
cache = os.environ["MIXPLANE_INDEX_CACHE"]
for run in ("profile_cold", "profile_warm"):
    t = time.perf_counter()
    r = subprocess.run(["mixplane", "profile", "/tmp/data/spec.json", "--max-rows", "200"], capture_output=True, text=True)
    out[run] = {"rc": r.returncode, "s": round(time.perf_counter() - t, 2),
                "index_files": sum(len(f) for _, _, f in os.walk(cache)) if os.path.isdir(cache) else 0}
    if r.returncode:
        out[run]["stderr"] = r.stderr[-2000:]
    else:
        out[run]["result"] = json.loads(r.stdout)
from mixplane.loader.indexscan import build_source_index  # noqa: E402

files = [f"/tmp/data/docs/part-{i}.parquet" for i in range(2)]
first = build_source_index(files, ["text"])
out["index_cache_files"] = sorted(os.listdir(cache)) if os.path.isdir(cache) else []
again = build_source_index(files, ["text"])
out["index_rows"] = [sum(f.num_rows for f in ix.files) for ix in (first, again)]
print(json.dumps(out))
