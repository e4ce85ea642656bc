"""Causal attention that keeps packed documents apart: a token attends to the earlier tokens of its own
document only (docs/data-at-scale.md, "Packing").

Two forms of one mask, built from a packed batch's ``document_ids`` (N, L): a flex-attention ``BlockMask``,
whose kernel skips the blocks no document spans (on CUDA, where torch has flex attention), and a
block-diagonal boolean mask for ``scaled_dot_product_attention`` everywhere else. :func:`attend` runs either.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

_KINDS = ("auto", "flex", "sdpa")


def document_mask(document_ids: torch.Tensor, kind: str = "auto") -> torch.Tensor | BlockMask:
    """The causal mask of a packed batch whose ``document_ids`` (N, L) name each token's document.

    ``kind="sdpa"``: a boolean (N, 1, L, L) tensor, True where a query may attend a key, for
    ``scaled_dot_product_attention(attn_mask=...)``; ``"flex"``: a flex-attention ``BlockMask``;
    ``"auto"``: the block mask on CUDA where torch has flex attention (its CPU kernel has no backward),
    else the boolean mask. Padding (document id -1) is a document of its own, so no query is left with
    nothing to attend to (a row of -inf would give nan, and nan gradients through the padding's zero loss).
    """
    _check_document_ids(document_ids)
    if kind not in _KINDS:
        raise FitforgeValueError(f"document_mask: kind must be one of {_KINDS}, got {kind!r}")
    if kind == "flex" or (kind == "auto" and document_ids.is_cuda and _has_flex()):
        return _block_mask(document_ids)
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)  # (N, L, L): query's document == key's
    length = document_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)  # one mask for every head


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any) -> torch.Tensor:
    """Attention of (N, heads, L, dim) ``query``/``key``/``value`` under a :func:`document_mask`: flex
    attention (compiled once per process, as its fused kernel needs) for a ``BlockMask``, else SDPA."""
    if isinstance(mask, torch.Tensor):
        if mask.dtype is not torch.bool:  # SDPA would add an integer mask to the scores
            raise FitforgeTypeError(
                f"attend: mask must be what document_mask returns (a bool tensor or a BlockMask), got a {mask.dtype} "
                "tensor: pass document_mask(batch['document_ids']), not the document ids themselves"
            )
        return functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    if not query.is_cuda:  # torch.compile of flex attention targets GPUs; on the CPU its eager form runs
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(query, key, value, block_mask=mask)
    return _compiled_flex()(query, key, value, block_mask=mask)


def _check_document_ids(document_ids: Any) -> None:
    if (
        not isinstance(document_ids, torch.Tensor)
        or document_ids.is_floating_point()
        or document_ids.dtype is torch.bool
        or document_ids.dim() != 2
    ):
        raise FitforgeTypeError(
            "document_mask: document_ids must be an integer tensor of shape (batch, length), the packed rows' "
            f"'document_ids', got {describe(document_ids)}"
        )


@functools.cache
def _has_flex() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401  (torch >= 2.5)
    except ImportError:
        return False
    return True


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _block_mask(document_ids: torch.Tensor) -> BlockMask:
    if not _has_flex():
        raise FitforgeValueError(
            f"document_mask: kind='flex' needs torch.nn.attention.flex_attention (torch >= 2.5), this is torch "
            f"{torch.__version__}: upgrade torch, or pass kind='sdpa'"
        )
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_before(batch: Any, head: Any, query: Any, key: Any) -> Any:
        return (document_ids[batch, query] == document_ids[batch, key]) & (query >= key)

    rows, length = document_ids.shape
    return create_block_mask(same_document_before, rows, None, length, length, device=document_ids.device)
