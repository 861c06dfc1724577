//! Statuses as `Result`: a failed call becomes an [`Error`] holding its status and the library's
//! message of that call, copied before the thread calls into the library again.

use std::ffi::CStr;
use std::fmt;

use crate::sys;

pub type Result<T> = std::result::Result<T, Error>;

/// A status other than success. `Unknown` keeps a value added by a newer library (statuses are
/// append-only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    InvalidValue,
    NullPointer,
    Misaligned,
    NotSupported,
    BadStructSize,
    CudaError,
    Unknown(sys::fp8kturbov_status_t),
}

impl Status {
    /// `None` for `FP8KTURBOV_STATUS_SUCCESS`.
    pub fn from_raw(raw: sys::fp8kturbov_status_t) -> Option<Status> {
        Some(match raw {
            sys::FP8KTURBOV_STATUS_SUCCESS => return None,
            sys::FP8KTURBOV_STATUS_INVALID_VALUE => Status::InvalidValue,
            sys::FP8KTURBOV_STATUS_NULL_POINTER => Status::NullPointer,
            sys::FP8KTURBOV_STATUS_MISALIGNED => Status::Misaligned,
            sys::FP8KTURBOV_STATUS_NOT_SUPPORTED => Status::NotSupported,
            sys::FP8KTURBOV_STATUS_BAD_STRUCT_SIZE => Status::BadStructSize,
            sys::FP8KTURBOV_STATUS_CUDA_ERROR => Status::CudaError,
            other => Status::Unknown(other),
        })
    }

    pub fn raw(self) -> sys::fp8kturbov_status_t {
        match self {
            Status::InvalidValue => sys::FP8KTURBOV_STATUS_INVALID_VALUE,
            Status::NullPointer => sys::FP8KTURBOV_STATUS_NULL_POINTER,
            Status::Misaligned => sys::FP8KTURBOV_STATUS_MISALIGNED,
            Status::NotSupported => sys::FP8KTURBOV_STATUS_NOT_SUPPORTED,
            Status::BadStructSize => sys::FP8KTURBOV_STATUS_BAD_STRUCT_SIZE,
            Status::CudaError => sys::FP8KTURBOV_STATUS_CUDA_ERROR,
            Status::Unknown(raw) => raw,
        }
    }

    /// The library's name of the status, "FP8KTURBOV_STATUS_...".
    pub fn name(self) -> String {
        // SAFETY: fp8kturbov_status_string returns a static NUL-terminated string, never NULL.
        unsafe { c_string(sys::fp8kturbov_status_string(self.raw())) }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A call returned `status`; `message` names the entry point and the argument at fault.
    Status { status: Status, message: String },
    /// The loaded library's ABI version is not the one this crate declares (`sys`).
    AbiMismatch { library: i32, crate_abi: i32 },
}

impl Error {
    /// The library status, `None` for an ABI mismatch.
    pub fn status(&self) -> Option<Status> {
        match self {
            Error::Status { status, .. } => Some(*status),
            Error::AbiMismatch { .. } => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Status { status, message } => write!(f, "{}: {message}", status.name()),
            Error::AbiMismatch { library, crate_abi } => write!(
                f,
                "libfp8kturbov has ABI version {library}, this crate was written for {crate_abi}"
            ),
        }
    }
}

impl std::error::Error for Error {}

/// `Ok` for success, else the status with the calling thread's last-error message. Call it right
/// after the call that returned `raw`, on the same thread.
pub fn check(raw: sys::fp8kturbov_status_t) -> Result<()> {
    match Status::from_raw(raw) {
        None => Ok(()),
        // SAFETY: the message is a NUL-terminated string valid until this thread's next call.
        Some(status) => Err(Error::Status {
            status,
            message: unsafe { c_string(sys::fp8kturbov_last_error_message()) },
        }),
    }
}

/// An error of this crate's own checks (not reported by a library call).
pub(crate) fn invalid_value(message: String) -> Error {
    Error::Status { status: Status::InvalidValue, message }
}

/// # Safety
/// `ptr` is a valid NUL-terminated string.
unsafe fn c_string(ptr: *const std::ffi::c_char) -> String {
    CStr::from_ptr(ptr).to_string_lossy().into_owned()
}
