//! LoRA and QLoRA as an edit of a layer description: the base's tensors become frozen (the
//! slot's first `frozen` weights, or, quantised, NF4 words in the packed region), each targeted
//! projection gets an `A` (r, in) and `B` (out, r) appended as the layer's only trained tensors,
//! and an [`Op::Lora`] after the product that computes it. The backward is derived again:
//! the adapters' backward follows their product's, and no frozen weight has a gradient.
//!
//! A target names a module (`q_proj`); its product may be fused (`q|k|v`, `gate|up`): the
//! adapter then adds into its columns of the fused output.

use std::ops::Range;

use crate::model::spec::{
    ActSpec, ExpertAdapters, ExpertLora, IO_SLOTS, Init, LayerSpec, Op, PackedPart, Stored,
    TensorSpec, Weight,
};
use crate::rng::SplitMix64;

/// The dtype the frozen tensors (all but NF4 ones) are kept in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaseDtype {
    F32,
    Bf16,
}

impl BaseDtype {
    pub fn bytes(self) -> usize {
        match self {
            BaseDtype::F32 => 4,
            BaseDtype::Bf16 => 2,
        }
    }
}

/// What an adapter adds to every layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    pub r: usize,
    /// `alpha / r`, or `alpha / sqrt(r)` with rsLoRA.
    pub scale: f32,
    /// Module names (`q_proj`, `down_proj`).
    pub targets: Vec<String>,
    /// QLoRA: every matrix of a product is stored as NF4.
    pub nf4: bool,
    /// The dtype of the frozen tensors not stored as NF4.
    pub base: BaseDtype,
    /// Adapters on the sparse layers' routed experts.
    pub experts: ExpertTargets,
}

/// Adapters on a sparse layer's experts, PEFT's `target_parameters`: the rank and scale of the
/// gate|up one (`mlp.experts.gate_up_proj`) and of the down one (`mlp.experts.down_proj`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertTargets {
    pub gate_up: Option<(usize, f32)>,
    pub down: Option<(usize, f32)>,
}

/// PEFT's names of a sparse layer's expert adapter tensors (A, B) for the gate|up (`gate_up`
/// true) or down parameter: two wrappers on one module nest, the inner (gate_up) one's names
/// carrying `base_layer.`; a lone wrapper has the plain names.
pub fn expert_adapter_names(t: ExpertTargets, gate_up: bool) -> (String, String) {
    let nested = gate_up && t.down.is_some();
    let path = if nested { "mlp.experts.base_layer" } else { "mlp.experts" };
    (format!("{path}.lora_A.weight"), format!("{path}.lora_B.weight"))
}

/// An expert adapter's B in PEFT's file order, (out, E*r) with column `j*E + e` expert e's
/// rank j, from Horizon's expert-major one (E, out, r).
pub fn expert_b_to_peft(ours: &[f32], e: usize, out: usize, r: usize) -> Vec<f32> {
    let mut peft = vec![0.0; ours.len()];
    b_indices(e, out, r).for_each(|(h, p)| peft[p] = ours[h]);
    peft
}

/// The inverse of [`expert_b_to_peft`].
pub fn expert_b_from_peft(peft: &[f32], e: usize, out: usize, r: usize) -> Vec<f32> {
    let mut ours = vec![0.0; peft.len()];
    b_indices(e, out, r).for_each(|(h, p)| ours[h] = peft[p]);
    ours
}

/// Each element of an expert adapter's B: (its index in Horizon's (E, out, r), in PEFT's
/// (out, E*r)).
fn b_indices(e: usize, out: usize, r: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..e).flat_map(move |x| {
        (0..out)
            .flat_map(move |o| (0..r).map(move |j| ((x * out + o) * r + j, o * e * r + j * e + x)))
    })
}

/// One targeted module of a layer, found in its description.
struct Target {
    name: String,
    /// Index of the product op that computes it.
    op: usize,
    /// Its rows of the product's weight, as output columns.
    col: usize,
    w: usize,
    ic: usize,
}

/// The target naming a sparse layer's router (PEFT's `target_parameters` `mlp.gate.weight`):
/// an adapter on the router's product, named `mlp.gate.lora_{A,B}.weight` in every family (the
/// module path transformers 5 gives it, Mixtral's too; gpt-oss's `mlp.router`); dense layers
/// have none.
pub const ROUTER: &str = "router";

/// The HF suffix of a target's adapter tensor (`self_attn.q_proj.lora_A.weight`).
pub fn adapter_suffix(module: &str, b: bool) -> String {
    format!("{module}.lora_{}.weight", if b { 'B' } else { 'A' })
}

impl LayerSpec {
    /// This layer with `lora`'s adapters. Errors (for the user) name a target the layer does
    /// not have, or a QLoRA layer with no product to quantise.
    pub fn with_lora(&self, lora: &LoraSpec) -> Result<LayerSpec, String> {
        self.with_lora_in(lora, false)
    }

    /// [`LayerSpec::with_lora`]; with `mxfp4`, the routed experts stay MXFP4 as the checkpoint
    /// packs them (gpt-oss).
    pub fn with_lora_in(&self, lora: &LoraSpec, mxfp4: bool) -> Result<LayerSpec, String> {
        let routed = self.ops.iter().any(|op| matches!(op, Op::Route { .. }));
        let names: Vec<String> =
            lora.targets.iter().filter(|t| routed || *t != ROUTER).cloned().collect();
        let targets = find_targets(self, &names)?;
        if lora.nf4 && !self.ops.iter().any(|op| matches!(op, Op::Linear { .. })) {
            return Err(format!("layer kind {} has no Linear weight to quantise", self.kind));
        }
        let mut out = self.clone();
        let moved = relayout(&mut out, (lora.nf4, mxfp4));
        for op in &mut out.ops {
            remap(op, &moved);
        }
        add_adapters(&mut out, &targets, lora);
        add_expert_adapters(&mut out, lora.experts);
        out.workspace = out
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Linear { w: w @ Weight::Packed(_), .. } => Some(w.numel()),
                Op::Experts { packed: Some(_), i, c, .. } => Some(2 * i * c),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        out.derive();
        Ok(out)
    }
}

/// Every target's product and columns; an error names a target no product computes.
fn find_targets(spec: &LayerSpec, names: &[String]) -> Result<Vec<Target>, String> {
    let mut found = Vec::new();
    for name in names {
        if name == ROUTER {
            found.push(router_target(spec));
            continue;
        }
        let suffix = format!(".{name}.weight");
        let Some(t) = spec.tensors.iter().find(|t| t.name.ends_with(&suffix)) else {
            let have: Vec<&str> = spec
                .ops
                .iter()
                .filter_map(|op| match op {
                    Op::Linear { w: Weight::Slot(r), .. } => Some(r.start),
                    _ => None,
                })
                .flat_map(|s| spec.tensors.iter().filter(move |t| t.offset >= s))
                .filter(|t| t.shape.len() == 2)
                .filter_map(|t| t.name.strip_suffix(".weight")?.rsplit('.').next())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            return Err(format!(
                "adapter target `{name}` is not a module of this model's layers (its linear \
                 modules: {})",
                have.join(", ")
            ));
        };
        let r = t.range();
        let op = spec.ops.iter().position(|op| {
            matches!(op, Op::Linear { w: Weight::Slot(w), .. } if w.start <= r.start && r.end <= w.end)
        });
        let Some(op) = op else {
            return Err(format!("adapter target `{name}` ({}) is not a product's weight", t.name));
        };
        let Op::Linear { w: Weight::Slot(ref w), ic, .. } = spec.ops[op] else { unreachable!() };
        let col = (r.start - w.start) / ic;
        found.push(Target {
            name: t.name.trim_end_matches(".weight").to_string(),
            op,
            col,
            w: t.shape[0],
            ic,
        });
    }
    found.sort_by_key(|t| (t.op, t.col));
    Ok(found)
}

/// The router's product of a sparse layer, as a target named as PEFT names it.
fn router_target(spec: &LayerSpec) -> Target {
    let logits = spec.ops.iter().find_map(|op| match op {
        Op::Route { logits, .. } => Some(*logits),
        _ => None,
    });
    let op = spec
        .ops
        .iter()
        .position(|op| matches!(op, Op::Linear { out, .. } if Some(*out) == logits))
        .expect("a router feeds the routing");
    let Op::Linear { ic, oc, w: Weight::Slot(ref w), .. } = spec.ops[op] else { unreachable!() };
    // gpt-oss's router is `mlp.router`; every other family's `mlp.gate` (Mixtral's too).
    let gpt_oss = spec.tensors.iter().any(|t| t.offset == w.start && t.name == "mlp.router.weight");
    let name = if gpt_oss { "mlp.router" } else { "mlp.gate" };
    Target { name: name.to_string(), op, col: 0, w: oc, ic }
}

/// Where each tensor of the base went: old slot start -> its new tensor.
type Moved = Vec<(usize, TensorSpec)>;

/// Lay the base out again, every tensor frozen: the products' matrices packed (NF4) with
/// `nf4`, the routed experts' as MXFP4 with `mxfp4` (whatever `nf4` says), the rest at the
/// front of the slot. Returns the old start of each tensor with its new spec.
fn relayout(spec: &mut LayerSpec, (nf4, mxfp4): (bool, bool)) -> Moved {
    let (mut linear, mut experts) = (Vec::new(), Vec::new());
    for op in &spec.ops {
        match op {
            Op::Linear { w: Weight::Slot(r), .. } => linear.push(r.clone()),
            Op::Experts { gate_up, down, .. } => experts.extend([gate_up.clone(), down.clone()]),
            _ => {}
        }
    }
    let inside = |ms: &[Range<usize>], t: &TensorSpec| ms.iter().any(|m| m.contains(&t.offset));
    let packed = |t: &TensorSpec| {
        if mxfp4 && inside(&experts, t) {
            Some(Stored::Mxfp4)
        } else if nf4 && (inside(&linear, t) || inside(&experts, t)) {
            Some(Stored::Nf4)
        } else {
            None
        }
    };
    let (mut slot, mut words) = (0, 0);
    let mut moved = Vec::new();
    for t in &spec.tensors {
        let mut n = t.clone();
        if let Some(stored) = packed(t) {
            n.stored = stored;
            n.offset = words;
            words += n.stored_len();
        } else {
            n.offset = slot;
            slot += n.numel();
        }
        moved.push((t.offset, n));
    }
    spec.tensors = moved.iter().map(|(_, t)| t.clone()).collect();
    // Slot tensors first, then the packed ones (stable within each).
    spec.tensors.sort_by_key(|t| (t.stored.is_packed(), t.offset));
    spec.len = slot;
    spec.frozen = slot;
    spec.packed = words;
    moved
}

/// The new home of the base slot range `r` (a run of whole tensors).
fn parts_of(moved: &Moved, r: &Range<usize>) -> Vec<TensorSpec> {
    moved.iter().filter(|(s, _)| r.start <= *s && *s < r.end).map(|(_, t)| t.clone()).collect()
}

/// `r`, a run of whole slot tensors, in the new slot (they stay adjacent and in order).
fn slot_range(moved: &Moved, r: &Range<usize>) -> Range<usize> {
    let ts = parts_of(moved, r);
    let (first, last) = (ts.first().expect("a weight has tensors"), ts.last().unwrap());
    assert!(ts.iter().all(|t| t.stored == Stored::Slot), "a slot weight stays in the slot");
    first.offset..last.offset + last.numel()
}

/// Point an op's weights at their new places.
fn remap(op: &mut Op, moved: &Moved) {
    match op {
        Op::RmsNorm { w, .. } | Op::HeadNorm { w, .. } => *w = slot_range(moved, w),
        Op::Linear { w, bias, .. } => {
            if let Some(b) = bias {
                *b = slot_range(moved, b);
            }
            let Weight::Slot(r) = w else { unreachable!("a base weight starts in the slot") };
            let ts = parts_of(moved, r);
            *w = if ts[0].stored.is_packed() {
                packed_weight(&ts)
            } else {
                Weight::Slot(slot_range(moved, r))
            };
        }
        Op::Attention { sinks: Some(r), .. } => *r = slot_range(moved, r),
        Op::Experts { gate_up, down, packed, bias, .. } => {
            if let Some([gb, db]) = bias {
                (*gb, *db) = (slot_range(moved, gb), slot_range(moved, db));
            }
            let (gu, dn) = (parts_of(moved, gate_up), parts_of(moved, down));
            if gu[0].stored.is_packed() {
                let weights = gu
                    .chunks(2)
                    .zip(&dn)
                    .map(|(g, d)| [packed_weight(g), packed_weight(std::slice::from_ref(d))]);
                *packed = Some(weights.collect());
                (*gate_up, *down) = (0..0, 0..0);
            } else {
                *gate_up = slot_range(moved, gate_up);
                *down = slot_range(moved, down);
            }
        }
        _ => {}
    }
}

/// NF4 tensors dequantised side by side into the workspace, as one matrix.
fn packed_weight(ts: &[TensorSpec]) -> Weight {
    let mut at = 0;
    Weight::Packed(
        ts.iter()
            .map(|t| {
                let p = PackedPart { words: t.range(), stored: t.stored, at, n: t.numel() };
                at += t.numel();
                p
            })
            .collect(),
    )
}

/// A sparse layer's expert adapters (`t`), appended to the trained part: per parameter A
/// (E*r, in) and B (E, out, r), and the experts op's scratch for them.
fn add_expert_adapters(spec: &mut LayerSpec, t: ExpertTargets) {
    let Some(at) = spec.ops.iter().position(|op| matches!(op, Op::Experts { .. })) else {
        return;
    };
    if t.gate_up.is_none() && t.down.is_none() {
        return;
    }
    let Op::Experts { e, i, c, .. } = spec.ops[at] else { unreachable!() };
    let mut adapter = |gate_up: bool, (r, scale): (usize, f32)| {
        let (ic, oc) = if gate_up { (c, 2 * i) } else { (i, c) };
        let (na, nb) = expert_adapter_names(t, gate_up);
        let a = push_tensor(spec, na, vec![e * r, ic], Init::KaimingUniform);
        let b = push_tensor(spec, nb, vec![oc, e * r], Init::Zeros);
        ExpertLora { a, b, r, scale }
    };
    let gate_up = t.gate_up.map(|g| adapter(true, g));
    let down = t.down.map(|d| adapter(false, d));
    let mut lora = ExpertAdapters { gate_up, down, scratch: None };
    let (wu, wt) = lora.widths(i, c);
    spec.acts.push(ActSpec { name: "experts_lora_u", width: wu, differentiable: false });
    spec.acts.push(ActSpec { name: "experts_lora_t", width: wt, differentiable: false });
    let n = IO_SLOTS + spec.acts.len();
    lora.scratch = Some([n - 2, n - 1]);
    let Op::Experts { lora: l, .. } = &mut spec.ops[at] else { unreachable!() };
    **l = lora;
}

/// Append each target's `A` and `B` to the slot (the trained part), its saved `u` and the
/// shared scratch, and an [`Op::Lora`] after its product.
fn add_adapters(spec: &mut LayerSpec, targets: &[Target], lora: &LoraSpec) {
    let tmp_w = targets.iter().map(|t| t.w).max().unwrap_or(0);
    spec.acts.push(ActSpec { name: "lora_tmp", width: tmp_w, differentiable: false });
    let tmp = IO_SLOTS + spec.acts.len() - 1;
    for (k, t) in targets.iter().enumerate() {
        // Adapters already inserted before this target's product (on earlier products).
        let inserted = targets[..k].iter().filter(|o| o.op < t.op).count();
        let a = push_tensor(
            spec,
            adapter_suffix(&t.name, false),
            vec![lora.r, t.ic],
            Init::KaimingUniform,
        );
        let b = push_tensor(spec, adapter_suffix(&t.name, true), vec![t.w, lora.r], Init::Zeros);
        spec.acts.push(ActSpec { name: "lora_u", width: lora.r, differentiable: false });
        let u = IO_SLOTS + spec.acts.len() - 1;
        let Op::Linear { inp, out, oc, .. } = spec.ops[t.op + inserted] else { unreachable!() };
        // After the product and any adapter already added to it.
        let mut at = t.op + inserted + 1;
        while matches!(spec.ops.get(at), Some(Op::Lora { out: o, .. }) if *o == out) {
            at += 1;
        }
        let op = Op::Lora {
            inp,
            out,
            a,
            b,
            col: t.col,
            w: t.w,
            oc,
            ic: t.ic,
            r: lora.r,
            u,
            tmp,
            scale: lora.scale,
        };
        spec.ops.insert(at, op);
    }
}

/// A trained tensor at the end of the slot.
fn push_tensor(spec: &mut LayerSpec, name: String, shape: Vec<usize>, init: Init) -> Range<usize> {
    let t = TensorSpec { name, shape, offset: spec.len, init, stored: Stored::Slot };
    spec.len += t.numel();
    let r = t.range();
    spec.tensors.push(t);
    r
}

/// Separates LoRA's init streams from every other use of a seed (ASCII "lora_A").
const LORA_STREAM: u64 = 0x6c6f_7261_5f41;

/// PEFT's default initialisation of a new adapter's A (`init_lora_weights: true`):
/// `torch.nn.init.kaiming_uniform_(A, a=sqrt(5))`, B zero, so the adapted model starts equal to
/// the base. Deterministic from a seed with the project's generator (splitmix64), one stream per
/// tensor, so the order or threads tensors are filled on change nothing.
///
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::spec::{AttnSpec, LayerBuilder, X, Y};

    fn spec(nf4: bool, targets: &[&str]) -> LoraSpec {
        LoraSpec {
            r: 2,
            scale: 1.0,
            targets: targets.iter().map(|t| t.to_string()).collect(),
            nf4,
            base: BaseDtype::F32,
            experts: ExpertTargets::default(),
        }
    }

    /// A layer of a norm and a residual add only: nothing to adapt, nothing to quantise.
    fn no_products() -> LayerSpec {
        let c = 4;
        let mut b = LayerBuilder::new(c);
        let ln = b.tensor("norm.weight", &[c], Init::Ones);
        let h = b.rmsnorm(X, ("h", "rstd"), ln, 0.0);
        b.op(Op::Add { a: X, b: h, out: Y });
        b.finish("plain", AttnSpec { h: 1, kvh: 1, d: c, window: 0, scale: 1.0 }, 1e-6)
    }

    #[test]
    fn qlora_on_a_layer_without_a_product_is_refused() {
        let err = no_products().with_lora(&spec(true, &[])).unwrap_err();
        assert!(err.contains("no Linear weight to quantise"), "{err}");
    }

    #[test]
    fn a_target_the_layer_lacks_is_refused_naming_it_and_the_modules_it_has() {
        let layer = crate::model::families::fixture_layout().kinds[0].clone();
        let err = layer.with_lora(&spec(false, &["q_proj", "wqkv"])).unwrap_err();
        assert!(
            err.contains("`wqkv`") && err.contains("q_proj") && err.contains("down_proj"),
            "{err}"
        );
    }

    #[test]
    fn adapters_are_the_trained_suffix_and_qlora_packs_every_product() {
        let cfg = crate::hf::config::ModelConfig::from_file(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/qwen2_tied_padded/model/config.json"
        )))
        .unwrap();
        let layer = crate::model::describe(&cfg).kinds[0].clone();
        let q = layer.with_lora(&spec(true, &["q_proj", "v_proj", "down_proj"])).unwrap();
        // Norms and biases stay in the slot, frozen; seven matrices are NF4.
        let packed = q.tensors.iter().filter(|t| t.stored == Stored::Nf4).count();
        assert_eq!(packed, 7);
        assert_eq!(q.trained().count(), 6, "A and B of three targets");
        let slot_base: usize =
            q.frozen_tensors().filter(|t| t.stored == Stored::Slot).map(|t| t.numel()).sum();
        assert_eq!(q.frozen, slot_base);
        assert_eq!(q.train_len(), q.trained().map(|t| t.numel()).sum::<usize>());
        assert_eq!(q.ops.iter().filter(|o| matches!(o, Op::Lora { .. })).count(), 3);
    }
}
