"""`mixplane demo-data DIR`: real demo sources from text every machine of this kind has.

Three sources, each a few Parquet files with realistic row groups and ~1 MB pages (offset
index written), one document per row:

* code  — the Python standard library's source (heavy-tailed lengths),
* man   — Debian man pages, roff markup stripped to prose,
* docs  — Debian package documentation (/usr/share/doc: READMEs, changelogs, copyright files),

plus a byte-level BPE tokenizer trained on them with Hugging Face `tokenizers`. Nothing is
downloaded; the same inputs give byte-identical outputs.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|image|>"]
MAX_DOC_BYTES = 512 << 10
FILES_PER_SOURCE = 4
ROW_GROUP_BYTES = 2 << 20


@dataclass(frozen=True)
class DemoSource:
    name: str
    roots: tuple[str, ...]
    accept: Callable[[str], bool]
    read: Callable[[str], str | None]


def _read_text(path: str) -> str | None:
    try:
        raw = gzip.open(path).read(MAX_DOC_BYTES * 4) if path.endswith(".gz") else open(path, "rb").read(MAX_DOC_BYTES * 4)
    except (OSError, EOFError, zlib.error):
        return None
    if b"\x00" in raw[:8192]:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text[:MAX_DOC_BYTES].strip()
    return text or None


_ROFF_ESC = re.compile(r"\\f[BIRPC0-9]|\\f\(..|\\f\[[^\]]*\]|\\s[+-]?\d+|\\\(..|\\\[[^\]]*\]|\\[&|^~0:%c]")


def _man_to_text(path: str) -> str | None:
    src = _read_text(path)
    if src is None or src.startswith(".so "):
        return None
    out = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\}', ".de", ".ig")):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].split(None, 1)
            if not parts:
                continue
            macro, rest = parts[0], (parts[1] if len(parts) > 1 else "")
            if macro in ("SH", "SS"):
                out.append("\n" + rest.strip('"').upper() if macro == "SH" else "\n" + rest.strip('"'))
            elif macro in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SM", "SB", "TP", "IP", "TH", "Nm", "Nd", "Ar", "Fl"):
                out.append(rest.replace('"', ""))
            elif macro in ("PP", "LP", "P", "br", "sp", "Pp"):
                out.append("")
            continue
        out.append(line)
    text = _ROFF_ESC.sub("", "\n".join(out)).replace("\\-", "-").replace("\\e", "\\")
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text or None


def _stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def demo_sources() -> list[DemoSource]:
    stdlib = _stdlib_root()
    return [
        DemoSource("code", (stdlib,), lambda p: p.endswith(".py") and "site-packages" not in p and "dist-packages" not in p, _read_text),
        DemoSource("man", ("/usr/share/man",), lambda p: p.endswith(".gz") and re.search(r"/man/man[1-9n][^/]*/", p) is not None, _man_to_text),
        DemoSource("docs", ("/usr/share/doc",), lambda p: not p.endswith((".png", ".jpg", ".gif", ".svg", ".pdf", ".ico", ".woff", ".ttf", ".js", ".css")), _read_text),
    ]


def _walk(roots: tuple[str, ...], accept: Callable[[str], bool]) -> list[str]:
    found = []
    for root in roots:
        for d, dirs, files in os.walk(root, followlinks=False):
            dirs.sort()
            for f in sorted(files):
                p = os.path.join(d, f)
                if os.path.isfile(p) and not os.path.islink(p) and accept(p):
                    found.append(p)
    # a fixed pseudo-random order (by path hash) gives every budget a varied sample
    return sorted(found, key=lambda p: (hashlib.sha1(p.encode()).hexdigest(), p))


def collect_documents(src: DemoSource, max_bytes: int) -> Iterator[tuple[str, str]]:
    total = 0
    seen: set[str] = set()
    for p in _walk(src.roots, src.accept):
        text = src.read(p)
        if text is None:
            continue
        h = hashlib.sha1(text.encode()).hexdigest()
        if h in seen:  # identical files (e.g. shared licence texts) once only
            continue
        seen.add(h)
        yield p, text
        total += len(text.encode())
        if total >= max_bytes:
            return


def write_source(out_dir: Path, name: str, docs: list[tuple[str, str]]) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.parquet"):
        old.unlink()
    n = len(docs)
    per_file = -(-n // FILES_PER_SOURCE)
    files = []
    for fi in range(FILES_PER_SOURCE):
        part = docs[fi * per_file : (fi + 1) * per_file]
        if not part:
            continue
        table = pa.table({
            "id": pa.array(range(fi * per_file, fi * per_file + len(part)), pa.int64()),
            "path": pa.array([p for p, _ in part], pa.string()),
            "text": pa.array([t for _, t in part], pa.large_string()),
        })
        avg = max(1, table.nbytes // max(1, len(part)))
        rows_per_group = max(16, ROW_GROUP_BYTES // avg)
        path = out_dir / f"part-{fi:05d}.parquet"
        pq.write_table(table, path, row_group_size=rows_per_group, compression="zstd", data_page_size=1 << 20,
                       use_dictionary=["path"], write_page_index=True, write_statistics=False)
        files.append(str(path))
    return {"name": name, "documents": n, "files": len(files),
            "bytes": sum(len(t.encode()) for _, t in docs), "dir": str(out_dir)}


def train_tokenizer(texts: Iterator[str], vocab_size: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))


def build_params(*, max_mb: float, vocab_size: int, tokenizer_mb: float) -> dict[str, float | int]:
    """What decides the demo data's content; recorded in SUMMARY.json so a different build is noticed."""
    return {"max_mb": float(max_mb), "vocab_size": int(vocab_size), "tokenizer_mb": float(tokenizer_mb)}


def summary_matches(summary_path: Path, params: dict[str, float | int]) -> bool:
    """True when SUMMARY.json exists and was built with exactly these parameters (old summaries lack them)."""
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("params") == params


def ensure_demo_data(out: Path, *, max_mb: float, vocab_size: int = 8192, tokenizer_mb: float = 6.0) -> bool:
    """Build the demo data unless `out` already holds a build with the same parameters; True if it built."""
    if summary_matches(out / "SUMMARY.json", build_params(max_mb=max_mb, vocab_size=vocab_size, tokenizer_mb=tokenizer_mb)):
        return False
    build_demo_data(out, max_mb=max_mb, vocab_size=vocab_size, tokenizer_mb=tokenizer_mb)
    return True


def build_demo_data(out: Path, *, max_mb: float = 24.0, vocab_size: int = 8192, tokenizer_mb: float = 6.0,
                    images: bool = False) -> dict:
    """Build every demo source and the tokenizer under `out` (and image-text pairs if asked); returns a summary."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "SUMMARY.json").unlink(missing_ok=True)  # a half-rebuilt directory must not look complete
    summary: dict = {"dir": str(out.resolve()), "sources": [],
                     "params": build_params(max_mb=max_mb, vocab_size=vocab_size, tokenizer_mb=tokenizer_mb)}
    tok_texts: list[str] = []
    for src in demo_sources():
        docs = list(collect_documents(src, int(max_mb * (1 << 20))))
        if not docs:
            raise RuntimeError(f"demo source {src.name!r}: no readable documents under {', '.join(src.roots)}")
        summary["sources"].append(write_source(out / src.name, src.name, docs))
        budget = int(tokenizer_mb * (1 << 20))
        for _, t in docs:
            if budget <= 0:
                break
            tok_texts.append(t[:16384])
            budget -= len(tok_texts[-1])
    tok_path = out / "tokenizer.json"
    train_tokenizer(iter(tok_texts), vocab_size, tok_path)
    if images:
        summary["sources"].append(build_image_pairs(out / "pairs"))
    summary["tokenizer"] = str(tok_path)
    summary["vocab_size"] = vocab_size
    (out / "SUMMARY.json").write_text(json.dumps(summary, indent=1))
    return summary


# ---- image-text pairs (for the VLM example) ----------------------------------------------

IMAGE_ROOTS = ("/usr/share", "/usr/lib/python3", os.path.expanduser("~/.rustup"), sysconfig.get_paths()["stdlib"])
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def _caption(path: str) -> str:
    """A caption from where the image lives: its name and folders, as words."""
    parts = [p for p in Path(path).with_suffix("").parts[-4:] if p not in ("/", "usr", "share", "doc", "html", "images", "img")]
    words = re.sub(r"[-_.]+", " ", " ".join(parts))
    words = re.sub(r"([a-z])([A-Z])", r"\1 \2", words)
    return f"an image named {words.strip().lower()}"


def build_image_pairs(out: Path, *, max_images: int = 2000, min_bytes: int = 2048, max_bytes: int = 2 << 20) -> dict:
    """`pairs`: real images found on this machine (documentation figures, icons) with captions made
    from their paths, as an image_text source (columns image, caption)."""
    from PIL import Image

    found = []
    for root in IMAGE_ROOTS:
        if os.path.isdir(root):
            found.extend(_walk((root,), lambda p: p.lower().endswith(IMAGE_SUFFIXES)))
    found = sorted(set(found), key=lambda p: (hashlib.sha1(p.encode()).hexdigest(), p))
    images: list[bytes] = []
    captions: list[str] = []
    seen: set[str] = set()
    for p in found:
        if len(images) >= max_images:
            break
        try:
            size = os.path.getsize(p)
            if not min_bytes <= size <= max_bytes:
                continue
            raw = open(p, "rb").read()
            h = hashlib.sha1(raw).hexdigest()
            if h in seen:
                continue
            with Image.open(p) as im:
                im.verify()
        except Exception:  # unreadable or not really an image: skip it
            continue
        seen.add(h)
        images.append(raw)
        captions.append(_caption(p))
    if not images:
        raise RuntimeError("no readable images found on this machine")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.parquet"):
        old.unlink()
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "caption": pa.array(captions, pa.string())}),
                   out / "part-00000.parquet", row_group_size=128, compression="zstd", use_dictionary=False,
                   write_page_index=True, write_statistics=False)
    return {"name": "pairs", "images": len(images), "bytes": sum(map(len, images)), "dir": str(out)}
