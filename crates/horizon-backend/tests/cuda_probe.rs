//! Without a CUDA driver, building the CUDA device or backend is an error that says what to do,
//! never a panic inside cudarc; without the `cuda` feature, it says the binary was built
//! without CUDA.

use horizon_backend::cuda::{CudaBackend, CudaDevice, CudaDeviceConfig, probe};

/// Prints why a test is skipped, past the test harness's output capture.
fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}
#[test]
fn without_a_driver_construction_is_a_clear_error() {
    if probe::driver_present() {
        skip("a CUDA driver is present on this machine");
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
