//! gpt-oss's MXFP4 checkpoints (issue 49): the `quantization_config` that marks them, and the
//! packed experts' `{name}_blocks` / `{name}_scales` pairs, checked against each other and
//! decoded to the fused in-to-out parameter transformers loads with
//! `Mxfp4Config(dequantize=True)` (`horizon_backend::mxfp4`; `tests/fixtures/README.md`,
//! "MXFP4 checkpoints").
//!
//! Data flow: `config.json` `quantization_config` -> [`quantization`]; checkpoint `{name}_blocks`
//! (E, rows, G, 16) u8 + `{name}_scales` (E, rows, G) u8 -> [`packed`] (shapes checked, both
//! named in errors) -> the checkpoint's MXFP4 views (`Checkpoint::add_mxfp4_view`): an expert
//! decoded in-to-out, (32 G, rows) f32, every value exact (in bf16 too).

use anyhow::{Result, bail};
use serde_json::Value;

use super::Checkpoint;

/// An MXFP4 checkpoint's `quantization_config`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mxfp4Config {
    /// Module patterns left unquantized (`modules_to_not_convert`); transformers packs only
    /// gpt-oss's experts whatever the list says.
    pub modules_to_not_convert: Vec<String>,
}

/// The quantization a `config.json` declares: none, or MXFP4; any other `quant_method` (or a
/// malformed section) is refused by name.
pub fn quantization(config: &Value, origin: &str) -> Result<Option<Mxfp4Config>> {
    let Some(q) = config.get("quantization_config").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let method = q.get("quant_method").and_then(Value::as_str);
    match method {
        Some("mxfp4") => {}
        Some(other) => bail!(
            "{origin}: quantization_config.quant_method '{other}' is not read by Horizon; it \
             reads mxfp4 (gpt-oss's experts)\nhint: load an unquantized (bf16 or fp32) \
             checkpoint of the model"
        ),
        None => bail!("{origin}: quantization_config has no quant_method: {q}"),
    }
    let modules = match q.get("modules_to_not_convert") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(v)) => v.iter().filter_map(|m| m.as_str().map(str::to_string)).collect(),
        Some(other) => {
            bail!(
                "{origin}: quantization_config.modules_to_not_convert must be a list, got {other}"
            )
        }
    };
    Ok(Some(Mxfp4Config { modules_to_not_convert: modules }))
}

/// One packed parameter: E experts of `rows` outputs, each row `cols` inputs in blocks of 32.
#[derive(Clone, Copy, Debug)]
pub struct Packed<'a> {
    pub blocks: &'a [u8],
    pub scales: &'a [u8],
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}

/// The packed pair of parameter `name` (`{name}_blocks`, `{name}_scales`) in `ckpt`, their
/// shapes checked against each other: an error names both tensors and both shapes.
pub fn packed<'a>(ckpt: &'a Checkpoint, name: &str) -> Result<Packed<'a>> {
    let (b, s) = (format!("{name}_blocks"), format!("{name}_scales"));
    let (blocks, bshape) = ckpt.read_u8(&b)?;
    let (scales, sshape) = ckpt.read_u8(&s)?;
    let agree = bshape.len() == 4 && bshape[3] == 16 && sshape.len() == 3 && bshape[..3] == sshape;
    if !agree {
        bail!(
            "{}: {b} {bshape:?} and {s} {sshape:?} disagree: MXFP4 stores (E, rows, G, 16) \
             blocks beside (E, rows, G) scales\nhint: the checkpoint is damaged or not a \
             transformers-format MXFP4 checkpoint",
            ckpt.source().display()
        );
    }
    let (experts, rows, groups) = (sshape[0], sshape[1], sshape[2]);
    Ok(Packed { blocks, scales, experts, rows, cols: groups * horizon_backend::mxfp4::BLOCK })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn case() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt_oss_mxfp4")
    }

    /// The fixture's packed experts, read through the checkpoint's MXFP4 views (one per
    /// expert, in-to-out), are what transformers loads (bf16 there: every value exact).
    #[test]
    fn packed_experts_load_as_transformers_dequantizes_them() {
        use crate::hf::checkpoint::NonFinite::Refuse;
        let mut ckpt = Checkpoint::open(&case().join("model")).unwrap();
        let want = Checkpoint::open(&case().join("dequantized.safetensors")).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for l in 0..2 {
            for proj in ["gate_up_proj", "down_proj"] {
                let name = format!("model.layers.{l}.mlp.experts.{proj}");
                let p = packed(&ckpt, &name).unwrap();
                let (e, per) = (p.experts, [p.cols, p.rows]);
                assert_eq!(want.shape(&name), Some(vec![e, per[0], per[1]]), "{name}");
                let mut all = vec![0.0f32; e * per[0] * per[1]];
                want.read_f32(&name, &[e, per[0], per[1]], &mut all, Refuse).unwrap();
                for (x, w) in all.chunks_exact(per[0] * per[1]).enumerate() {
                    let view = format!("{name}.{x}");
                    ckpt.add_mxfp4_view(&view, &name, x * w.len(), &per, &[per[1], 1]).unwrap();
                    let mut got = vec![0.0f32; w.len()];
                    ckpt.read_f32(&view, &per, &mut got, Refuse).unwrap();
                    assert_eq!(bits(&got), bits(w), "{view}");
                }
            }
        }
    }

    #[test]
    fn quantization_config_is_read_or_refused_by_name() {
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(case().join("model/config.json")).unwrap(),
        )
        .unwrap();
        let q = quantization(&cfg, "config.json").unwrap().unwrap();
        assert!(q.modules_to_not_convert.iter().any(|m| m == "lm_head"), "{q:?}");
        assert_eq!(quantization(&serde_json::json!({}), "c").unwrap(), None);
        let gptq = serde_json::json!({"quantization_config": {"quant_method": "gptq"}});
        let e = format!("{:#}", quantization(&gptq, "config.json").unwrap_err());
        assert!(e.contains("quantization_config.quant_method 'gptq'"), "{e}");
    }

    /// Blocks and scales that disagree in shape, or a pair stored in another dtype, are refused
    /// naming the tensors.
    #[test]
    fn mismatched_pairs_are_refused_by_name() {
        use safetensors::tensor::{Dtype, TensorView};
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("model.safetensors");
        let (blocks, scales, f) = (vec![0u8; 2 * 4 * 16], vec![127u8; 2 * 2 * 2], vec![0u8; 4 * 8]);
        let tensors = vec![
            ("e.w_blocks", TensorView::new(Dtype::U8, vec![2, 4, 1, 16], &blocks).unwrap()),
            ("e.w_scales", TensorView::new(Dtype::U8, vec![2, 2, 2], &scales).unwrap()),
            ("e.f_blocks", TensorView::new(Dtype::F32, vec![2, 4], &f).unwrap()),
        ];
        safetensors::serialize_to_file(tensors, None, &path).unwrap();
        let ckpt = Checkpoint::open(&path).unwrap();
        let e = format!("{:#}", packed(&ckpt, "e.w").unwrap_err());
        assert!(e.contains("e.w_blocks [2, 4, 1, 16] and e.w_scales [2, 2, 2] disagree"), "{e}");
        let e = format!("{:#}", packed(&ckpt, "e.f").unwrap_err());
        assert!(e.contains("e.f_blocks is F32, not U8"), "{e}");
        let e = format!("{:#}", packed(&ckpt, "e.g").unwrap_err());
        assert!(e.contains("no tensor e.g_blocks"), "{e}");
    }
}
