//! Every kernel source compiles with NVRTC to an sm_90 CUBIN (feature `cuda`). Needs only
//! libnvrtc, no GPU and no driver: CI installs the `nvidia-cuda-nvrtc` wheel and sets
//! `LD_LIBRARY_PATH` and `HORIZON_REQUIRE_NVRTC=1`, which turns a missing NVRTC into a failure;
//! elsewhere the compile checks are skipped with the reason printed.

#![cfg(feature = "cuda")]

use horizon_backend::cuda::kernels::{FUNCTIONS, SOURCES, compile_cubin};
use horizon_backend::cuda::probe;

/// Prints why a test is skipped, past the test harness's output capture.
fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}
/// True when NVRTC is there; otherwise prints why the test is skipped (or fails in CI).
fn nvrtc() -> bool {
    if probe::nvrtc_present() {
        return true;
    }
    let why = "NVRTC (libnvrtc.so.13) not found: `pip install nvidia-cuda-nvrtc==13.0.88` and \
               put its nvidia/cu13/lib on LD_LIBRARY_PATH";
    assert!(
        std::env::var_os("HORIZON_REQUIRE_NVRTC").is_none(),
        "{why} (HORIZON_REQUIRE_NVRTC is set)"
    );
    skip(why);
    false
}

#[test]
fn every_kernel_compiles_to_an_sm90_cubin() {
    if !nvrtc() {
        return;
    }
    let mut failures = Vec::new();
    for (op, src) in SOURCES {
        match compile_cubin(op, src, "sm_90") {
            Ok(cubin) => {
                assert!(
                    cubin.starts_with(b"\x7fELF"),
                    "kernels/{op}.cu: NVRTC's CUBIN is not an ELF image"
                );
                // Every entry point the backend loads from this file is a symbol of its image
                // (a NUL-delimited name in the ELF string table), so a name missing from
                // kernels::FUNCTIONS' list, or misspelt there, fails here and not at start.
                let (_, names) = FUNCTIONS.iter().find(|(o, _)| *o == op).expect("listed");
                for name in names.iter() {
                    let sym = format!("\0{name}\0").into_bytes();
                    if !cubin.windows(sym.len()).any(|w| w == sym) {
                        failures.push(format!("kernels/{op}.cu: no entry point {name}"));
                    }
                }
                eprintln!("kernels/{op}.cu: {} bytes of sm_90 CUBIN", cubin.len());
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} kernels failed to compile:\n{}",
        failures.len(),
        SOURCES.len(),
        failures.join("\n\n")
    );
}

#[test]
fn a_broken_kernel_fails_with_the_compiler_log() {
    if !nvrtc() {
        return;
    }
    let src = "extern \"C\" __global__ void broken(float* x) { x[0] = not_declared_anywhere; }";
    let err = compile_cubin("broken", src, "sm_90").expect_err("a broken kernel compiled");
    let msg = err.to_string();
    assert!(msg.contains("kernels/broken.cu") && msg.contains("not_declared_anywhere"), "{msg}");
}

#[test]
fn every_file_in_kernels_is_embedded() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".cu").map(str::to_string))
        .collect();
    on_disk.sort();
    let mut embedded: Vec<String> = SOURCES.iter().map(|(op, _)| op.to_string()).collect();
    embedded.sort();
    assert_eq!(on_disk, embedded, "kernels/*.cu and kernels::SOURCES disagree");
    let sources: Vec<&str> = SOURCES.iter().map(|(op, _)| *op).collect();
    let loaded: Vec<&str> = FUNCTIONS.iter().map(|(op, _)| *op).collect();
    assert_eq!(sources, loaded, "kernels::SOURCES and kernels::FUNCTIONS list different files");
}
