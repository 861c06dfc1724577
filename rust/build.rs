//! Finds libfp8kturbov.so and links it with an rpath, so that binaries run without
//! LD_LIBRARY_PATH. The library comes from, in order:
//!  1. `FP8KTURBOV_LIB_DIR` (the folder holding libfp8kturbov.so);
//!  2. pkg-config (`pkg-config --variable=libdir fp8kturbov`, the installed fp8kturbov.pc);
//!  3. the Python package (`$PYTHON -m fp8kturbov --library`, PYTHON defaulting to python3).
//!
//! The header folder (for the layout test, which compiles a C program against it) is
//! `FP8KTURBOV_INCLUDE_DIR`, else this crate's checkout (`../cuda/include`), else the include
//! folder installed next to the library (a CMake prefix or the Python package).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const LIBRARY_FILE: &str = "libfp8kturbov.so";
const HEADER_FILE: &str = "fp8kturbov.h";

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    for var in [
        "FP8KTURBOV_LIB_DIR",
        "FP8KTURBOV_INCLUDE_DIR",
        "FP8KTURBOV_LIBRARY",
        "PKG_CONFIG_PATH",
        "PYTHON",
    ] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let mut tried = Vec::new();
    let lib_dir = find_library(&mut tried).unwrap_or_else(|| {
        panic!(
            "\n\nfp8kturbov: {LIBRARY_FILE} not found. Tried:\n  {}\n\
             Set FP8KTURBOV_LIB_DIR to the folder holding {LIBRARY_FILE} (a CMake build or install \
             prefix's lib/), or install the library so that pkg-config or `python3 -m fp8kturbov \
             --library` finds it.\n\n",
            tried.join("\n  ")
        )
    });
    println!("cargo::rustc-link-search=native={}", lib_dir.display());
    println!("cargo::rustc-link-lib=dylib=fp8kturbov");
    // Only this package's tests, examples and binaries get the rpath; dependents read the folder
    // from DEP_FP8KTURBOV_LIB_DIR (README.md).
    println!("cargo::rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    println!("cargo::metadata=lib_dir={}", lib_dir.display());
    if let Some(include_dir) = find_header(&lib_dir) {
        println!("cargo::rustc-env=FP8KTURBOV_INCLUDE_DIR={}", include_dir.display());
    }
}

/// The first folder that holds the library, recording each place looked at in `tried`.
fn find_library(tried: &mut Vec<String>) -> Option<PathBuf> {
    type Finder = fn() -> Option<PathBuf>;
    let candidates: [(&str, Finder); 3] = [
        ("FP8KTURBOV_LIB_DIR", || env::var_os("FP8KTURBOV_LIB_DIR").map(PathBuf::from)),
        ("pkg-config --variable=libdir fp8kturbov", || {
            command_output("pkg-config", &["--variable=libdir", "fp8kturbov"]).map(PathBuf::from)
        }),
        ("$PYTHON -m fp8kturbov --library", || {
            let python = env::var("PYTHON").unwrap_or_else(|_| "python3".to_string());
            let library =
                PathBuf::from(command_output(&python, &["-m", "fp8kturbov", "--library"])?);
            library.parent().map(Path::to_path_buf)
        }),
    ];
    for (source, find) in candidates {
        match find() {
            // Canonical, so that the rpath names the folder plainly.
            Some(dir) if dir.join(LIBRARY_FILE).is_file() => return dir.canonicalize().ok(),
            Some(dir) => tried.push(format!("{source}: {} has no {LIBRARY_FILE}", dir.display())),
            None => tried.push(format!("{source}: not set, or no answer")),
        }
    }
    None
}

fn find_header(lib_dir: &Path) -> Option<PathBuf> {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR")?);
    env::var_os("FP8KTURBOV_INCLUDE_DIR")
        .map(PathBuf::from)
        .into_iter()
        .chain([
            manifest_dir.join("../cuda/include"),
            lib_dir.join("../include"), // an install prefix: lib/ and include/
            lib_dir.join("include"),    // the Python package: fp8kturbov/include/
        ])
        .find(|dir| dir.join(HEADER_FILE).is_file())
}

/// The first line of a command's standard output, when it ran and succeeded.
fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let output = Command::new(program).args(args).output().ok()?;
    let stdout = String::from_utf8(output.stdout).ok()?;
    let line = stdout.lines().next()?.trim();
    (output.status.success() && !line.is_empty()).then(|| line.to_string())
}
