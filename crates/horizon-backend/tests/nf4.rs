//! NF4 against bitsandbytes itself: `tests/fixtures/nf4` (written by
//! `scripts/nf4_reference.py` with bitsandbytes 0.50's `quantize_4bit` / `dequantize_4bit` on
//! the CPU) holds, per tensor, the input, the packed codes, the absmax and the dequantised
//! values. Our quantiser must give the same bytes and the same bits, on every
//! q/k/v/o/gate/up/down weight of the QLoRA fixture model and on the synthetic edge cases (zero
//! blocks, values at code midpoints, negative zeros, huge and tiny magnitudes, partial last
//! blocks). The CPU backend's `dequantize_nf4` of the device form equals `nf4::dequantize`
//! bit for bit. Tolerance: none (bitwise).

use std::path::PathBuf;

use horizon_backend::cpu::testing::Rng;
use horizon_backend::nf4::{self, BLOCK, Nf4};
use horizon_backend::{Backend, CpuBackend};
use safetensors::SafeTensors;

fn fixture(name: &str) -> Vec<u8> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/nf4").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The first index where two sequences differ, for the failure message.
fn first_diff<T: PartialEq + Copy + std::fmt::Debug>(a: &[T], b: &[T]) -> String {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => format!("first difference at {i}: {:?} vs {:?}", a[i], b[i]),
        None => format!("lengths {} vs {}", a.len(), b.len()),
    }
}

/// Every tensor of a fixture file against our quantiser; returns (tensors, elements) compared.
fn check_file(file: &str) -> (usize, usize) {
    let bytes = fixture(file);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> =
        st.names().iter().filter_map(|n| n.strip_suffix(".w").map(str::to_string)).collect();
    names.sort();
    let mut elements = 0;
    for name in &names {
        let w = f32s(&st, &format!("{name}.w"));
        let codes = st.tensor(&format!("{name}.codes")).unwrap().data().to_vec();
        let absmax = f32s(&st, &format!("{name}.absmax"));
        let deq = f32s(&st, &format!("{name}.deq"));
        let q = nf4::quantize(&w);
        assert_eq!(q.n, w.len());
        assert!(q.codes == codes, "{file} {name}: codes differ, {}", first_diff(&q.codes, &codes));
        let (got, want) = (bits(&q.absmax), bits(&absmax));
        assert!(got == want, "{file} {name}: absmax differ, {}", first_diff(&got, &want));
        let mut out = vec![f32::NAN; w.len()];
        nf4::dequantize(&q, &mut out);
        let (got, want) = (bits(&out), bits(&deq));
        assert!(got == want, "{file} {name}: dequantised differ, {}", first_diff(&got, &want));
        elements += w.len();
    }
    (names.len(), elements)
}

#[test]
fn quantize_matches_bitsandbytes_on_the_fixture_model() {
    let (tensors, elements) = check_file("qwen2_weights.safetensors");
    assert_eq!(tensors, 14, "2 layers x q, k, v, o, gate, up, down");
    assert_eq!(elements, 294_912);
}

#[test]
fn quantize_matches_bitsandbytes_on_edge_cases() {
    let (tensors, elements) = check_file("edge_cases.safetensors");
    assert_eq!(tensors, 7);
    assert!(elements > 10_000);
}

/// The device form, read by the CPU backend, gives `nf4::dequantize`'s bits.
#[test]
fn cpu_dequantize_nf4_of_the_device_form_equals_dequantize() {
    let mut rng = Rng::new(16);
    for n in [1, 2, 3, 7, 64, 65, 127, 128, 1000, 64 * 37 + 5] {
        let w = rng.vec(n, 2.0);
        let q = nf4::quantize(&w);
        let mut want = vec![0.0; n];
        nf4::dequantize(&q, &mut want);
        let mut words = vec![0u32; nf4::words(n)];
        nf4::to_words(&q, &mut words);
        let packed: Vec<f32> = words.iter().map(|&u| f32::from_bits(u)).collect();
        let mut got = vec![f32::NAN; n];
        CpuBackend.dequantize_nf4(&mut got, &packed, n);
        assert_eq!(bits(&got), bits(&want), "n = {n}");
        // The f64 reference: CODE[q] * absmax is exact in f64, so rounding it to f32 gives the
        // correctly rounded fp32 product, which is what both must be.
        let code = |i: usize| {
            usize::from(if i.is_multiple_of(2) { q.codes[i / 2] >> 4 } else { q.codes[i / 2] & 15 })
        };
        let f64_ref: Vec<f32> = (0..n)
            .map(|i| (f64::from(nf4::CODE[code(i)]) * f64::from(q.absmax[i / BLOCK])) as f32)
            .collect();
        assert_eq!(bits(&want), bits(&f64_ref), "n = {n}: dequantize vs the f64 reference");
    }
}

#[test]
fn words_is_code_bytes_in_whole_words_then_one_per_block() {
    for (n, want) in [(1, 1 + 1), (8, 1 + 1), (9, 2 + 1), (64, 8 + 1), (65, 9 + 2), (130, 17 + 3)] {
        assert_eq!(nf4::words(n), want, "n = {n}");
    }
    let q = Nf4 { codes: vec![0x12, 0x34, 0x56, 0x78, 0x9a], absmax: vec![0.5], n: 10 };
    let mut w = vec![0u32; nf4::words(10)];
    nf4::to_words(&q, &mut w);
    assert_eq!(w, vec![0x7856_3412, 0x0000_009a, 0.5f32.to_bits()]);
}

/// Each value is within half a code gap (times the absmax) of its dequantised value, and the
/// quantiser does not depend on the thread count.
#[test]
fn quantize_is_nearest_and_deterministic() {
    let mut rng = Rng::new(17);
    let w = rng.vec(BLOCK * 300 + 11, 1.0);
    let q = nf4::quantize(&w);
    let serial = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    assert_eq!(serial.install(|| nf4::quantize(&w)), q);
    let mut d = vec![0.0; w.len()];
    nf4::dequantize(&q, &mut d);
    let gap = nf4::CODE.windows(2).map(|c| f64::from(c[1] - c[0])).fold(0.0, f64::max);
    for (i, (&x, &y)) in w.iter().zip(&d).enumerate() {
        let am = f64::from(q.absmax[i / BLOCK]);
        assert!(f64::from(x - y).abs() <= gap / 2.0 * am * (1.0 + 1e-6), "element {i}");
    }
}
