//! AdamW on fp32 master weights, bit-exact with `torch.optim.AdamW`'s single-tensor CPU path, and
//! the global-L2-norm clip coefficient of `torch.nn.utils.clip_grad_norm_`.
//!
//! # How this maps to PyTorch
//!
//! `torch.optim.AdamW(foreach=False, fused=False, amsgrad=False, maximize=False)` runs
//! `_single_tensor_adam(..., decoupled_weight_decay=True)`, which for each parameter tensor does
//! (float32 tensors, Python-float scalars):
//!
//! | PyTorch (`torch/optim/adam.py`)                              | here (`update_one`)                          |
//! |--------------------------------------------------------------|----------------------------------------------|
//! | `clip_grad_norm_`: `grad.mul_(clip_coef_clamped)`            | `g = grad * grad_scale`                      |
//! | `step_t += 1`                                                | caller passes the 1-based `t` to [`AdamWStep::new`] |
//! | `param.mul_(1 - lr * weight_decay)`                          | `p = param * decay`                          |
//! | `exp_avg.lerp_(grad, 1 - beta1)`                             | `m = m + w * (g - m)` (`\|w\| < 0.5`), else `g - (g - m) * (1 - w)` |
//! | `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)` | `v = v * beta2 + ((1 - beta2) * g) * g`    |
//! | `bias_correction1 = 1 - beta1 ** step`, `step_size = lr / bias_correction1` | [`AdamWStep::neg_step_size`], in f64 |
//! | `bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5`         | [`AdamWStep::bias_correction2_sqrt`], in f64 |
//! | `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` | `denom = sqrt(v) / bc2_sqrt + eps`        |
//! | `param.addcdiv_(exp_avg, denom, value=-step_size)`           | `p = p + (neg_step_size * m) / denom`        |
//!
//! Every Python-float scalar is computed in f64 as Python does and becomes an f32 operand when it
//! meets an f32 tensor (ATen casts a CPU scalar to the tensor's `opmath_t`, `float` for f32). Each
//! elementwise op rounds to f32 once, in the association order of ATen's CPU kernels (`addcmul`:
//! `self + value * t1 * t2`; `addcdiv`: `self + value * t1 / t2`; `div` by a scalar is a true
//! division on CPU, not a reciprocal multiply).
//!
//! Known FMA subtlety: ATen's *vectorised* `lerp` body on AVX2/AVX-512 builds computes
//! `fmadd(w, end - self, self)` (one rounding) while its scalar tail computes
//! `self + w * (end - self)` (two roundings). We implement the two-rounding form everywhere (no FMA
//! in any path, so the SIMD and scalar paths here agree bit for bit); against a real PyTorch run,
//! `m` may therefore differ, on elements PyTorch handled in its vector body, by the rounding of the
//! product `w * (g - m)`: half an ulp of that product, usually 1 ulp of `m` or less, more in ulps of
//! `m` where the sum nearly cancels (switching this code to FMA moved `m` by up to 25 ulp on the
//! 22-element fixture). In absolute terms that is at most about 3e-9 times `|g - m|`, far
//! below every tolerance the model fixtures use. `scripts/adamw_reference.py` emulates the formula
//! above in numpy float32 and `tests/adamw.rs` checks this code against it bit for bit.
//!
//! # Execution
//!
//! The rule is elementwise, so one call can update a flat buffer holding many tensors.
//! [`adamw_update`] splits the buffer into fixed chunks of [`ADAMW_CHUNK`] elements run in
//! parallel (rayon); each chunk is a body over lanes of 8 (auto-vectorised; compiled a second time
//! with AVX2 and picked by runtime detection on x86-64) plus a scalar tail. No reduction crosses
//! elements, so the result does not depend on the chunking, the thread count or the SIMD width:
//! serial, parallel, SIMD and scalar runs are bit-identical (tested).
//!
//! [`adamw_update_image`] (and [`adamw_update_serial_image`]) also write the bf16 image of the
//! new masters, `Bf16::from_f32` (round to nearest even), in the same lane loop: the device's
//! bf16 weights, produced while the masters are in registers instead of in a second pass over
//! them. The masters and moments are bit-identical with and without the image (tested); the
//! plain functions are compiled without the image code.
//!
//! # Held elements
//!
//! An element whose new master, `m` or `v` would not be finite (an f32 overflow: `g * g` of a
//! huge unclipped gradient in `v`, a master pushed past `f32::MAX` by a huge `lr`; or a NaN)
//! is *held*: nothing new is written for it, its master and moments keep their old values
//! (still in registers), and its image is `bf16` of that old master. Every update function
//! returns how many elements it held, counted in the same pass (no second pass over the
//! masters). The test is a select after the element's update, so the held count and every
//! written bit are the same on the serial, parallel, SIMD and scalar paths (tested), and an
//! update that holds nothing is bit-identical to one without the test.

use horizon_backend::Bf16;
use rayon::prelude::*;

/// Elements per parallel task of [`adamw_update`] (a multiple of the lane width 8).
pub const ADAMW_CHUNK: usize = 1 << 15;

/// Elements per partial sum of [`sum_squares`]. Fixed, so the result does not depend on threads.
pub const SUM_SQUARES_CHUNK: usize = 1 << 16;

/// Lane width of the vectorised body.
const LANES: usize = 8;

/// AdamW hyper-parameters, with PyTorch's names and meanings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Peak learning rate (a schedule may pass a different `lr` to [`AdamWStep::new`]).
    pub lr: f64,
    /// Decay of the first moment (`betas[0]`).
    pub beta1: f64,
    /// Decay of the second moment (`betas[1]`).
    pub beta2: f64,
    /// Added to `sqrt(v_hat)` in the denominator.
    pub eps: f64,
    /// Decoupled weight decay: `param *= 1 - lr * weight_decay` every step.
    pub weight_decay: f64,
}

/// The scalars of optimizer step `t` (1-based), computed in f64 as PyTorch's Python code does, then
/// cast to f32 where PyTorch uses them as scalar operands of f32 tensor ops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// `1 - lr * weight_decay` (`param.mul_`).
    pub decay: f32,
    /// `1 - beta1`, the weight of `exp_avg.lerp_(grad, weight)`.
    pub lerp_weight: f32,
    /// `beta2` (`exp_avg_sq.mul_`).
    pub beta2: f32,
    /// `1 - beta2`, the value of `addcmul_`.
    pub one_minus_beta2: f32,
    /// `(1 - beta2^t) ** 0.5`.
    pub bias_correction2_sqrt: f32,
    /// `1 / (1 - beta2^t) ** 0.5`, rounded once from f64: what the 8-bit update multiplies by
    /// instead of dividing by `bias_correction2_sqrt` ([`update_one`]'s `RECIPROCAL`).
    pub inv_bias_correction2_sqrt: f32,
    /// `eps` (`add_`).
    pub eps: f32,
    /// `-lr / (1 - beta1^t)`, the value of `addcdiv_`.
    pub neg_step_size: f32,
}

impl AdamWStep {
    /// Scalars for step `step` (1-based, as PyTorch's `state["step"]` after its increment) at
    /// learning rate `lr` (`cfg.lr` is not read, so a schedule can pass its own value).
    pub fn new(cfg: &AdamWConfig, step: u64, lr: f64) -> Self {
        assert!(step >= 1, "AdamW steps are 1-based, got step {step}");
        // Python: `beta ** step` with `step` a float (from `step_t.item()`): C `pow`.
        let t = step as f64;
        let bias_correction1 = 1.0 - cfg.beta1.powf(t);
        let bias_correction2 = 1.0 - cfg.beta2.powf(t);
        let step_size = lr / bias_correction1;
        Self {
            decay: (1.0 - lr * cfg.weight_decay) as f32,
            lerp_weight: (1.0 - cfg.beta1) as f32,
            beta2: cfg.beta2 as f32,
            one_minus_beta2: (1.0 - cfg.beta2) as f32,
            // Python's `** 0.5`; sqrt is correctly rounded, as glibc's pow is in practice.
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            inv_bias_correction2_sqrt: (1.0 / bias_correction2.sqrt()) as f32,
            eps: cfg.eps as f32,
            neg_step_size: (-step_size) as f32,
        }
    }

    /// ATen's `is_lerp_weight_small`: which of `lerp`'s two formulas applies.
    pub(crate) fn lerp_weight_small(&self) -> bool {
        self.lerp_weight.abs() < 0.5
    }

    /// The same step in a parameter group of `weight_decay` 0: `decay` is 1, and `p * 1` is
    /// `p` bit for bit, as PyTorch's skipped `param.mul_`.
    pub fn without_decay(&self) -> AdamWStep {
        AdamWStep { decay: 1.0, ..*self }
    }
}

/// One buffer's update scalars: the step's, and the element ranges of the buffer that take no
/// weight decay (`optim::decay`'s groups: sorted, disjoint, whole tensors). An elementwise
/// update splits the buffer into runs ([`BufferStep::runs`]); one that goes tensor by tensor
/// asks for each tensor's scalars ([`BufferStep::of`]).
#[derive(Clone, Copy, Debug)]
pub struct BufferStep<'a> {
    /// The step's scalars, with the run's weight decay.
    pub step: AdamWStep,
    /// The ranges that take `step.without_decay()`.
    pub exempt: &'a [std::ops::Range<usize>],
}

impl<'a> BufferStep<'a> {
    /// `step` on every element but those of `exempt`, which take no decay.
    pub fn new(step: AdamWStep, exempt: &'a [std::ops::Range<usize>]) -> Self {
        BufferStep { step, exempt }
    }

    /// `step` on every element.
    pub fn uniform(step: AdamWStep) -> BufferStep<'static> {
        BufferStep { step, exempt: &[] }
    }

    /// The scalars of the tensor at elements `r` (wholly inside an exempt range or outside all
    /// of them: a range that straddles one is a caller's bug).
    pub fn of(&self, r: std::ops::Range<usize>) -> AdamWStep {
        match self.exempt.iter().find(|e| e.start < r.end && r.start < e.end) {
            None => self.step,
            Some(e) => {
                assert!(
                    e.start <= r.start && r.end <= e.end,
                    "tensor {r:?} straddles the no-decay range {e:?}"
                );
                self.step.without_decay()
            }
        }
    }

    /// Elements `0..n` as consecutive runs, each with its scalars: the one run `(0..n, step)`
    /// when nothing is exempt. No allocation.
    pub fn runs(
        &self,
        n: usize,
    ) -> impl Iterator<Item = (std::ops::Range<usize>, AdamWStep)> + use<'a> {
        let (step, exempt, plain) = (self.step, self.exempt, self.step.without_decay());
        let (mut at, mut next) = (0, 0);
        std::iter::from_fn(move || {
            if at >= n {
                return None;
            }
            let (end, s) = match exempt.get(next) {
                Some(e) if e.start <= at => {
                    next += 1;
                    (e.end.clamp(at, n), plain)
                }
                Some(e) => (e.start.min(n), step),
                None => (n, step),
            };
            let r = at..end;
            at = end;
            Some((r, s))
        })
    }
}

/// One element of the update: returns the new `(param, m, v)`. Every operation rounds to f32,
/// in ATen's order (see the module table); no FMA. With `RECIPROCAL`, `sqrt(v) *
/// inv_bias_correction2_sqrt` replaces the division by `bias_correction2_sqrt`: one division
/// per element fewer, for the 8-bit AdamW, whose SIMD bodies are bound by the divider and whose
/// moments are stored in 8 bits, so the last bit of the denominator is moot there. Not torch's
/// operation: the fp32 AdamW passes `false`.
#[inline(always)]
pub(crate) fn update_one<const SMALL_LERP: bool, const RECIPROCAL: bool>(
    p: f32,
    grad: f32,
    m: f32,
    v: f32,
    s: &AdamWStep,
    grad_scale: f32,
) -> (f32, f32, f32) {
    let g = grad * grad_scale;
    let p = p * s.decay;
    let m =
        if SMALL_LERP { m + s.lerp_weight * (g - m) } else { g - (g - m) * (1.0 - s.lerp_weight) };
    let v = v * s.beta2 + s.one_minus_beta2 * g * g;
    let v_hat_sqrt = if RECIPROCAL {
        v.sqrt() * s.inv_bias_correction2_sqrt
    } else {
        v.sqrt() / s.bias_correction2_sqrt
    };
    let denom = v_hat_sqrt + s.eps;
    let p = p + s.neg_step_size * m / denom;
    (p, m, v)
}

/// Whether an element's new `(param, m, v)` is held (see the module's "Held elements"): one of
/// them is not finite. `&`, not `&&`: no branch, so the lane loops stay vectorised.
#[inline(always)]
pub(crate) fn held(p: f32, m: f32, v: f32) -> bool {
    !(p.is_finite() & m.is_finite() & v.is_finite())
}

/// [`update_one`], or the element held: the new `(param, m, v)` where all three are finite,
/// else the old ones; and whether it was held. A select, so the SIMD bodies keep it
/// branch-free.
#[inline(always)]
fn update_or_hold<const SMALL_LERP: bool>(
    p: f32,
    grad: f32,
    m: f32,
    v: f32,
    s: &AdamWStep,
    grad_scale: f32,
) -> (f32, f32, f32, bool) {
    let (pn, mn, vn) = update_one::<SMALL_LERP, false>(p, grad, m, v, s, grad_scale);
    let h = held(pn, mn, vn);
    if h { (p, m, v, true) } else { (pn, mn, vn, false) }
}

/// Scalar loop over one slice; with `IMAGE`, also `image[i] = bf16(param[i])` of the new
/// masters (`image` is empty without it). Returns the elements held.
#[inline(always)]
fn update_scalar<const SMALL_LERP: bool, const IMAGE: bool>(
    param: &mut [f32],
    image: &mut [Bf16],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWStep,
    grad_scale: f32,
) -> usize {
    let mut held = 0;
    for (i, (((p, &g), m), v)) in
        param.iter_mut().zip(grad).zip(m.iter_mut()).zip(v.iter_mut()).enumerate()
    {
        let h;
        (*p, *m, *v, h) = update_or_hold::<SMALL_LERP>(*p, g, *m, *v, s, grad_scale);
        held += usize::from(h);
        if IMAGE {
            image[i] = Bf16::from_f32(*p);
        }
    }
    held
}

/// Body over lanes of [`LANES`] (fixed-size arrays the compiler turns into vector instructions),
/// then the scalar tail. Bit-identical to [`update_scalar`]: the same IEEE operations per element,
/// the same elements held (returned: their count).
#[inline(always)]
fn update_lanes<const SMALL_LERP: bool, const IMAGE: bool>(
    param: &mut [f32],
    image: &mut [Bf16],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWStep,
    grad_scale: f32,
) -> usize {
    let body = param.len() / LANES * LANES;
    let (p_body, p_tail) = param.split_at_mut(body);
    let (g_body, g_tail) = grad.split_at(body);
    let (m_body, m_tail) = m.split_at_mut(body);
    let (v_body, v_tail) = v.split_at_mut(body);
    // Per lane, elements held (u32: a lane sees at most 2^32 elements of one call, 2^35 in all).
    let mut held = [0u32; LANES];
    for (c, (((p, g), m), v)) in p_body
        .chunks_exact_mut(LANES)
        .zip(g_body.chunks_exact(LANES))
        .zip(m_body.chunks_exact_mut(LANES))
        .zip(v_body.chunks_exact_mut(LANES))
        .enumerate()
    {
        let p: &mut [f32; LANES] = p.try_into().unwrap();
        let g: &[f32; LANES] = g.try_into().unwrap();
        let m: &mut [f32; LANES] = m.try_into().unwrap();
        let v: &mut [f32; LANES] = v.try_into().unwrap();
        for l in 0..LANES {
            let h;
            (p[l], m[l], v[l], h) =
                update_or_hold::<SMALL_LERP>(p[l], g[l], m[l], v[l], s, grad_scale);
            held[l] += u32::from(h);
        }
        if IMAGE {
            let img: &mut [Bf16; LANES] = (&mut image[c * LANES..][..LANES]).try_into().unwrap();
            for l in 0..LANES {
                img[l] = Bf16::from_f32(p[l]);
            }
        }
    }
    let i_tail = if IMAGE { &mut image[body..] } else { &mut [] };
    let tail =
        update_scalar::<SMALL_LERP, IMAGE>(p_tail, i_tail, g_tail, m_tail, v_tail, s, grad_scale);
    held.iter().map(|&h| h as usize).sum::<usize>() + tail
}

/// [`update_lanes`] compiled with AVX2 enabled (8 f32 lanes per instruction). Enabling AVX2 does
/// not enable FMA contraction: Rust never fuses a separate multiply and add.
///
/// # Safety
/// The CPU must support AVX2 (checked by the caller with `is_x86_feature_detected!`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn update_lanes_avx2<const SMALL_LERP: bool, const IMAGE: bool>(
    param: &mut [f32],
    image: &mut [Bf16],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWStep,
    grad_scale: f32,
) -> usize {
    update_lanes::<SMALL_LERP, IMAGE>(param, image, grad, m, v, s, grad_scale)
}

/// The fastest body this CPU runs, for one chunk; returns the elements held.
fn update_chunk<const SMALL_LERP: bool, const IMAGE: bool>(
    param: &mut [f32],
    image: &mut [Bf16],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWStep,
    grad_scale: f32,
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 support was just detected at run time, the only requirement of
        // `update_lanes_avx2`.
        return unsafe {
            update_lanes_avx2::<SMALL_LERP, IMAGE>(param, image, grad, m, v, s, grad_scale)
        };
    }
    update_lanes::<SMALL_LERP, IMAGE>(param, image, grad, m, v, s, grad_scale)
}

/// [`update_chunk`] with the lerp formula of `s` picked.
fn update_chunk_any<const IMAGE: bool>(
    param: &mut [f32],
    image: &mut [Bf16],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWStep,
    grad_scale: f32,
) -> usize {
    if s.lerp_weight_small() {
        update_chunk::<true, IMAGE>(param, image, grad, m, v, s, grad_scale)
    } else {
        update_chunk::<false, IMAGE>(param, image, grad, m, v, s, grad_scale)
    }
}

fn check_lengths(param: &[f32], grad: &[f32], m: &[f32], v: &[f32]) {
    let n = param.len();
    assert!(
        grad.len() == n && m.len() == n && v.len() == n,
        "adamw_update: lengths differ: param {n}, grad {}, m {}, v {}",
        grad.len(),
        m.len(),
        v.len()
    );
}

fn check_image(param: &[f32], image: &[Bf16]) {
    assert_eq!(
        image.len(),
        param.len(),
        "adamw_update: lengths differ: image {}, param {}",
        image.len(),
        param.len()
    );
}

/// One AdamW step on a flat buffer (one tensor, or many laid end to end), in parallel and
/// vectorised.
///
/// - `param`: (N) fp32 master weights, updated in place.
/// - `grad`: (N) gradient before clipping; read only (the clip is applied on the fly).
/// - `m`, `v`: (N) first and second moments, updated in place (zeros before step 1).
/// - `step`: the scalars of this step, from [`AdamWStep::new`].
/// - `grad_scale`: the clip coefficient ([`clip_coefficient`]); `1.0` leaves the gradient as is.
///
/// Returns the elements held (see the module's "Held elements": their master and moments are
/// unchanged). Bit-identical to [`adamw_update_serial`], the same count.
pub fn adamw_update(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: &AdamWStep,
    grad_scale: f32,
) -> usize {
    check_lengths(param, grad, m, v);
    param
        .par_chunks_mut(ADAMW_CHUNK)
        .zip(grad.par_chunks(ADAMW_CHUNK))
        .zip(m.par_chunks_mut(ADAMW_CHUNK))
        .zip(v.par_chunks_mut(ADAMW_CHUNK))
        .map(|(((p, g), m), v)| update_chunk_any::<false>(p, &mut [], g, m, v, step, grad_scale))
        .sum()
}

/// [`adamw_update`] that also writes the bf16 image of the new masters in the same pass.
///
/// - `image`: (N) overwritten: `image[i] = Bf16::from_f32(param[i])` of the updated `param`
///   (round to nearest even), what the device's bf16 weights are.
///
/// `param`, `m` and `v` end bit-identical to [`adamw_update`]'s, the same elements held (the
/// count returned; a held element's image is `bf16` of its unchanged master).
pub fn adamw_update_image(
    param: &mut [f32],
    image: &mut [Bf16],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: &AdamWStep,
    grad_scale: f32,
) -> usize {
    check_lengths(param, grad, m, v);
    check_image(param, image);
    param
        .par_chunks_mut(ADAMW_CHUNK)
        .zip(image.par_chunks_mut(ADAMW_CHUNK))
        .zip(grad.par_chunks(ADAMW_CHUNK))
        .zip(m.par_chunks_mut(ADAMW_CHUNK))
        .zip(v.par_chunks_mut(ADAMW_CHUNK))
        .map(|((((p, i), g), m), v)| update_chunk_any::<true>(p, i, g, m, v, step, grad_scale))
        .sum()
}

/// Table rows per parallel task of a row-wise update ([`row_runs`]).
pub const ROW_TASK: usize = 64;

/// The runs of consecutive rows in `rows` (one task's [`ROW_TASK`] rows of a table) whose pick
/// is `want`, as row ranges within them: how the embedding's update walks each of its two parts
/// (the rows the next step gathers, then the rest).
pub fn row_runs(rows: &[bool], want: bool) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut r = 0;
    std::iter::from_fn(move || {
        while r < rows.len() {
            let start = r;
            r += rows[r..].iter().take_while(|&&x| x == rows[start]).count();
            if rows[start] == want {
                return Some(start..r);
            }
        }
        None
    })
}

/// [`adamw_update`] (no `image`) or [`adamw_update_image`] of one stretch, vectorised, on the
/// calling thread: the body of their parallel chunks, for callers that split a buffer their own
/// way (the embedding's update in two parts of rows). Bit-identical to them on every element;
/// returns the elements held.
pub fn adamw_update_local(
    param: &mut [f32],
    image: Option<&mut [Bf16]>,
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: &AdamWStep,
    grad_scale: f32,
) -> usize {
    check_lengths(param, grad, m, v);
    match image {
        Some(image) => {
            check_image(param, image);
            update_chunk_any::<true>(param, image, grad, m, v, step, grad_scale)
        }
        None => update_chunk_any::<false>(param, &mut [], grad, m, v, step, grad_scale),
    }
}

/// [`adamw_update`] as one plain scalar loop on the calling thread: the reference path.
/// Returns the elements held.
pub fn adamw_update_serial(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: &AdamWStep,
    grad_scale: f32,
) -> usize {
    check_lengths(param, grad, m, v);
    if step.lerp_weight_small() {
        update_scalar::<true, false>(param, &mut [], grad, m, v, step, grad_scale)
    } else {
        update_scalar::<false, false>(param, &mut [], grad, m, v, step, grad_scale)
    }
}

/// [`adamw_update_image`] as one plain scalar loop on the calling thread. Returns the elements
/// held.
pub fn adamw_update_serial_image(
    param: &mut [f32],
    image: &mut [Bf16],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: &AdamWStep,
    grad_scale: f32,
) -> usize {
    check_lengths(param, grad, m, v);
    check_image(param, image);
    if step.lerp_weight_small() {
        update_scalar::<true, true>(param, image, grad, m, v, step, grad_scale)
    } else {
        update_scalar::<false, true>(param, image, grad, m, v, step, grad_scale)
    }
}

/// Sum of squares of one chunk in f64: 8 lane accumulators, combined in a fixed tree, then the
/// tail.
fn sum_squares_chunk(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let mut lanes = x.chunks_exact(LANES);
    for c in &mut lanes {
        for l in 0..LANES {
            let y = f64::from(c[l]);
            acc[l] += y * y;
        }
    }
    let mut tail = 0.0f64;
    for &y in lanes.remainder() {
        let y = f64::from(y);
        tail += y * y;
    }
    combine_lanes(&acc, tail)
}

/// A chunk's lane accumulators combined in a fixed tree, then its tail: the one order both
/// [`sum_squares_chunk`] and [`sum_squares_chunk_rows`] use, so that they agree bit for bit.
fn combine_lanes(acc: &[f64; LANES], tail: f64) -> f64 {
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// Sum of squares of `x` (N) in f64, in parallel and deterministic: partial sums over fixed
/// chunks of [`SUM_SQUARES_CHUNK`] elements, added in chunk order. The result depends only on
/// `x`, never on the thread count. The global gradient norm is `sqrt` of the sum over all
/// gradient buffers.
pub fn sum_squares(x: &[f32]) -> f64 {
    let partials: Vec<f64> = x.par_chunks(SUM_SQUARES_CHUNK).map(sum_squares_chunk).collect();
    partials.iter().fold(0.0, |acc, &s| acc + s)
}

/// [`sum_squares`] of a table of rows of `width` elements whose rows not marked in `rows` are
/// all zero (an untied embedding's gradient: only the rows a step's tokens name are written),
/// read from the marked rows only: the same number, bit for bit. Every element goes into the
/// same chunk, lane and order as there, and a zero adds exactly nothing to a non-negative sum,
/// as a chunk of zeros adds nothing to the total.
pub fn sum_squares_rows(x: &[f32], width: usize, rows: &[bool]) -> f64 {
    assert_eq!(x.len(), width * rows.len(), "a table of rows.len() rows of `width`");
    let chunks = x.len().div_ceil(SUM_SQUARES_CHUNK);
    let partials: Vec<f64> = (0..chunks)
        .into_par_iter()
        .filter_map(|k| {
            let span = k * SUM_SQUARES_CHUNK..((k + 1) * SUM_SQUARES_CHUNK).min(x.len());
            let mut marked = (span.start / width..span.end.div_ceil(width)).filter(|&r| rows[r]);
            let first = marked.next()?;
            Some(sum_squares_chunk_rows(x, span, width, std::iter::once(first).chain(marked)))
        })
        .collect();
    partials.iter().fold(0.0, |acc, &s| acc + s)
}

/// [`sum_squares_chunk`] of `x[span]` from the parts of rows `rows` (ascending) inside it, the
/// rest being zeros.
fn sum_squares_chunk_rows(
    x: &[f32],
    span: std::ops::Range<usize>,
    width: usize,
    rows: impl Iterator<Item = usize>,
) -> f64 {
    let sq = |y: f32| f64::from(y) * f64::from(y);
    // Where the chunk's 8-lane body ends and its tail begins.
    let body_end = span.start + (span.len() / LANES) * LANES;
    let lane = |i: usize| (i - span.start) % LANES;
    let (mut acc, mut tail) = ([0.0f64; LANES], 0.0f64);
    for r in rows {
        let (s, e) = ((r * width).max(span.start), ((r + 1) * width).min(span.end));
        let (mut i, body) = (s, e.min(body_end));
        while i < body && lane(i) != 0 {
            acc[lane(i)] += sq(x[i]);
            i += 1;
        }
        let whole = (body.saturating_sub(i) / LANES) * LANES;
        for c in x[i..i + whole].chunks_exact(LANES) {
            for l in 0..LANES {
                acc[l] += sq(c[l]);
            }
        }
        i += whole;
        while i < body {
            acc[lane(i)] += sq(x[i]);
            i += 1;
        }
        for &y in &x[s.max(body_end)..e.max(body_end)] {
            tail += sq(y);
        }
    }
    combine_lanes(&acc, tail)
}

/// `torch.nn.utils.clip_grad_norm_`'s factor for the gradients: `min(1, max_norm / (total_norm +
/// 1e-6))`, `1.0` when `max_norm <= 0` (clipping off).
///
/// Emulates PyTorch's float32 arithmetic: `total_norm` is an f32 tensor there, and
/// `max_norm / tensor` is `Tensor.__rtruediv__`, i.e. `tensor.reciprocal() * max_norm`, two
/// roundings. A NaN norm gives a NaN coefficient, as `clamp(max=1.0)` propagates NaN.
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    let denom = total_norm as f32 + 1e-6f32;
    let coef = (1.0f32 / denom) * max_norm as f32;
    if coef > 1.0 { 1.0 } else { coef }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_runs_are_the_runs_of_the_wanted_pick() {
        let rows = [true, true, false, true, false, false, true];
        let runs = |want| row_runs(&rows, want).collect::<Vec<_>>();
        assert_eq!(runs(true), vec![0..2, 3..4, 6..7]);
        assert_eq!(runs(false), vec![2..3, 4..6]);
        assert_eq!(row_runs(&[], true).count(), 0);
        assert_eq!(row_runs(&[false; 3], true).count(), 0);
    }

    fn cfg() -> AdamWConfig {
        AdamWConfig { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }

    /// Deterministic values in [-1, 1), exactly representable.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let mut x = i.wrapping_mul(0x9E37_79B1) ^ seed.wrapping_mul(0x85EB_CA77);
                x ^= x >> 15;
                x = x.wrapping_mul(0x2C1B_3C6D);
                x ^= x >> 12;
                (x >> 8) as f32 * (1.0 / 8_388_608.0) - 1.0
            })
            .collect()
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|y| y.to_bits()).collect()
    }

    #[test]
    fn a_buffer_updated_in_uneven_stretches_matches_the_whole_update() {
        let n = 3 * ADAMW_CHUNK / 2 + 37;
        let (p0, g) = (values(n, 1), values(n, 2));
        let (m0, v0) = (values(n, 3), values(n, 4).iter().map(|x| x * x).collect::<Vec<_>>());
        for (step, with_image) in [(1, false), (7, true)] {
            let s = AdamWStep::new(&cfg(), step, 1e-3);
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let mut img = vec![Bf16::from_f32(0.0); n];
            adamw_update_image(&mut p, &mut img, &g, &mut m, &mut v, &s, 0.7);
            let (mut pl, mut ml, mut vl) = (p0.clone(), m0.clone(), v0.clone());
            let mut imgl = vec![Bf16::from_f32(0.0); n];
            // Stretches of 1, 2, 3, ... elements, the last what is left.
            let (mut at, mut len) = (0, 1);
            while at < n {
                let r = at..(at + len).min(n);
                let image = with_image.then(|| &mut imgl[r.clone()]);
                let (p, m, v) = (&mut pl[r.clone()], &mut ml[r.clone()], &mut vl[r.clone()]);
                adamw_update_local(p, image, &g[r.clone()], m, v, &s, 0.7);
                (at, len) = (r.end, len + 1);
            }
            assert_eq!(bits(&pl), bits(&p), "step {step}");
            assert_eq!((bits(&ml), bits(&vl)), (bits(&m), bits(&v)), "step {step}");
            if with_image {
                assert_eq!(imgl, img);
            }
        }
    }

    #[test]
    fn step_scalars() {
        let s = AdamWStep::new(&cfg(), 1, 1e-3);
        assert_eq!(s.decay, (1.0f64 - 1e-4) as f32);
        assert_eq!(s.lerp_weight, (1.0f64 - 0.9) as f32);
        assert_eq!(s.one_minus_beta2, (1.0f64 - 0.95) as f32);
        assert_eq!(s.neg_step_size, (-1e-3f64 / (1.0 - 0.9)) as f32);
        assert_eq!(s.bias_correction2_sqrt, (1.0f64 - 0.95).sqrt() as f32);
        // Weight decay off: the decay factor is exactly 1.
        let s = AdamWStep::new(&AdamWConfig { weight_decay: 0.0, ..cfg() }, 5, 1e-3);
        assert_eq!(s.decay, 1.0);
    }

    #[test]
    fn first_step_moves_by_about_lr() {
        // At step 1 Adam's update is lr * g / (|g| + eps'), i.e. about -lr * sign(g).
        let c = AdamWConfig { weight_decay: 0.0, ..cfg() };
        let s = AdamWStep::new(&c, 1, c.lr);
        let mut p = vec![1.0f32, 1.0, 1.0];
        let mut m = vec![0.0f32; 3];
        let mut v = vec![0.0f32; 3];
        adamw_update(&mut p, &[0.5, -2.0, 0.0], &mut m, &mut v, &s, 1.0);
        assert!((p[0] - (1.0 - 1e-3)).abs() < 1e-6, "{p:?}");
        assert!((p[1] - (1.0 + 1e-3)).abs() < 1e-6, "{p:?}");
        assert_eq!(p[2], 1.0);
    }

    #[test]
    fn simd_parallel_and_serial_are_bit_identical() {
        // Sizes around the lane width and the chunk size, to cover every tail.
        for n in [0, 1, 7, 8, 9, 15, 17, 63, ADAMW_CHUNK - 1, ADAMW_CHUNK + 9, 3 * ADAMW_CHUNK + 5]
        {
            for beta1 in [0.9, 0.3] {
                let c = AdamWConfig { beta1, ..cfg() };
                let p0 = values(n, 1);
                let (mut pa, mut ma, mut va) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
                let (mut pb, mut mb, mut vb) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
                for t in 1..=3u64 {
                    let g = values(n, 10 + t as u32);
                    let s = AdamWStep::new(&c, t, c.lr);
                    let scale = if t == 2 { 0.37 } else { 1.0 };
                    adamw_update(&mut pa, &g, &mut ma, &mut va, &s, scale);
                    adamw_update_serial(&mut pb, &g, &mut mb, &mut vb, &s, scale);
                }
                assert_eq!(bits(&pa), bits(&pb), "param, n = {n}, beta1 = {beta1}");
                assert_eq!(bits(&ma), bits(&mb), "m, n = {n}, beta1 = {beta1}");
                assert_eq!(bits(&va), bits(&vb), "v, n = {n}, beta1 = {beta1}");
            }
        }
    }

    /// Three ways an update goes non-finite, on `n` elements: masters at `f32::MAX` pushed
    /// outward by a large `lr` (every 5th), gradients whose `g²` overflows `v` with clipping
    /// off (every 7th), and an `lr` so large that every step is infinite. Returns the config,
    /// masters, gradients, moments and the elements that must be held.
    #[allow(clippy::type_complexity)]
    fn overflowing(
        case: usize,
        n: usize,
    ) -> (AdamWConfig, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<usize>) {
        let c = AdamWConfig { weight_decay: 0.0, ..cfg() };
        let (mut p, mut g) = (values(n, 1), values(n, 2));
        let (mut m, v) = (values(n, 3), values(n, 4).iter().map(|x| x * x).collect());
        match case {
            0 => {
                let at: Vec<usize> = (0..n).step_by(5).collect();
                for &i in &at {
                    (p[i], g[i], m[i]) = (f32::MAX, -0.5, 0.0);
                }
                // Half an ulp of f32::MAX is 1.0e31; these steps are 8e31 or more outward.
                (AdamWConfig { lr: 1e33, ..c }, p, g, m, v, at)
            }
            1 => {
                let at: Vec<usize> = (0..n).step_by(7).collect();
                at.iter().for_each(|&i| g[i] = 1e21);
                (c, p, g, m, v, at)
            }
            _ => (AdamWConfig { lr: 1e39, ..c }, p, g, m, v, (0..n).collect()),
        }
    }

    /// `update_one` element by element, written only where all three results are finite: what
    /// every path must produce, and the count it must return.
    fn held_reference(
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        s: &AdamWStep,
    ) -> usize {
        let mut held = 0;
        for i in 0..p.len() {
            let (pn, mn, vn) = if s.lerp_weight_small() {
                update_one::<true, false>(p[i], g[i], m[i], v[i], s, 1.0)
            } else {
                update_one::<false, false>(p[i], g[i], m[i], v[i], s, 1.0)
            };
            if pn.is_finite() && mn.is_finite() && vn.is_finite() {
                (p[i], m[i], v[i]) = (pn, mn, vn);
            } else {
                held += 1;
            }
        }
        held
    }

    /// An element whose new master or moment would not be finite is held: its master and
    /// moments keep their bits (and its image is bf16 of the kept master), every other element
    /// is updated, and the count is returned; on every path (parallel, serial, image, local,
    /// portable lanes, scalar), at sizes that are not multiples of the lane width, with the
    /// same bits and count. A master at f32::MAX, a gradient whose square overflows v with no
    /// clipping, an infinite step.
    #[test]
    fn an_element_that_would_go_non_finite_is_held_on_every_path() {
        type Path =
            fn(&mut [f32], &mut [Bf16], &[f32], &mut [f32], &mut [f32], &AdamWStep) -> usize;
        let paths: [(&str, Path); 8] = [
            ("parallel", |p, _, g, m, v, s| adamw_update(p, g, m, v, s, 1.0)),
            ("serial", |p, _, g, m, v, s| adamw_update_serial(p, g, m, v, s, 1.0)),
            ("image", |p, i, g, m, v, s| adamw_update_image(p, i, g, m, v, s, 1.0)),
            ("serial image", |p, i, g, m, v, s| adamw_update_serial_image(p, i, g, m, v, s, 1.0)),
            ("local", |p, _, g, m, v, s| adamw_update_local(p, None, g, m, v, s, 1.0)),
            ("local image", |p, i, g, m, v, s| adamw_update_local(p, Some(i), g, m, v, s, 1.0)),
            ("portable lanes", |p, i, g, m, v, s| {
                update_lanes::<true, true>(p, i, g, m, v, s, 1.0)
            }),
            ("scalar", |p, i, g, m, v, s| update_scalar::<true, true>(p, i, g, m, v, s, 1.0)),
        ];
        for n in [43, ADAMW_CHUNK + 9] {
            for case in 0..3 {
                let (c, p0, g, m0, v0, must) = overflowing(case, n);
                let s = AdamWStep::new(&c, 2, c.lr);
                assert!(s.lerp_weight_small(), "the lane paths above are the small-lerp ones");
                let (mut pw, mut mw, mut vw) = (p0.clone(), m0.clone(), v0.clone());
                let want = held_reference(&mut pw, &g, &mut mw, &mut vw, &s);
                assert!(must.iter().all(|&i| pw[i] == p0[i] && mw[i] == m0[i]), "case {case}");
                assert!(want >= must.len() && (want < n || case == 2), "case {case}: {want}");
                for (name, f) in paths {
                    let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
                    let mut img = vec![Bf16(0xdead); n];
                    let held = f(&mut p, &mut img, &g, &mut m, &mut v, &s);
                    let what = format!("{name}, case {case}, n {n}");
                    assert_eq!(held, want, "{what}: held count");
                    assert_eq!(bits(&p), bits(&pw), "{what}: masters");
                    assert_eq!((bits(&m), bits(&v)), (bits(&mw), bits(&vw)), "{what}: moments");
                    assert!(p.iter().chain(&m).chain(&v).all(|x| x.is_finite()), "{what}");
                    if !name.contains("image") && !name.contains("lanes") && name != "scalar" {
                        continue;
                    }
                    let rounded: Vec<Bf16> = p.iter().map(|&x| Bf16::from_f32(x)).collect();
                    assert!(img == rounded, "{what}: image != bf16(masters)");
                }
            }
        }
    }

    #[test]
    fn portable_lanes_match_scalar() {
        // The non-AVX2 body (what a CPU without AVX2 runs) against the scalar loop.
        let n = 8 * 5 + 3;
        let s = AdamWStep::new(&cfg(), 2, 1e-3);
        let g = values(n, 7);
        let (mut pa, mut ma, mut va) = (values(n, 1), values(n, 2), values(n, 3));
        va.iter_mut().for_each(|x| *x = x.abs());
        let (mut pb, mut mb, mut vb) = (pa.clone(), ma.clone(), va.clone());
        update_lanes::<true, false>(&mut pa, &mut [], &g, &mut ma, &mut va, &s, 0.5);
        update_scalar::<true, false>(&mut pb, &mut [], &g, &mut mb, &mut vb, &s, 0.5);
        assert_eq!(bits(&pa), bits(&pb));
        assert_eq!(bits(&ma), bits(&mb));
        assert_eq!(bits(&va), bits(&vb));
    }

    /// Runs `steps` of one update function from the same start; returns (param, m, v, image).
    fn run_image(
        n: usize,
        beta1: f64,
        f: impl Fn(&mut [f32], &mut [Bf16], &[f32], &mut [f32], &mut [f32], &AdamWStep, f32) -> usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<Bf16>) {
        let c = AdamWConfig { beta1, ..cfg() };
        let (mut p, mut m, mut v) = (values(n, 1), vec![0.0; n], vec![0.0; n]);
        let mut image = vec![Bf16(0xdead); n];
        for t in 1..=2u64 {
            let g = values(n, 20 + t as u32);
            f(&mut p, &mut image, &g, &mut m, &mut v, &AdamWStep::new(&c, t, c.lr), 0.6);
        }
        (p, m, v, image)
    }

    /// With the image the masters and moments are bit-identical to the update without it, in
    /// the parallel and the serial path, and the image is exactly `bf16(master)`.
    #[test]
    fn image_is_the_rounded_masters_and_changes_nothing_else() {
        for n in [0, 1, 7, 9, 63, ADAMW_CHUNK + 9, 2 * ADAMW_CHUNK + 13] {
            for beta1 in [0.9, 0.3] {
                let plain =
                    run_image(n, beta1, |p, _, g, m, v, s, c| adamw_update(p, g, m, v, s, c));
                let par = run_image(n, beta1, adamw_update_image);
                let ser = run_image(n, beta1, adamw_update_serial_image);
                for (name, got) in [("parallel", &par), ("serial", &ser)] {
                    assert_eq!(bits(&got.0), bits(&plain.0), "{name} param, n = {n}");
                    assert_eq!(bits(&got.1), bits(&plain.1), "{name} m, n = {n}");
                    assert_eq!(bits(&got.2), bits(&plain.2), "{name} v, n = {n}");
                    let want: Vec<Bf16> = plain.0.iter().map(|&x| Bf16::from_f32(x)).collect();
                    assert!(got.3 == want, "{name} image, n = {n}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ: image")]
    fn image_length_mismatch_panics() {
        let s = AdamWStep::new(&cfg(), 1, 1e-3);
        let mut image = [Bf16(0); 2];
        adamw_update_image(
            &mut [0.0; 3],
            &mut image,
            &[0.0; 3],
            &mut [0.0; 3],
            &mut [0.0; 3],
            &s,
            1.0,
        );
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn length_mismatch_panics() {
        let s = AdamWStep::new(&cfg(), 1, 1e-3);
        adamw_update(&mut [0.0; 3], &[0.0; 2], &mut [0.0; 3], &mut [0.0; 3], &s, 1.0);
    }

    #[test]
    fn sum_squares_rows_is_sum_squares_bit_for_bit() {
        // Widths that straddle chunks and lanes, tables whose length is not a multiple of 8,
        // picks from none to all; the unpicked rows zeroed.
        for (width, n_rows) in [(1, 200_000), (7, 40_000), (300, 1000), (3584, 40), (65_539, 3)] {
            let full = values(width * n_rows, width as u32);
            // Every `every`-th row (1: all), and none.
            for every in [Some(1), Some(2), Some(3), Some(17), None] {
                let rows: Vec<bool> =
                    (0..n_rows).map(|r| every.is_some_and(|k| r % k == 0)).collect();
                let mut x = full.clone();
                for (r, &keep) in rows.iter().enumerate() {
                    if !keep {
                        x[r * width..(r + 1) * width].fill(0.0);
                    }
                }
                let (dense, sparse) = (sum_squares(&x), sum_squares_rows(&x, width, &rows));
                assert_eq!(dense.to_bits(), sparse.to_bits(), "width {width}, every {every:?}");
            }
        }
    }

    #[test]
    fn sum_squares_small_and_exact() {
        assert_eq!(sum_squares(&[]), 0.0);
        assert_eq!(sum_squares(&[3.0, 4.0]), 25.0);
        let x: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let want: f64 = (0..1000u64).map(|i| (i * i) as f64).sum();
        assert_eq!(sum_squares(&x), want);
    }

    #[test]
    fn clip_coefficient_cases() {
        assert_eq!(clip_coefficient(5.0, 0.0), 1.0);
        assert_eq!(clip_coefficient(5.0, -1.0), 1.0);
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(0.0, 1.0), 1.0);
        let c = clip_coefficient(4.0, 1.0);
        assert_eq!(c, (1.0f32 / (4.0f32 + 1e-6f32)) * 1.0f32);
        assert!((c - 0.25).abs() < 1e-6);
        assert!(clip_coefficient(f64::NAN, 1.0).is_nan());
    }

    // Lists of one range are what is meant: one exempt tensor.
    #[allow(clippy::single_range_in_vec_init)]
    #[test]
    fn buffer_step_runs_alternate_the_groups() {
        let st = AdamWStep::new(&cfg(), 1, 1e-2);
        let plain = st.without_decay();
        assert_eq!(plain.decay, 1.0);
        assert_eq!(AdamWStep { decay: st.decay, ..plain }, st, "only the decay differs");
        let runs = |exempt: &[std::ops::Range<usize>], n| {
            BufferStep::new(st, exempt).runs(n).map(|(r, s)| (r, s.decay)).collect::<Vec<_>>()
        };
        let (d, one) = (st.decay, 1.0);
        assert_eq!(runs(&[], 10), vec![(0..10, d)]);
        assert_eq!(runs(&[], 0), vec![]);
        assert_eq!(runs(&[0..2, 5..6], 10), vec![(0..2, one), (2..5, d), (5..6, one), (6..10, d)]);
        assert_eq!(runs(&[3..10], 10), vec![(0..3, d), (3..10, one)]);
        let b = BufferStep::new(st, &[2..4]);
        assert_eq!((b.of(0..2).decay, b.of(2..3).decay, b.of(4..9).decay), (d, one, d));
        assert_eq!(BufferStep::uniform(st).of(0..5), st);
    }

    #[allow(clippy::single_range_in_vec_init)]
    #[test]
    #[should_panic(expected = "straddles the no-decay range")]
    fn a_tensor_across_a_group_boundary_is_a_bug() {
        let st = AdamWStep::new(&cfg(), 1, 1e-2);
        BufferStep::new(st, &[2..4]).of(3..6);
    }
}
