//! PEFT's default initialisation of a new LoRA adapter (`init_lora_weights: true`): A drawn as
//! `torch.nn.init.kaiming_uniform_(A, a=sqrt(5))`, B zero, so the adapted model starts equal to
//! the base. Deterministic from a seed with the project's generator (splitmix64), one stream per
//! tensor, so the order or threads tensors are filled on change nothing.

use crate::rng::SplitMix64;

/// Separates LoRA's init streams from every other use of a seed (ASCII "lora_A").
const LORA_STREAM: u64 = 0x6c6f_7261_5f41;

/// Fills A (r, in) — `out`, `r * fan_in` values — from uniform(-1/√in, 1/√in), the stream
/// `(seed, tensor_index)`; B starts at zero (the caller's zeroed buffer).
///
/// kaiming_uniform_ with negative slope `a = √5`, fan_in mode (torch: `fan_in = A.size(1)`):
///   gain  = √(2 / (1 + a²)) = √(1/3)
///   std   = gain / √fan_in
///   bound = √3 · std = 1 / √fan_in
/// and A ~ uniform(-bound, bound). Here each value is `bound · (2u − 1)`, u uniform in (0, 1],
/// computed in f64 and rounded to f32.
///
/// # Panics
/// When `fan_in` is 0 or does not divide `out.len()` (a caller's bug).
pub fn init_a(out: &mut [f32], fan_in: usize, seed: u64, tensor_index: u64) {
    assert!(
        fan_in > 0 && out.len().is_multiple_of(fan_in),
        "init_a: {} values are not rows of fan_in {fan_in}",
        out.len()
    );
    let bound = 1.0 / (fan_in as f64).sqrt();
    let mut rng = generator(seed, tensor_index);
    for x in out {
        *x = (bound * (2.0 * rng.uniform() - 1.0)) as f32;
    }
}

/// A generator for the stream `(seed, stream)` with a well mixed, distinct start for each
/// pair (as `data::split` derives its streams; `seed + stream` would hand each stream the tail
/// of its neighbour's).
fn generator(seed: u64, stream: u64) -> SplitMix64 {
    let key = SplitMix64::new(seed ^ LORA_STREAM).next_u64();
    SplitMix64::new(SplitMix64::new(key ^ stream).next_u64())
}
