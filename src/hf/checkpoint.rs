//! Hugging Face safetensors checkpoints: memory-mapped reading (single file or sharded with an
//! index) with dtype conversion to f32 and a NaN/inf scan in the same pass, and streaming
//! writing.
//!
//! Architecture Invariant: a checkpoint is never copied whole into memory. Reading maps every file
//! and converts one tensor straight into the caller's buffer; writing computes the header first,
//! then converts and writes one tensor at a time through a bounded buffer.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::Dtype;
use safetensors::tensor::Metadata;

/// Single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One memory-mapped safetensors file with its parsed header.
struct MappedFile {
    path: PathBuf,
    mmap: Mmap,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
    meta: Metadata,
}

impl MappedFile {
    /// Maps `path` and validates its header against the file size.
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path)
            .with_context(|| format!("opening safetensors file {}", path.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("reading the size of {}", path.display()))?
            .len();
        if len < 8 {
            bail!(
                "{}: {len} bytes is too short for a safetensors file (truncated?)",
                path.display()
            );
        }
        // SAFETY: the map is read-only and lives as long as `MappedFile`. The one hazard of a
        // file map is another process truncating or rewriting the file while it is mapped;
        // Horizon never writes a checkpoint it has open (writes go to a temporary file that is
        // renamed over the target, which leaves existing maps of the old inode intact).
        let mmap = unsafe { Mmap::map(&file) }
            .with_context(|| format!("memory-mapping {}", path.display()))?;
        let (data_start, meta) = parse_header(&mmap, path)?;
        Ok(MappedFile { path: path.to_path_buf(), mmap, data_start, meta })
    }

    /// The bytes, dtype and shape of tensor `name`, if present.
    fn tensor(&self, name: &str) -> Option<(&[u8], Dtype, &[usize])> {
        let info = self.meta.info(name)?;
        let (s, e) = info.data_offsets;
        let bytes = &self.mmap[self.data_start + s..self.data_start + e];
        Some((bytes, info.dtype, &info.shape))
    }
}

/// Parses and validates the header of a whole safetensors file held in `buf`; returns the start
/// of the data section and the metadata.
fn parse_header(buf: &[u8], path: &Path) -> Result<(usize, Metadata)> {
    let corrupt =
        "hint: the file is truncated or not a safetensors file (an interrupted download?)";
    let mut n_bytes = [0u8; 8];
    n_bytes.copy_from_slice(&buf[..8]);
    let n = u64::from_le_bytes(n_bytes);
    let data_start = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_add(8))
        .filter(|&end| end <= buf.len())
        .with_context(|| {
            format!(
                "{}: header length {n} runs past the end of the {}-byte file; {corrupt}",
                path.display(),
                buf.len()
            )
        })?;
    let meta: Metadata = serde_json::from_slice(&buf[8..data_start])
        .with_context(|| format!("{}: invalid safetensors header; {corrupt}", path.display()))?;
    let expected = data_start + meta.data_len();
    if expected != buf.len() {
        bail!(
            "{}: header describes {expected} bytes but the file holds {}; {corrupt}",
            path.display(),
            buf.len()
        );
    }
    Ok((data_start, meta))
}

/// A tensor read as part of a stored one: element `[i0, i1, ..]` of the view is element
/// `at + sum_d i_d strides[d]` of `source` (row-major contiguous strides for a plain slice).
/// With `mxfp4`, `source` names a packed parameter (`{source}_blocks` / `_scales`), read as
/// transformers dequantizes it (E, in, out), one expert of `per_expert` values at a time.
#[derive(Clone, Debug)]
struct View {
    source: String,
    at: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
    mxfp4: Option<usize>,
}

impl View {
    /// Whether the view is one contiguous run of a stored tensor.
    fn contiguous(&self) -> bool {
        self.mxfp4.is_none() && self.strides == row_major(&self.shape)
    }

    /// The source offsets of the view's elements, in row-major order.
    fn offsets(&self) -> Vec<usize> {
        let mut out = vec![self.at];
        for (&n, &st) in self.shape.iter().zip(&self.strides) {
            out = out.iter().flat_map(|&o| (0..n).map(move |i| o + i * st)).collect();
        }
        out
    }
}

/// Row-major strides of `shape`.
fn row_major(shape: &[usize]) -> Vec<usize> {
    let mut st = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1] * shape[d + 1];
    }
    st
}

/// A Hugging Face checkpoint directory, every file memory-mapped.
pub struct Checkpoint {
    /// `model.safetensors` or the index file: what error messages name.
    source: PathBuf,
    files: Vec<MappedFile>,
    /// Tensor name -> index into `files`.
    tensors: BTreeMap<String, usize>,
    /// Tensors read as parts of stored ones (a fused expert tensor's per-expert matrices).
    views: BTreeMap<String, View>,
    /// Stored tensors read only through views: not listed.
    hidden: std::collections::BTreeSet<String>,
}

impl Checkpoint {
    /// Opens `dir` holding `model.safetensors`, or shards listed by `model.safetensors.index.json`
    /// (`weight_map`: name -> file). `dir` may also be a single `.safetensors` file.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.exists() {
            bail!("checkpoint directory {} does not exist", dir.display());
        }
        if dir.is_file() {
            return Self::open_single(dir);
        }
        let single = dir.join(SINGLE_FILE);
        if single.exists() {
            return Self::open_single(&single);
        }
        let index = dir.join(INDEX_FILE);
        if index.exists() {
            return Self::open_sharded(dir, &index);
        }
        let hint = if dir.join("pytorch_model.bin").exists()
            || dir.join("pytorch_model.bin.index.json").exists()
        {
            "; hint: only PyTorch .bin weights are present, convert them to safetensors first"
        } else {
            ""
        };
        bail!("{} holds neither {SINGLE_FILE} nor {INDEX_FILE}{hint}", dir.display())
    }

    fn open_single(path: &Path) -> Result<Self> {
        let file = MappedFile::open(path)?;
        let tensors = file.meta.tensors().into_keys().map(|name| (name, 0)).collect();
        Ok(Checkpoint {
            source: path.to_path_buf(),
            files: vec![file],
            tensors,
            views: BTreeMap::new(),
            hidden: Default::default(),
        })
    }

    fn open_sharded(dir: &Path, index: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(index)
            .with_context(|| format!("reading checkpoint index {}", index.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", index.display()))?;
        let weight_map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{}: missing object 'weight_map'", index.display()))?;
        let mut shard_of: BTreeMap<&str, &str> = BTreeMap::new();
        for (name, file) in weight_map {
            let file = file.as_str().with_context(|| {
                format!("{}: weight_map['{name}'] must be a file name, got {file}", index.display())
            })?;
            shard_of.insert(name, file);
        }
        let mut shard_names: Vec<&str> = shard_of.values().copied().collect();
        shard_names.sort_unstable();
        shard_names.dedup();

        let mut files: Vec<MappedFile> = Vec::with_capacity(shard_names.len());
        let mut file_index = HashMap::new();
        for shard in &shard_names {
            let path = dir.join(shard);
            let file = MappedFile::open(&path).with_context(|| {
                format!("opening shard '{shard}' listed in {}", index.display())
            })?;
            file_index.insert(*shard, files.len());
            files.push(file);
        }

        let mut tensors: BTreeMap<String, usize> = BTreeMap::new();
        for (i, file) in files.iter().enumerate() {
            for name in file.meta.tensors().into_keys() {
                if let Some(&j) = tensors.get(&name) {
                    bail!(
                        "tensor '{name}' is stored twice, in {} and in {}",
                        files[j].path.display(),
                        file.path.display()
                    );
                }
                tensors.insert(name, i);
            }
        }
        for (name, shard) in &shard_of {
            let i = file_index[shard];
            if tensors.get(*name) != Some(&i) {
                bail!(
                    "{} maps tensor '{name}' to {}, but that shard does not hold it",
                    index.display(),
                    files[i].path.display()
                );
            }
        }
        Ok(Checkpoint {
            source: index.to_path_buf(),
            files,
            tensors,
            views: BTreeMap::new(),
            hidden: Default::default(),
        })
    }

    /// `model.safetensors` or the index file this checkpoint was opened from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Every tensor name, sorted (views included, the stored tensors they cover not).
    pub fn names(&self) -> Vec<String> {
        let stored = self.tensors.keys().filter(|n| !self.hidden.contains(*n));
        let mut names: Vec<String> = stored.chain(self.views.keys()).cloned().collect();
        names.sort_unstable();
        names
    }

    /// Reads the stored tensor `source`'s elements `at..` of `shape` as tensor `name` from now
    /// on, and lists `name` instead of `source` (a fused expert tensor read expert by expert).
    /// Errors name the tensor when `source` is absent or too small.
    pub fn add_view(&mut self, name: &str, source: &str, at: usize, shape: &[usize]) -> Result<()> {
        self.add_strided_view(name, source, at, shape, &row_major(shape))
    }

    /// [`Checkpoint::add_view`] of elements `at + sum_d i_d strides[d]` (a transposed or
    /// interleaved part: gpt-oss's in-to-out, gate/up-interleaved experts).
    pub fn add_strided_view(
        &mut self,
        name: &str,
        source: &str,
        at: usize,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<()> {
        let have: usize = self
            .shape(source)
            .with_context(|| format!("{}: no tensor '{source}'", self.source.display()))?
            .iter()
            .product();
        let view = View {
            source: source.to_string(),
            at,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            mxfp4: None,
        };
        self.insert_view(name, view, have)?;
        self.hidden.insert(source.to_string());
        Ok(())
    }

    /// [`Checkpoint::add_strided_view`] of an MXFP4 packed parameter `param` (its
    /// `{param}_blocks` and `{param}_scales`, checked against each other), read as transformers
    /// dequantizes it: (E, in, out) in-to-out, every value exact.
    pub fn add_mxfp4_view(
        &mut self,
        name: &str,
        param: &str,
        at: usize,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<()> {
        let p = super::mxfp4::packed(self, param)?;
        let per_expert = p.rows * p.cols;
        let view = View {
            source: param.to_string(),
            at,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            mxfp4: Some(per_expert),
        };
        self.insert_view(name, view, p.experts * per_expert)?;
        self.hidden.insert(format!("{param}_blocks"));
        self.hidden.insert(format!("{param}_scales"));
        Ok(())
    }

    /// Adds `view` as `name` after checking it stays inside its source's `have` values; a
    /// packed view also inside one expert.
    fn insert_view(&mut self, name: &str, view: View, have: usize) -> Result<()> {
        let last = view.at
            + view
                .shape
                .iter()
                .zip(&view.strides)
                .map(|(&n, &s)| (n.max(1) - 1) * s)
                .sum::<usize>();
        let one_expert = view.mxfp4.is_none_or(|per| view.at / per == last / per);
        if last >= have || !one_expert {
            bail!(
                "{}: tensor '{}' has {have} values; view '{name}' reaches {}",
                self.source.display(),
                view.source,
                last + 1
            );
        }
        self.views.insert(name.to_string(), view);
        Ok(())
    }

    /// Shape of tensor `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        if let Some(v) = self.views.get(name) {
            return Some(v.shape.clone());
        }
        let &i = self.tensors.get(name)?;
        self.files[i].meta.info(name).map(|info| info.shape.clone())
    }

    /// The stored dtype of tensor `name` (`F32`, `BF16`, ...), if the checkpoint has it.
    pub fn dtype(&self, name: &str) -> Option<&'static str> {
        if let Some(v) = self.views.get(name) {
            return if v.mxfp4.is_some() { Some("MXFP4") } else { self.dtype(&v.source) };
        }
        let &i = self.tensors.get(name)?;
        let (_, dtype, _) = self.files[i].tensor(name)?;
        Some(dtype_name(dtype))
    }

    /// The stored bytes of tensor `name`, which must be `U8` (MXFP4's blocks and scales), and
    /// its shape; an error naming the tensor otherwise.
    pub fn read_u8(&self, name: &str) -> Result<(&[u8], Vec<usize>)> {
        let at = self.tensors.get(name).filter(|_| !self.views.contains_key(name));
        let Some(&i) = at else {
            bail!("{}: no tensor {name}", self.source.display());
        };
        let (bytes, dtype, shape) = self.files[i].tensor(name).expect("indexed names exist");
        if dtype != Dtype::U8 {
            bail!(
                "{}: {name} is {}, not U8\nhint: MXFP4 blocks and scales are stored as uint8",
                self.source.display(),
                dtype_name(dtype)
            );
        }
        Ok((bytes, shape.to_vec()))
    }

    /// Whether tensor `name` is present (a view, or a stored tensor no view covers).
    pub fn contains(&self, name: &str) -> bool {
        self.views.contains_key(name)
            || (self.tensors.contains_key(name) && !self.hidden.contains(name))
    }

    /// Reads tensor `name`, which must have `shape`, converting f32, bf16, f16 or f64 to f32,
    /// and scans it for NaN and ±inf as it converts: [`NonFinite::Refuse`] makes one an error
    /// naming the tensor, its flat index and the value; [`NonFinite::Allow`] loads it with a
    /// warning. dst: (product of `shape`,), overwritten.
    pub fn read_f32(
        &self,
        name: &str,
        shape: &[usize],
        dst: &mut [f32],
        non_finite: NonFinite,
    ) -> Result<()> {
        self.read_into(name, shape, dst, non_finite, false).map(|_| ())
    }

    /// [`Checkpoint::read_f32`], also returning the tensor's content hash ([`tensor_hash`]):
    /// every stored byte, hashed tile by tile in the conversion's own pass (each tile while it
    /// is in cache, the tiles in parallel, combined in order: the same hash on any thread
    /// count, and whichever shard holds the tensor).
    pub fn read_f32_hashed(
        &self,
        name: &str,
        shape: &[usize],
        dst: &mut [f32],
        non_finite: NonFinite,
    ) -> Result<u64> {
        self.read_into(name, shape, dst, non_finite, true).map(|h| h.expect("hashed"))
    }

    /// [`Checkpoint::read_f32`], and with `hash` the tensor's content hash.
    fn read_into(
        &self,
        name: &str,
        shape: &[usize],
        dst: &mut [f32],
        non_finite: NonFinite,
        hash: bool,
    ) -> Result<Option<u64>> {
        let numel: usize = shape.iter().product();
        assert_eq!(dst.len(), numel, "read_f32('{name}'): dst length does not match {shape:?}");
        let view = self.views.get(name);
        if let Some(v) = view.filter(|v| v.mxfp4.is_some()) {
            let bytes: Vec<u8> =
                self.mxfp4_values(v)?.iter().flat_map(|x| x.to_le_bytes()).collect();
            let (path, got) = (self.source.clone(), v.shape.clone());
            return Self::convert(
                name,
                shape,
                dst,
                (&bytes, Dtype::F32, got),
                &path,
                non_finite,
                hash,
            );
        }
        let stored = view.map_or(name, |v| v.source.as_str());
        let &i = self.tensors.get(stored).with_context(|| {
            format!(
                "tensor '{name}' not found in {} ({} tensors); hint: does the checkpoint match \
                 config.json?",
                self.source.display(),
                self.tensors.len()
            )
        })?;
        let file = &self.files[i];
        let (bytes, dtype, got) = file.tensor(stored).expect("tensor map and file agree");
        let size = bytes.len() / got.iter().product::<usize>().max(1);
        let gathered: Vec<u8>;
        let (bytes, got) = match view {
            None => (bytes, got.to_vec()),
            Some(v) if v.contiguous() => {
                (&bytes[v.at * size..(v.at + numel) * size], v.shape.clone())
            }
            Some(v) => {
                gathered = v
                    .offsets()
                    .iter()
                    .flat_map(|&o| &bytes[o * size..(o + 1) * size])
                    .copied()
                    .collect();
                (&gathered[..], v.shape.clone())
            }
        };
        Self::convert(name, shape, dst, (bytes, dtype, got), &file.path, non_finite, hash)
    }

    /// The values of packed view `v`: its expert decoded (in-to-out, as transformers
    /// dequantizes it), its elements gathered.
    fn mxfp4_values(&self, v: &View) -> Result<Vec<f32>> {
        let per = v.mxfp4.expect("a packed view");
        let p = super::mxfp4::packed(self, &v.source)?;
        let x = v.at / per;
        let (nb, ns) = (p.blocks.len() / p.experts, p.scales.len() / p.experts);
        let one = horizon_backend::mxfp4::decode_transposed(
            &p.blocks[x * nb..(x + 1) * nb],
            &p.scales[x * ns..(x + 1) * ns],
            (1, p.rows, p.cols),
        );
        Ok(v.offsets().iter().map(|&o| one[o - x * per]).collect())
    }

    /// Tensor `name`'s stored `bytes` of `dtype` and shape `got` (from `path`) converted into
    /// `dst` as [`Checkpoint::read_f32`] states, and with `hash` their content hash.
    #[allow(clippy::too_many_arguments)]
    fn convert(
        name: &str,
        shape: &[usize],
        dst: &mut [f32],
        (bytes, dtype, got): (&[u8], Dtype, Vec<usize>),
        path: &Path,
        non_finite: NonFinite,
        hash: bool,
    ) -> Result<Option<u64>> {
        if got != shape {
            bail!(
                "tensor '{name}' in {} has shape {got:?}, expected {shape:?}; hint: does the \
                 checkpoint match config.json?",
                path.display()
            );
        }
        let (bad, tiles) = match dtype {
            Dtype::F32 => convert_f32(dst, bytes, f32::from_le_bytes, hash),
            Dtype::BF16 => convert_f32(dst, bytes, bf16_to_f32, hash),
            Dtype::F16 => convert_f32(dst, bytes, |b| half::f16::from_le_bytes(b).to_f32(), hash),
            Dtype::F64 => convert_f32(dst, bytes, |b| f64::from_le_bytes(b) as f32, hash),
            other => bail!(
                "tensor '{name}' in {} has dtype {other:?}; supported: F32, BF16, F16, F64",
                path.display()
            ),
        };
        let content = hash.then(|| tensor_hash(name, dtype_name(dtype), shape, &tiles));
        let Some(NonFiniteFound { first, count }) = bad else { return Ok(content) };
        let what = format!(
            "tensor '{name}' in {} holds {count} non-finite value(s) of {}; the first is {} at flat index {first} (index {:?} of shape {shape:?})",
            path.display(),
            dst.len(),
            dst[first],
            unravel(first, shape),
        );
        match non_finite {
            NonFinite::Refuse => bail!(
                "{what}\nhint: the checkpoint is damaged (a diverged run, a bad conversion); a training config can set model.allow_non_finite: true to load it anyway"
            ),
            NonFinite::Allow => {
                tracing::warn!("{what} (loaded anyway: model.allow_non_finite)");
                Ok(content)
            }
        }
    }

    /// Checks the set of names: every `expected` present, nothing outside `expected` and
    /// `optional`. The error lists the first missing and unexpected names.
    pub fn check_names(&self, expected: &[String], optional: &[String]) -> Result<()> {
        self.check_names_under("", expected, optional)
    }

    /// Each of `expected` (names under `prefix`, with the shapes the config gives them) present
    /// with that shape: checked from the headers before anything is allocated from the config,
    /// so that sizes that disagree with the weights (a vocabulary of 4e9 over small tensors)
    /// are an error naming the tensor and both shapes, not an allocation that aborts.
    pub fn check_shapes_under(
        &self,
        prefix: &str,
        expected: &[(String, Vec<usize>)],
    ) -> Result<()> {
        const SHOW: usize = 4;
        let wrong: Vec<String> = expected
            .iter()
            .filter_map(|(n, want)| {
                let have = self.shape(&format!("{prefix}{n}"))?;
                (have != *want)
                    .then(|| format!("{prefix}{n} is {have:?}, config.json makes it {want:?}"))
            })
            .collect();
        if wrong.is_empty() {
            return Ok(());
        }
        let more = if wrong.len() > SHOW {
            format!("; ... ({} more)", wrong.len() - SHOW)
        } else {
            String::new()
        };
        bail!(
            "{}: the tensors do not have the shapes config.json gives them: {}{more}\nhint: \
             config.json's sizes (vocab_size, hidden_size, intermediate_size, heads, layers) must \
             be the checkpoint's",
            self.source.display(),
            wrong[..wrong.len().min(SHOW)].join("; ")
        )
    }

    /// [`Checkpoint::check_names`] for names stored under `prefix` (the text model of a
    /// multimodal checkpoint, `language_model.`): `expected` and `optional` are given without
    /// it, and with a prefix, tensors outside it (a vision tower) are ignored.
    pub fn check_names_under(
        &self,
        prefix: &str,
        expected: &[String],
        optional: &[String],
    ) -> Result<()> {
        const SHOW: usize = 8;
        let missing: Vec<String> =
            expected.iter().map(|n| format!("{prefix}{n}")).filter(|n| !self.contains(n)).collect();
        let missing: Vec<&str> = missing.iter().map(String::as_str).collect();
        let known: std::collections::HashSet<String> =
            expected.iter().chain(optional).map(|n| format!("{prefix}{n}")).collect();
        let names = self.names();
        let unexpected: Vec<&str> = names
            .iter()
            .map(String::as_str)
            .filter(|n| n.starts_with(prefix) && !known.contains(*n))
            .collect();
        if missing.is_empty() && unexpected.is_empty() {
            return Ok(());
        }
        let list = |names: &[&str]| {
            let mut s = names[..names.len().min(SHOW)].join(", ");
            if names.len() > SHOW {
                s.push_str(&format!(", ... ({} more)", names.len() - SHOW));
            }
            s
        };
        let mut msg = format!("{}: tensor names do not match the model", self.source.display());
        if !missing.is_empty() {
            msg.push_str(&format!("; {} missing: {}", missing.len(), list(&missing)));
        }
        if !unexpected.is_empty() {
            msg.push_str(&format!("; {} unexpected: {}", unexpected.len(), list(&unexpected)));
        }
        let experts = missing.iter().chain(&unexpected).any(|n| n.contains(".experts."));
        msg.push_str(if experts {
            "; hint: check that config.json (num_experts or num_local_experts, mlp_only_layers, \
             decoder_sparse_step, num_hidden_layers) describes this checkpoint's experts"
        } else {
            "; hint: check that config.json (num_hidden_layers, tie_word_embeddings, biases) \
             describes this checkpoint"
        });
        bail!(msg)
    }
}

/// What loading does with a NaN or ±inf weight (`model.allow_non_finite`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NonFinite {
    /// An error naming the tensor, the flat index and the value (the default).
    #[default]
    Refuse,
    /// Load it, with a warning.
    Allow,
}

impl NonFinite {
    /// `Allow` when `allow` (the config's `model.allow_non_finite`).
    pub fn allowed_if(allow: bool) -> Self {
        if allow { NonFinite::Allow } else { NonFinite::Refuse }
    }
}

/// The non-finite values of a tensor: the flat index of the first and how many there are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NonFiniteFound {
    first: usize,
    count: usize,
}

/// The index of flat element `i` in a row-major tensor of `shape`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (k, &n) in shape.iter().enumerate().rev() {
        idx[k] = i % n.max(1);
        i /= n.max(1);
    }
    idx
}

/// A little-endian bf16 as f32: its bits are the f32's top half (exact; a NaN keeps its
/// payload, where `half` would set the quiet bit: branch-free, so the conversion vectorises).
fn bf16_to_f32(b: [u8; 2]) -> f32 {
    f32::from_bits(u32::from(u16::from_le_bytes(b)) << 16)
}

/// A stored dtype's safetensors name (`F32`, `BF16`, `F16`, `F64`; `other` for the rest).
fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::F32 => "F32",
        Dtype::BF16 => "BF16",
        Dtype::F16 => "F16",
        Dtype::F64 => "F64",
        Dtype::U8 => "U8",
        _ => "other",
    }
}

/// Elements per tile of [`convert_f32`]: a tile's source bytes are hashed as one piece.
const TILE: usize = 1 << 16;

/// A tensor's content hash: [`crate::hash`] of its name, dtype and shape, then of the hash of
/// each tile of [`TILE`] elements of its stored bytes, in order (`tiles`).
pub fn tensor_hash(name: &str, dtype: &str, shape: &[usize], tiles: &[u64]) -> u64 {
    let mut h = crate::hash::Stream::new();
    h.feed(name.as_bytes());
    h.feed(&[0]);
    h.feed(dtype.as_bytes());
    for &d in shape {
        h.feed(&(d as u64).to_le_bytes());
    }
    for t in tiles {
        h.feed(&t.to_le_bytes());
    }
    h.finish()
}

/// [`convert`] into f32, counting the non-finite values of each tile while it is still in
/// cache (one pass over memory; `None` when every value is finite) and with `hash` hashing
/// each tile's source bytes there too (the hashes in tile order; empty without `hash`).
/// dst: (n,), overwritten; src: (n * N,) bytes.
fn convert_f32<const N: usize>(
    dst: &mut [f32],
    src: &[u8],
    f: impl Fn([u8; N]) -> f32 + Sync,
    hash: bool,
) -> (Option<NonFiniteFound>, Vec<u64>) {
    assert_eq!(src.len(), dst.len() * N, "convert_f32: byte count does not match element count");
    let tiles: Vec<(Option<NonFiniteFound>, u64)> = dst
        .par_chunks_mut(TILE)
        .zip(src.par_chunks(TILE * N))
        .enumerate()
        .map(|(t, (d, s))| {
            // A branch-free flag in the conversion loop (it vectorises with it); the count and
            // the position only for a tile that has one.
            let mut any = false;
            for (x, b) in d.iter_mut().zip(s.chunks_exact(N)) {
                let v = f(b.try_into().expect("chunks_exact yields N bytes"));
                any |= !v.is_finite();
                *x = v;
            }
            let bad = any.then(|| NonFiniteFound {
                first: t * TILE + d.iter().position(|x| !x.is_finite()).expect("one is"),
                count: d.iter().filter(|x| !x.is_finite()).count(),
            });
            (bad, if hash { crate::hash::of(s) } else { 0 })
        })
        .collect();
    let bad = tiles
        .iter()
        .filter_map(|(b, _)| *b)
        .reduce(|a, b| NonFiniteFound { first: a.first.min(b.first), count: a.count + b.count });
    (bad, if hash { tiles.iter().map(|(_, h)| *h).collect() } else { Vec::new() })
}

/// Decodes little-endian elements of `N` bytes from `src` into `dst`, in parallel tiles.
/// dst: (n,), overwritten; src: (n * N,) bytes.
fn convert<T: Send, const N: usize>(dst: &mut [T], src: &[u8], f: impl Fn([u8; N]) -> T + Sync) {
    assert_eq!(src.len(), dst.len() * N, "convert: byte count does not match element count");
    dst.par_chunks_mut(TILE).zip(src.par_chunks(TILE * N)).for_each(|(d, s)| {
        for (x, b) in d.iter_mut().zip(s.chunks_exact(N)) {
            *x = f(b.try_into().expect("chunks_exact yields N bytes"));
        }
    });
}

/// Element type written by [`write_safetensors`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveDtype {
    /// float32, exact.
    F32,
    /// bfloat16, rounded to nearest, ties to even.
    Bf16,
}

impl SaveDtype {
    fn name(self) -> &'static str {
        match self {
            SaveDtype::F32 => "F32",
            SaveDtype::Bf16 => "BF16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            SaveDtype::F32 => 4,
            SaveDtype::Bf16 => 2,
        }
    }

    /// The `torch_dtype` of a HF `config.json` for weights of this type.
    pub fn torch_dtype(self) -> &'static str {
        match self {
            SaveDtype::F32 => "float32",
            SaveDtype::Bf16 => "bfloat16",
        }
    }
}

/// Writes `tensors` (name, shape, data) as one safetensors file at `path`, in the given order,
/// converting to `dtype`, with metadata `{"format": "pt"}`. The header is computed first, then
/// each tensor is converted and written through a bounded buffer; the file is written to a
/// temporary sibling and renamed over `path`, so a reader never sees a partial file.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, &[f32])],
    dtype: SaveDtype,
) -> Result<()> {
    let esize = dtype.size();
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            bail!(
                "writing {}: tensor '{name}' has shape {shape:?} ({numel} elements) but {} values",
                path.display(),
                data.len()
            );
        }
        if name == "__metadata__" || header.contains_key(name) {
            bail!("writing {}: tensor name '{name}' is duplicated or reserved", path.display());
        }
        let end = offset + numel * esize;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&serde_json::Value::Object(header))?;
    header.resize(header.len().next_multiple_of(8), b' ');

    let file_name =
        path.file_name().with_context(|| format!("writing {}: not a file path", path.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);

    let result = (|| -> Result<()> {
        let file = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        let mut buf = Vec::with_capacity((1 << 16) * esize);
        for (_, _, data) in tensors {
            for tile in data.chunks(1 << 16) {
                buf.clear();
                match dtype {
                    SaveDtype::F32 => tile.iter().for_each(|x| buf.extend(x.to_le_bytes())),
                    SaveDtype::Bf16 => {
                        tile.iter().for_each(|&x| buf.extend(half::bf16::from_f32(x).to_le_bytes()))
                    }
                }
                w.write_all(&buf)?;
            }
        }
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(())
    })()
    .with_context(|| format!("writing {}", tmp.display()));
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).with_context(|| {
        let _ = std::fs::remove_file(&tmp);
        format!("renaming {} to {}", tmp.display(), path.display())
    })
}

/// Reads tensor `name` of the safetensors file `path` as f64 (from f64, f32, bf16 or f16);
/// returns its shape and data.
pub fn read_tensor_f64(path: &Path, name: &str) -> Result<(Vec<usize>, Vec<f64>)> {
    let file = MappedFile::open(path)?;
    let (bytes, dtype, shape) = file
        .tensor(name)
        .with_context(|| format!("tensor '{name}' not found in {}", path.display()))?;
    let mut out = vec![0.0f64; shape.iter().product()];
    match dtype {
        Dtype::F64 => convert(&mut out, bytes, f64::from_le_bytes),
        Dtype::F32 => convert(&mut out, bytes, |b| f32::from_le_bytes(b) as f64),
        Dtype::BF16 => convert(&mut out, bytes, |b| half::bf16::from_le_bytes(b).to_f64()),
        Dtype::F16 => convert(&mut out, bytes, |b| half::f16::from_le_bytes(b).to_f64()),
        other => bail!(
            "tensor '{name}' in {} has dtype {other:?}; supported: F64, F32, BF16, F16",
            path.display()
        ),
    }
    Ok((shape.to_vec(), out))
}

/// Names of the tensors of the safetensors file `path`, in file order.
pub fn list_tensors(path: &Path) -> Result<Vec<String>> {
    Ok(MappedFile::open(path)?.meta.offset_keys())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(case: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(case).join("model")
    }

    fn err(r: Result<impl Sized>) -> String {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => format!("{e:#}"),
        }
    }

    /// Writes a raw safetensors file with one tensor of `dtype` holding `bytes`.
    fn write_raw(path: &Path, name: &str, dtype: &str, shape: &[usize], bytes: &[u8]) {
        let mut header = serde_json::to_vec(&serde_json::json!({
            name: {"dtype": dtype, "shape": shape, "data_offsets": [0, bytes.len()]}
        }))
        .unwrap();
        header.resize(header.len().next_multiple_of(8), b' ');
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend(header);
        out.extend(bytes);
        std::fs::write(path, out).unwrap();
    }

    #[test]
    fn opens_fixture_models() {
        let ckpt = Checkpoint::open(&fixture("llama_gqa")).unwrap();
        assert!(ckpt.contains("model.embed_tokens.weight"));
        assert!(ckpt.contains("lm_head.weight"));
        assert_eq!(ckpt.shape("model.layers.0.self_attn.k_proj.weight"), Some(vec![32, 64]));
        assert_eq!(ckpt.names().len(), 2 * 9 + 3);
        let mut w = vec![0.0f32; 64];
        ckpt.read_f32("model.norm.weight", &[64], &mut w, NonFinite::Refuse).unwrap();
        assert!(w.iter().all(|x| x.is_finite()));

        let ckpt = Checkpoint::open(&fixture("qwen2_tied_padded")).unwrap();
        assert!(!ckpt.contains("lm_head.weight"));
        assert_eq!(ckpt.shape("model.layers.2.self_attn.k_proj.bias"), Some(vec![16]));
        assert_eq!(ckpt.names().len(), 3 * 12 + 2);
    }

    #[test]
    fn f32_round_trip_is_exact_and_bf16_rounds_to_nearest_even() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let a: Vec<f32> = (0..300).map(|i| (i as f32 * 0.37).sin() * 1e3 + 1e-30).collect();
        let b = [1.0f32 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -3.0, f32::MIN_POSITIVE];
        let tensors = [("a".to_string(), vec![3, 100], &a[..]), ("b".to_string(), vec![4], &b[..])];
        write_safetensors(&path, &tensors, SaveDtype::F32).unwrap();
        assert_eq!(list_tensors(&path).unwrap(), vec!["a", "b"]);
        let ckpt = Checkpoint::open(&path).unwrap();
        let mut got = vec![0.0f32; 300];
        ckpt.read_f32("a", &[3, 100], &mut got, NonFinite::Refuse).unwrap();
        assert_eq!(got, a);
        let (shape, got64) = read_tensor_f64(&path, "b").unwrap();
        assert_eq!(shape, vec![4]);
        assert_eq!(got64, b.iter().map(|&x| x as f64).collect::<Vec<_>>());

        write_safetensors(&path, &tensors, SaveDtype::Bf16).unwrap();
        let ckpt = Checkpoint::open(&path).unwrap();
        let mut got = vec![0.0f32; 4];
        ckpt.read_f32("b", &[4], &mut got, NonFinite::Refuse).unwrap();
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa, 1.0.
        // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to the even one, 1 + 2^-6.
        assert_eq!(got, vec![1.0, 1.015625, -3.0, f32::MIN_POSITIVE]);
        // Only the temporary file's rename leaves anything behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn converts_bf16_f16_and_f64_inputs() {
        let dir = tempfile::tempdir().unwrap();
        let vals = [0.5f32, -2.25, 448.0, 1.0 / 1024.0];
        let cases: [(&str, Vec<u8>); 3] = [
            ("BF16", vals.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect()),
            ("F16", vals.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect()),
            ("F64", vals.iter().flat_map(|&x| (x as f64).to_le_bytes()).collect()),
        ];
        for (dtype, bytes) in cases {
            let path = dir.path().join(format!("{dtype}.safetensors"));
            write_raw(&path, "w", dtype, &[2, 2], &bytes);
            let mut got = vec![0.0f32; 4];
            Checkpoint::open(&path)
                .unwrap()
                .read_f32("w", &[2, 2], &mut got, NonFinite::Refuse)
                .unwrap();
            assert_eq!(got, vals, "{dtype}");
            let (_, got64) = read_tensor_f64(&path, "w").unwrap();
            assert_eq!(got64, vals.iter().map(|&x| x as f64).collect::<Vec<_>>(), "{dtype}");
        }
        let path = dir.path().join("i32.safetensors");
        write_raw(&path, "ids", "I32", &[1], &[1, 0, 0, 0]);
        let msg = err(Checkpoint::open(&path).unwrap().read_f32(
            "ids",
            &[1],
            &mut [0.0],
            NonFinite::Refuse,
        ));
        assert!(msg.contains("'ids'") && msg.contains("I32") && msg.contains("i32.safetensors"));
    }

    #[test]
    fn a_non_finite_value_is_refused_naming_tensor_index_and_value() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SINGLE_FILE);
        // Past one parallel tile (65536 elements): the two values lie in different tiles.
        let (rows, cols) = (3, 40_000);
        let mut w = vec![0.25f32; rows * cols];
        w[cols + 27] = f32::INFINITY;
        w[2 * cols + 5] = f32::NAN;
        let tensors =
            [("model.layers.0.self_attn.v_proj.weight".to_string(), vec![rows, cols], &w[..])];
        let mut dst = vec![0.0f32; w.len()];
        for dtype in [SaveDtype::F32, SaveDtype::Bf16] {
            write_safetensors(&path, &tensors, dtype).unwrap();
            let ckpt = Checkpoint::open(dir.path()).unwrap();
            let name = "model.layers.0.self_attn.v_proj.weight";
            let msg = err(ckpt.read_f32(name, &[rows, cols], &mut dst, NonFinite::Refuse));
            let quoted = format!("'{name}'");
            for needle in [
                quoted.as_str(),
                SINGLE_FILE,
                "2 non-finite",
                "inf at flat index 40027",
                "[1, 27]",
                "model.allow_non_finite",
            ] {
                assert!(msg.contains(needle), "{dtype:?}: {needle:?} missing from: {msg}");
            }
            ckpt.read_f32(name, &[rows, cols], &mut dst, NonFinite::Allow).unwrap();
            assert!(dst[cols + 27].is_infinite() && dst[2 * cols + 5].is_nan());
        }
        // f64 beyond the range of f32 becomes inf: refused too.
        let big = [1.0f64, 1e300];
        let bytes: Vec<u8> = big.iter().flat_map(|x| x.to_le_bytes()).collect();
        write_raw(&path, "w", "F64", &[2], &bytes);
        let msg = err(Checkpoint::open(&path).unwrap().read_f32(
            "w",
            &[2],
            &mut [0.0; 2],
            NonFinite::Refuse,
        ));
        assert!(msg.contains("inf at flat index 1"), "{msg}");
        assert_eq!(unravel(7, &[2, 3, 4]), [0, 1, 3]);
        assert_eq!(unravel(23, &[2, 3, 4]), [1, 2, 3]);
    }

    /// The scan's cost: converting 64M elements (f32 and bf16 sources) with the non-finite
    /// count against the same conversion without it, best of 5, on all cores. Measured on the
    /// 2-core CI machine: see the figures in bench/RESULTS.md (`non_finite_scan_speed`). `cargo test --lib -- --ignored non_finite_scan_speed --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn non_finite_scan_speed() {
        let n = 1usize << 26;
        let vals: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
        let f32_bytes: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        let bf16_bytes: Vec<u8> =
            vals.iter().flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()).collect();
        let mut dst = vec![0.0f32; n];
        let best = |f: &mut dyn FnMut()| {
            (0..5)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f();
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let gbs = |bytes: usize, s: f64| bytes as f64 / s / 1e9;
        let plain = best(&mut || convert(&mut dst, &f32_bytes, f32::from_le_bytes));
        let scanned = best(&mut || {
            assert!(convert_f32(&mut dst, &f32_bytes, f32::from_le_bytes, false).0.is_none());
        });
        let hashed = best(&mut || {
            assert!(convert_f32(&mut dst, &f32_bytes, f32::from_le_bytes, true).0.is_none());
        });
        eprintln!(
            "f32 -> f32, 256 MiB: plain {:.1} GB/s, with the scan {:.1} GB/s ({:+.1}%), and the \
             hash {:.1} GB/s ({:+.1}%)",
            gbs(4 * n, plain),
            gbs(4 * n, scanned),
            (scanned / plain - 1.0) * 100.0,
            gbs(4 * n, hashed),
            (hashed / plain - 1.0) * 100.0
        );
        let to_f32 = |b: [u8; 2]| half::bf16::from_le_bytes(b).to_f32();
        let plain = best(&mut || convert(&mut dst, &bf16_bytes, to_f32));
        let scanned = best(&mut || {
            assert!(convert_f32(&mut dst, &bf16_bytes, bf16_to_f32, false).0.is_none())
        });
        let hashed = best(&mut || {
            assert!(convert_f32(&mut dst, &bf16_bytes, bf16_to_f32, true).0.is_none())
        });
        eprintln!(
            "bf16 -> f32, 128 MiB: plain (half) {:.1} GB/s, bit shift with the scan {:.1} GB/s \
             ({:+.1}%), and the hash {:.1} GB/s ({:+.1}%)",
            gbs(2 * n, plain),
            gbs(2 * n, scanned),
            (scanned / plain - 1.0) * 100.0,
            gbs(2 * n, hashed),
            (hashed / plain - 1.0) * 100.0
        );
    }

    /// A tensor's content hash covers every stored byte, its dtype and shape: the same
    /// tensors give the same hashes in one file or split over shards in any order, on one
    /// thread or three (tensors of several tiles, a partial last one); a byte changed anywhere,
    /// or another dtype of the same values, changes it. It reads what `read_f32` reads.
    #[test]
    fn a_tensors_content_hash_is_its_bytes_wherever_it_is_stored() {
        let dir = tempfile::tempdir().unwrap();
        let a: Vec<f32> = (0..3 * TILE + 18).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..1000).map(|i| (i % 256) as f32).collect(); // exact in bf16
        let single = dir.path().join("single");
        std::fs::create_dir(&single).unwrap();
        let tensors = [("a".to_string(), vec![3, TILE + 6], &a[..]), ("b".into(), vec![1000], &b)];
        write_safetensors(&single.join(SINGLE_FILE), &tensors, SaveDtype::F32).unwrap();
        let sharded = dir.path().join("sharded");
        std::fs::create_dir(&sharded).unwrap();
        for (file, t) in [("s2.safetensors", &tensors[..1]), ("s1.safetensors", &tensors[1..])] {
            write_safetensors(&sharded.join(file), t, SaveDtype::F32).unwrap();
        }
        let index =
            serde_json::json!({"weight_map": {"a": "s2.safetensors", "b": "s1.safetensors"}});
        std::fs::write(sharded.join(INDEX_FILE), index.to_string()).unwrap();
        let hashes = |dir: &Path, threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let ckpt = Checkpoint::open(dir).unwrap();
            pool.install(|| {
                tensors.clone().map(|(name, shape, data)| {
                    let mut got = vec![0.0f32; data.len()];
                    let h = ckpt.read_f32_hashed(&name, &shape, &mut got, NonFinite::Refuse);
                    let mut plain = vec![0.0f32; data.len()];
                    ckpt.read_f32(&name, &shape, &mut plain, NonFinite::Refuse).unwrap();
                    assert!(got == plain, "{name}: the values read_f32 reads");
                    h.unwrap()
                })
            })
        };
        let want = hashes(&single, 1);
        assert_ne!(want[0], want[1]);
        for (d, threads) in [(&single, 3), (&sharded, 1), (&sharded, 3)] {
            assert_eq!(hashes(d, threads), want, "{} on {threads} threads", d.display());
        }
        // One byte of `a`, in a middle tile, changed: its hash changes, `b`'s does not.
        let path = single.join(SINGLE_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 1000 * 4 - 4 * (TILE + 5)] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let got = hashes(&single, 3);
        assert!(got[0] != want[0] && got[1] == want[1], "{got:x?} {want:x?}");
        // The same values as bf16: another content.
        write_safetensors(&path, &tensors, SaveDtype::Bf16).unwrap();
        let ckpt = Checkpoint::open(&single).unwrap();
        let mut got = vec![0.0f32; 1000];
        let h = ckpt.read_f32_hashed("b", &[1000], &mut got, NonFinite::Refuse).unwrap();
        assert!(got == b && h != want[1]);
    }

    #[test]
    fn opens_sharded_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let a = [1.0f32; 6];
        let b = [2.0f32; 4];
        let c = [3.0f32; 2];
        write_safetensors(
            &dir.path().join("model-00001-of-00002.safetensors"),
            &[("a".into(), vec![2, 3], &a[..]), ("b".into(), vec![4], &b[..])],
            SaveDtype::F32,
        )
        .unwrap();
        write_safetensors(
            &dir.path().join("model-00002-of-00002.safetensors"),
            &[("c".into(), vec![2], &c[..])],
            SaveDtype::Bf16,
        )
        .unwrap();
        let index = serde_json::json!({"metadata": {"total_size": 44}, "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors"}});
        let index_path = dir.path().join(INDEX_FILE);
        std::fs::write(&index_path, index.to_string()).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ckpt.names(), vec!["a", "b", "c"]);
        assert_eq!(ckpt.shape("a"), Some(vec![2, 3]));
        let mut got = vec![0.0f32; 2];
        ckpt.read_f32("c", &[2], &mut got, NonFinite::Refuse).unwrap();
        assert_eq!(got, c);
        let all: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        ckpt.check_names(&all, &[]).unwrap();

        // An index pointing at a shard that is not there.
        let mut bad = index.clone();
        bad["weight_map"]["c"] = "model-00003-of-00002.safetensors".into();
        std::fs::write(&index_path, bad.to_string()).unwrap();
        let msg = err(Checkpoint::open(dir.path()));
        assert!(
            msg.contains("model-00003-of-00002.safetensors") && msg.contains(INDEX_FILE),
            "{msg}"
        );
        // An index mapping a tensor to a shard that does not hold it.
        let mut bad = index;
        bad["weight_map"]["c"] = "model-00001-of-00002.safetensors".into();
        std::fs::write(&index_path, bad.to_string()).unwrap();
        let msg = err(Checkpoint::open(dir.path()));
        assert!(msg.contains("'c'") && msg.contains("does not hold it"), "{msg}");
    }

    #[test]
    fn errors_name_file_and_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        assert!(err(Checkpoint::open(&missing)).contains("nope"));
        let msg = err(Checkpoint::open(dir.path()));
        assert!(msg.contains(SINGLE_FILE) && msg.contains(INDEX_FILE), "{msg}");

        let path = dir.path().join(SINGLE_FILE);
        let w = [0.5f32; 12];
        write_safetensors(&path, &[("w".into(), vec![3, 4], &w[..])], SaveDtype::F32).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let mut dst = vec![0.0f32; 12];
        let msg = err(ckpt.read_f32("w", &[4, 3], &mut dst, NonFinite::Refuse));
        assert!(
            msg.contains("'w'") && msg.contains("[3, 4]") && msg.contains(SINGLE_FILE),
            "{msg}"
        );
        let msg = err(ckpt.read_f32("v", &[3, 4], &mut dst, NonFinite::Refuse));
        assert!(msg.contains("'v'") && msg.contains(SINGLE_FILE), "{msg}");

        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        ckpt.check_names(&names(&["w"]), &names(&["lm_head.weight"])).unwrap();
        let msg = err(ckpt.check_names(&names(&["w", "x"]), &[]));
        assert!(msg.contains("1 missing: x") && !msg.contains("unexpected"), "{msg}");
        let msg = err(ckpt.check_names(&[], &[]));
        assert!(msg.contains("1 unexpected: w") && msg.contains(SINGLE_FILE), "{msg}");
        drop(ckpt);

        // Truncated: drop the last bytes of the data, then most of the header.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
        let msg = err(Checkpoint::open(dir.path()));
        assert!(msg.contains(SINGLE_FILE) && msg.contains("truncated"), "{msg}");
        std::fs::write(&path, &bytes[..20]).unwrap();
        let msg = err(Checkpoint::open(dir.path()));
        assert!(msg.contains(SINGLE_FILE) && msg.contains("truncated"), "{msg}");
        std::fs::write(&path, &bytes[..3]).unwrap();
        assert!(err(Checkpoint::open(dir.path())).contains("truncated"));
        std::fs::write(&path, b"\x08\0\0\0\0\0\0\0not json").unwrap();
        assert!(err(Checkpoint::open(dir.path())).contains("invalid safetensors header"));

        let msg = err(read_tensor_f64(&path, "w"));
        assert!(msg.contains(SINGLE_FILE), "{msg}");
        let msg = err(write_safetensors(&path, &[("w".into(), vec![5], &w[..])], SaveDtype::F32));
        assert!(msg.contains("'w'") && msg.contains("12 values"), "{msg}");
    }
}
