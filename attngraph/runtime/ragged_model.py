"""`RaggedModel`: an HF causal LM compiled once in ragged form.

The model is traced as ``input_ids[1, N]``, ``position_ids[1, N]``, no HF cache, logits only
at ``logits_indices``. Token-wise layers do not care which request a token belongs to;
attention is lowered to the paged op, which reads the per-request structure from the
`ForwardContext`. The mask the model builds from positions becomes dead code.

N and the number of logits are dynamic. Both are padded to at least 2 so that Dynamo's
specialization of sizes 0 and 1 never produces a second graph (a 1-token graph could also
let HF skip a sliding-window mask, hiding the window from the passes).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import types
import torch
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

from ..compiler.backend import AttnGraphBackend
from ..compiler.ragged_check import ROW_INDEX_INPUTS, TOKEN_INPUTS
from ..compiler.model_checks import check_attn_implementation
from ..config import CompileConfig
from ..errors import AttnGraphError, UnsupportedGenerationError, UnsupportedModelError
from ..forward_context import get_forward_context, use_forward_context
from ..passes.site import AttentionSite

logger = logging.getLogger(__name__)

MIN_TOKENS = 2


def graph_rows(batch_size: int) -> int:
    """Rows a step over static buffers hands `RaggedModel`: at least `MIN_TOKENS`, so that a
    captured batch of one holds no padding kernels (the copies ``__call__`` makes otherwise).
    The rows past ``batch_size`` are padding: ids and positions left there by earlier steps
    (in range, as every value those buffers ever held is), outputs never read."""
    return max(batch_size, MIN_TOKENS)
_instance_ids = itertools.count()


_UNCOMPILED = (
    "the paged runtime's forward ran uncompiled (torch.compiler.set_stance('force_eager'), or a stance "
    "that runs eagerly instead of recompiling, is active), so its attention was not lowered and would "
    "mix the requests of a step. Call generate outside that stance, or call attngraph.restore(model) "
    "first to run HF's own generate."
)


#: Largest step length `step_token_limit` looks for (beyond it a model counts as unbounded).
TOKEN_LIMIT_SEARCH = 1 << 20


def step_token_limit(sites: list[AttentionSite]) -> int | None:
    """The most tokens one step of the ragged graph may hold, when Dynamo's guards bound it
    (MPT slices its ALiBi table of ``max_seq_len`` columns by the sequence length: the graph
    holds only shorter steps); None when every length up to `TOKEN_LIMIT_SEARCH` passes.

    Read from the guards on the token count alone, evaluated at every length: a longer step
    would fail them and recompile, and the model's own code would then fail."""
    import numpy as np
    import sympy

    from ..passes.fx_utils import example_value

    if not sites:
        return None
    n = example_value(sites[0].q).shape[2]  # [1, H, N, D]
    if not isinstance(n, torch.SymInt) or not isinstance(n.node.expr, sympy.Symbol):
        return None
    sym, env = n.node.expr, n.node.shape_env
    lengths = np.arange(0, TOKEN_LIMIT_SEARCH + 1, dtype=np.int64)
    ok = lengths >= MIN_TOKENS
    for guard in env.guards:
        expr = guard.expr
        if expr.free_symbols != {sym}:
            continue
        try:
            holds = sympy.lambdify(sym, expr, modules=[{"Max": np.maximum, "Min": np.minimum}, "numpy"])(lengths)
        except Exception:  # a guard numpy cannot evaluate: leave the limit to the recompile's error
            continue
        ok &= np.broadcast_to(np.asarray(holds, dtype=bool), ok.shape)
    hint = int(n.node.hint) if n.node.hint is not None else MIN_TOKENS
    failing = np.nonzero(~ok[hint:])[0]
    return None if not len(failing) else int(hint + failing[0] - 1)


class RaggedModel:
    """Calls ``model`` in ragged form through the attngraph compiler (paged mode)."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig, compile_hook=None) -> None:
        """``compile_hook``: see `AttnGraphBackend` (the piecewise runtime's split compile)."""
        check_attn_implementation(model)
        self.model = model
        self.config = config
        self.backend = AttnGraphBackend(
            config,
            mode="paged",
            trusted_positions=("position_ids",),
            on_sites=self._check_sites,
            token_inputs=TOKEN_INPUTS,
            row_index_inputs=ROW_INDEX_INPUTS,
            compile_hook=compile_hook,
        )
        forward = model.forward  # bound before `accelerate` patches the instance

        def ragged_forward(input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
            # Dynamo reads this as True while it traces, and the compiled graph never runs this
            # body; so it runs only uncompiled (set_stance("force_eager"), a stance that skips
            # recompiles), where attention is the model's own, over all requests at once.
            if not torch.compiler.is_compiling():
                raise UnsupportedGenerationError(_UNCOMPILED)
            out = forward(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=logits_indices)
            return out.logits[0]

        # Dynamo caches compiled graphs per code object; a code object of its own per model
        # keeps every accelerated model's graph (and its recompile budget) separate.
        code = ragged_forward.__code__.replace(co_name=f"ragged_forward_{next(_instance_ids)}")
        own = types.FunctionType(code, ragged_forward.__globals__, code.co_name, None, ragged_forward.__closure__)
        self._compiled = torch.compile(own, backend=self.backend, fullgraph=True, dynamic=False)

    @property
    def num_compilations(self) -> int:
        return self.backend.report.num_graphs

    @property
    def sites(self) -> list[AttentionSite]:
        return self.backend.sites

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """``input_ids, positions: [T]``, ``logits_indices: [L]`` -> logits ``[L, vocab]``.

        Token rows beyond the ForwardBatch's ``num_tokens`` are padding (their attention output
        is left unwritten and their K/V are not stored; `check_token_mixing` has proven that no
        other row reads them).
        """
        n, n_logits = input_ids.shape[0], logits_indices.shape[0]
        if n < MIN_TOKENS:
            pad = MIN_TOKENS - n
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        if n_logits < MIN_TOKENS:
            logits_indices = torch.cat([logits_indices, logits_indices.new_zeros(MIN_TOKENS - n_logits)])
        ids, pos = input_ids[None], positions[None]
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(pos, 1)
        torch._dynamo.mark_dynamic(logits_indices, 0)
        ctx = get_forward_context()
        if ctx is not None and n_logits < logits_indices.shape[0] and ctx.num_logits is None:
            ctx = dataclasses.replace(ctx, num_logits=n_logits)  # the padded logits rows are not read
        try:
            with torch.no_grad(), use_forward_context(ctx):
                logits = self._compiled(ids, pos, logits_indices)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            inner = getattr(exc, "inner_exception", None)
            if isinstance(inner, AttnGraphError):
                raise inner from None
            raise
        except ConstraintViolationError as exc:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}'s forward fixes the number of tokens while it is traced, so it has "
                "no graph for every step length, which the paged runtime needs:\n"
                f"{str(exc).strip()}\nUse the stateless form instead: torch.compile(model, backend='attngraph')."
            ) from exc
        return logits[:n_logits]

    def _check_sites(self, sites: list[AttentionSite]) -> None:
        """In ragged form every attention must be lowered (an unlowered site would mix
        requests), and nothing else may move data between tokens: a convolution, scan or
        linear attention over the sequence keeps state that the ragged form loses.

        Runs inside the compiler, before the graph ever executes.
        """
        report = self.backend.report
        mixing = report.token_mixing_of(report.num_graphs - 1)
        bad = [s for s in sites if not s.lowered]
        problems = []
        if not sites or bad:
            lines = "\n".join(f"  {s.name} ({s.kind}): {s.reason}" for s in sites) or "  (no attention found)"
            problems.append(f"every attention site must be lowered, {len(sites) - len(bad)}/{len(sites)} were.\n{lines}")
        if mixing:
            lines = "\n".join(f"  {op}" for op in mixing)
            problems.append(
                f"{len(mixing)} op(s) outside attention move data between tokens; in the paged runtime a step "
                "holds only the new tokens of every request, so such layers (convolutions or scans over the "
                "sequence, SSM / linear-attention state) would lose their history and mix requests.\n" + lines
            )
        if problems:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} cannot run on the paged runtime: " + "\n".join(problems)
                + "\nUse the stateless form instead: torch.compile(model, backend='attngraph')."
            )
