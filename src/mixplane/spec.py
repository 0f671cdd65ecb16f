"""The DataMixture: one declarative description of sources, mixing, batch, parallelism and runtime.

This model is the single source of truth: the YAML a user writes locally, the `spec` of the
DataMixture custom resource, and the CRD schema (generated from it) all come from here.
Every default lives in a `Field(default=..., description=...)` below; `docs/spec-reference.md`
is generated from this file (`python -m mixplane.spec --markdown`).

Validation has two stages. Pydantic checks shapes and types; :func:`semantic_problems` checks
the rules that span fields (mixture rules of KempnerForge plus the ones users get wrong) and
returns every problem with its field path, so `mixplane validate` can list them all at once.
"""

from __future__ import annotations

import copy
import math
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mixplane.errors import MixplaneError

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
AXES = ("tp", "cp", "dp", "pp")
Axis = Literal["tp", "cp", "dp", "pp"]
# keys of the ClientPlaceTree override `strategy.options.place_tree` (see ClientPlaceTree.from_spec)
PLACE_TREE_KEYS = ("order", "modules", "rank_map", "constructors", "broadcast", "ranks_per_node", "function")
PLACE_TREE_MODULE_KEYS = ("order", "rank_map")
# the one list of each: the planner's strategy table and packer take their names from here
BUILTIN_STRATEGIES = ("vanilla", "llm_balance", "vlm_balance")
PackingPolicy = Literal["best_fit", "next_fit", "none"]
OverlongPolicy = Literal["split", "truncate", "drop"]
PACKING_POLICIES: tuple[str, ...] = typing.get_args(PackingPolicy)
OVERLONG_POLICIES: tuple[str, ...] = typing.get_args(OverlongPolicy)

# Bounds on what would exhaust a machine (processes, memory, CPU) long before it could run: a spec past one is
# refused with the bound in the message. Generous against the largest runs measured (bench/plan_scale.py).
MAX_SOURCES = 4096
MAX_REPLICAS = 1024  # Source Loader replicas of one source
MAX_LOADER_WORKERS = 64  # worker threads of one partition (sources[].workers)
MAX_COMPONENT_PROCESSES = 8192  # loader processes + Data Constructors of one mixture
MAX_WORLD = 1 << 20  # GPU ranks
MAX_STEP_SEQUENCES = 1 << 24
MAX_SEQ_LEN = 1 << 24
MAX_STEP_TOKENS = 1 << 40
MAX_WINDOW = 1 << 22  # samples in one loader replica's window
MAX_SHUFFLE_BUFFER = 10_000_000  # rows
MAX_SHUFFLE_BUFFER_MB = 65536.0
MAX_IMAGE_SIDE = 16384
MAX_AHEAD_STEPS = 1 << 16
MAX_PHASES = 10_000
MAX_DOC_BYTES = 64 << 20  # one document a loader tokenizes (64 MiB took ~55-100 s and 6-7 GB unbounded)
MAX_DOC_TOKENS = 1 << 26
# the spec file itself: size, YAML nesting and YAML values after aliases are expanded
MAX_SPEC_BYTES = 4 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_VALUES = 250_000
_BOUNDED = {  # what each bound applies to (docs/spec-reference.md)
    "MAX_SOURCES": "`sources` (count), `runtime.sources_per_loader`",
    "MAX_REPLICAS": "`sources[].replicas`",
    "MAX_LOADER_WORKERS": "`sources[].workers` (threads of one partition)",
    "MAX_COMPONENT_PROCESSES": "loader processes + Data Constructors of the mixture",
    "MAX_WORLD": "`topology.modules.*` dp, pp, cp, tp, and their product",
    "MAX_STEP_SEQUENCES": "`batch.sequences`, `batch.microbatches`",
    "MAX_SEQ_LEN": "`batch.seq_len`",
    "MAX_STEP_TOKENS": "`batch.tokens`, `runtime.window_tokens`",
    "MAX_WINDOW": "`runtime.window`, `runtime.window_max` (samples)",
    "MAX_SHUFFLE_BUFFER": "`sources[].shuffle_buffer` (rows)",
    "MAX_SHUFFLE_BUFFER_MB": "`sources[].shuffle_buffer_mb`",
    "MAX_IMAGE_SIDE": "`sources[].image.max_side`, `sources[].image.patch_size` (pixels)",
    "MAX_AHEAD_STEPS": "`runtime.prefetch_steps`, `runtime.max_lead_steps`",
    "MAX_PHASES": "`mixture.phases` (count)",
    "MAX_DOC_BYTES": "`sources[].max_doc_bytes`",
    "MAX_DOC_TOKENS": "`sources[].max_doc_tokens`",
    "MAX_SPEC_BYTES": "the spec file (bytes)",
    "MAX_YAML_DEPTH": "YAML nesting (levels)",
    "MAX_YAML_VALUES": "YAML values once aliases are expanded",
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ImageSpec(_Model):
    patch_size: int = Field(14, ge=1, le=MAX_IMAGE_SIDE, description="Side of one square image patch in pixels.")
    max_side: int = Field(896, ge=1, le=MAX_IMAGE_SIDE, description="Longer image side is resized down to at most this many pixels.")
    merge: int = Field(1, ge=1, le=1024, description="Patches merged into one backbone token (e.g. 4 for 2x2 merging).")
    image_token_id: int | None = Field(None, description="Placeholder token id for image positions; default: the tokenizer's `<|image|>` token, else vocab size - 1.")
    decode_at: Literal["auto", "loader", "constructor", "client"] = Field("auto", description="Where images are decoded, resized and cut into patches: `loader` (decoded pixels travel), `constructor` or `client` (the loader reads only the header for the patch grid and ships the raw encoded bytes; batches are bit-identical wherever it runs); `auto`: chosen per source when the run starts (an operator-managed mixture: from its profile) from measured decode CPU and raw vs decoded bytes (mixplane.imagedecode.choose_decode_place), the loader unless another place is cheaper; the choice is written into the run's spec and the planner's journal. An image whose header reads but whose pixels do not is delivered as zeros of its grid, flagged `image_quarantined`, wherever it is decoded. docs/constructor.md, Where images are decoded.")


class SourceSpec(_Model):
    name: str = Field(..., pattern=NAME_PATTERN, max_length=40, description="Unique source name (used in metrics, pods and mixture weights).")
    uri: str = Field(..., min_length=1, description="A Parquet file, directory, or glob; local or a pyarrow.fs URI (s3://, gs://, hdfs://); or an Iceberg table `iceberg://<catalog>/<namespace>.<table>[@<snapshot-id>]` (pyiceberg catalogs; `mixplane run` pins the current snapshot unless the source is live).")
    columns: list[str] = Field(default_factory=lambda: ["text"], min_length=1, description="Columns to read. text: [text]; tokens: [token ids]; image_text: [image bytes, caption].")
    kind: Literal["text", "tokens", "image_text"] = Field("text", description="How samples are turned into tokens.")
    tokenizer: str | None = Field(None, description="Path of a Hugging Face `tokenizers` JSON file (required for text and image_text).")
    append_eos: bool = Field(True, description="Append the tokenizer's end-of-text token to every document.")
    live: bool = Field(False, description="New files matching `uri` join while running; a dry source blocks instead of failing.")
    shuffle: Literal["page", "row", "rowgroup", "sequential"] = Field("page", description="Read order: page-level shuffle (default), full row shuffle, or baselines.")
    replicas: int = Field(1, ge=1, le=MAX_REPLICAS, description="Source Loader replicas that partition this source disjointly.")
    workers: int | Literal["auto"] = Field(1, description="Worker threads of each partition (Source Loader) of this source for transforming its rows (tokenizing, image decoding: HF tokenizers and Pillow release the GIL) and decoding its pages (local files): 1 (default) reads and transforms on the loader's own thread; N > 1 overlaps the stream's reads with up to N transforms of later chunks and decodes a read's new pages on N threads, delivered in stream order, so batches, cursors and replays are identical whatever N; `auto`: the cores the process may use, at most 4. Measured: docs/loader.md, Workers.")
    shuffle_buffer: int = Field(10000, ge=1, le=MAX_SHUFFLE_BUFFER, description="Rows in the loader's shuffle buffer (YOUMU's aggressive buffer shuffle in page mode).")
    shuffle_buffer_mb: float | None = Field(32.0, gt=0, le=MAX_SHUFFLE_BUFFER_MB, description="Memory cap of the shuffle buffer (decoded bytes, from the footers); fewer rows when documents are long. null: rows only.")
    image: ImageSpec = Field(default_factory=ImageSpec, description="Image handling for kind image_text.")
    max_doc_bytes: int = Field(1 << 20, ge=1, le=MAX_DOC_BYTES, description="Longest document (UTF-8 bytes of a text or caption) a loader tokenizes; checked before tokenizing, so one giant row cannot exhaust the loader's memory or stall delivery.")
    max_doc_tokens: int = Field(1 << 20, ge=1, le=MAX_DOC_TOKENS, description="Most tokens one document may carry (after tokenizing, EOS included); a multiple of seq_len keeps the planner's chunks of a cut document whole.")
    overlong_doc: Literal["truncate", "drop", "split"] = Field("truncate", description="A document over max_doc_bytes / max_doc_tokens keeps its first bounded piece (cut at a space), is dropped, or (split; kinds text and tokens) is delivered whole as consecutive bounded pieces, each tokenized only when the loader needs it (at most 4096 pieces per document); all counted (`mixplane_loader_overlong_docs_total{action}`).")
    endpoint: str | None = Field(None, description="S3-compatible endpoint override for an s3:// uri (e.g. http://minio:9000). Credentials never go in the spec: they come from the environment, an AWS profile or a mounted credentials file (AWS_SHARED_CREDENTIALS_FILE).")
    region: str | None = Field(None, description="Object-storage region for an s3:// uri (default: the environment's / profile's).")
    read_cache_dir: str | None = Field(None, description="Remote uris: a local directory for a disk cache of the byte ranges read (pages, dictionaries), shared by the loaders of a node and kept across restarts; null: memory only.")
    read_cache_gb: float = Field(10.0, gt=0, description="Size bound of `read_cache_dir` (least recently used ranges evicted beyond it).")
    oversample: bool | None = Field(None, description="Read past the source's end, wrapping: each pass (epoch) a new shuffle of the whole source. null: true for a static source (mixplane's behaviour so far), false for a live one (each file is read once; a dry live source waits). false on a static source: one pass, as `max_epochs: 1`. What happens at a source's end: docs/mixtures.md.")
    max_epochs: int | None = Field(None, ge=1, le=1_000_000, description="Most passes over a static source within the run (OLMo-core's repetition limit, in whole epochs); null: no limit while `oversample`, 1 otherwise. When a source has delivered its last row of its last pass it ends at that piece, exactly: the rest of the step and every later step are mixed over the sources left (weights renormalised), the step is journaled (`ended`) and resume / replay end it at the same piece; when no share-weighted source is left the run's data is exhausted (the planner stops planning and says so). docs/mixtures.md.")
    pack_by: str | None = Field(None, min_length=1, description="A column of `columns` to pack within (e.g. `repo`, as `mixplane prep depsort` orders files): adjacent rows of the stream with the same value are concatenated, in order, into one document (each keeps its EOS; at most max_doc_tokens, then the next row begins another), which the planner packs like any document -- a repository's files stay together and in dependency order inside the rows, within the mixture's per-step guarantee. Needs `shuffle: sequential` (file order), batch.overlong split, kind text or tokens, a static source, overlong_doc truncate or drop. docs/mixtures.md.")
    lazy_index_files: int = Field(4096, ge=0, description="A static page-mode source whose listing has at least this many files is indexed block by block in read order instead of whole before it serves: its files are cut into blocks of `block_files` (drawn once by the seed from the listing alone), each epoch reads the blocks in a new order, pages shuffled within a block, and a block's footers are read only when the read order reaches it (the next block in the background). Its first batch waits for one block, not every file. 0: never (the whole source's page order, as for smaller listings). docs/loader.md, Start-up on many files.")
    block_files: int = Field(256, ge=1, le=1 << 16, description="Files per block of a source indexed block by block (`lazy_index_files`): the shuffle buffer draws from the pages of this many files at a time; a block is indexed (and its index packed) as one unit. A partition reads whole blocks: such a source can be split into at most ceil(files / block_files) partitions (`replicas`; `mixplane validate` and `mixplane run` check it against the listing, the operator's profile caps its auto-partitioning there).")
    index_beside_data: bool = Field(False, description="Also keep each file's page index beside it in its store (`<dir>/_mixplane_index/`): a new loader pod, another node or a later run reads one small object per file instead of its footer and OffsetIndexes. Written best effort (read-only credentials only lose the cache); keyed by the file's path, size and mtime like the local cache (MIXPLANE_INDEX_CACHE).")
    listing_max_age_s: float = Field(86400.0, ge=0, description="A remote (`scheme://`) static source's listing is kept (in MIXPLANE_INDEX_CACHE; with `index_beside_data` also beside the data, `<dir>/_mixplane_index/listings/`) and a loader, a check or a profile that starts while the newest kept listing is younger than this many seconds reads the files it names instead of listing the store again (at 10^5 objects that is tens of seconds per loader). A file written under the uri later is read by a run that starts once the kept listing is older than this, or after `mixplane listing SPEC --refresh`; a file of the listing removed or rewritten since is quarantined by name. 0: list at every start. Local sources are listed at every start; live sources always list. docs/loader.md, Start-up on many files.")

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_LOADER_WORKERS:
            raise ValueError(f"workers must be an integer in [1, {MAX_LOADER_WORKERS}] or 'auto', got {v!r}")
        return v

    @property
    def block_read_from(self) -> int | None:
        """The listing size from which this source's loaders read it block by block (`lazy_index_files`; the rule
        is loader.blocks.lazy_indexing), None when they never do: a live source, another shuffle than page, or
        lazy_index_files 0."""
        if self.live or self.shuffle != "page" or not self.lazy_index_files:
            return None
        return int(self.lazy_index_files)


class PhaseSpec(_Model):
    start_step: int = Field(..., ge=0, description="First step of the phase.")
    weights: dict[str, float] = Field(default_factory=dict, description="Weights by source from start_step on; a source not named keeps its base weight (KempnerForge), a source is dropped only by an explicit 0.")
    lr_scale: float = Field(1.0, description="Learning-rate multiplier delivered with every batch of the phase.")


class AnnealSpec(_Model):
    start_step: int = Field(..., ge=0, description="Step where annealing starts.")
    weights: dict[str, float] = Field(..., description="Weights by source from start_step on; a source not named falls back to its base weight (KempnerForge: 'drops to its default'), a source is dropped only by an explicit 0.")
    lr_scale: float = Field(1.0, description="Learning-rate multiplier during annealing.")


class AdaptiveSpec(_Model):
    method: Literal["doremi"] = Field("doremi", description="DoReMi's exponentiated-gradient update on each source's excess loss over `reference_loss` (Xie et al., 2023; where mixplane departs from it: docs/integrations.md).")
    every_steps: int = Field(..., ge=1, le=10**9, description="One update of the weights per this many steps, from the trainers' per-source loss reports (`MixtureLoader.report_loss`).")
    delay_steps: int | None = Field(None, ge=0, le=10**9, description="The k-th update takes effect at step k·every_steps + delay_steps, the same step in every run (it must exceed how far the planner plans ahead: `runtime.max_lead_steps` plus the clients' look-ahead; an update whose step was planned already takes the first step not planned). Unset: the first step not planned when the reports cover the interval.")
    reference_loss: dict[str, float] = Field(default_factory=dict, description="Reference loss per source; a source's excess loss is its interval's mean token loss minus this (sources not named: no excess).")
    step_size: float = Field(1.0, description="η of the exponentiated-gradient step (> 0).")
    smoothing: float = Field(1e-3, description="Mix with the uniform distribution after each step, in [0, 1).")
    min_weight: float = Field(0.0, description="No source's weight goes below this.")
    max_weight: float = Field(1.0, description="No source's weight goes above this.")
    max_change: float = Field(1.0, description="Largest change of any source's weight per update, in (0, 1].")
    min_tokens: int = Field(1, ge=1, description="A source's interval loss counts only over at least this many reported tokens.")
    wait_steps: int | None = Field(None, ge=0, le=10**9, description="An interval's update waits for the reports of every rank that reports, but at most until the fastest rank is this many steps past the interval (a straggler or a rank that stopped reporting cannot hold the mixture longer; planning never waits). Unset: every_steps; 0: the first report past the interval closes it.")


class MixtureSpec(_Model):
    weights: dict[str, float] = Field(default_factory=dict, description="Base weights by source name; empty means equal weights.")
    temperature: float = Field(1.0, description="p_i ∝ w_i^(1/T); T > 1 flattens the mixture (KempnerForge semantics).")
    unit: Literal["tokens", "samples"] = Field("tokens", description="Whether weights are fractions of tokens or of samples.")
    phases: list[PhaseSpec] = Field(default_factory=list, max_length=MAX_PHASES, description="Step-triggered weight changes (curriculum). A live update of the whole mixture section (a `kubectl patch` of spec.mixture, `mixplane update --mixture`) replaces the phases from its effective step on with the new section's; a weights-only update (`mixplane update --weight`) lasts until the next phase (or the anneal), which still starts at its step with its weights as written.")
    anneal: AnnealSpec | None = Field(None, description="Shortcut for one final phase; exclusive with `phases`.")
    adaptive: AdaptiveSpec | None = Field(None, description="Weights that follow the trainers' per-source losses: the planner turns the reported losses into new weights every `every_steps` steps, each update a new generation in the journal (resume, recovery and replay stay exact). Exclusive with `phases` and `anneal`.")
    rows: dict[str, int] = Field(default_factory=dict, description="Sources weighted by rows per step instead of a share (Blender's rows per request): source -> how many of its documents (rows of the source) begin in every step, exactly; a longer document's pieces go with it. They are placed first; share weights (`weights`, phases, anneal) divide the rest of the step among the other sources, so a source named here takes no share weight. Fixed for the run (a live update keeps them). docs/mixtures.md.")
    seed: int = Field(0, description="Seed of every shuffle and tie-break; same seed, same batches.")


class BatchSpec(_Model):
    sequences: int | None = Field(None, ge=1, le=MAX_STEP_SEQUENCES, description="Global batch in sequences (packed rows of seq_len) per step.")
    tokens: int | None = Field(None, ge=1, le=MAX_STEP_TOKENS, description="Global batch in tokens per step (a multiple of seq_len); exclusive with `sequences`.")
    seq_len: int = Field(..., le=MAX_SEQ_LEN, description="Tokens per packed row.")
    microbatches: int = Field(1, ge=1, le=MAX_STEP_SEQUENCES, description="Microbatches per data-parallel rank per step.")
    packing: PackingPolicy = Field("best_fit", description="How documents are packed into rows.")
    overlong: OverlongPolicy = Field("split", description="Documents longer than seq_len are split into chunks, truncated, or dropped (by the loader, before the planner sees them; counted in `mixplane_loader_dropped_overlong_total`).")
    pad_id: int = Field(0, ge=0, description="Token id used for padding (labels are -100 there).")


class ModuleSpec(_Model):
    role: Literal["backbone", "encoder"] | None = Field(None, description="What the module consumes; default from its name (`encoder` else backbone).")
    dp: int = Field(1, ge=1, le=MAX_WORLD, description="Data-parallel size.")
    pp: int = Field(1, ge=1, le=MAX_WORLD, description="Pipeline-parallel stages.")
    cp: int = Field(1, ge=1, le=MAX_WORLD, description="Context-parallel size.")
    tp: int = Field(1, ge=1, le=MAX_WORLD, description="Tensor-parallel size.")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def resolved_role(self, name: str) -> str:
        return self.role or ("encoder" if name.startswith("encoder") or name in ("vit", "vision") else "backbone")


class TopologySpec(_Model):
    modules: dict[str, ModuleSpec] = Field(default_factory=lambda: {"backbone": ModuleSpec()}, description="Modules with their own parallelism over one world, e.g. backbone {dp,pp,cp,tp} and encoder {dp}.")
    order: list[Axis] = Field(default_factory=lambda: typing.cast("list[Axis]", list(AXES)), description="Rank order of the axes, fastest-varying first (Megatron: tp, cp, dp, pp).")
    ranks_per_node: int = Field(8, ge=1, le=1024, description="GPU ranks per node (for per-node constructors and sidecars).")

    def backbone(self) -> tuple[str, ModuleSpec]:
        for name, m in self.modules.items():
            if m.resolved_role(name) == "backbone":
                return name, m
        raise KeyError("no backbone module")

    def encoder(self) -> tuple[str, ModuleSpec] | None:
        for name, m in self.modules.items():
            if m.resolved_role(name) == "encoder":
                return name, m
        return None


class CostCalibration(_Model):
    linear_s_per_flop: float = Field(..., gt=0, description="Measured seconds per training FLOP of the token-wise work: projections, MLP, LM head (matrix multiplies).")
    pair_s_per_flop: float = Field(..., gt=0, description="Measured seconds per training FLOP of attention scores and their weighted sum (the term quadratic in a document's length).")
    document_s: float = Field(0.0, ge=0, description="Measured fixed seconds per document (attention segment) for the whole model: kernel launches and per-segment work that does not scale with its length.")
    device: str = Field("", description="Where it was measured (`mixplane calibrate`: the torch device and its name).")
    measured_hidden: int | None = Field(None, ge=1, description="The hidden size the kernels were timed at, when smaller than the model's (a CPU calibration of a large model); the coefficients are then applied to the model's own FLOP counts.")


class ModelDims(_Model):
    hidden: int = Field(4096, ge=1, description="Hidden size.")
    layers: int = Field(32, ge=1, description="Transformer layers.")
    heads: int = Field(32, ge=1, description="Attention (query) heads; head_dim = hidden / heads.")
    kv_heads: int | None = Field(None, ge=1, description="Key/value heads (grouped-query attention); default: heads (multi-head attention).")
    ffn_hidden: int | None = Field(None, ge=1, description="MLP hidden size; default 4 x hidden (x 2/3 x 2 for gated).")
    vocab: int = Field(32000, ge=1, description="Vocabulary size (the LM head's cost).")
    moe_topk: int = Field(1, ge=1, description="Experts per token (1 for dense).")
    gated_mlp: bool = Field(True, description="SwiGLU-style MLP with three matrices.")
    calibration: CostCalibration | None = Field(None, description="Seconds per FLOP measured on the trainer's hardware (`mixplane calibrate` writes it): the cost model then predicts time, with the token-wise and attention terms weighted by how fast each runs, plus a fixed cost per document. Unset: FLOPs.")


class StrategySpec(_Model):
    name: str = Field("llm_balance", description=f"Built-in strategy ({', '.join(BUILTIN_STRATEGIES)}), `package.module:function`, or `path/to/file.py:function` (relative to the spec file).")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the strategy.")


class ConstructorHookSpec(_Model):
    name: str = Field(..., min_length=1, description="`package.module:function` or `path/to/file.py:function` (relative to the spec file): `fn(batch, ctx, **options) -> batch`, called by the constructor on each data-parallel rank's collated batch (numpy arrays) before it is cut for CP / PP / TP; `ctx` has step, dp_rank, phase, generation, sources, seq_len. It may change a field (same shape) or add fields (numpy arrays); it must be deterministic (replay calls it again).")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the hook (checked against its signature at validation and start-up).")
    token_fields: list[str] = Field(default_factory=list, description="Fields the hook adds that are aligned with the tokens (last dimension seq_len): context parallelism cuts them as it cuts input_ids; other added fields reach every rank of the data-parallel group whole.")


class LoaderHookSpec(_Model):
    name: str = Field(..., min_length=1, description="`package.module:function` or `path/to/file.py:function` (relative to the spec file): `fn(plan, ctx, **options) -> dict | None`, called by a Source Loader on its part of each step's plan (numpy arrays, one entry per planned span: pos, key, start, len, dest, img, retire, tokens); `ctx` has step, source, replica, constructors, window_samples, window_tokens, read_ahead_tokens. It returns how the loader consumes that part -- `order` (a permutation of the entries: the order the loader gathers the spans and serves the constructors) and `read_ahead_tokens` (how far past its window it reads ahead) -- never which samples go where, so batches, cursors and resume are those of a run without it.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the hook (checked against its signature at validation and start-up).")
    sources: list[str] | None = Field(None, description="Sources whose loaders run the hook; default: every source.")


class HooksSpec(_Model):
    constructor: ConstructorHookSpec | None = Field(None, description="How a constructor assembles its part of a plan (the paper's constructor_do_plan): custom collation, extra fields.")
    loader: LoaderHookSpec | None = Field(None, description="How a Source Loader consumes its part of a plan (the paper's loader_do_plan): the order it gathers and serves the planned spans, its read-ahead.")


class CurveSpec(_Model):
    enabled: bool = Field(False, description="Encrypt and authenticate every socket with CURVE.")
    key_dir: str | None = Field(None, description="Directory holding the component key pairs and the public-key allowlist.")


class RuntimeSpec(_Model):
    host: str = Field("127.0.0.1", description="Interface the embedded runtime binds to.")
    planner_port: int = Field(0, ge=0, le=65535, description="Planner port; 0 picks a free one.")
    metrics: bool = Field(True, description="Serve Prometheus /metrics from every component.")
    window: int = Field(32, ge=1, le=MAX_WINDOW, description="Samples per loader replica the planner sees at least (its read-ahead window; window_tokens usually decides).")
    window_tokens: int | None = Field(None, ge=1, le=MAX_STEP_TOKENS, description="Tokens per loader replica the window holds at least; default 2 x tokens per step / replicas.")
    window_max: int = Field(65536, ge=1, le=MAX_WINDOW, description="Upper bound on a window's samples (memory cap), whatever window_tokens asks.")
    prefetch_steps: int = Field(2, ge=0, le=MAX_AHEAD_STEPS, description="Steps a constructor prepares ahead of its slowest client.")
    prefetch_s: float = Field(10.0, ge=0, le=3600, description="Seconds of training every rank holds ready ahead: a client measures its trainer's time per step and keeps that many seconds of steps requested (at least 2, at most `max_lead_steps`), so a failover or restart of a loader, constructor or the planner that takes less than this costs the trainer no wait. 0: `prefetch_steps` only. Memory: that many steps of each rank's batch in the trainer process, the constructor and the loaders.")
    max_lead_steps: int = Field(32, ge=1, le=MAX_AHEAD_STEPS, description="Steps the planner may run ahead of the slowest running constructor.")
    constructors: Literal["per_dp_group", "per_node"] = Field("per_dp_group", description="One Data Constructor per data-parallel group, or per node.")
    sources_per_loader: int = Field(1, ge=1, le=MAX_SOURCES, description="Source Loaders hosted by one loader process (source grouping: hundreds of small sources need not cost an interpreter each).")
    run_dir: str | None = Field(None, description="Where endpoints, logs and the planner journal go; default ./.mixplane/<name>.")
    step_timeout_s: float = Field(120.0, gt=0, description="A client waiting longer for a step raises an error naming its constructor (the planner tells clients; `MixtureLoader(timeout_s=)` or MIXPLANE_TIMEOUT_S override it).")
    heartbeat_s: float = Field(2.0, gt=0, description="Heartbeat interval between components.")
    checksum_payloads: bool = Field(True, description="Checksum bulk payloads (SAMPLES, STEP_DATA) and close them with an end-of-message marker, so a damaged or truncated one is refused and asked for again (false: skip it on trusted links); control messages are always checksummed.")
    journal_every: int = Field(100, ge=1, description="The planner journals a full cursor every this many steps (replay starts there).")
    curve: CurveSpec = Field(default_factory=CurveSpec, description="Transport security.")
    security: Literal["secure", "open"] = Field("secure", description="`secure`: the embedded runtime generates CURVE keys per role into `<run_dir>/keys` (0700) and every socket admits only them; `open` (on purpose, logged as a warning): no CURVE unless `curve` is enabled, any local process that reaches a port can control the run.")
    shadow_loaders: int = Field(0, ge=0, le=4, description="Hot-standby loader processes per loader group: each opens the same partitions, follows the primary's cursor and reads ahead without sending; when the primary is silent for `failover_after_s` the planner hands its partitions to a shadow (partition handoff), and the restarted primary becomes the shadow.")
    loader_snapshot_every: int = Field(0, ge=0, le=1_000_000, description="Loaders write a differential checkpoint (stream position, partial progress, live listing) every this many steps planned for them into `<run_dir>/loader-state/`; a restarted loader reads ahead from it while the planner's record bridges the gap to the exact cursor. 0: off (the planner's cursor alone positions a restarted loader exactly).")
    failover_after_s: float = Field(1.0, gt=0, le=60, description="A loader host (process) silent this long is taken for dead or hung: a shadow of its partitions is promoted. Hosts beat four times per interval.")
    rank_binding: Literal["auto", "required", "off"] = Field("auto", description="Bind trainer ranks to client keys: a rank's batches (GET_STEP), route and resume go only to a key bound to that rank (`client-r<rank>` or a pod's `client-r<first>-<last>` in the key directory). `auto`: required when the key directory holds rank keys (the embedded runtime generates one per rank); `required`: a shared `client` key is refused; `off`: any client key may claim any rank. See docs/security.md.")


class KubernetesSpec(_Model):
    """How the operator deploys the mixture in a cluster (ignored by the embedded runtime)."""

    placement: Literal["remote", "sidecar"] = Field("remote", description="Where Source Loaders run: loader pods of their own (remote), or loader containers injected into the trainer pods labelled `mixplane.io/mixture: <name>` (sidecar; remote pods only for what sidecars cannot hold).")
    image: str | None = Field(None, description="Container image of the components; default: the operator's own image.")
    trainer_pods: int | None = Field(None, ge=1, le=1 << 20, description="Trainer pods labelled for this mixture; default: one per node of the topology (world size / ranks_per_node). Pod slot k runs the k-th block of ranks and gets the CURVE key bound to them (unless runtime.rank_binding is off) and, under sidecar placement, its loader sidecars. A trainer pod's slot is its `mixplane.io/trainer-index` label or annotation, its Indexed Job completion index, or its StatefulSet ordinal.")
    sidecar_cpu: float = Field(2.0, gt=0, le=1024, description="Cores each trainer pod gives its loader sidecars (sidecar placement); partitions that do not fit run in remote loader pods.")
    sidecar_memory_mb: int = Field(4096, ge=64, le=1 << 24, description="MiB of memory each trainer pod gives its loader sidecars (sidecar placement).")
    journal_mb: int = Field(1024, ge=0, le=1 << 24, description="Size of the planner journal's PersistentVolumeClaim in MiB (a restarted planner pod recovers from it); 0 keeps the journal in an emptyDir that dies with the pod.")
    storage_class: str | None = Field(None, max_length=253, description="StorageClass of the planner journal's claim; default: the cluster's default class.")
    source_secret: str | None = Field(None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", description="A Secret in the mixture's namespace whose keys become environment variables of every loader container (remote pods and sidecars): the storage credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, HF_TOKEN, ...), which never go in the spec. No other component gets it.")


class DataMixtureSpec(_Model):
    name: str = Field("mixture", pattern=NAME_PATTERN, description="Name of the mixture (run directory, metrics label).")
    sources: list[SourceSpec] = Field(..., min_length=1, max_length=MAX_SOURCES, description="The data sources.")
    mixture: MixtureSpec = Field(default_factory=MixtureSpec, description="How sources are mixed over steps.")
    batch: BatchSpec = Field(..., description="What one training step consumes.")
    topology: TopologySpec = Field(default_factory=TopologySpec, description="The trainer's parallelism.")
    model: dict[str, ModelDims] = Field(default_factory=dict, description="Model dimensions by module name (for cost models).")
    strategy: StrategySpec = Field(default_factory=StrategySpec, description="Planning strategy.")
    hooks: HooksSpec = Field(default_factory=HooksSpec, description="User code in how components consume a plan (constructor, loader).")
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, description="Ports, buffers, timeouts.")
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec, description="Cluster deployment (operator only).")

    # ---- derived values used everywhere ----
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]

    def source_index(self, name: str) -> int:
        return self.source_names().index(name)

    @property
    def world_size(self) -> int:
        return self.topology.backbone()[1].world

    @property
    def rows_per_step(self) -> int:
        b = self.batch
        return b.sequences if b.sequences is not None else (b.tokens or 0) // b.seq_len

    @property
    def rows_per_microbatch(self) -> int:
        dp = self.topology.backbone()[1].dp
        return self.rows_per_step // (dp * self.batch.microbatches)

    @property
    def tokens_per_step(self) -> int:
        return self.rows_per_step * self.batch.seq_len

    def window_bounds(self, source: int) -> tuple[int, int, int]:
        """(min samples, min unconsumed tokens, max samples) of each loader replica's window of this source."""
        r = self.runtime
        src = self.sources[source]
        tokens = r.window_tokens if r.window_tokens is not None else max(2 * self.tokens_per_step // src.replicas, 2 * self.batch.seq_len)
        samples = r.window
        quota = self.mixture.rows.get(src.name)
        if quota:  # a source weighted by rows: two steps' worth of documents in view (mixture.rows)
            samples = max(samples, 2 * -(-quota // src.replicas))
        return min(samples, r.window_max), tokens, r.window_max


def overlong_limit(spec: "DataMixtureSpec") -> int | None:
    """Token count above which loaders drop a sample (batch.overlong == 'drop'), else None."""
    return spec.batch.seq_len if spec.batch.overlong == "drop" else None


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


Checker = Callable[["DataMixtureSpec"], list[Problem]]
"""A check that needs storage or user code (source files, a strategy's import): the caller passes it in,
so this module imports neither. Paths in its problems are relative to the spec (no `spec.` prefix)."""


class SpecError(MixplaneError, ValueError):
    """An invalid DataMixture; `problems` lists every rule it breaks."""

    def __init__(self, problems: list[Problem], origin: str = "<spec>"):
        self.problems = problems
        self.origin = origin
        super().__init__("\n".join(f"{origin}: {p}" for p in problems))


def _loc_to_path(prefix: str, loc: tuple) -> str:
    parts = [prefix] if prefix else []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        else:
            parts.append(str(item))
    return ".".join(parts) or "<root>"


def unwrap_document(doc: Any) -> tuple[dict[str, Any], str]:
    """Accept a bare spec or a whole `kind: DataMixture` resource; return (spec, path prefix)."""
    if not isinstance(doc, dict):
        got = "an empty document" if doc is None else f"a {type(doc).__name__}"
        raise SpecError([Problem("<root>", f"expected a mapping, got {got}")])
    if "spec" in doc and ("kind" in doc or "apiVersion" in doc):
        if doc.get("kind") not in (None, "DataMixture"):
            raise SpecError([Problem("kind", f"expected DataMixture, got {doc.get('kind')!r}")])
        if not isinstance(doc["spec"] or {}, dict):
            raise SpecError([Problem("spec", f"expected a mapping, got a {type(doc['spec']).__name__}")])
        spec = dict(doc["spec"] or {})
        meta = doc.get("metadata")
        name = meta.get("name") if isinstance(meta, dict) else None
        if name and "name" not in spec:
            spec["name"] = name
        return spec, "spec"
    return doc, ""


def parse_spec(doc: Any, *, base_dir: str | os.PathLike | None = None, origin: str = "<spec>",
               checks: Sequence[Checker] = ()) -> DataMixtureSpec:
    """Build and fully validate a spec; relative paths resolve against base_dir. Raises SpecError.

    Every problem is reported at once: when fields have the wrong shape, the cross-field rules and
    `checks` still run on the rest (the bad fields set back to their defaults), so a NaN weight is
    reported beside `batch.sequences: 0`. `checks` add what this pure module cannot see (files, user
    code): see mixplane.checks."""
    try:
        raw, prefix = unwrap_document(doc)
    except SpecError as e:  # root-level problems name the file too
        raise SpecError(e.problems, origin) from None
    spec, structural = _model_or_partial(raw, prefix)
    problems = list(structural)
    if spec is not None:
        if base_dir is not None:
            spec = resolve_paths(spec, Path(base_dir))
        semantic = semantic_problems(spec, prefix=prefix, checks=checks)
        # a rule about a field whose value was set aside would only echo the structural problem
        problems += [q for q in semantic if not any(_related(q.path, s.path) for s in structural)]
    if problems or spec is None:
        raise SpecError(problems, origin)
    return spec


def _model_or_partial(raw: dict[str, Any], prefix: str) -> tuple[DataMixtureSpec | None, list[Problem]]:
    """The validated model and no problems; or the shape problems and the model of the rest (None if there is none)."""
    try:
        return DataMixtureSpec.model_validate(raw), []
    except ValidationError as e:
        problems = [Problem(_loc_to_path(prefix, tuple(err["loc"])), err["msg"]) for err in e.errors()]
        errors = e.errors()
    partial: Any = copy.deepcopy(raw)  # bounded: load_spec refuses alias bombs before this
    for _ in range(4):  # a removed field can uncover another (its default may be what was wrong)
        if not all(_remove(partial, tuple(err["loc"])) for err in errors):
            return None, problems
        try:
            return DataMixtureSpec.model_validate(partial), problems
        except ValidationError as e:
            errors = e.errors()
    return None, problems


def _remove(doc: Any, loc: tuple) -> bool:
    """Remove the mapping entry that holds `loc` (a list item takes its whole list); False if there is none."""
    node, key, at = doc, None, None
    for item in loc:
        if isinstance(node, dict) and item in node:
            at, key, node = node, item, node[item]
        elif isinstance(node, list) and isinstance(item, int) and 0 <= item < len(node):
            node = node[item]  # removing the item would renumber its siblings: the list's entry goes instead
        else:
            break
    if at is None or key is None:
        return False
    del at[key]
    return True


def _related(a: str, b: str) -> bool:
    """One path is the other or inside it (`batch` and `batch.sequences`, `sources[0]` and `sources[0].uri`)."""
    short, long = sorted((a, b), key=len)
    return long == short or long.startswith(short + ".") or long.startswith(short + "[")


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a nesting bound (deep nesting would exhaust Python's stack)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_YAML_DEPTH} levels deep",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _expanded_values(node: yaml.Node, limit: int) -> int:
    """Values the document holds once its aliases are expanded (an alias bomb is small on disk, huge in memory)."""
    memo: dict[int, int] = {}

    def size(n: yaml.Node) -> int:  # recursion depth is bounded by MAX_YAML_DEPTH
        k = id(n)
        if k in memo:
            return memo[k]
        memo[k] = limit + 1  # a node that contains itself is unbounded
        if isinstance(n, yaml.SequenceNode):
            total = 1 + sum(size(c) for c in n.value)
        elif isinstance(n, yaml.MappingNode):
            total = 1 + sum(size(a) + size(b) for a, b in n.value)
        else:
            total = 1
        memo[k] = min(total, limit + 1)
        return memo[k]

    return size(node)


def read_spec_document(path: str | os.PathLike, origin: str | None = None) -> Any:
    """The YAML document of a spec file, within the bounds of MAX_SPEC_BYTES / _YAML_DEPTH / _YAML_VALUES.

    Anything else (unreadable, binary, not UTF-8, not YAML, too big, too deep, an alias bomb) is a SpecError."""
    origin = os.fspath(path) if origin is None else origin

    def fail(where: str, message: str) -> SpecError:
        return SpecError([Problem(where, " ".join(message.split()))], origin)  # one line per problem

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise fail("<file>", f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise fail("<file>", f"larger than the bound of {MAX_SPEC_BYTES} bytes for a DataMixture file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise fail(f"line {line}", f"not UTF-8 text (byte 0x{data[e.start]:02x}); a DataMixture is a UTF-8 YAML file") from None
    loader = None
    try:
        loader = _BoundedLoader(text)  # refuses control characters already
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_values(node, MAX_YAML_VALUES) > MAX_YAML_VALUES:
            raise fail("<file>", f"expands to more than the bound of {MAX_YAML_VALUES} YAML values (aliases repeat what they name)")
        return loader.construct_document(node)
    except SpecError:
        raise
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "<file>"
        raise fail(where, f"not valid YAML: {getattr(e, 'problem', None) or e}") from None
    except (ValueError, TypeError, RecursionError) as e:  # e.g. an integer of more digits than Python converts
        raise fail("<file>", f"not a usable YAML document: {type(e).__name__}: {e}") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_spec(path: str | os.PathLike, *, checks: Sequence[Checker] = ()) -> DataMixtureSpec:
    """Read and validate a spec file; problems name the file exactly as the caller spelt it."""
    origin = os.fspath(path)  # Path() would turn ./x.yaml into x.yaml
    doc = read_spec_document(path, origin)
    return parse_spec(doc, base_dir=Path(path).parent, origin=origin, checks=checks)


def _is_uri(s: str) -> bool:
    return "://" in s


def resolve_paths(spec: DataMixtureSpec, base: Path) -> DataMixtureSpec:
    """Relative file paths in a spec are relative to the spec file, as users expect."""
    def fix(p: str | None) -> str | None:
        if p is None or _is_uri(p) or os.path.isabs(p):
            return p
        return str((base / os.path.expanduser(p)).resolve()) if not p.startswith("~") else os.path.expanduser(p)

    sources = [s.model_copy(update={"uri": fix(s.uri), "tokenizer": fix(s.tokenizer)}) for s in spec.sources]
    runtime = spec.runtime.model_copy(update={"run_dir": fix(spec.runtime.run_dir)})
    update: dict = {"sources": sources, "runtime": runtime}
    mod, sep, fn = spec.strategy.name.rpartition(":")
    if sep and mod.endswith(".py"):
        update["strategy"] = spec.strategy.model_copy(update={"name": f"{fix(mod)}:{fn}"})
    hooks: dict[str, Any] = {}
    for field in ("constructor", "loader"):
        hook = getattr(spec.hooks, field)
        if hook is not None:
            mod, sep, fn = hook.name.rpartition(":")
            if sep and mod.endswith(".py"):
                hooks[field] = hook.model_copy(update={"name": f"{fix(mod)}:{fn}"})
    if hooks:
        update["hooks"] = spec.hooks.model_copy(update=hooks)
    return spec.model_copy(update=update)


def semantic_problems(spec: DataMixtureSpec, *, prefix: str = "", checks: Sequence[Checker] = ()) -> list[Problem]:
    """Every cross-field rule, each reported with the path of the field to fix, then the problems `checks` find."""
    p = (prefix + ".") if prefix else ""
    out: list[Problem] = []
    names = spec.source_names()
    known = set(names)

    seen: dict[str, int] = {}
    for i, s in enumerate(spec.sources):
        if s.name in seen:
            out.append(Problem(f"{p}sources[{i}].name", f"duplicate source name {s.name!r} (also sources[{seen[s.name]}])"))
        seen.setdefault(s.name, i)
        if s.kind in ("text", "image_text") and not s.tokenizer:
            out.append(Problem(f"{p}sources[{i}].tokenizer", f"kind {s.kind} needs a tokenizer"))
        if s.kind == "image_text" and len(s.columns) < 2:
            out.append(Problem(f"{p}sources[{i}].columns", "image_text needs two columns: image bytes and caption"))
        if s.live and s.oversample:
            out.append(Problem(f"{p}sources[{i}].oversample", "a live source cannot wrap: it reads each new file once and "
                               "waits when dry (leave oversample unset or false)"))
        if s.live and s.max_epochs is not None:
            out.append(Problem(f"{p}sources[{i}].max_epochs", "a live source has no passes to count: it reads each new "
                               "file once (remove max_epochs)"))
        elif s.oversample is False and s.max_epochs is not None and s.max_epochs > 1:
            out.append(Problem(f"{p}sources[{i}].max_epochs", f"max_epochs {s.max_epochs} needs oversample: a source "
                               "that does not wrap is read once"))
        if s.pack_by is not None:
            out.extend(_pack_by_problems(spec, i, p))
        if s.live and s.replicas > 1:
            out.append(Problem(f"{p}sources[{i}].replicas", f"a live source must have 1 replica, got {s.replicas}: each replica "
                               "lists new files on its own schedule, so their partitions would differ and rows repeat"))

    m = spec.mixture

    def check_weights(weights: dict[str, float], path: str) -> None:
        for name, w in weights.items():
            if name not in known:
                out.append(Problem(f"{path}.{name}", f"unknown source {name!r} (sources: {', '.join(names)})"))
            if not (math.isfinite(w) and w >= 0):
                out.append(Problem(f"{path}.{name}", f"weight must be a finite number >= 0, got {w}"))

    check_weights(m.weights, f"{p}mixture.weights")
    out.extend(_rows_problems(spec, p))
    base = effective_base_weights(spec)
    if sum(base.values()) <= 0:
        if m.rows and all(n in m.rows for n in names):
            out.append(Problem(f"{p}mixture.rows", "every source is weighted by rows: at least one source must take a "
                               "share weight, to fill the rest of each step"))
        else:
            out.append(Problem(f"{p}mixture.weights", "weights must have a positive sum"))
    if not _positive_finite(m.temperature):
        out.append(Problem(f"{p}mixture.temperature", f"temperature must be a finite number > 0, got {m.temperature}"))
    if m.phases and m.anneal is not None:
        out.append(Problem(f"{p}mixture.anneal", "phases and anneal cannot both be set"))
    prev = None
    for i, ph in enumerate(m.phases):
        path = f"{p}mixture.phases[{i}]"
        if prev is not None and ph.start_step <= prev:
            out.append(Problem(f"{path}.start_step", f"start_step must be strictly increasing ({ph.start_step} after {prev})"))
        prev = ph.start_step
        if not _positive_finite(ph.lr_scale):
            out.append(Problem(f"{path}.lr_scale", f"lr_scale must be a finite number > 0, got {ph.lr_scale}"))
        check_weights(ph.weights, f"{path}.weights")
        merged = {**base, **{k: v for k, v in ph.weights.items() if k in known}}
        if sum(merged.values()) <= 0:
            out.append(Problem(f"{path}.weights", "weights must have a positive sum"))
    if m.anneal is not None:
        check_weights(m.anneal.weights, f"{p}mixture.anneal.weights")
        if not _positive_finite(m.anneal.lr_scale):
            out.append(Problem(f"{p}mixture.anneal.lr_scale", f"lr_scale must be a finite number > 0, got {m.anneal.lr_scale}"))
        merged = {**base, **{k: v for k, v in m.anneal.weights.items() if k in known}}  # unnamed keep their base weight
        if sum(merged.values()) <= 0:
            out.append(Problem(f"{p}mixture.anneal.weights", "weights must have a positive sum"))

    if m.adaptive is not None:
        if m.phases or m.anneal is not None:
            out.append(Problem(f"{p}mixture.adaptive", "an adaptive mixture cannot have phases or an anneal (the next "
                               "phase would replace the adapted weights)"))
        from mixplane.adaptive import AdaptiveConfig

        for field, what in AdaptiveConfig.of(m.adaptive.model_dump(mode="json")).problems(names):
            out.append(Problem(f"{p}mixture.adaptive.{field}", what))

    b = spec.batch
    if b.seq_len <= 0:
        out.append(Problem(f"{p}batch.seq_len", f"seq_len must be > 0, got {b.seq_len}"))
    if (b.sequences is None) == (b.tokens is None):
        out.append(Problem(f"{p}batch", "set exactly one of sequences or tokens"))
    elif b.tokens is not None and b.seq_len > 0 and b.tokens % b.seq_len:
        out.append(Problem(f"{p}batch.tokens", f"tokens ({b.tokens}) must be a multiple of seq_len ({b.seq_len})"))

    t = spec.topology
    if sorted(t.order) != sorted(AXES):
        out.append(Problem(f"{p}topology.order", f"order must name each of {', '.join(AXES)} once"))
    if not t.modules:
        out.append(Problem(f"{p}topology.modules", "at least one module is needed"))
    else:
        roles = [(n, mod.resolved_role(n)) for n, mod in t.modules.items()]
        backbones = [n for n, r in roles if r == "backbone"]
        encoders = [n for n, r in roles if r == "encoder"]
        if len(backbones) != 1:
            out.append(Problem(f"{p}topology.modules", f"exactly one backbone module is needed, found {len(backbones)}"))
        if len(encoders) > 1:
            out.append(Problem(f"{p}topology.modules", f"at most one encoder module, found {len(encoders)}"))
        worlds = {n: mod.world for n, mod in t.modules.items()}
        first = next(iter(worlds))
        for n, w in worlds.items():
            if w != worlds[first]:
                out.append(Problem(f"{p}topology.modules.{n}", f"world size {w} (dp*pp*cp*tp) differs from module {first!r} ({worlds[first]})"))
        if len(backbones) == 1 and b.seq_len > 0 and (b.sequences or b.tokens):
            bb = t.modules[backbones[0]]
            rows = spec.rows_per_step
            if rows % (bb.dp * b.microbatches):
                out.append(Problem(f"{p}batch", f"{rows} sequences per step do not divide into dp ({bb.dp}) x microbatches ({b.microbatches})"))
            if bb.cp > 1 and b.seq_len % (2 * bb.cp):
                out.append(Problem(f"{p}batch.seq_len", f"seq_len ({b.seq_len}) must be a multiple of 2 x cp ({2 * bb.cp}) for the zig-zag split"))
        if len(backbones) == 1:
            out.extend(_process_problems(spec, backbones[0], p))
        if encoders and not any(s.kind == "image_text" for s in spec.sources):
            out.append(Problem(f"{p}topology.modules.{encoders[0]}", "an encoder module needs at least one image_text source"))

    for name in spec.model:
        if name not in t.modules:
            out.append(Problem(f"{p}model.{name}", f"unknown module {name!r} (modules: {', '.join(t.modules)})"))

    out.extend(place_tree_problems(spec.strategy.options.get("place_tree"), list(t.modules), f"{p}strategy.options.place_tree"))
    if spec.strategy.name == "llm_balance" and spec.strategy.options.get("hybrid_cp"):
        out.extend(hybrid_cp_problems(spec, f"{p}strategy.options.hybrid_cp"))

    st = spec.strategy.name
    if ":" in st:
        mod, _, fn = st.rpartition(":")
        if not mod or not fn:
            out.append(Problem(f"{p}strategy.name", f"strategy {st!r}: expected package.module:function or file.py:function"))
        # whether user code imports and takes its options is a check the shell passes in (mixplane.checks)
    elif st not in BUILTIN_STRATEGIES:
        out.append(Problem(f"{p}strategy.name", f"unknown strategy {st!r} (built-in: {', '.join(BUILTIN_STRATEGIES)}; or package.module:function)"))

    lh = spec.hooks.loader
    if lh is not None and lh.sources is not None:
        for j, name in enumerate(lh.sources):
            if name not in known:
                out.append(Problem(f"{p}hooks.loader.sources[{j}]", f"unknown source {name!r} (sources: {', '.join(names)})"))

    for check in checks:
        out.extend(Problem(f"{p}{q.path}", q.message) for q in check(spec))
    return out


def hybrid_cp_problems(spec: DataMixtureSpec, path: str) -> list[Problem]:
    """What delivering hybrid DP x CP consumers (`llm_balance` option `hybrid_cp`) needs: cp a power of two (a
    group stays inside one DP replica), text sources only, no CP or PP broadcast (a step's groups differ per
    sequence)."""
    out: list[Problem] = []
    try:
        cp = spec.topology.backbone()[1].cp
    except KeyError:  # named by the topology's own rules
        cp = 1
    if cp & (cp - 1):
        out.append(Problem(path, f"needs the backbone's cp to be a power of two, got {cp}"))
    images = [s.name for s in spec.sources if s.kind == "image_text"]
    if images:
        out.append(Problem(path, f"delivers text only; image_text source(s): {', '.join(images)}"))
    tree = spec.strategy.options.get("place_tree")
    axes = {str(a).upper() for a in spec.strategy.options.get("broadcast", ()) or () if isinstance(a, str)}
    if isinstance(tree, dict) and isinstance(tree.get("broadcast"), (list, tuple)):
        axes |= {str(a).upper() for a in tree["broadcast"]}
    bad = sorted(axes & {"CP", "PP"})
    if bad:
        out.append(Problem(path, f"cannot be combined with broadcast {', '.join(bad)} (only TP broadcasts)"))
    return out


def _pack_by_problems(spec: DataMixtureSpec, i: int, p: str) -> list[Problem]:
    """`sources[i].pack_by`: what packing within buckets needs (one problem per field to change)."""
    s, path, out = spec.sources[i], f"{p}sources[{i}]", []
    if s.pack_by not in s.columns:
        out.append(Problem(f"{path}.pack_by", f"{s.pack_by!r} must be one of columns ({', '.join(s.columns)}): the "
                           "loader reads it"))
    elif s.columns.index(s.pack_by) == 0:
        out.append(Problem(f"{path}.pack_by", f"{s.pack_by!r} is the {s.kind} column; name a metadata column"))
    if s.kind not in ("text", "tokens"):
        out.append(Problem(f"{path}.kind", f"pack_by needs kind text or tokens, got {s.kind}"))
    if s.shuffle != "sequential":
        out.append(Problem(f"{path}.shuffle", f"pack_by needs shuffle: sequential (a bucket's rows must be adjacent "
                           f"in the stream, as in the files; {s.shuffle} scatters them)"))
    if s.live:
        out.append(Problem(f"{path}.live", "pack_by needs a static source (a dry live source cannot tell that a "
                           "bucket is complete)"))
    if s.overlong_doc == "split":
        out.append(Problem(f"{path}.overlong_doc", "pack_by cannot be combined with overlong_doc: split"))
    if spec.batch.overlong != "split":
        out.append(Problem(f"{p}batch.overlong", f"sources[{i}].pack_by makes documents longer than a row: it needs "
                           f"batch.overlong: split, got {spec.batch.overlong}"))
    return out


def _rows_problems(spec: DataMixtureSpec, p: str) -> list[Problem]:
    """`mixture.rows`: known sources, counts a window can hold, and no share weight for a source weighted by rows."""
    m, out = spec.mixture, []
    known = {s.name: s for s in spec.sources}
    for name, n in m.rows.items():
        path = f"{p}mixture.rows.{name}"
        src = known.get(name)
        if src is None:
            out.append(Problem(path, f"unknown source {name!r} (sources: {', '.join(known)})"))
            continue
        if isinstance(n, bool) or n < 1:
            out.append(Problem(path, f"rows per step must be an integer >= 1, got {n}"))
            continue
        per = 2 * -(-n // src.replicas)  # each replica's window holds two steps' worth
        if per > spec.runtime.window_max:
            out.append(Problem(path, f"{n} rows per step need windows of {per} samples per replica, more than "
                               f"runtime.window_max ({spec.runtime.window_max})"))
    if not m.rows:
        return out
    if m.adaptive is not None:
        out.append(Problem(f"{p}mixture.rows", "an adaptive mixture adapts share weights only: it cannot be combined "
                           "with rows per step"))
    named = [("mixture.weights", m.weights)] + [(f"mixture.phases[{i}].weights", ph.weights) for i, ph in enumerate(m.phases)]
    if m.anneal is not None:
        named.append(("mixture.anneal.weights", m.anneal.weights))
    for where, weights in named:
        for name, w in weights.items():
            if name in m.rows and w != 0:
                out.append(Problem(f"{p}{where}.{name}", f"source {name!r} is weighted by rows (mixture.rows.{name}); "
                                   "it takes no share weight (remove it here or set 0)"))
    return out


def _process_problems(spec: DataMixtureSpec, backbone: str, p: str) -> list[Problem]:
    """Ranks and component processes past the bounds: a typo (dp: 100000) must not start a machine-filling run."""
    bb, r = spec.topology.modules[backbone], spec.runtime
    if bb.world > MAX_WORLD:
        return [Problem(f"{p}topology.modules.{backbone}", f"world size {bb.world} (dp*pp*cp*tp) is more than the bound of {MAX_WORLD} ranks")]
    loaders = -(-sum(s.replicas for s in spec.sources) // r.sources_per_loader)
    constructors = bb.dp if r.constructors == "per_dp_group" else -(-bb.world // spec.topology.ranks_per_node)
    if loaders + constructors > MAX_COMPONENT_PROCESSES:
        return [Problem(f"{p}sources", f"{loaders} loader processes + {constructors} Data Constructors are more than the bound of "
                        f"{MAX_COMPONENT_PROCESSES} component processes (fewer replicas, a larger runtime.sources_per_loader, "
                        "or runtime.constructors: per_node)")]
    return []


def _positive_finite(x: float) -> bool:
    """NaN and inf slip through `x > 0` checks; a scale or temperature must be a real positive number."""
    return math.isfinite(x) and x > 0


def place_tree_problems(overrides: Any, modules: list[str], path: str) -> list[Problem]:
    """Unknown keys of a ClientPlaceTree override: a misspelt key would otherwise be silently ignored."""
    if overrides is None:
        return []
    if not isinstance(overrides, dict):
        return [Problem(path, f"expected a mapping with keys {', '.join(PLACE_TREE_KEYS)}")]
    out = [Problem(f"{path}.{k}", f"unknown key {k!r} (allowed: {', '.join(PLACE_TREE_KEYS)})")
           for k in overrides if k not in PLACE_TREE_KEYS]
    bc = overrides.get("broadcast", ())
    if not isinstance(bc, (list, tuple)) or any(str(a).lower() not in ("tp", "pp", "cp") for a in bc):
        out.append(Problem(f"{path}.broadcast", f"only tp, pp and cp can be broadcast by the trainer (got {bc!r}; "
                                                "DP replicas receive different data)"))
    per_mod = overrides.get("modules") or {}
    if not isinstance(per_mod, dict):
        return out + [Problem(f"{path}.modules", "expected a mapping of module name to {order, rank_map}")]
    for name, o in per_mod.items():
        if name not in modules:
            out.append(Problem(f"{path}.modules.{name}", f"unknown module {name!r} (modules: {', '.join(modules)})"))
        if not isinstance(o, dict):
            out.append(Problem(f"{path}.modules.{name}", f"expected a mapping with keys {', '.join(PLACE_TREE_MODULE_KEYS)}"))
            continue
        out.extend(Problem(f"{path}.modules.{name}.{k}", f"unknown key {k!r} (allowed: {', '.join(PLACE_TREE_MODULE_KEYS)})")
                   for k in o if k not in PLACE_TREE_MODULE_KEYS)
    return out


def effective_base_weights(spec: DataMixtureSpec) -> dict[str, float]:
    """Base weights for every source: the given ones, 0 for unnamed sources, or equal weights when none are given."""
    names, rows = spec.source_names(), spec.mixture.rows
    if not spec.mixture.weights:
        return {n: 0.0 if n in rows else 1.0 for n in names}
    return {n: 0.0 if n in rows else float(spec.mixture.weights.get(n, 0.0)) for n in names}


def pack_bucket(source: SourceSpec) -> tuple[str, int] | None:
    """(column, most tokens of one bucket) of a source packed within buckets (`pack_by`), else None: what the
    loader's window joins rows by (loader.buckets), for the loader server and replay alike."""
    return None if source.pack_by is None else (source.pack_by, int(source.max_doc_tokens))


def epoch_caps(spec: DataMixtureSpec) -> list[int | None]:
    """Per source, the passes it may be read (None: no end). The one rule for `oversample` / `max_epochs`: a
    live source has none (it never wraps, it waits); a static one wraps unless `oversample: false` (one pass),
    up to `max_epochs` if given."""
    out: list[int | None] = []
    for s in spec.sources:
        if s.live:
            out.append(None)
        elif s.oversample is False:
            out.append(1)
        else:
            out.append(s.max_epochs)
    return out


# ---- reference documentation of every field and default ----

def reference_markdown() -> str:
    lines = ["# DataMixture reference", "", "Generated from `src/mixplane/spec.py` (`python -m mixplane.spec --markdown`). Do not edit by hand.", ""]

    def walk(model: type[BaseModel], path: str) -> None:
        lines.append(f"## `{path}`" if path else "## top level")
        lines.append("")
        lines.append("| field | type | default | meaning |")
        lines.append("|---|---|---|---|")
        nested: list[tuple[type[BaseModel], str]] = []
        for fname, f in model.model_fields.items():
            ann = f.annotation
            tname = ann.__name__ if isinstance(ann, type) and not typing.get_args(ann) else str(ann)
            tname = re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", tname).replace("NoneType", "None")
            if f.is_required():
                default = "required"
            else:
                d = f.get_default(call_default_factory=True)
                default = f"`{d.model_dump() if isinstance(d, BaseModel) else d!r}`"
                if len(default) > 60:
                    default = "see below"
            lines.append(f"| `{fname}` | {tname.replace('|', 'or')} | {default} | {f.description or ''} |")
            for cand in _nested_models(ann):
                nested.append((cand, f"{path}.{fname}" if path else fname))
        lines.append("")
        for cand, sub in nested:
            walk(cand, sub)

    walk(DataMixtureSpec, "")
    lines += ["## Bounds", "", "A spec past one of these is refused (`mixplane validate`: exit 2, the bound in the message): "
              "each would exhaust a machine long before it could run.", "", "| bound | value |", "|---|---|"]
    lines[-2:] = ["| what | bound | constant |", "|---|---|---|"]
    lines += [f"| {what} | {globals()[k]:,} | `{k}` |" for k, what in _BOUNDED.items()]
    return "\n".join(lines) + "\n"


def _nested_models(ann: Any) -> list[type[BaseModel]]:
    import typing

    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(ann):
        found.extend(_nested_models(arg))
    # list[X] and dict[str, X] document X under the field's path
    return found


if __name__ == "__main__":  # pragma: no cover - documentation helper
    if "--markdown" in sys.argv:
        sys.stdout.write(reference_markdown())
