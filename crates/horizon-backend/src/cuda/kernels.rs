//! The kernel sources, embedded in the binary, and their compilation by NVRTC to a CUBIN for
//! the device's architecture (sm_90 on H100/H200), once at start.
//!
//! Every source is self-contained C++ without `#include`s (bf16 is handled as its 16 bits), so
//! NVRTC needs no CUDA headers at run time.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, sys};
use cudarc::nvrtc;

use super::CudaError;

/// `(op, source)` of every kernel file, `kernels/<op>.cu`.
pub const SOURCES: [(&str, &str); 20] = [
    ("attention", include_str!("../../kernels/attention.cu")),
    ("attention_decode", include_str!("../../kernels/attention_decode.cu")),
    ("attention_mma", include_str!("../../kernels/attention_mma.cu")),
    ("attention_sink", include_str!("../../kernels/attention_sink.cu")),
    ("attention_tc", include_str!("../../kernels/attention_tc.cu")),
    ("cols", include_str!("../../kernels/cols.cu")),
    ("convert", include_str!("../../kernels/convert.cu")),
    ("cross_entropy", include_str!("../../kernels/cross_entropy.cu")),
    ("embedding", include_str!("../../kernels/embedding.cu")),
    ("gate", include_str!("../../kernels/gate.cu")),
    ("geglu", include_str!("../../kernels/geglu.cu")),
    ("grad_norm", include_str!("../../kernels/grad_norm.cu")),
    ("head_rmsnorm", include_str!("../../kernels/head_rmsnorm.cu")),
    ("matmul", include_str!("../../kernels/matmul.cu")),
    ("moe", include_str!("../../kernels/moe.cu")),
    ("nf4", include_str!("../../kernels/nf4.cu")),
    ("residual", include_str!("../../kernels/residual.cu")),
    ("rmsnorm", include_str!("../../kernels/rmsnorm.cu")),
    ("rope", include_str!("../../kernels/rope.cu")),
    ("swiglu", include_str!("../../kernels/swiglu.cu")),
];

/// The `extern "C"` entry points of each source, loaded by name.
pub const FUNCTIONS: [(&str, &[&str]); 20] = [
    (
        "attention",
        &[
            "attention_forward",
            "attention_forward_tiled",
            "attention_delta",
            "attention_backward_dq",
            "attention_backward_dkv",
            "attention_backward_dq_tiled",
            "attention_backward_dkv_tiled",
        ],
    ),
    ("attention_decode", &["attention_decode"]),
    (
        "attention_mma",
        &["attention_forward_mma", "attention_backward_dq_mma", "attention_backward_dkv_mma"],
    ),
    ("attention_sink", &["attention_sink_forward", "attention_sink_backward"]),
    (
        "attention_tc",
        &["attention_forward_tc", "attention_backward_dq_tc", "attention_backward_dkv_tc"],
    ),
    ("cols", &["add_cols", "scaled_cols"]),
    ("convert", &["convert_f32_to_bf16"]),
    (
        "cross_entropy",
        &[
            "cross_entropy_forward",
            "cross_entropy_fused",
            "cross_entropy_tile_stats",
            "cross_entropy_tile_grad",
            "cross_entropy_tile_loss",
        ],
    ),
    ("embedding", &["embedding_forward", "embedding_backward"]),
    ("gate", &["sigmoid_gate_forward", "sigmoid_gate_backward"]),
    ("geglu", &["geglu_forward", "geglu_backward"]),
    ("grad_norm", &["grad_norm_partial"]),
    (
        "head_rmsnorm",
        &["head_rmsnorm_forward", "head_rmsnorm_backward_dinp", "head_rmsnorm_backward_dweight"],
    ),
    ("matmul", &["matmul_bias_forward", "matmul_bias_backward"]),
    (
        "moe",
        &[
            "moe_route_forward",
            "moe_route_backward",
            "moe_aux_stats",
            "moe_gather",
            "moe_scatter_add",
            "moe_scale_rows",
            "moe_row_dots",
            "moe_bias_dots",
        ],
    ),
    ("nf4", &["dequantize_nf4", "dequantize_mxfp4"]),
    ("residual", &["residual_forward", "add_inplace"]),
    ("rmsnorm", &["rmsnorm_forward", "rmsnorm_backward_dinp", "rmsnorm_backward_dweight"]),
    ("rope", &["rope_rotate"]),
    (
        "swiglu",
        &["swiglu_forward", "swiglu_backward", "clamped_swiglu_forward", "clamped_swiglu_backward"],
    ),
];

/// Compiles `kernels/<op>.cu` to a CUBIN for `arch` (`sm_90`). The error carries NVRTC's log.
/// Needs only `libnvrtc` (no GPU, no driver): CI compile-checks every kernel with it.
pub fn compile_cubin(op: &str, src: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    if !super::probe::nvrtc_present() {
        return Err(CudaError(format!(
            "cannot compile kernels/{op}.cu: NVRTC (libnvrtc.so.13) not found\nhint: `pip install \
             nvidia-cuda-nvrtc==13.0.88` and add nvidia/cu13/lib to LD_LIBRARY_PATH"
        )));
    }
    let nul = |s: &str| {
        CString::new(s).map_err(|_| CudaError(format!("kernels/{op}.cu: a NUL byte in {s:?}")))
    };
    let (c_src, c_name) = (nul(src)?, nul(&format!("{op}.cu"))?);
    let prog = nvrtc::result::create_program(&c_src, Some(&c_name))
        .map_err(|e| CudaError(format!("NVRTC: cannot create a program for {op}.cu: {e:?}")))?;
    let opts = [format!("--gpu-architecture={arch}"), "--std=c++17".to_string()];
    // SAFETY: `prog` was created above and is destroyed only at the end of this function.
    let compiled = unsafe { nvrtc::result::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { nvrtc::result::get_program_log(prog) }
        .map(|l| {
            let bytes: Vec<u8> = l.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let result = match compiled {
        Err(e) => Err(CudaError(format!(
            "NVRTC could not compile kernels/{op}.cu for {arch} ({e:?}):\n{log}"
        ))),
        // SAFETY: `prog` compiled successfully, so its CUBIN exists.
        Ok(()) => unsafe { cubin(prog) }
            .map_err(|e| CudaError(format!("NVRTC: no CUBIN for kernels/{op}.cu ({e:?}): {log}"))),
    };
    // SAFETY: created above, not destroyed before.
    let _ = unsafe { nvrtc::result::destroy_program(prog) };
    result
}

/// # Safety
/// `prog` must be a live, successfully compiled program.
unsafe fn cubin(prog: nvrtc::sys::nvrtcProgram) -> Result<Vec<u8>, nvrtc::result::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: `prog` is live (caller); `size` is a valid out pointer.
    unsafe { nvrtc::sys::nvrtcGetCUBINSize(prog, &mut size) }.result()?;
    let mut out = vec![0u8; size];
    // SAFETY: `out` has the `size` bytes NVRTC said the CUBIN has.
    unsafe { nvrtc::sys::nvrtcGetCUBIN(prog, out.as_mut_ptr().cast()) }.result()?;
    Ok(out)
}

/// The architecture NVRTC compiles for: `sm_<major><minor>` of the device.
pub fn arch_of(ctx: &CudaContext) -> Result<String, CudaError> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| CudaError::driver("reading the compute capability", e))?;
    Ok(format!("sm_{major}{minor}"))
}

/// Compiled images by (op, arch).
type CubinCache = HashMap<(&'static str, String), Vec<u8>>;

/// [`compile_cubin`], once per (op, arch) in the process: every device or backend built later
/// (tests build many) loads the same image.
fn cached_cubin(op: &'static str, src: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    static CACHE: OnceLock<Mutex<CubinCache>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (op, arch.to_string());
    if let Some(image) = cache.lock().expect("CUBIN cache lock poisoned").get(&key) {
        return Ok(image.clone());
    }
    let image = compile_cubin(op, src, arch)?;
    cache.lock().expect("CUBIN cache lock poisoned").insert(key, image.clone());
    Ok(image)
}

/// Every kernel, compiled and loaded into one context, looked up by name.
pub struct Kernels {
    funcs: HashMap<&'static str, CudaFunction>,
    /// The dynamic shared memory each function has been allowed so far (bytes; absent: the
    /// default 48 KiB), so that the attribute is set once, not before every launch.
    shared: Mutex<HashMap<&'static str, u32>>,
}

impl Kernels {
    /// Compiles every source for the context's device and loads its functions.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let arch = arch_of(ctx)?;
        let mut funcs = HashMap::new();
        for ((op, src), (op2, names)) in SOURCES.iter().zip(FUNCTIONS.iter()) {
            debug_assert_eq!(op, op2);
            let image = cached_cubin(op, src, &arch)?;
            let module = ctx
                .load_module(nvrtc::Ptx::from_binary(image))
                .map_err(|e| CudaError::driver(&format!("loading kernels/{op}.cu"), e))?;
            for &name in names.iter() {
                let f = module
                    .load_function(name)
                    .map_err(|e| CudaError::driver(&format!("finding {name} in {op}.cu"), e))?;
                funcs.insert(name, f);
            }
        }
        Ok(Kernels { funcs, shared: Mutex::default() })
    }

    /// Runs `allow` (which raises function `name`'s dynamic shared memory limit to `bytes`)
    /// unless an earlier call already allowed at least `bytes`.
    pub(crate) fn allow_shared_once(&self, name: &str, bytes: u32, allow: impl FnOnce()) {
        let (&key, _) =
            self.funcs.get_key_value(name).unwrap_or_else(|| panic!("no CUDA kernel named {name}"));
        let mut shared = self.shared.lock().expect("shared memory table lock poisoned");
        if shared.get(key).is_none_or(|&allowed| allowed < bytes) {
            allow();
            shared.insert(key, bytes);
        }
    }

    /// The function `name` (a bug if it does not exist).
    pub(crate) fn get(&self, name: &str) -> sys::CUfunction {
        self.funcs.get(name).unwrap_or_else(|| panic!("no CUDA kernel named {name}")).cu_function()
    }
}
