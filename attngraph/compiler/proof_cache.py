"""On-disk cache of the token-mixing proof (`passes.token_mixing.check_token_mixing`).

The proof re-traces the whole lowered graph to ATen, the largest share of the compiler's own
time at `accelerate()` (seconds for a 16-layer model). Its result depends only on the graph's
code, its inputs' shapes and dtypes, the token inputs named, and the analysing code; so a
second process compiling the same model reads the findings back instead of tracing again.

The key hashes all of those: ``gm.code``, every placeholder's name and fake value (symbolic
sizes, strides, dtype, device type), the token and row-index input names, the torch and
attngraph versions, and the source of the modules that prove it (a changed analysis never
reads an old answer). Entries are small JSON files written atomically; an unreadable entry is
recomputed.

Location: ``$ATTNGRAPH_CACHE_DIR/token_mixing`` (default ``$XDG_CACHE_HOME/attngraph`` or
``~/.cache/attngraph``); ``ATTNGRAPH_CACHE_DIR=off`` disables it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import fx

from ..passes import aten_graph, token_mixing
from ..passes import fx_utils as fu
from ..passes.token_mixing import TokenMixingOp

logger = logging.getLogger(__name__)

CACHE_ENV = "ATTNGRAPH_CACHE_DIR"
#: Bumped when the entry format changes.
FORMAT = 1


def cache_root() -> Path | None:
    """The cache folder, or None when ``ATTNGRAPH_CACHE_DIR=off``."""
    env = os.environ.get(CACHE_ENV, "")
    if env.lower() in ("off", "0", "none", "false"):
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attngraph"


@functools.lru_cache(maxsize=1)
def _analysis_source_hash() -> str:
    h = hashlib.sha256()
    for module in (token_mixing, aten_graph, fu):
        with open(module.__file__, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}{value.device.type}"
    return f"{type(value).__name__}:{value}"


def graph_key(gm: fx.GraphModule, token_inputs: Iterable[str], row_index_inputs: Iterable[str]) -> str:
    """Hash of everything the token-mixing proof of ``gm`` depends on (module docstring)."""
    from .. import __version__

    h = hashlib.sha256()
    parts = [
        f"format={FORMAT}", torch.__version__, __version__, _analysis_source_hash(),
        repr(tuple(token_inputs)), repr(tuple(row_index_inputs)), gm.code,
    ]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            parts.append(f"{node.name}={_describe(fu.example_value(node))}")
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def cached_token_mixing(
    gm: fx.GraphModule,
    token_inputs: Iterable[str],
    row_index_inputs: Iterable[str],
    prove: Callable[[], list[TokenMixingOp]],
) -> list[TokenMixingOp]:
    """``prove()``'s findings for ``gm``, read from the cache when an entry has its key."""
    root = cache_root()
    if root is None:
        return prove()
    key = graph_key(gm, token_inputs, row_index_inputs)
    path = root / "token_mixing" / f"{key}.json"
    try:
        with open(path) as f:
            entry = json.load(f)
        found = [TokenMixingOp(**op) for op in entry["findings"]]
        logger.debug("token-mixing proof read from %s", path)
        return found
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.debug("token-mixing cache entry %s unreadable (%s); proving again", path, exc)
    found = prove()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": FORMAT, "findings": [dataclasses.asdict(op) for op in found]}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f)
        os.replace(f.name, path)
    except OSError as exc:  # a read-only home: the proof still stands, only the reuse is lost
        logger.debug("token-mixing cache not written (%s)", exc)
    return found
