"""Pool geometry and the transfer-buffer layout shared by every page-copy backend.

Used by the worker agent to size transfer buffers and by the copy functions to name shapes. The buffer
layout is FlashInfer's paged layout, layer-major, so that a receiver can hand one layer's slice to FlashInfer
as its paged KV cache without another copy:

    MHA, NHD:  (L, P, 2, ps, H, D)   per layer == FlashInfer (num_pages, 2, page_size, num_kv_heads, head_dim)
    MHA, HND:  (L, P, 2, H, ps, D)   per layer == FlashInfer (num_pages, 2, num_kv_heads, page_size, head_dim)
    MLA:       (L, P, ps, H, D)      H == 1 in SGLang; per layer == FlashInfer MLA paged ckv (num_pages,
                                     page_size, ckv_dim) with the kpe columns kept in place (D = lora + rope)

`P` is the number of pages in the transfer (the i-th buffer page holds the i-th requested page id), `L` the
number of layers. For MLA the ``layout`` is ignored in the shape: with H == 1 the NHD and HND orders are the
same bytes, so MLA buffers are always reported as NHD.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("mha", "mla")
LAYOUTS = ("NHD", "HND")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Map ``"bfloat16"``, ``"torch.float16"``, ``"fp8_e4m3"``-style names or a torch dtype to a torch dtype.

    fp8 names map to ``torch.uint8``: SGLang stores fp8 KV as bytes (``store_dtype``).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name.startswith(("fp8", "float8")):
        return torch.uint8
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    resolved = getattr(torch, aliases.get(name, name), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown KV dtype {dtype!r}")
    return resolved


@dataclass(frozen=True)
class PoolGeometry:
    """Shape of one worker's KV pool as far as page copies are concerned (one attention-TP rank)."""

    num_layers: int
    """Number of layers whose KV is stored in the pool."""
    num_kv_heads: int
    """KV heads per attention-TP rank (1 for MLA)."""
    head_dim: int
    """Elements per head row (for MLA: kv_lora_rank + qk_rope_head_dim)."""
    page_size: int
    """Tokens per page; page p is token slots [p*page_size, (p+1)*page_size)."""
    dtype: torch.dtype | str
    """Storage dtype of the pool (fp8 pools store uint8); a torch dtype or its name."""
    kind: str = "mha"
    """``"mha"`` (a K and a V tensor per layer) or ``"mla"`` (one latent tensor per layer)."""
    layout: str = "NHD"
    """Buffer (and wire) layout inside a page: ``"NHD"`` (token, head, dim) or ``"HND"`` (head, token, dim)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PoolGeometry.{name} must be a positive int, got {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"PoolGeometry.kind must be one of {KINDS}, got {self.kind!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"PoolGeometry.layout must be one of {LAYOUTS}, got {self.layout!r}")
        resolve_dtype(self.dtype)  # raises ValueError on an unknown name

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def num_kv(self) -> int:
        """Tensors per layer: 2 (K, V) for MHA, 1 for MLA."""
        return 2 if self.kind == "mha" else 1

    def page_elems(self) -> int:
        """Elements of one page of one layer's K (or V, or MLA latent) tensor."""
        return self.page_size * self.num_kv_heads * self.head_dim

    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V together (the transfer size per page)."""
        return self.num_layers * self.num_kv * self.page_elems() * self.torch_dtype.itemsize

    def buffer_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of the transfer buffer holding ``num_pages`` pages (see the module docstring).

        Args:
            num_pages: pages in the transfer.
        Returns:
            The buffer shape; its numel times the itemsize equals ``num_pages * page_bytes()``.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        L, P, ps, H, D = self.num_layers, num_pages, self.page_size, self.num_kv_heads, self.head_dim
        if self.kind == "mla":
            return (L, P, ps, H, D)
        if self.layout == "NHD":
            return (L, P, 2, ps, H, D)
        return (L, P, 2, H, ps, D)
