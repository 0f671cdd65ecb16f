"""Validation checks that need storage or user code, passed into spec validation by the shells.

`mixplane.spec` is pure: it never lists storage nor imports user code. The CLI (and the operator, the
demo) hand these checkers to :func:`mixplane.spec.load_spec` / :func:`~mixplane.spec.parse_spec`:

* :func:`strategy_problems` loads a user strategy as the planner will and binds its options;
* :func:`source_file_problems` lists each source's files, opens them and checks columns and tokenizer, and that a
  source read block by block has at least as many blocks as `replicas` (:func:`block_partition_problem`);
* :func:`partition_problem`: whether a source can be split into N partitions (the runtime's re-partition asks).

Problem paths are relative to the spec; validation adds the `spec.` prefix of a resource.
"""

from __future__ import annotations

import os

from mixplane.loader.blocks import block_order
from mixplane.loader.files import SourceFilesError, read_schema_names
from mixplane.loader.listing import source_listing
from mixplane.planner.strategies import StrategyError, bind_options, load_callable
from mixplane.spec import Checker, DataMixtureSpec, Problem, SourceSpec


OPEN_TRIES = 64  # files of one source opened to find a readable one (a footer read each)


def _is_uri(s: str) -> bool:
    return "://" in s


def strategy_problems(spec: DataMixtureSpec) -> list[Problem]:
    """A user strategy that does not import, lacks its function or refuses its options (planner start-up, earlier)."""
    st = spec.strategy.name
    mod, sep, fn = st.rpartition(":")
    if not sep or not mod or not fn:
        return []  # built-in names and malformed names are spec rules
    if mod.endswith(".py") and not os.path.isfile(os.path.expanduser(mod)):  # relative paths resolve against the spec file
        return [Problem("strategy.name", f"no such strategy file: {mod}")]
    try:
        bind_options(load_callable(st), dict(spec.strategy.options), st)
    except StrategyError as e:
        return [Problem("strategy.name", str(e))]
    return []


def hook_problems(spec: DataMixtureSpec) -> list[Problem]:
    """A constructor or loader hook that does not import, is not callable or refuses its options (what the
    constructor's or loader's start-up would find, earlier)."""
    from mixplane.constructor.hooks import HookError, load_hook
    from mixplane.loader.hooks import LoaderHookError, load_loader_hook

    out: list[Problem] = []
    for field, h, load, error in (("constructor", spec.hooks.constructor, load_hook, HookError),
                                  ("loader", spec.hooks.loader, load_loader_hook, LoaderHookError)):
        if h is None:
            continue
        mod, sep, _ = h.name.rpartition(":")
        if sep and mod.endswith(".py") and not os.path.isfile(os.path.expanduser(mod)):
            out.append(Problem(f"hooks.{field}.name", f"no such hook file: {mod}"))
            continue
        try:
            load(spec)
        except error as e:
            out.append(Problem(f"hooks.{field}.name", str(e)))
    return out


def source_file_problems(spec: DataMixtureSpec) -> list[Problem]:
    """Every source lists files, one of them opens as Parquet and has the columns; tokenizers exist."""
    out: list[Problem] = []
    for i, s in enumerate(spec.sources):
        if s.tokenizer and not _is_uri(s.tokenizer) and not os.path.isfile(s.tokenizer):
            out.append(Problem(f"sources[{i}].tokenizer", f"no such file: {s.tokenizer}"))
        try:
            files = source_listing(s)  # kept for the loaders that start next (loader.listing)
        except SourceFilesError as e:
            out.append(Problem(f"sources[{i}].uri", str(e)))
            continue
        if not files.paths:
            if not s.live:
                out.append(Problem(f"sources[{i}].uri", f"matches no Parquet file: {s.uri}"))
            continue
        first, have, errors = None, [], []
        for path in files.paths[:OPEN_TRIES]:  # the loader quarantines unreadable files; none readable cannot run
            try:
                have = read_schema_names(files, path)
            except SourceFilesError as e:
                errors.append(str(e))
                continue
            first = path
            break
        if first is None:
            tried = len(errors)
            what = f"its {tried} file(s)" if tried == len(files.paths) else f"the first {tried} of its {len(files.paths)} files"
            out.append(Problem(f"sources[{i}].uri", f"no readable Parquet file among {what}; first: {errors[0]}"))
            continue
        for j, c in enumerate(s.columns):
            if c not in have:
                out.append(Problem(f"sources[{i}].columns[{j}]", f"column {c!r} not in {first} (has: {', '.join(have)})"))
        if (why := block_partition_problem(s, len(files.paths), s.replicas)) is not None:
            out.append(Problem(f"sources[{i}].replicas", why))
    return out


def block_partition_problem(source: SourceSpec, files_listed: int, partitions: int) -> str | None:
    """Why a source of `files_listed` files cannot be split into `partitions` partitions by its listing alone: its
    loaders read it block by block (`loader.blocks.lazy_indexing`) and a partition takes whole blocks, so it has
    at most its number of blocks (what a loader would fail with at start). None when it can, or when only its
    index can tell (a source read in page order)."""
    blocks = block_order(source, files_listed)
    if blocks is None or partitions <= blocks.num_blocks:
        return None
    return (f"source {source.name!r} is read block by block ({files_listed} files listed >= lazy_index_files "
            f"{source.lazy_index_files}): {blocks.num_blocks} blocks of block_files {blocks.block_files} files cannot "
            f"be split into {partitions} partitions; use at most {blocks.num_blocks} partitions or a smaller "
            "block_files")


def partition_problem(source: SourceSpec, partitions: int, seed: int) -> str | None:
    """Why `source` cannot be split into `partitions` partitions, before any loader of that split starts: a source
    read block by block by its listing alone (:func:`block_partition_problem`, no footer read), another static
    source by opening its stream with that split (its index: pages, row groups or rows). None when it can; a live
    source is the spec's rule (one partition)."""
    from mixplane.loader.stream import StreamError, open_stream

    if source.live:
        return None
    files = source_listing(source)
    if (why := block_partition_problem(source, len(files.paths), partitions)) is not None:
        return why
    if block_order(source, len(files.paths)) is not None:
        return None  # enough blocks: opening it would index a block for nothing
    try:
        open_stream(source, seed=seed, partition=0, num_partitions=int(partitions), files=files).close()
    except StreamError as e:
        return str(e)
    return None


def default_checks(files: bool = True) -> list[Checker]:
    """What `mixplane validate` and `mixplane run` check beyond the spec itself (`files=False`: --no-files)."""
    return [strategy_problems, hook_problems, source_file_problems] if files else [strategy_problems, hook_problems]
