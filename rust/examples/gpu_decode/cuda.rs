//! The few CUDA driver calls the example needs, declared here (no crate) and looked up in
//! libcuda.so.1 at run time: the example then builds on machines without the driver, and the
//! library itself never links it either. Allocations live in the device's primary context, the
//! one the library's CUDA runtime uses, and are freed when the `Gpu` is dropped.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::mem::size_of_val;

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuDevicePtr = u64;

const CUDA_SUCCESS: CuResult = 0;
const RTLD_NOW: c_int = 2;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// One function pointer per driver entry point, named as in cuda.h (the `_v2` symbols are what
/// cuda.h's macros select).
macro_rules! driver_api {
    ($($field:ident = $symbol:literal ($($arg:ty),*);)*) => {
        struct Api {
            $($field: unsafe extern "C" fn($($arg),*) -> CuResult,)*
        }

        impl Api {
            /// # Safety
            /// `library` is a dlopen handle of libcuda.
            unsafe fn load(library: *mut c_void) -> Result<Api, String> {
                Ok(Api {$($field: {
                    let symbol = dlsym(library, concat!($symbol, "\0").as_ptr().cast());
                    if symbol.is_null() {
                        return Err(format!("libcuda.so.1 has no {}", $symbol));
                    }
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CuResult>(
                        symbol,
                    )
                },)*})
            }
        }
    };
}

driver_api! {
    init = "cuInit"(c_uint);
    device_get_count = "cuDeviceGetCount"(*mut c_int);
    device_get = "cuDeviceGet"(*mut CuDevice, c_int);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain"(*mut CuContext, CuDevice);
    ctx_set_current = "cuCtxSetCurrent"(CuContext);
    ctx_synchronize = "cuCtxSynchronize"();
    mem_alloc = "cuMemAlloc_v2"(*mut CuDevicePtr, usize);
    mem_free = "cuMemFree_v2"(CuDevicePtr);
    memcpy_htod = "cuMemcpyHtoD_v2"(CuDevicePtr, *const c_void, usize);
    memcpy_dtoh = "cuMemcpyDtoH_v2"(*mut c_void, CuDevicePtr, usize);
    memset_d8 = "cuMemsetD8_v2"(CuDevicePtr, u8, usize);
    get_error_name = "cuGetErrorName"(CuResult, *mut *const c_char);
}

pub struct Gpu {
    api: Api,
    allocations: Vec<CuDevicePtr>,
}

impl Gpu {
    /// Device 0's primary context made current; `Err` says why there is no usable GPU.
    pub fn open() -> Result<Gpu, String> {
        // SAFETY: dlopen with a NUL-terminated name; the handle is never closed.
        let library = unsafe { dlopen(c"libcuda.so.1".as_ptr(), RTLD_NOW) };
        if library.is_null() {
            return Err("no CUDA driver (libcuda.so.1 not found)".to_string());
        }
        // SAFETY: a libcuda handle.
        let gpu = Gpu { api: unsafe { Api::load(library)? }, allocations: Vec::new() };
        let (mut count, mut device, mut context) = (0, 0, std::ptr::null_mut());
        // SAFETY (every call): out-parameters of the right types.
        unsafe {
            gpu.check((gpu.api.init)(0), "cuInit")?;
            gpu.check((gpu.api.device_get_count)(&mut count), "cuDeviceGetCount")?;
            if count == 0 {
                return Err("no CUDA device".to_string());
            }
            gpu.check((gpu.api.device_get)(&mut device, 0), "cuDeviceGet")?;
            gpu.check(
                (gpu.api.primary_ctx_retain)(&mut context, device),
                "cuDevicePrimaryCtxRetain",
            )?;
            gpu.check((gpu.api.ctx_set_current)(context), "cuCtxSetCurrent")?;
        }
        Ok(gpu)
    }

    /// A device allocation of `bytes` (at least 256-byte aligned), filled with `byte`.
    pub fn alloc(&mut self, bytes: usize, byte: u8) -> Result<u64, String> {
        let mut ptr = 0;
        // SAFETY: an out-parameter, then a memset of the new allocation.
        unsafe {
            self.check((self.api.mem_alloc)(&mut ptr, bytes.max(1)), "cuMemAlloc")?;
            self.allocations.push(ptr);
            self.check((self.api.memset_d8)(ptr, byte, bytes), "cuMemsetD8")?;
        }
        Ok(ptr)
    }

    /// A device copy of `data`.
    pub fn upload<T: Copy>(&mut self, data: &[T]) -> Result<u64, String> {
        let ptr = self.alloc(size_of_val(data), 0)?;
        // SAFETY: the allocation holds size_of_val(data) bytes.
        let status =
            unsafe { (self.api.memcpy_htod)(ptr, data.as_ptr().cast(), size_of_val(data)) };
        self.check(status, "cuMemcpyHtoD")?;
        Ok(ptr)
    }

    /// Waits for all work, then copies `out.len()` elements from `ptr`.
    pub fn download<T: Copy>(&self, ptr: u64, out: &mut [T]) -> Result<(), String> {
        // SAFETY: `ptr` is one of this Gpu's allocations of at least that size.
        unsafe {
            self.check((self.api.ctx_synchronize)(), "cuCtxSynchronize")?;
            let status = (self.api.memcpy_dtoh)(out.as_mut_ptr().cast(), ptr, size_of_val(out));
            self.check(status, "cuMemcpyDtoH")
        }
    }

    pub fn memset(&self, ptr: u64, byte: u8, bytes: usize) -> Result<(), String> {
        // SAFETY: `ptr` is one of this Gpu's allocations of at least `bytes`.
        self.check(unsafe { (self.api.memset_d8)(ptr, byte, bytes) }, "cuMemsetD8")
    }

    fn check(&self, status: CuResult, call: &str) -> Result<(), String> {
        if status == CUDA_SUCCESS {
            return Ok(());
        }
        let mut name = std::ptr::null();
        // SAFETY: cuGetErrorName writes a static string or leaves NULL.
        unsafe { (self.api.get_error_name)(status, &mut name) };
        let name = if name.is_null() {
            format!("CUresult {status}")
        } else {
            // SAFETY: a static NUL-terminated string of the driver.
            unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
        };
        Err(format!("{call} failed: {name}"))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        for &ptr in &self.allocations {
            // SAFETY: allocated by cuMemAlloc, freed once.
            unsafe { (self.api.mem_free)(ptr) };
        }
    }
}
