//! The one content hash: XXH3-64 (the `twox-hash` crate), for a checkpoint's file checksums, the
//! seal over its state, and the content hash of a frozen base's weights.
//!
//! XXH3 rather than a word-at-a-time multiply-xorshift of our own (Horizon's hash until
//! checkpoint format 2, kept in `run/resume.rs` to verify older checkpoints): that one chains a
//! dependent multiply per 8 bytes, 1.3-2.5 GB/s a core, while the base's hash rides in the
//! load's conversion pass, which moves 8 GB/s a core; XXH3 hashes 11 GB/s a core (its SIMD body
//! picked at run time), so hashing every byte of a base costs a few percent of its load. Not
//! cryptographic: it finds damage and changed weights, it does not stand against a forger.

use std::hash::Hasher;

use twox_hash::XxHash3_64;

/// The hash of `bytes`.
pub fn of(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot(bytes)
}

/// A hash fed piece by piece: the hash of the pieces laid end to end ([`of`] their
/// concatenation).
pub struct Stream(XxHash3_64);

impl Stream {
    pub fn new() -> Self {
        Stream(XxHash3_64::new())
    }

    pub fn feed(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    pub fn finish(&self) -> u64 {
        self.0.finish()
    }
}

impl Default for Stream {
    fn default() -> Self {
        Stream::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces hash as their concatenation, however they are cut; XXH3-64's published value of
    /// the empty input pins the algorithm.
    #[test]
    fn a_stream_is_the_hash_of_its_pieces_end_to_end() {
        let bytes: Vec<u8> =
            (0..100_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
        for cut in [0, 1, 63, 64, 240, 4096, 99_999] {
            let mut s = Stream::new();
            s.feed(&bytes[..cut]);
            s.feed(&bytes[cut..]);
            assert_eq!(s.finish(), of(&bytes), "cut at {cut}");
        }
        assert_eq!(of(b""), 0x2d06_8005_38d3_94c2);
    }
}
