//! Without a CUDA driver, building the CUDA device or backend is an error that says what to do,
//! never a panic inside cudarc; without the `cuda` feature, it says the binary was built
//! without CUDA.

use horizon_backend::cuda::{CudaBackend, CudaDevice, CudaDeviceConfig, probe};

/// Prints why a test is skipped, past the test harness's output capture.
fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}

/// Set in the child process that runs the test without the library path's CUDA libraries.
const CHILD: &str = "HORIZON_PROBE_WITHOUT_DRIVER";

#[test]
fn without_a_driver_construction_is_a_clear_error() {
    if probe::driver_present() {
        // The driver (a GPU's, or the CUDA test double) comes from LD_LIBRARY_PATH here: run
        // this test again in a child process whose library path lacks every libcuda.so.
        if std::env::var_os(CHILD).is_some() {
            // Still present without them: installed system-wide, as on a GPU machine, where no
            // process can be without a driver.
            return skip("a CUDA driver is installed system-wide (needs a machine without one)");
        }
        let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        let kept: Vec<&str> = path
            .split(':')
            .filter(|d| !std::path::Path::new(d).join("libcuda.so").exists())
            .collect();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "without_a_driver_construction_is_a_clear_error", "--nocapture"])
            .env("LD_LIBRARY_PATH", kept.join(":"))
            .env(CHILD, "1")
            .output()
            .expect("cannot run this test binary again");
        let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "the test without a driver failed:\n{text}");
        assert!(text.contains("1 passed"), "the test without a driver did not run:\n{text}");
        if let Some(line) = text.lines().find(|l| l.starts_with("SKIPPED: ")) {
            skip(&line["SKIPPED: ".len()..]);
        }
        return;
    }
    let want = if cfg!(feature = "cuda") {
        "no CUDA driver found; use device.backend = cpu"
    } else {
        "this binary was built without CUDA"
    };
    let err = CudaDevice::new(CudaDeviceConfig::with_capacity(1 << 20))
        .expect_err("a device without a driver");
    assert!(err.to_string().contains(want), "{err}");
    let err = CudaBackend::new(0, 64 << 20).expect_err("a backend without a driver");
    assert!(err.to_string().contains(want), "{err}");
    assert!(probe().is_err());
}

/// The kernels' limits are refused before any device work, naming the limit and the value (the
/// same check with and without the `cuda` feature: `horizon plan` and `horizon train` call it).
#[test]
fn kernel_limits_are_refused_by_name() {
    use horizon_backend::cuda::{KernelShape, MAX_HEAD_DIM, check_kernel_limits};
    let ok = KernelShape { c: 4096, h: 32, kvh: 8, d: 128, f: 14336, v: 128_256, b: 4, t: 4096 };
    assert!(check_kernel_limits(&ok).is_ok());
    assert!(check_kernel_limits(&KernelShape { d: MAX_HEAD_DIM, ..ok }).is_ok());
    let refused = |s: KernelShape, want: &[&str]| {
        let err = check_kernel_limits(&s).expect_err("a shape beyond the kernels").to_string();
        for w in want {
            assert!(err.contains(w), "{w:?} not in: {err}");
        }
    };
    refused(KernelShape { d: 320, ..ok }, &["head_dim 320", "1..=256", "device.backend = cpu"]);
    refused(KernelShape { d: 0, ..ok }, &["head_dim 0"]);
    refused(KernelShape { kvh: 5, ..ok }, &["num_attention_heads 32", "num_key_value_heads 5"]);
    refused(KernelShape { b: 70_000, t: 1, ..ok }, &["sequences per micro-batch, 70000", "65535"]);
    refused(
        KernelShape { b: 1024, t: 1 << 21, ..ok },
        &["tokens per micro-batch", "2147483648", "train.max_seq_len"],
    );
    refused(KernelShape { v: 1 << 31, ..ok }, &["vocab_size = 2147483648"]);
}
