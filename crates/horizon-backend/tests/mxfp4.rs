//! MXFP4 against transformers 5.25's own decoder (`convert_moe_packed_tensors`): the fixture
//! `tests/fixtures/gpt_oss_mxfp4` (from `../shared/fixtures`, `make_mxfp4_fixture.py`) holds the
//! decoder alone over every byte value and the scales 0..252 (`codec.safetensors`, float32),
//! and what `from_pretrained(..., Mxfp4Config(dequantize=True))` loads from the case's packed
//! experts (`dequantized.safetensors`, bf16). Ours must give the same bits, signed zeros and
//! subnormals included. Tolerance: none (bitwise).

use std::path::PathBuf;

use horizon_backend::mxfp4::decode_transposed;
use safetensors::SafeTensors;

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gpt_oss_mxfp4")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A tensor's bytes and shape.
fn raw<'a>(st: &'a SafeTensors, name: &str) -> (&'a [u8], Vec<usize>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    (t.data(), t.shape().to_vec())
}

/// `blocks` (E, rows, G, 16) and `scales` (E, rows, G) of `st` decoded, in-to-out.
fn decoded(st: &SafeTensors, blocks: &str, scales: &str) -> Vec<f32> {
    let ((b, bs), (s, ss)) = (raw(st, blocks), raw(st, scales));
    assert_eq!((bs[..3].to_vec(), bs[3]), (ss.clone(), 16), "{blocks} against {scales}");
    decode_transposed(b, s, (ss[0], ss[1], ss[2] * 32))
}

fn first_diff(got: &[u32], want: &[u32]) -> Option<String> {
    assert_eq!(got.len(), want.len());
    let i = got.iter().zip(want).position(|(a, b)| a != b)?;
    Some(format!("element {i}: {:#010x} vs {:#010x}", got[i], want[i]))
}

/// Every byte value under the scales 0..252, against transformers' float32 decode.
#[test]
fn the_codec_is_transformers_bit_for_bit() {
    let bytes = fixture("codec.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let got: Vec<u32> = decoded(&st, "blocks", "scales").iter().map(|v| v.to_bits()).collect();
    let (want, shape) = raw(&st, "dequantized");
    assert_eq!(shape, [2, 128, 8]);
    let want: Vec<u32> =
        want.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(first_diff(&got, &want), None);
    assert!(got.iter().any(|&b| b == (-0.0f32).to_bits()), "signed zeros occur");
    assert!(got.iter().any(|&b| f32::from_bits(b).is_subnormal()), "subnormals occur");
}

/// The case's packed experts, every layer and projection, against what transformers loads
/// (bf16: every decoded value is exact in bf16).
#[test]
fn the_packed_experts_decode_to_what_transformers_loads() {
    let (model, deq) = (fixture("model/model.safetensors"), fixture("dequantized.safetensors"));
    let (model, deq) =
        (SafeTensors::deserialize(&model).unwrap(), SafeTensors::deserialize(&deq).unwrap());
    let mut compared = 0;
    for l in 0..2 {
        for proj in ["gate_up_proj", "down_proj"] {
            let p = format!("model.layers.{l}.mlp.experts.{proj}");
            let got = decoded(&model, &format!("{p}_blocks"), &format!("{p}_scales"));
            let (want, _) = raw(&deq, &p);
            let want: Vec<u32> = want
                .chunks_exact(2)
                .map(|b| (u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
                .collect();
            let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            assert_eq!(first_diff(&got, &want), None, "{p}");
            compared += got.len();
        }
    }
    assert_eq!(compared, 2 * (8 * 32 * 128 + 8 * 64 * 32));
}
