//! The one small random-number generator Horizon's host code uses (shuffling, synthetic data,
//! random initialisation): splitmix64, deterministic and independent of threads.

/// splitmix64 (Steele, Lea, Flood 2014).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the modulo bias is below 2^-40 for the sizes we draw).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in (0, 1].
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Fill `out` with normal(0, std) samples (Box-Muller, two per pair of uniforms).
    pub fn fill_normal(&mut self, out: &mut [f32], std: f32) {
        for pair in out.chunks_mut(2) {
            let (u1, u2) = (self.uniform(), self.uniform());
            let r = (-2.0 * u1.ln()).sqrt();
            let th = std::f64::consts::TAU * u2;
            pair[0] = (r * th.cos()) as f32 * std;
            if pair.len() > 1 {
                pair[1] = (r * th.sin()) as f32 * std;
            }
        }
    }
}
