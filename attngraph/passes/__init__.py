"""FX passes over Dynamo-level graphs. Each is usable alone on a `torch.fx.GraphModule`:

>>> sites = find_attention(gm)          # what is there, and what may be lowered
>>> lower_attention(gm, sites)          # rewrite lowerable sites to torch.ops.attngraph.attention
>>> cleanup(gm)                         # drop the dead mask / repeat_kv code
>>> absorb_mla(gm, sites)               # paged MLA: attend over the latent, kv_b absorbed
>>> check_token_mixing(gm)              # ragged graphs: ops besides attention that mix tokens
>>> fuse_linears(gm, real_inputs)       # q/k/v, gate/up: one GEMM on concatenated weights
>>> skinny_linears(gm)                  # linears -> attngraph's GEMV ops, SiLU * up into down
>>> fold_rms_norm(gm)                   # then: RMSNorm (+ residual add) into the GEMV reading it
>>> fold_norm_epilogue(gm)              # or, before a cuBLAS product, into the GEMV before it
>>> fuse_gated_mlp(gm)                  # a gated MLP as one op: SiLU * up in the gate/up epilogue
>>> fold_rope(gm)                       # paged: HF's rotary embedding of q and k into the attention op
>>> fold_rope_linear(gm)                # then on into the q/k/v projection whose columns q and k are
"""

from .absorb_mla import absorb_mla
from .cleanup import cleanup
from .find_attention import find_attention
from .fold_norm_epilogue import FoldNormEpilogueResult, fold_norm_epilogue
from .fold_rms_norm import FoldNormResult, fold_rms_norm
from .fold_rope import FoldRopeResult, fold_rope
from .fold_rope_linear import FoldRopeLinearResult, fold_rope_linear
from .fuse_gated_mlp import FuseGatedMlpResult, fuse_gated_mlp
from .fuse_linears import FuseResult, fuse_linears
from .lower_attention import ATTENTION_OP, lower_attention
from .mask_analysis import MaskPattern, NotProvable, analyze_mask
from .site import AttentionSite
from .skinny_linears import SkinnyResult, skinny_linears
from .token_mixing import TokenMixingOp, check_token_mixing

__all__ = [
    "ATTENTION_OP",
    "AttentionSite",
    "TokenMixingOp",
    "absorb_mla",
    "check_token_mixing",
    "MaskPattern",
    "NotProvable",
    "analyze_mask",
    "cleanup",
    "find_attention",
    "FoldNormEpilogueResult",
    "fold_norm_epilogue",
    "FoldNormResult",
    "fold_rms_norm",
    "FoldRopeResult",
    "fold_rope",
    "FoldRopeLinearResult",
    "fold_rope_linear",
    "FuseGatedMlpResult",
    "fuse_gated_mlp",
    "FuseResult",
    "fuse_linears",
    "lower_attention",
    "SkinnyResult",
    "skinny_linears",
]
