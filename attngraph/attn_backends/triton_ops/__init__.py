"""Triton kernels of the attention backends (paged metadata, decode and extend attention).

Launch functions (tensor shapes in their docstrings):

* `decode_attention_fwd`: split-KV paged decode (stage 1 per split, stage 2 merge).
* `decode_attention_o_fwd` (`decode_attention_o`): one request's decode attention and the
  output projection after it in one launch (benchmarked, not yet used by the model).
* `extend_attention_fwd`: ragged new tokens over paged keys, one online softmax.
* `dense_attention_fwd`: the same kernel over contiguous, equal-length sequences.
* `store_kv`: a step's new K and V into a layer's pool slots, one launch.
"""

from .decode_attention import DEFAULT_MIN_SPLIT_LEN, decode_attention_fwd, interpreter_problem, interpreting, slopes_tensor
from .extend_attention import dense_attention_fwd, extend_attention_fwd
from .kv_store import store_kv

__all__ = [
    "DEFAULT_MIN_SPLIT_LEN",
    "decode_attention_fwd",
    "dense_attention_fwd",
    "extend_attention_fwd",
    "interpreter_problem",
    "interpreting",
    "slopes_tensor",
    "store_kv",
]
