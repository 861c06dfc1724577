//! Rust bindings to libfp8kturbov, a paged KV cache with FP8 E4M3 keys and TurboQuant 2/3/4-bit
//! values, through its C ABI (`fp8kturbov.h`).
//!
//! - [`sys`]: the header, one declaration per C item, checked against it by `tests/layout.rs`;
//! - statuses as [`Result`] with the library's message ([`Error`]), the ABI checked once
//!   ([`check_abi`]) before any other call;
//! - sizes: [`k_page_bytes`], [`v_page_bytes`], [`v_data_section_bytes`], [`CacheLayout`].

mod error;
mod layout;
pub mod sys;
mod version;

pub use error::{check, Error, Result, Status};
pub use layout::{k_page_bytes, v_data_section_bytes, v_page_bytes, CacheLayout};
pub use version::{abi_version, check_abi, version};
