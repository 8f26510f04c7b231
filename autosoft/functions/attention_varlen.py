"""autosoft.attention_varlen: attention over sequences of different lengths packed into one tensor,
with FlashAttention's flash_attn_varlen_func calling convention, over the attention_varlen family
(autosoft/families/attention_varlen.py)."""
from __future__ import annotations

from typing import Any

from ..api import run_call
from ..families.attention_varlen import ATTENTION_VARLEN

__all__ = ["attention_varlen"]


def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool = False, scale: float | None = None, window: Any = None,
                     softcap: float | None = None, return_lse: bool = False) -> Any:
    """Attention of each packed sequence's queries over its own keys.

    q (total_q, Hq, D), k and v (total_k, Hkv, D): CUDA torch tensors or CuPy arrays (float16,
    bfloat16) holding the sequences' tokens one after another, Hq a multiple of Hkv; cu_seqlens_q
    and cu_seqlens_k (B + 1,) int32: where each sequence's tokens start, the totals last;
    max_seqlen_q and max_seqlen_k: bounds every sequence's lengths fit (they pick the compiled and
    tuned variant, the bucket). Query i of a sequence of Nq queries and Nkv keys stands at key
    i + Nkv - Nq (bottom-right); causal, window and softcap as autosoft.attention's; scale defaults
    to 1/sqrt(D). Returns o (total_q, Hq, D), and with return_lse=True lse (Hq, total_q) float32,
    a view of the kernel's (total_q, Hq). The host checks shapes and dtypes before anything reaches
    the GPU (TypeError or ValueError naming the argument). The offsets are read on the GPU and are
    the caller's to keep valid, as with FlashAttention: increasing, within q's and k's tokens, and
    no sequence longer than max_seqlen_q queries or max_seqlen_k keys.
    While torch.compile traces, the call is the operator torch.ops.autosoft.attention_varlen; it
    has no backward (tensors that require gradients while autograd records are refused)."""
    call = ATTENTION_VARLEN.python_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                       scale, window, softcap, return_lse)
    o, lse = run_call("attention_varlen", ATTENTION_VARLEN.inputs, call)  # torch.compile: one operator
    return (o, lse.T) if return_lse else o
