//! Statuses and messages through the real library; nothing here needs a GPU.

use fp8kturbov::{sys, Status};

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
