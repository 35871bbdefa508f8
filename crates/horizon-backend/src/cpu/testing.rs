//! Test helpers shared by every crate of the workspace: [`assert_close`], which explains a
//! failure (first mismatches, their index, the largest difference), and [`Rng`], a tiny
//! deterministic generator for test data.

/// How many mismatching elements [`assert_close`] prints before summarising.
const SHOW: usize = 8;

/// Asserts that `got` and `want` match elementwise within `tol`, where element `i` passes when
/// `|got[i] - want[i]| <= tol * max(1, |want[i]|)`: an absolute tolerance for values of
/// magnitude below 1 and a relative one above. NaN or infinity in `got` never passes unless
/// `want` holds the same value at that index.
///
/// On failure it panics with `name`, the first few mismatches (index, got, want, difference),
/// the number of mismatches and the largest difference with its index.
#[track_caller]
pub fn assert_close<G, W>(name: &str, got: &[G], want: &[W], tol: f64)
where
    G: Copy + Into<f64>,
    W: Copy + Into<f64>,
{
    assert_eq!(
        got.len(),
        want.len(),
        "{name}: got has {} elements, want has {}",
        got.len(),
        want.len()
    );
    let mut bad = 0usize;
    let mut lines = String::new();
    let mut worst = (0usize, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w): (f64, f64) = (g.into(), w.into());
        let diff = (g - w).abs();
        let ok = if g.is_finite() && w.is_finite() {
            diff <= tol * w.abs().max(1.0)
        } else {
            g == w || (g.is_nan() && w.is_nan())
        };
        if diff > worst.1 || (diff.is_nan() && !worst.1.is_nan()) {
            worst = (i, diff);
        }
        if !ok {
            if bad < SHOW {
                lines.push_str(&format!("\n  [{i}] got {g:.9e}, want {w:.9e}, diff {diff:.3e}"));
            }
            bad += 1;
        }
    }
    if bad > 0 {
        panic!(
            "{name}: {bad} of {} elements differ by more than tol = {tol:e} (x max(1, |want|)); \
             largest difference {:.3e} at [{}]; first mismatches:{lines}",
            got.len(),
            worst.1,
            worst.0
        );
    }
}

/// The largest absolute difference between two equal-length slices (for reporting margins).
pub fn max_abs_diff<G, W>(got: &[G], want: &[W]) -> f64
where
    G: Copy + Into<f64>,
    W: Copy + Into<f64>,
{
    assert_eq!(got.len(), want.len(), "max_abs_diff: lengths differ");
    got.iter().zip(want).map(|(&g, &w)| (g.into() - w.into()).abs()).fold(0.0, f64::max)
}

/// A small deterministic random generator (splitmix64) for test data: the same seed gives the
/// same numbers on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[lo, hi)`, as f32.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        (f64::from(lo) + (f64::from(hi) - f64::from(lo)) * self.next_f64()) as f32
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "Rng::below: n must be positive");
        (self.next_f64() * n as f64) as usize % n
    }

    /// `len` values uniform in `[-scale, scale)`.
    pub fn vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.uniform(-scale, scale)).collect()
    }
}
