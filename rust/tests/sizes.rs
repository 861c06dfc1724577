//! Versions, the size functions and `CacheLayout` through the real library, against the format's
//! rules as tests/c/test_c_abi.c states them (docs/format.md §2, §3): with n = num_kv_heads ·
//! head_dim, a K page is B·n bytes, a V page's code section B·n·b/8 and the page
//! (2b + 1)·B·n/16 (the codes, then one E4M3 scale byte per 16 elements).

use fp8kturbov::{sys, CacheLayout, Status};

#[test]
fn the_library_has_the_crates_abi_and_version() {
    assert_eq!(fp8kturbov::check_abi(), Ok(()));
    assert_eq!(fp8kturbov::abi_version(), sys::FP8KTURBOV_ABI_VERSION);
    assert_eq!(fp8kturbov::version(), sys::FP8KTURBOV_VERSION);
}

#[test]
fn page_sizes_follow_the_format() {
    for (block_size, num_kv_heads, head_dim) in [(16u32, 2u32, 128u32), (16, 8, 128), (32, 1, 64)] {
        let elems = u64::from(block_size * num_kv_heads * head_dim);
        let k_page = fp8kturbov::k_page_bytes(block_size, num_kv_heads, head_dim).unwrap();
        assert_eq!(k_page, elems);
        for bits in 2..=4u32 {
            let shape = (block_size, num_kv_heads, head_dim, bits);
            let data = fp8kturbov::v_data_section_bytes(block_size, num_kv_heads, head_dim, bits);
            let page = fp8kturbov::v_page_bytes(block_size, num_kv_heads, head_dim, bits);
            assert_eq!(data, Ok(elems * u64::from(bits) / 8), "{shape:?}");
            assert_eq!(page, Ok((2 * u64::from(bits) + 1) * elems / 16), "{shape:?}");
        }
    }
}

#[test]
fn shapes_without_a_layout_are_invalid_values() {
    let cases = [
        (fp8kturbov::k_page_bytes(16, 2, 100), "head_dim = 100"),
        (fp8kturbov::k_page_bytes(0, 2, 128), "block_size = 0"),
        (fp8kturbov::v_page_bytes(16, 2, 128, 5), "v_bits = 5"),
        (fp8kturbov::v_data_section_bytes(16, 2, 128, 1), "v_bits = 1"),
    ];
    for (result, text) in cases {
        let err = result.unwrap_err();
        assert_eq!(err.status(), Some(Status::InvalidValue));
        assert!(err.to_string().contains(text), "{err}");
    }
}

#[test]
fn cache_layout_takes_the_library_sizes() {
    let (num_blocks, block_size, num_kv_heads, head_dim, v_bits) = (24, 16, 2, 128, 3);
    let layout = CacheLayout::new(num_blocks, block_size, num_kv_heads, head_dim, v_bits).unwrap();
    let k_page = fp8kturbov::k_page_bytes(block_size, num_kv_heads, head_dim).unwrap();
    let v_page = fp8kturbov::v_page_bytes(block_size, num_kv_heads, head_dim, v_bits).unwrap();
    let v_data = fp8kturbov::v_data_section_bytes(block_size, num_kv_heads, head_dim, v_bits);
    assert_eq!(layout.k_block_stride_bytes(), k_page);
    assert_eq!(layout.v_block_stride_bytes(), v_page);
    assert_eq!(Ok(layout.v_data_section_bytes()), v_data);
    assert_eq!(layout.k_pool_bytes(), num_blocks * k_page);
    assert_eq!(layout.v_pool_bytes(), num_blocks * v_page);
    assert_eq!(layout.row_elems(), num_kv_heads * head_dim);
    assert_eq!(layout.bytes_per_token(), (k_page + v_page) / u64::from(block_size));
    assert_eq!(layout.num_slots(), num_blocks * u64::from(block_size));
}

#[test]
fn cache_layout_refuses_what_the_size_functions_refuse_and_overflowing_pools() {
    let err = CacheLayout::new(1, 16, 2, 100, 3).unwrap_err();
    assert!(err.to_string().contains("head_dim = 100"), "{err}");
    let err = CacheLayout::new(u64::MAX, 16, 2, 128, 3).unwrap_err();
    assert_eq!(err.status(), Some(Status::InvalidValue));
    assert!(err.to_string().contains("2^64"), "{err}");
}
