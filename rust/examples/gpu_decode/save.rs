//! `--save DIR`: the run's arrays as raw little-endian files and its sizes as `name value` lines
//! (`meta.txt`; float scalars as their IEEE-754 bits), for a reader that recomputes them.

use std::fs;
use std::io;
use std::path::Path;

/// `data`'s bytes as they lie in memory (little-endian on the hosts this example runs on).
pub fn raw<T: Copy>(dir: &Path, name: &str, data: &[T]) -> io::Result<()> {
    // SAFETY: any initialised slice of plain integers can be viewed as bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
    };
    fs::write(dir.join(name), bytes)
}

pub fn meta(dir: &Path, entries: &[(&str, u64)]) -> io::Result<()> {
    fs::create_dir_all(dir)?;
    let text: String = entries.iter().map(|(name, value)| format!("{name} {value}\n")).collect();
    fs::write(dir.join("meta.txt"), text)
}
