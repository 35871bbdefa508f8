//! Looks for the CUDA libraries before cudarc touches them: cudarc's dynamic loading panics
//! when `libcuda`, `libnvrtc` or `libcublas` cannot be opened; we return an error instead.

use super::CudaError;

/// Whether a library of cudarc's candidate names for `name` can be opened.
fn loadable(name: &str) -> bool {
    cudarc::get_lib_name_candidates(name).iter().any(|file| {
        // SAFETY: opening a CUDA library runs its initialisers, which have no preconditions;
        // the handle is dropped at once (cudarc opens it again, and keeps it).
        unsafe { libloading::Library::new(file) }.is_ok()
    })
}

/// True when the CUDA driver library can be opened.
pub fn driver_present() -> bool {
    loadable("cuda")
}

/// True when NVRTC can be opened (`LD_LIBRARY_PATH` must name the directory of
/// `libnvrtc.so.13` and `libnvrtc-builtins.so.13.0`, e.g. the `nvidia-cuda-nvrtc` wheel's).
pub fn nvrtc_present() -> bool {
    loadable("nvrtc")
}

/// Checks that the driver, NVRTC and cuBLAS libraries can be opened.
pub fn probe() -> Result<(), CudaError> {
    if !driver_present() {
        return Err(CudaError(
            "no CUDA driver found; use device.backend = cpu (libcuda.so could not be opened: \
             is an NVIDIA driver installed, and is this a GPU machine?)"
                .into(),
        ));
    }
    if !nvrtc_present() {
        return Err(CudaError(
            "NVRTC not found (libnvrtc.so.13): the CUDA kernels are compiled at start\n\
             hint: install the CUDA toolkit or `pip install nvidia-cuda-nvrtc==13.0.88` and add \
             its lib directory to LD_LIBRARY_PATH; or use device.backend = cpu"
                .into(),
        ));
    }
    if !loadable("cublas") || !loadable("cublasLt") {
        return Err(CudaError(
            "cuBLAS not found (libcublas.so.13, libcublasLt.so.13)\n\
             hint: install the CUDA toolkit or `pip install nvidia-cublas` and add its lib \
             directory to LD_LIBRARY_PATH; or use device.backend = cpu"
                .into(),
        ));
    }
    Ok(())
}
