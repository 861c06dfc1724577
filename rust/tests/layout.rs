//! `sys` against `fp8kturbov.h`, so that the two cannot drift apart. A C program generated from
//! the lists below and compiled with the system C compiler (`$CC`, else `cc`) against the header
//! prints the size of every struct and enum type, the offset and size of every field, and every
//! enum value and macro; the Rust side computes the same with `size_of` / `offset_of!`. The
//! program also redeclares every function with the C types of its Rust declaration, which the
//! compiler refuses if they differ (pointee `const` included). Finally the lists are compared with
//! the names the preprocessed header declares, so that an item added to the header and not to
//! `sys` fails as well.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_void};
use std::mem::{offset_of, size_of, MaybeUninit};
use std::path::{Path, PathBuf};
use std::process::Command;

use fp8kturbov::sys;

// ---- What the Rust side declares ----------------------------------------------------------------

struct Struct {
    name: &'static str,
    size: usize,
    fields: Vec<(&'static str, usize, usize)>, // name, offset, size
}

fn pointee_size<T>(_: *const T) -> usize {
    size_of::<T>()
}

macro_rules! structs {
    ($($t:ident { $($f:ident),* $(,)? })*) => {
        vec![$(Struct {
            name: stringify!($t),
            size: size_of::<sys::$t>(),
            fields: vec![$({
                let uninit = MaybeUninit::<sys::$t>::uninit();
                // SAFETY: takes a field's address without reading it.
                let size = pointee_size(unsafe { std::ptr::addr_of!((*uninit.as_ptr()).$f) });
                (stringify!($f), offset_of!(sys::$t, $f), size)
            }),*],
        }),*]
    };
}

fn rust_structs() -> Vec<Struct> {
    structs! {
        fp8kturbov_write_params_t {
            struct_size, key, value, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads,
            head_dim, block_size, key_stride, value_stride, k_scale, v_bits, k_block_stride_bytes,
            v_block_stride_bytes, v_data_section_bytes, num_blocks, error_flags, v_encoder,
            v_rotation,
        }
        fp8kturbov_decode_params_t {
            struct_size, q, k_cache, v_cache, output, block_tables, seq_lens, max_blocks_per_seq,
            num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, inv_sqrt_d, k_scale,
            q_stride, v_bits, k_block_stride_bytes, v_block_stride_bytes, v_data_section_bytes,
            sliding_window, sparse_v_threshold, workspace, workspace_bytes, num_blocks,
            error_flags, sinks, soft_cap, query_start, max_q_len, num_query_rows, v_rotation,
            block_tables_stride, append_key, append_value, append_slot_mapping, append_key_stride,
            append_value_stride, v_encoder,
        }
        fp8kturbov_prefill_params_t {
            struct_size, q, k_cache, v_cache, output, lse, block_tables, seq_lens, query_start,
            max_blocks_per_seq, num_seqs, num_q_heads, num_kv_heads, head_dim, block_size,
            inv_sqrt_d, k_scale, q_stride, v_bits, k_block_stride_bytes, v_block_stride_bytes,
            v_data_section_bytes, block_tables_stride, sliding_window, soft_cap, sinks, v_rotation,
            max_q_len, num_query_rows, workspace, workspace_bytes, num_blocks, error_flags,
        }
        fp8kturbov_dequantize_params_t {
            struct_size, k_cache, v_cache, slot_mapping, key, value, num_tokens, num_kv_heads,
            head_dim, block_size, key_stride, value_stride, k_scale, v_bits, k_block_stride_bytes,
            v_block_stride_bytes, v_data_section_bytes, num_blocks, error_flags,
        }
    }
}

macro_rules! type_sizes {
    ($($t:ident),* $(,)?) => { vec![$((stringify!($t), size_of::<sys::$t>())),*] };
}

fn rust_type_sizes() -> Vec<(&'static str, usize)> {
    type_sizes![
        fp8kturbov_status_t,
        fp8kturbov_index_error_t,
        fp8kturbov_v_encoder_t,
        fp8kturbov_v_rotation_t,
        fp8kturbov_stream_t,
    ]
}

/// (name, is a float, value: the integer, or the float's bits)
macro_rules! constants {
    (ints: $($i:ident),* ; floats: $($f:ident),* $(,)?) => {
        vec![
            $((stringify!($i), false, sys::$i as i128),)*
            $((stringify!($f), true, sys::$f.to_bits() as i128),)*
        ]
    };
}

fn rust_constants() -> Vec<(&'static str, bool, i128)> {
    constants! {
        ints: FP8KTURBOV_VERSION_MAJOR, FP8KTURBOV_VERSION_MINOR, FP8KTURBOV_VERSION_PATCH,
        FP8KTURBOV_VERSION, FP8KTURBOV_ABI_VERSION, FP8KTURBOV_DEFAULT_V_BITS,
        FP8KTURBOV_MAX_QUERY_LEN, FP8KTURBOV_STATUS_SUCCESS, FP8KTURBOV_STATUS_INVALID_VALUE,
        FP8KTURBOV_STATUS_NULL_POINTER, FP8KTURBOV_STATUS_MISALIGNED,
        FP8KTURBOV_STATUS_NOT_SUPPORTED, FP8KTURBOV_STATUS_BAD_STRUCT_SIZE,
        FP8KTURBOV_STATUS_CUDA_ERROR, FP8KTURBOV_INDEX_ERROR_SLOT,
        FP8KTURBOV_INDEX_ERROR_BLOCK_TABLE, FP8KTURBOV_INDEX_ERROR_SEQ_LEN,
        FP8KTURBOV_INDEX_ERROR_QUERY_START, FP8KTURBOV_V_ENCODER_MATCHED_NORM,
        FP8KTURBOV_V_ENCODER_MSE, FP8KTURBOV_V_ENCODER_PROJECTION, FP8KTURBOV_V_ROTATION_NONE,
        FP8KTURBOV_V_ROTATION_HADAMARD,
        FP8KTURBOV_WRITE_PARAMS_V1_SIZE, FP8KTURBOV_WRITE_PARAMS_V2_SIZE,
        FP8KTURBOV_DECODE_PARAMS_V1_SIZE, FP8KTURBOV_DECODE_PARAMS_V2_SIZE,
        FP8KTURBOV_DECODE_PARAMS_V3_SIZE, FP8KTURBOV_DECODE_PARAMS_V4_SIZE, FP8KTURBOV_DEQUANTIZE_PARAMS_V1_SIZE;
        floats: FP8KTURBOV_DEFAULT_SPARSE_V_THRESHOLD,
    }
}

/// The C spelling of a Rust type of the ABI.
trait CType {
    fn c_type() -> String;
}

macro_rules! c_types {
    ($($t:ty => $c:expr),* $(,)?) => {
        $(impl CType for $t { fn c_type() -> String { $c.to_string() } })*
    };
}

c_types! {
    () => "void", c_void => "void", c_char => "char", u32 => "uint32_t", u64 => "uint64_t",
    i32 => "int32_t", i64 => "int64_t", usize => "size_t", f32 => "float",
    sys::CUstream_st => "struct CUstream_st",
    sys::fp8kturbov_write_params_t => "fp8kturbov_write_params_t",
    sys::fp8kturbov_decode_params_t => "fp8kturbov_decode_params_t",
    sys::fp8kturbov_prefill_params_t => "fp8kturbov_prefill_params_t",
    sys::fp8kturbov_dequantize_params_t => "fp8kturbov_dequantize_params_t",
}

impl<T: CType> CType for *const T {
    fn c_type() -> String {
        format!("const {}*", T::c_type())
    }
}

impl<T: CType> CType for *mut T {
    fn c_type() -> String {
        format!("{}*", T::c_type())
    }
}

/// A C prototype of a function pointer type.
trait CFunction {
    fn c_declaration(name: &str) -> String;
}

macro_rules! c_function {
    ($($arg:ident),*) => {
        impl<R: CType, $($arg: CType),*> CFunction for unsafe extern "C" fn($($arg),*) -> R {
            fn c_declaration(name: &str) -> String {
                let params: Vec<String> = vec![$($arg::c_type()),*];
                let params = if params.is_empty() { "void".to_string() } else { params.join(", ") };
                format!("{} {name}({params});", R::c_type())
            }
        }
    };
}

/// `CFunction` for every arity up to 19 (the decode launchers').
macro_rules! c_functions {
    () => { c_function!(); };
    ($head:ident $($tail:ident)*) => { c_functions!($($tail)*); c_function!($head $(, $tail)*); };
}
c_functions!(A B C D E F G H I J K L M N O P Q S T);

fn declaration<F: CFunction>(name: &str, _: F) -> (String, String) {
    (name.to_string(), F::c_declaration(name))
}

/// Each function cast to a pointer of its arity (one `_` per argument): the argument and return
/// types are those `sys` declares.
macro_rules! functions {
    ($($f:ident($($arg:tt),*)),* $(,)?) => {
        vec![$(declaration(stringify!($f), sys::$f as unsafe extern "C" fn($($arg),*) -> _)),*]
    };
}

fn rust_functions() -> Vec<(String, String)> {
    functions![
        fp8kturbov_version(),
        fp8kturbov_abi_version(),
        fp8kturbov_cuda_runtime_version(),
        fp8kturbov_build_commit(),
        fp8kturbov_status_string(_),
        fp8kturbov_last_error_message(),
        fp8kturbov_k_page_bytes(_, _, _),
        fp8kturbov_v_data_section_bytes(_, _, _, _),
        fp8kturbov_v_page_bytes(_, _, _, _),
        fp8kturbov_write_params_init(_),
        fp8kturbov_write_params_init_sized(_, _),
        fp8kturbov_reshape_and_cache(_, _),
        fp8kturbov_reshape_and_cache_fp8k_turbo2v(_, _, _, _, _, _, _, _, _, _, _, _, _, _, _, _),
        fp8kturbov_reshape_and_cache_fp8k_turbo3v(_, _, _, _, _, _, _, _, _, _, _, _, _, _, _, _),
        fp8kturbov_reshape_and_cache_fp8k_turbo4v(_, _, _, _, _, _, _, _, _, _, _, _, _, _, _, _),
        fp8kturbov_decode_params_init(_),
        fp8kturbov_decode_params_init_sized(_, _),
        fp8kturbov_paged_decode_attn(_, _),
        fp8kturbov_paged_decode_workspace_bytes(_, _),
        fp8kturbov_paged_decode_attn_fp8k_turbo2v(
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _
        ),
        fp8kturbov_paged_decode_attn_fp8k_turbo3v(
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _
        ),
        fp8kturbov_paged_decode_attn_fp8k_turbo4v(
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _,
            _
        ),
        fp8kturbov_prefill_params_init(_),
        fp8kturbov_prefill_params_init_sized(_, _),
        fp8kturbov_paged_prefill_attn(_, _),
        fp8kturbov_paged_prefill_workspace_bytes(_, _),
        fp8kturbov_dequantize_params_init(_),
        fp8kturbov_dequantize_params_init_sized(_, _),
        fp8kturbov_dequantize(_, _),
    ]
}

// ---- The C side ---------------------------------------------------------------------------------

fn include_dir() -> PathBuf {
    // Set by the build script when it found the header (see build.rs).
    PathBuf::from(env!(
        "FP8KTURBOV_INCLUDE_DIR",
        "the build script found no fp8kturbov.h: set FP8KTURBOV_INCLUDE_DIR to its folder"
    ))
}

fn work_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(command: &mut Command) -> String {
    let output = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{command:?} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn cc() -> Command {
    let mut words = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    if words.trim().is_empty() {
        words = "cc".to_string();
    }
    let mut words = words.split_whitespace();
    let mut command = Command::new(words.next().unwrap());
    command.args(words);
    command
}

/// The C program: redeclarations of the functions, then one `key=value` line per size, offset
/// and constant (a float's value as its bits).
fn c_program() -> String {
    let mut body = String::new();
    for s in rust_structs() {
        body += &format!("  P(\"sizeof {0}\", sizeof({0}));\n", s.name);
        for (field, _, _) in &s.fields {
            body += &format!("  P(\"offsetof {0}.{1}\", offsetof({0}, {1}));\n", s.name, field);
            body +=
                &format!("  P(\"sizeof {0}.{1}\", sizeof(((const {0}*)0)->{1}));\n", s.name, field);
        }
    }
    for (name, _) in rust_type_sizes() {
        body += &format!("  P(\"sizeof {name}\", sizeof({name}));\n");
    }
    for (name, is_float, _) in rust_constants() {
        let value = if is_float { format!("float_bits({name})") } else { name.to_string() };
        body += &format!("  P(\"{name}\", {value});\n");
    }
    let declarations: Vec<String> = rust_functions().into_iter().map(|(_, d)| d).collect();
    format!(
        "#include <stdio.h>\n#include <string.h>\n#include \"fp8kturbov.h\"\n\n{}\n\n\
         static long long float_bits(float f) {{\n  uint32_t bits;\n  \
         memcpy(&bits, &f, sizeof bits);\n  return (long long)bits;\n}}\n\
         #define P(key, value) printf(\"%s=%lld\\n\", key, (long long)(value))\n\n\
         int main(void) {{\n{body}  return 0;\n}}\n",
        declarations.join("\n")
    )
}

fn c_values() -> BTreeMap<String, i128> {
    let dir = work_dir("layout");
    let source = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&source, c_program()).unwrap();
    run(cc()
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(include_dir())
        .arg(&source)
        .arg("-o")
        .arg(&exe));
    run(&mut Command::new(&exe))
        .lines()
        .map(|line| {
            let (key, value) = line.split_once('=').unwrap();
            (key.to_string(), value.parse().unwrap())
        })
        .collect()
}

fn rust_values() -> BTreeMap<String, i128> {
    let mut values = BTreeMap::new();
    for s in rust_structs() {
        values.insert(format!("sizeof {}", s.name), s.size as i128);
        for (field, offset, size) in s.fields {
            values.insert(format!("offsetof {}.{field}", s.name), offset as i128);
            values.insert(format!("sizeof {}.{field}", s.name), size as i128);
        }
    }
    for (name, size) in rust_type_sizes() {
        values.insert(format!("sizeof {name}"), size as i128);
    }
    for (name, _, value) in rust_constants() {
        values.insert(name.to_string(), value);
    }
    values
}

#[test]
fn sizes_offsets_constants_and_signatures_match_the_header() {
    let (c, rust) = (c_values(), rust_values());
    let differences: Vec<String> = c
        .keys()
        .chain(rust.keys())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter(|key| c.get(*key) != rust.get(*key))
        .map(|key| format!("{key}: C {:?}, Rust {:?}", c.get(key), rust.get(key)))
        .collect();
    assert!(differences.is_empty(), "sys differs from the header:\n{}", differences.join("\n"));
}

// ---- Names the header declares ------------------------------------------------------------------

fn preprocessed_header(extra: &[&str]) -> String {
    run(cc().args(["-E", "-P"]).args(extra).arg(include_dir().join("fp8kturbov.h")))
}

/// The text between the braces of `keyword name {` (a struct's or enum's body).
fn body<'a>(text: &'a str, keyword: &str, name: &str) -> &'a str {
    let start = text.find(&format!("{keyword} {name} {{")).unwrap_or_else(|| panic!("{name}"));
    let open = start + text[start..].find('{').unwrap() + 1;
    &text[open..open + text[open..].find('}').unwrap()]
}

fn identifiers(text: &str) -> Vec<&str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect()
}

fn assert_same_names(what: &str, header: &BTreeSet<String>, rust: &BTreeSet<String>) {
    let header_only: Vec<&String> = header.difference(rust).collect();
    let rust_only: Vec<&String> = rust.difference(header).collect();
    assert!(
        header_only.is_empty() && rust_only.is_empty(),
        "{what}: in the header only {header_only:?}, in sys (or the lists here) only {rust_only:?}"
    );
}

#[test]
fn sys_declares_every_item_of_the_header() {
    let header = preprocessed_header(&[]);
    for s in rust_structs() {
        let tag = s.name.strip_suffix("_t").unwrap();
        // A member declaration's last identifier is its name.
        let c_fields: Vec<&str> = body(&header, "typedef struct", tag)
            .split(';')
            .filter_map(|member| identifiers(member).last().copied())
            .collect();
        let rust_fields: Vec<&str> = s.fields.iter().map(|(name, _, _)| *name).collect();
        assert_eq!(c_fields, rust_fields, "fields of {}", s.name);
    }

    let mut c_constants = BTreeSet::new();
    for (name, _) in
        rust_type_sizes().into_iter().filter(|(name, _)| *name != "fp8kturbov_stream_t")
    {
        let tag = name.strip_suffix("_t").unwrap();
        for enumerator in body(&header, "typedef enum", tag).split(',') {
            c_constants.extend(identifiers(enumerator).first().map(|s| s.to_string()));
        }
    }
    // Object-like macros, less the include guard and the export attribute.
    for line in preprocessed_header(&["-dM"]).lines() {
        let name = line.strip_prefix("#define ").and_then(|rest| rest.split(' ').next());
        match name {
            Some(name) if name.starts_with("FP8KTURBOV_") && !name.contains('(') => {
                c_constants.insert(name.to_string());
            }
            _ => {}
        }
    }
    c_constants.remove("FP8KTURBOV_H_");
    c_constants.remove("FP8KTURBOV_API");
    let rust_constants: BTreeSet<String> =
        rust_constants().into_iter().map(|(name, _, _)| name.to_string()).collect();
    assert_same_names("enum values and macros", &c_constants, &rust_constants);

    let c_functions: BTreeSet<&str> = header
        .match_indices("fp8kturbov_")
        .filter(|(at, _)| *at == 0 || !header.as_bytes()[at - 1].is_ascii_alphanumeric())
        .filter_map(|(at, _)| {
            let name = identifiers(&header[at..])[0];
            header[at + name.len()..].trim_start().starts_with('(').then_some(name)
        })
        .collect();
    let c_functions: BTreeSet<String> = c_functions.into_iter().map(String::from).collect();
    let rust_functions: BTreeSet<String> =
        rust_functions().into_iter().map(|(name, _)| name).collect();
    assert_same_names("functions", &c_functions, &rust_functions);
}

#[test]
fn crate_version_is_the_headers() {
    let header = format!(
        "{}.{}.{}",
        sys::FP8KTURBOV_VERSION_MAJOR,
        sys::FP8KTURBOV_VERSION_MINOR,
        sys::FP8KTURBOV_VERSION_PATCH
    );
    assert_eq!(env!("CARGO_PKG_VERSION"), header, "Cargo.toml's version");
}
