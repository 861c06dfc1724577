//! Page and pool sizes in bytes, from the library's size functions (docs/format.md §2, §3): the
//! byte rules live in C only.

use crate::error::{invalid_value, Result};
use crate::sys;
use crate::version::check_abi;

/// Bytes of one packed K page.
pub fn k_page_bytes(block_size: u32, num_kv_heads: u32, head_dim: u32) -> Result<u64> {
    check_abi()?;
    // SAFETY: a host-only computation on scalars.
    let bytes = unsafe { sys::fp8kturbov_k_page_bytes(block_size, num_kv_heads, head_dim) };
    nonzero(bytes, block_size, num_kv_heads, head_dim, None)
}

/// Bytes of the code section at the start of a packed V page (the scale section follows).
pub fn v_data_section_bytes(
    block_size: u32,
    num_kv_heads: u32,
    head_dim: u32,
    v_bits: u32,
) -> Result<u64> {
    check_abi()?;
    // SAFETY: a host-only computation on scalars.
    let bytes =
        unsafe { sys::fp8kturbov_v_data_section_bytes(block_size, num_kv_heads, head_dim, v_bits) };
    nonzero(bytes, block_size, num_kv_heads, head_dim, Some(v_bits))
}

/// Bytes of one packed V page.
pub fn v_page_bytes(block_size: u32, num_kv_heads: u32, head_dim: u32, v_bits: u32) -> Result<u64> {
    check_abi()?;
    // SAFETY: a host-only computation on scalars.
    let bytes = unsafe { sys::fp8kturbov_v_page_bytes(block_size, num_kv_heads, head_dim, v_bits) };
    nonzero(bytes, block_size, num_kv_heads, head_dim, Some(v_bits))
}

/// The size functions return 0 for a shape no entry point accepts; they set no message.
fn nonzero(
    bytes: u64,
    block_size: u32,
    num_kv_heads: u32,
    head_dim: u32,
    v_bits: Option<u32>,
) -> Result<u64> {
    if bytes != 0 {
        return Ok(bytes);
    }
    let bits = v_bits.map_or(String::new(), |b| format!(", v_bits = {b} (2, 3 or 4)"));
    Err(invalid_value(format!(
        "no layout for block_size = {block_size}, num_kv_heads = {num_kv_heads}, \
         head_dim = {head_dim} (a multiple of 16){bits}"
    )))
}

/// The packed layout of one layer's K and V pools: `num_blocks` pages each, one page holding
/// `block_size` tokens of all `num_kv_heads` heads. The strides are what the params structs and
/// the launchers take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLayout {
    num_blocks: u64,
    block_size: u32,
    num_kv_heads: u32,
    head_dim: u32,
    v_bits: u32,
    k_block_stride_bytes: u64,
    v_block_stride_bytes: u64,
    v_data_section_bytes: u64,
}

impl CacheLayout {
    pub fn new(
        num_blocks: u64,
        block_size: u32,
        num_kv_heads: u32,
        head_dim: u32,
        v_bits: u32,
    ) -> Result<Self> {
        let layout = CacheLayout {
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            v_bits,
            k_block_stride_bytes: k_page_bytes(block_size, num_kv_heads, head_dim)?,
            v_block_stride_bytes: v_page_bytes(block_size, num_kv_heads, head_dim, v_bits)?,
            v_data_section_bytes: v_data_section_bytes(block_size, num_kv_heads, head_dim, v_bits)?,
        };
        // So that the pool sizes below cannot overflow.
        if num_blocks
            .checked_mul(layout.k_block_stride_bytes.max(layout.v_block_stride_bytes))
            .is_none()
        {
            return Err(invalid_value(format!(
                "num_blocks = {num_blocks}: the pools exceed 2^64 bytes"
            )));
        }
        Ok(layout)
    }

    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    pub fn num_kv_heads(&self) -> u32 {
        self.num_kv_heads
    }
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    pub fn v_bits(&self) -> u32 {
        self.v_bits
    }
    /// Bytes of one K page (packed: the page stride).
    pub fn k_block_stride_bytes(&self) -> u64 {
        self.k_block_stride_bytes
    }
    /// Bytes of one V page (packed: the page stride).
    pub fn v_block_stride_bytes(&self) -> u64 {
        self.v_block_stride_bytes
    }
    /// Byte offset of the scale section inside a V page.
    pub fn v_data_section_bytes(&self) -> u64 {
        self.v_data_section_bytes
    }
    /// Elements of one token row: `num_kv_heads * head_dim`.
    pub fn row_elems(&self) -> u32 {
        // Cannot overflow: the size functions refuse rows over 2^32 - 1 elements.
        self.num_kv_heads * self.head_dim
    }
    pub fn k_pool_bytes(&self) -> u64 {
        self.num_blocks * self.k_block_stride_bytes
    }
    pub fn v_pool_bytes(&self) -> u64 {
        self.num_blocks * self.v_block_stride_bytes
    }
    /// Cache bytes one token occupies, K and V together, all KV heads.
    pub fn bytes_per_token(&self) -> u64 {
        (self.k_block_stride_bytes + self.v_block_stride_bytes) / u64::from(self.block_size)
    }
    /// Token slots in the pools: `num_blocks * block_size`.
    pub fn num_slots(&self) -> u64 {
        self.num_blocks * u64::from(self.block_size)
    }
}
