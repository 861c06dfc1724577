//! Statuses and messages through the real library, from the raw calls that only `sys` can make
//! (NULL params, a wrong struct_size); nothing here needs a GPU.

mod common;

use std::mem::size_of;

use common::{assert_failure, valid_decode, valid_prefill, valid_write};
use fp8kturbov::{check, reshape_and_cache, sys, Status};

#[test]
fn statuses_have_the_librarys_names() {
    let statuses = [
        (Status::InvalidValue, "INVALID_VALUE"),
        (Status::NullPointer, "NULL_POINTER"),
        (Status::Misaligned, "MISALIGNED"),
        (Status::NotSupported, "NOT_SUPPORTED"),
        (Status::BadStructSize, "BAD_STRUCT_SIZE"),
        (Status::CudaError, "CUDA_ERROR"),
    ];
    for (status, name) in statuses {
        assert_eq!(status.name(), format!("FP8KTURBOV_STATUS_{name}"));
        assert_eq!(Status::from_raw(status.raw()), Some(status));
    }
    assert_eq!(Status::from_raw(sys::FP8KTURBOV_STATUS_SUCCESS), None);
    assert_eq!(Status::from_raw(99), Some(Status::Unknown(99)));
    assert!(!Status::Unknown(99).name().is_empty());
}

#[test]
fn a_null_params_pointer_is_named() {
    use std::ptr::{null, null_mut};
    // SAFETY (every call): NULL params are refused before anything is read. Each message is
    // checked before the next call replaces it.
    unsafe {
        let raw = sys::fp8kturbov_reshape_and_cache(null(), null_mut());
        let entry = "fp8kturbov_reshape_and_cache";
        assert_failure(check(raw), Status::NullPointer, entry, "params is NULL");
        let raw = sys::fp8kturbov_paged_decode_attn(null(), null_mut());
        let entry = "fp8kturbov_paged_decode_attn";
        assert_failure(check(raw), Status::NullPointer, entry, "params is NULL");
        let raw = sys::fp8kturbov_paged_prefill_attn(null(), null_mut());
        let entry = "fp8kturbov_paged_prefill_attn";
        assert_failure(check(raw), Status::NullPointer, entry, "params is NULL");
        let raw = sys::fp8kturbov_dequantize(null(), null_mut());
        assert_failure(check(raw), Status::NullPointer, "fp8kturbov_dequantize", "params is NULL");
        let raw = sys::fp8kturbov_write_params_init_sized(std::ptr::null_mut(), 8);
        assert_eq!(check(raw).unwrap_err().status(), Some(Status::NullPointer));
    }
}

#[test]
fn an_unknown_struct_size_is_refused() {
    let mut write = *valid_write().as_raw();
    write.struct_size += 8;
    // SAFETY: the library reads struct_size first and stops there.
    let raw = unsafe { sys::fp8kturbov_reshape_and_cache(&write, std::ptr::null_mut()) };
    let entry = "fp8kturbov_reshape_and_cache";
    assert_failure(check(raw), Status::BadStructSize, entry, "struct_size");
    // The prefill struct has one version: its size is the only one known.
    let mut prefill = *valid_prefill().as_raw();
    prefill.struct_size -= 8;
    // SAFETY: as above.
    let raw = unsafe { sys::fp8kturbov_paged_prefill_attn(&prefill, std::ptr::null_mut()) };
    let known = format!("knows {}", size_of::<sys::fp8kturbov_prefill_params_t>());
    assert_failure(check(raw), Status::BadStructSize, "fp8kturbov_paged_prefill_attn", &known);
    let mut decode = *valid_decode().as_raw();
    // SAFETY: an unknown size is refused before anything is written.
    let raw = unsafe { sys::fp8kturbov_decode_params_init_sized(&mut decode, 7) };
    assert_eq!(check(raw).unwrap_err().status(), Some(Status::BadStructSize));
}

#[test]
fn the_message_belongs_to_the_failing_thread() {
    // SAFETY: refused on the host.
    let failed = unsafe { reshape_and_cache(&valid_write().k_scale(0.0), 0) };
    assert!(failed.is_err());
    let other = std::thread::spawn(|| {
        // SAFETY: a NUL-terminated string, valid until this thread's next call.
        unsafe { std::ffi::CStr::from_ptr(sys::fp8kturbov_last_error_message()) }.to_owned()
    });
    assert_eq!(other.join().unwrap().to_bytes(), b"");
}
