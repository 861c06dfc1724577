"""Pool layout: every byte size and stride the kernels need, from the library's size functions."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._errors import InvalidValueError, Status
from ._lib import library
from ._limits import DEFAULT_V_BITS
from ._scalars import U32_MAX, integer


@dataclass(frozen=True)
class CacheLayout:
    """The packed layout of one layer's K and V pools (docs/format.md §2, §3).

    Inputs are counts (``block_size`` in tokens per page, ``head_dim`` in elements). Derived
    fields are in BYTES: ``k_block_stride_bytes`` / ``v_block_stride_bytes`` (one page),
    ``v_data_section_bytes`` (the codes part of a V page), ``k_pool_bytes`` / ``v_pool_bytes``
    (all ``num_blocks`` pages).
    """

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    v_bits: int = DEFAULT_V_BITS
    k_block_stride_bytes: int = field(init=False)
    v_block_stride_bytes: int = field(init=False)
    v_data_section_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        num_blocks = integer(self.num_blocks)  # NumPy integers too, kept as Python ints
        if num_blocks is None or num_blocks < 0:
            raise InvalidValueError(Status.INVALID_VALUE, f"num_blocks = {self.num_blocks!r} is not an integer >= 0")
        object.__setattr__(self, "num_blocks", num_blocks)
        for name in ("block_size", "num_kv_heads", "head_dim", "v_bits"):
            value = integer(getattr(self, name))
            object.__setattr__(self, name, getattr(self, name) if value is None else value)
        shape = (self.block_size, self.num_kv_heads, self.head_dim)
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= U32_MAX
                   for v in (*shape, self.v_bits)):
            raise InvalidValueError(
                Status.INVALID_VALUE,
                f"block_size={self.block_size!r}, num_kv_heads={self.num_kv_heads!r}, "
                f"head_dim={self.head_dim!r}, v_bits={self.v_bits!r}: each must be an integer "
                f"in [1, 2^32 - 1]")
        lib = library()
        sizes = {
            "k_block_stride_bytes": lib.fp8kturbov_k_page_bytes(*shape),
            "v_block_stride_bytes": lib.fp8kturbov_v_page_bytes(*shape, self.v_bits),
            "v_data_section_bytes": lib.fp8kturbov_v_data_section_bytes(*shape, self.v_bits),
        }
        if 0 in sizes.values():
            raise InvalidValueError(
                Status.INVALID_VALUE,
                f"no layout for block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim} (a multiple of 16), v_bits={self.v_bits} (2, 3 or 4)",
            )
        for name, value in sizes.items():
            object.__setattr__(self, name, value)

    @property
    def row_elems(self) -> int:
        """Elements of one token row: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def k_pool_bytes(self) -> int:
        return self.num_blocks * self.k_block_stride_bytes

    @property
    def v_pool_bytes(self) -> int:
        return self.num_blocks * self.v_block_stride_bytes

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies, K and V together, all KV heads."""
        return (self.k_block_stride_bytes + self.v_block_stride_bytes) // self.block_size

    @property
    def num_slots(self) -> int:
        """Token slots in the pools: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size
