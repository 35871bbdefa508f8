//! The whole model's optimizer state in host RAM, one storage for every buffer. Each optimizer
//! (AdamW with fp32 moments; the 8-bit AdamW of `optimizer.memory: compact`) implements
//! [`OptimizerState`]: its state bytes, a buffer's state borrowed for an update or a rescale
//! (the per-buffer [`Moments`](crate::optim::moments::Moments) trait), and checkpoint save/load.
//! A memory mode picks a storage ([`MomentStorage`]); nothing else branches on the mode.

use std::fs;
use std::io::{Read, Write};
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::hf::checkpoint::SaveDtype;
use crate::model::layout::ModelLayout;
use crate::model::params::ParamStore;
use crate::optim::adamw8bit::Moments8;
use crate::optim::moments::{AnyMoments, MomentStorage, Moments32};

/// `optimizer.memory`: how much host memory the optimizer state takes (see docs/configuration.md).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerMemory {
    /// fp32 masters, m, v and a whole-model fp32 gradient; exact global-norm clipping.
    #[default]
    Exact,
    /// fp32 masters, m, v; no whole-model gradient: a layer is updated as soon as its gradient
    /// is complete (clipping by an estimate of the step's norm) unless its slab can wait for the
    /// norm; embedding, final norm and head clip by the step's norm.
    Lean,
    /// `lean` with m and v quantised to 8 bits per block of 256 (dynamic quantisation).
    Compact,
}

impl OptimizerMemory {
    pub const ALL: [OptimizerMemory; 3] =
        [OptimizerMemory::Exact, OptimizerMemory::Lean, OptimizerMemory::Compact];

    /// The name used in configs and messages.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerMemory::Exact => "exact",
            OptimizerMemory::Lean => "lean",
            OptimizerMemory::Compact => "compact",
        }
    }

    /// Whether gradients are consumed layer by layer (no whole-model gradient buffer).
    pub fn streams_updates(self) -> bool {
        self != OptimizerMemory::Exact
    }

    /// Whether the host store keeps the decoder layers' gradients (only `exact` does).
    pub fn keeps_layer_grads(self) -> bool {
        !self.streams_updates()
    }

    /// How the mode stores the AdamW moments.
    pub fn moment_storage(self) -> MomentStorage {
        match self {
            OptimizerMemory::Compact => MomentStorage::Q8,
            OptimizerMemory::Exact | OptimizerMemory::Lean => MomentStorage::F32,
        }
    }
}

/// What every optimizer's state can do.
pub trait OptimizerState: Sized {
    /// Zero state for every buffer of `layout`.
    fn zeros(layout: &ModelLayout) -> Self;
    /// Host bytes the state takes.
    fn state_bytes(&self) -> usize;
    /// Buffer `i`'s state (the order of [`ParamStore::buffers`]), borrowed for an update or a
    /// rescale.
    fn buffer(&mut self, i: usize) -> AnyMoments<'_>;
    /// Write the state into the checkpoint directory `dir`.
    fn save(&self, dir: &Path, layout: &ModelLayout) -> Result<()>;
    /// Read the state from the checkpoint directory `dir`, checked against `layout`.
    fn load(dir: &Path, layout: &ModelLayout) -> Result<Self>;
}

/// AdamW's fp32 moments, shaped like the masters.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW32 {
    pub m: ParamStore,
    pub v: ParamStore,
}

/// The fp32 moments' files in a checkpoint (HF tensor names).
const EXP_AVG: &str = "exp_avg.safetensors";
const EXP_AVG_SQ: &str = "exp_avg_sq.safetensors";

impl OptimizerState for AdamW32 {
    fn zeros(layout: &ModelLayout) -> Self {
        AdamW32 { m: ParamStore::zeros(layout), v: ParamStore::zeros(layout) }
    }
    fn state_bytes(&self) -> usize {
        8 * self.m.buffers().iter().map(|b| b.len()).sum::<usize>()
    }
    fn buffer(&mut self, i: usize) -> AnyMoments<'_> {
        AnyMoments::F32(Moments32 { m: self.m.buffer_mut(i), v: self.v.buffer_mut(i) })
    }
    fn save(&self, dir: &Path, layout: &ModelLayout) -> Result<()> {
        self.m.save_safetensors(layout, &dir.join(EXP_AVG), SaveDtype::F32)?;
        self.v.save_safetensors(layout, &dir.join(EXP_AVG_SQ), SaveDtype::F32)
    }
    fn load(dir: &Path, layout: &ModelLayout) -> Result<Self> {
        // Finite (the loader refuses NaN and inf), and second moments never negative: a
        // damaged state would write NaN into the masters at the first update.
        let m = ParamStore::load_hf(layout, &dir.join(EXP_AVG))?;
        let v = ParamStore::load_hf(layout, &dir.join(EXP_AVG_SQ))?;
        for (name, _) in layout.hf_tensors() {
            let t = v.tensor(layout, &name).expect("the layout names its own tensors");
            if let Some(i) = t.iter().position(|x| *x < 0.0) {
                bail!(
                    "{}: tensor {name}, index {i}: a second moment of {} (they are never \
                     negative); the checkpoint is damaged\nhint: resume from an earlier \
                     checkpoint (--resume DIR)",
                    dir.join(EXP_AVG_SQ).display(),
                    t[i]
                );
            }
        }
        Ok(AdamW32 { m, v })
    }
}

/// The 8-bit AdamW state: one [`Moments8`] per buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW8 {
    pub buffers: Vec<Moments8>,
}

/// The 8-bit moments' file in a checkpoint.
pub const MOMENTS8: &str = "moments8.bin";
const MOMENTS8_MAGIC: &[u8; 8] = b"HZNQ8v2\0";
/// The first layout: blocks of 256 across tensor boundaries, `sqrt(v)` (no longer read).
const MOMENTS8_MAGIC_V1: &[u8; 8] = b"HZNQ8v1\0";

impl OptimizerState for AdamW8 {
    fn zeros(layout: &ModelLayout) -> Self {
        AdamW8 { buffers: layout.buffer_tensors().iter().map(|t| Moments8::zeros(t)).collect() }
    }
    fn state_bytes(&self) -> usize {
        self.buffers.iter().map(|q| Moments8::bytes(&q.tensors)).sum()
    }
    fn buffer(&mut self, i: usize) -> AnyMoments<'_> {
        AnyMoments::Q8(self.buffers[i].view_mut())
    }
    /// `moments8.bin`: magic, buffer count, then per buffer its tensor sizes, the m and sqrt-v
    /// codes, the fp32 block scales of m and of v, and the fp32 m and v of the small tensors
    /// (see [`Moments8`]).
    fn save(&self, dir: &Path, _layout: &ModelLayout) -> Result<()> {
        let path = dir.join(MOMENTS8);
        let f =
            fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = std::io::BufWriter::new(f);
        w.write_all(MOMENTS8_MAGIC)?;
        w.write_all(&(self.buffers.len() as u64).to_le_bytes())?;
        for q in &self.buffers {
            w.write_all(&(q.tensors.len() as u64).to_le_bytes())?;
            for &n in &q.tensors {
                w.write_all(&(n as u64).to_le_bytes())?;
            }
            w.write_all(&q.m_codes)?;
            w.write_all(&q.v_codes)?;
            for x in q.m_absmax.iter().chain(&q.v_absmax).chain(&q.m32).chain(&q.v32) {
                w.write_all(&x.to_le_bytes())?;
            }
        }
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all().with_context(|| format!("cannot sync {}", path.display()))
    }
    fn load(dir: &Path, layout: &ModelLayout) -> Result<Self> {
        let path = dir.join(MOMENTS8);
        let f = fs::File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        let mut r = Reader { r: std::io::BufReader::new(f), path: &path };
        let magic = r.bytes8()?;
        if &magic == MOMENTS8_MAGIC_V1 {
            bail!(
                "{}: 8-bit moments in an older layout (blocks across tensors, no fp32 small tensors)\nhint: resume with the Horizon version that wrote it, or start the run again",
                path.display()
            );
        }
        if &magic != MOMENTS8_MAGIC {
            return Err(r.bad("not an 8-bit moments file"));
        }
        let tensors = layout.buffer_tensors();
        // Its exact size first: nothing is allocated from a count read off a damaged file.
        let want: u64 = 16
            + tensors
                .iter()
                .map(|t| 8 + 8 * t.len() as u64 + Moments8::bytes(t) as u64)
                .sum::<u64>();
        let have = fs::metadata(&path)?.len();
        if have != want {
            return Err(r.bad(&format!("{have} bytes where this model's state takes {want}")));
        }
        if r.u64()? != tensors.len() as u64 {
            return Err(r.bad("wrong number of buffers for this model"));
        }
        let buffers: Vec<Moments8> =
            tensors.iter().map(|t| r.moments8(t)).collect::<Result<_>>()?;
        for (b, q) in buffers.iter().enumerate() {
            let scales = q.m_absmax.iter().chain(&q.v_absmax).chain(&q.v32);
            let bad = |x: &f32| !x.is_finite() || *x < 0.0;
            if let Some(x) =
                scales.clone().find(|x| bad(x)).or(q.m32.iter().find(|x| !x.is_finite()))
            {
                return Err(r.bad(&format!(
                    "buffer {b}: a block scale or small-tensor moment of {x} (scales and second \
                     moments are finite and never negative)"
                )));
            }
        }
        Ok(AdamW8 { buffers })
    }
}

/// Reads `moments8.bin`; every short read is "truncated".
struct Reader<'a> {
    r: std::io::BufReader<fs::File>,
    path: &'a Path,
}

impl Reader<'_> {
    fn bad(&self, what: &str) -> anyhow::Error {
        anyhow::anyhow!("{}: {what}; the checkpoint is damaged", self.path.display())
    }
    fn fill(&mut self, buf: &mut [u8]) -> Result<()> {
        self.r.read_exact(buf).map_err(|_| self.bad("truncated"))
    }
    fn bytes8(&mut self) -> Result<[u8; 8]> {
        let mut b = [0u8; 8];
        self.fill(&mut b)?;
        Ok(b)
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes8()?))
    }
    /// One buffer's moments, whose tensors must be `want`.
    fn moments8(&mut self, want: &[usize]) -> Result<Moments8> {
        let count = self.u64()?;
        if count != want.len() as u64 {
            return Err(self.bad(&format!(
                "a buffer of {count} tensors where this model's has {}",
                want.len()
            )));
        }
        let mut theirs = vec![0usize; want.len()];
        for n in theirs.iter_mut() {
            *n = self.u64()? as usize;
        }
        if theirs != want {
            return Err(self.bad("a buffer's tensors do not match this model"));
        }
        let mut q = Moments8::zeros(want);
        self.fill(&mut q.m_codes)?;
        self.fill(&mut q.v_codes)?;
        let mut b4 = [0u8; 4];
        for x in q
            .m_absmax
            .iter_mut()
            .chain(q.v_absmax.iter_mut())
            .chain(q.m32.iter_mut())
            .chain(q.v32.iter_mut())
        {
            self.r.read_exact(&mut b4).map_err(|_| self.bad("truncated"))?;
            *x = f32::from_le_bytes(b4);
        }
        Ok(q)
    }
}

/// The optimizer state of a run, in the storage its memory mode picks.
#[derive(Clone, Debug, PartialEq)]
pub enum OptState {
    F32(AdamW32),
    Q8(AdamW8),
}

impl OptState {
    /// Zero state in `storage`.
    pub fn zeros(storage: MomentStorage, layout: &ModelLayout) -> Self {
        match storage {
            MomentStorage::F32 => OptState::F32(AdamW32::zeros(layout)),
            MomentStorage::Q8 => OptState::Q8(AdamW8::zeros(layout)),
        }
    }

    /// The storage this state is in.
    pub fn storage(&self) -> MomentStorage {
        match self {
            OptState::F32(_) => MomentStorage::F32,
            OptState::Q8(_) => MomentStorage::Q8,
        }
    }

    /// Read a checkpoint's state, written in `storage`.
    pub fn load(storage: MomentStorage, dir: &Path, layout: &ModelLayout) -> Result<Self> {
        Ok(match storage {
            MomentStorage::F32 => OptState::F32(AdamW32::load(dir, layout)?),
            MomentStorage::Q8 => OptState::Q8(AdamW8::load(dir, layout)?),
        })
    }

    /// The same state in `to`: 8-bit encoding rounds each moment to the nearest code; decoding
    /// is exact.
    pub fn into_storage(self, to: MomentStorage, layout: &ModelLayout) -> Self {
        match (self, to) {
            (OptState::F32(s), MomentStorage::Q8) => {
                let mut q = AdamW8::zeros(layout);
                for ((q, m), v) in q.buffers.iter_mut().zip(s.m.buffers()).zip(s.v.buffers()) {
                    q.encode(m, v);
                }
                OptState::Q8(q)
            }
            (OptState::Q8(q), MomentStorage::F32) => {
                OptState::F32(q.decoded(&ParamStore::zeros(layout)))
            }
            (s, _) => s,
        }
    }

    /// fp32 copies of the moments, shaped `like` the masters (decoded from 8 bits; for tests
    /// and comparisons).
    pub fn fp32_moments(&self, like: &ParamStore) -> AdamW32 {
        match self {
            OptState::F32(s) => s.clone(),
            OptState::Q8(q) => q.decoded(like),
        }
    }
}

impl AdamW8 {
    /// The decoded fp32 moments, shaped `like` the masters (allocates).
    fn decoded(&self, like: &ParamStore) -> AdamW32 {
        let mut s = AdamW32 { m: like.zeros_like(false), v: like.zeros_like(false) };
        for ((q, m), v) in self.buffers.iter().zip(s.m.buffers_mut()).zip(s.v.buffers_mut()) {
            let (dm, dv) = q.decode();
            m.copy_from_slice(&dm);
            v.copy_from_slice(&dv);
        }
        s
    }
}

impl OptimizerState for OptState {
    fn zeros(layout: &ModelLayout) -> Self {
        OptState::F32(AdamW32::zeros(layout))
    }
    fn state_bytes(&self) -> usize {
        match self {
            OptState::F32(s) => s.state_bytes(),
            OptState::Q8(s) => s.state_bytes(),
        }
    }
    fn buffer(&mut self, i: usize) -> AnyMoments<'_> {
        match self {
            OptState::F32(s) => s.buffer(i),
            OptState::Q8(s) => s.buffer(i),
        }
    }
    fn save(&self, dir: &Path, layout: &ModelLayout) -> Result<()> {
        match self {
            OptState::F32(s) => s.save(dir, layout),
            OptState::Q8(s) => s.save(dir, layout),
        }
    }
    /// The storage is found from the files present (`moments8.bin`: 8-bit).
    fn load(dir: &Path, layout: &ModelLayout) -> Result<Self> {
        let storage =
            if dir.join(MOMENTS8).exists() { MomentStorage::Q8 } else { MomentStorage::F32 };
        OptState::load(storage, dir, layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::families::fixture_layout;

    /// Each storage's save and load round-trip bit-exactly, and the bytes agree with the
    /// storage's own count.
    #[test]
    fn save_load_round_trips_each_storage() {
        let layout = fixture_layout();
        let dir = std::env::temp_dir().join(format!("horizon-optstate-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let mut s32 = AdamW32::zeros(&layout);
        for (i, b) in s32.m.buffers_mut().into_iter().enumerate() {
            b.iter_mut().enumerate().for_each(|(j, x)| *x = (i * 7 + j) as f32 * 1e-3);
        }
        for b in s32.v.buffers_mut() {
            b.iter_mut().enumerate().for_each(|(j, x)| *x = j as f32 * 1e-6);
        }
        let q = OptState::F32(s32.clone()).into_storage(MomentStorage::Q8, &layout);
        for s in [OptState::F32(s32), q] {
            let tensors: Vec<usize> = layout.buffer_tensors().concat();
            assert_eq!(s.state_bytes(), s.storage().bytes(&tensors));
            s.save(&dir, &layout).unwrap();
            assert_eq!(OptState::load(s.storage(), &dir, &layout).unwrap(), s);
            if s.storage() == MomentStorage::Q8 {
                assert_eq!(<OptState as OptimizerState>::load(&dir, &layout).unwrap(), s);
            }
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
