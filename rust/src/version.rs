//! Versions, and the ABI check that every safe entry point passes before its first call.

use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::sys;

/// The loaded library's `FP8KTURBOV_VERSION` (major * 10000 + minor * 100 + patch).
pub fn version() -> i32 {
    // SAFETY: no arguments, no preconditions.
    unsafe { sys::fp8kturbov_version() }
}

/// The loaded library's `FP8KTURBOV_ABI_VERSION`.
pub fn abi_version() -> i32 {
    // SAFETY: no arguments, no preconditions.
    unsafe { sys::fp8kturbov_abi_version() }
}

/// `Ok` when the loaded library has the ABI that `sys` mirrors. Asked of the library once per
/// process; the answer is kept.
pub fn check_abi() -> Result<()> {
    static CHECKED: OnceLock<Result<()>> = OnceLock::new();
    CHECKED.get_or_init(|| compare_abi(abi_version())).clone()
}

fn compare_abi(library: i32) -> Result<()> {
    if library == sys::FP8KTURBOV_ABI_VERSION {
        Ok(())
    } else {
        Err(Error::AbiMismatch { library, crate_abi: sys::FP8KTURBOV_ABI_VERSION })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_abi_is_refused() {
        assert_eq!(compare_abi(sys::FP8KTURBOV_ABI_VERSION), Ok(()));
        let other = sys::FP8KTURBOV_ABI_VERSION + 1;
        let err = compare_abi(other).unwrap_err();
        assert_eq!(
            err,
            Error::AbiMismatch { library: other, crate_abi: sys::FP8KTURBOV_ABI_VERSION }
        );
        assert_eq!(err.status(), None);
    }
}
