//! TensorBoard event files (`OUT/tb/`): every `metrics.jsonl` field as a scalar (HF Trainer's
//! tag names: `train/loss`, `train/learning_rate`, `eval/loss`, ...) and the run's config as
//! text, readable by TensorBoard (`tensorboard --logdir OUT/tb`).
//!
//! Written by hand: the format is a TFRecord stream of `tensorflow.Event` protobufs, and the
//! few messages it needs (an event with a wall time, a step, and a summary of scalars or of one
//! string tensor under the text plugin) are a page of encoding, where the crates that write it
//! pull in a protobuf code generator and an image stack, or are unmaintained. The record
//! checksums are CRC-32C (the `crc32c` crate). Checked against TensorBoard's own reader by
//! `scripts/check-tensorboard.py` (locally; TensorBoard is not installed in CI), and in the tests
//! by [`read_events`], a reader of the same subset.

use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

use crate::run::summary::StepMetrics;

/// One events file of a run, appended to step by step.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<fs::File>,
}

impl EventWriter {
    /// A new events file in `dir` (created), opened with the file-version record.
    pub fn create(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let now = wall_time();
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "horizon".into());
        // Two files of one second (a resume at once) must not share a name.
        let name = format!("events.out.tfevents.{}.{host}.{}", now as u64, std::process::id());
        let path = dir.join(name);
        let file =
            fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = EventWriter { path, out: BufWriter::new(file) };
        let mut event = Vec::new();
        field_f64(&mut event, 1, now);
        field_bytes(&mut event, 3, b"brain.Event:2");
        w.record(&event)?;
        Ok(w)
    }

    /// Scalars `(tag, value)` at `step`, flushed.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            field_bytes(&mut value, 1, tag.as_bytes());
            value.push(2 << 3 | 5); // simple_value: float
            value.extend_from_slice(&(*v as f32).to_le_bytes());
            field_bytes(&mut summary, 1, &value);
        }
        self.summary(step, &summary)
    }

    /// Text `text` under `tag` at `step` (TensorBoard's text plugin: a string tensor), flushed.
    pub fn text(&mut self, step: u64, tag: &str, text: &str) -> Result<()> {
        let mut plugin = Vec::new();
        field_bytes(&mut plugin, 1, b"text");
        let mut metadata = Vec::new();
        field_bytes(&mut metadata, 1, &plugin);
        let mut tensor = Vec::new();
        field_varint(&mut tensor, 1, 7); // DT_STRING
        field_bytes(&mut tensor, 2, &[]); // a scalar's (empty) shape
        field_bytes(&mut tensor, 8, text.as_bytes());
        let mut value = Vec::new();
        field_bytes(&mut value, 1, tag.as_bytes());
        field_bytes(&mut value, 9, &metadata);
        field_bytes(&mut value, 8, &tensor);
        let mut summary = Vec::new();
        field_bytes(&mut summary, 1, &value);
        self.summary(step, &summary)
    }

    /// Every field of a step's metrics, under HF Trainer's tags.
    pub fn step(&mut self, m: &StepMetrics) -> Result<()> {
        let mut v = vec![
            ("train/loss", m.loss),
            ("train/grad_norm", m.grad_norm),
            ("train/learning_rate", m.lr),
            ("train/tokens", m.tokens as f64),
            ("train/step_seconds", m.step_s),
            ("train/epoch", m.epoch),
            ("train/skipped", f64::from(u8::from(m.skipped))),
        ];
        v.extend(m.ce_loss.map(|x| ("train/ce_loss", x)));
        v.extend(m.aux_loss.map(|x| ("train/aux_loss", x)));
        v.extend(m.eval_loss.map(|x| ("eval/loss", x)));
        let mut tags = Vec::new();
        for (split, metrics) in [("train", m.dpo), ("eval", m.eval_dpo.map(|e| e.0))] {
            tags.extend(metrics.map(|d| trl_tags(split, &d)).unwrap_or_default());
        }
        v.extend(tags.iter().map(|(k, x)| (k.as_str(), *x)));
        self.scalars(m.step as u64, &v)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn summary(&mut self, step: u64, summary: &[u8]) -> Result<()> {
        let mut event = Vec::new();
        field_f64(&mut event, 1, wall_time());
        field_varint(&mut event, 2, step);
        field_bytes(&mut event, 5, summary);
        self.record(&event)
    }

    /// One TFRecord: length, its masked CRC, the data, its masked CRC; flushed.
    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(data);
        rec.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.out
            .write_all(&rec)
            .and_then(|()| self.out.flush())
            .with_context(|| format!("cannot write {}", self.path.display()))
    }
}

/// A DPO step's metrics under TRL's tags (`train/rewards/chosen`, ..., `train/logps/rejected`).
fn trl_tags(split: &str, d: &crate::model::dpo::DpoMetrics) -> Vec<(String, f64)> {
    d.fields().into_iter().map(|(_, tag, x)| (format!("{split}/{tag}"), x)).collect()
}

fn wall_time() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// TFRecord's checksum: CRC-32C, rotated right by 15 and offset.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn field_varint(out: &mut Vec<u8>, field: u64, v: u64) {
    varint(out, field << 3);
    varint(out, v);
}

fn field_f64(out: &mut Vec<u8>, field: u64, v: f64) {
    varint(out, field << 3 | 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn field_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// What an events file holds, as far as this writer writes: per event, its step and its
/// scalars `(tag, value)` and texts `(tag, text)`; every record's checksums verified.
#[derive(Debug, Default, PartialEq)]
pub struct Event {
    pub step: u64,
    pub scalars: Vec<(String, f32)>,
    pub texts: Vec<(String, String)>,
}

/// Read back an events file this writer wrote (the tests' reader; TensorBoard's own is
/// `scripts/check-tensorboard.py`). The file-version record is skipped.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let bytes = fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut at = 0;
    let mut out = Vec::new();
    while at < bytes.len() {
        let take = |at: usize, n: usize| bytes.get(at..at + n).context("truncated record");
        let len_b = take(at, 8)?;
        let len = u64::from_le_bytes(len_b.try_into()?) as usize;
        if u32::from_le_bytes(take(at + 8, 4)?.try_into()?) != masked_crc(len_b) {
            bail!("{}: bad length checksum at byte {at}", path.display());
        }
        let data = take(at + 12, len)?;
        if u32::from_le_bytes(take(at + 12 + len, 4)?.try_into()?) != masked_crc(data) {
            bail!("{}: bad data checksum at byte {at}", path.display());
        }
        at += 16 + len;
        let fields = parse(data)?;
        let Some(summary) = find(&fields, 5) else { continue };
        let mut e = Event { step: find_varint(&fields, 2).unwrap_or(0), ..Event::default() };
        for (_, v) in parse(summary)?.into_iter().filter(|(f, _)| *f == 1) {
            let value = parse(v.bytes())?;
            let tag = String::from_utf8_lossy(find(&value, 1).unwrap_or_default()).into_owned();
            if let Some(f) = find(&value, 2) {
                e.scalars.push((tag, f32::from_le_bytes(f.try_into()?)));
            } else if let Some(t) = find(&value, 8) {
                let s = find(&parse(t)?, 8).unwrap_or_default();
                e.texts.push((tag, String::from_utf8_lossy(s).into_owned()));
            }
        }
        out.push(e);
    }
    Ok(out)
}

/// A protobuf field's value: a varint, or bytes (length-delimited, or fixed 32/64 bits).
enum Wire<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

impl<'a> Wire<'a> {
    fn bytes(&self) -> &'a [u8] {
        match self {
            Wire::Bytes(b) => b,
            Wire::Varint(_) => &[],
        }
    }
}

fn find<'a>(fields: &[(u64, Wire<'a>)], field: u64) -> Option<&'a [u8]> {
    fields.iter().find(|(f, _)| *f == field).map(|(_, w)| w.bytes())
}

fn find_varint(fields: &[(u64, Wire<'_>)], field: u64) -> Option<u64> {
    fields.iter().find_map(|(f, w)| match w {
        Wire::Varint(v) if *f == field => Some(*v),
        _ => None,
    })
}

/// A message's fields, in order.
fn parse(mut b: &[u8]) -> Result<Vec<(u64, Wire<'_>)>> {
    fn read_varint(b: &mut &[u8]) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = b.split_first().context("truncated varint")?;
            *b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Ok(v);
            }
        }
        bail!("varint longer than 64 bits")
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = read_varint(&mut b)?;
        let n = match key & 7 {
            0 => {
                out.push((key >> 3, Wire::Varint(read_varint(&mut b)?)));
                continue;
            }
            1 => 8,
            2 => read_varint(&mut b)? as usize,
            5 => 4,
            t => bail!("wire type {t} is not one this writer writes"),
        };
        let (v, rest) = b.split_at_checked(n).context("truncated field")?;
        out.push((key >> 3, Wire::Bytes(v)));
        b = rest;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TFRecord's masked CRC of a known string, as TensorBoard's own reader computes it
    /// (`tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c(b"a")`), which it
    /// checks on every record it reads.
    #[test]
    fn records_carry_tensorflows_masked_crc32c() {
        assert_eq!(crc32c::crc32c(b"a"), 0xc1d0_4330);
        assert_eq!(masked_crc(b"a"), 0x28e4_6e78);
    }

    /// What is written reads back: scalars by tag and step, the config as text.
    #[test]
    fn scalars_and_text_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(tmp.path()).unwrap();
        w.text(0, "config", "train:\n  steps: 3\n").unwrap();
        w.scalars(1, &[("train/loss", 2.5), ("train/learning_rate", 1e-4)]).unwrap();
        w.scalars(300, &[("eval/loss", 1.25)]).unwrap();
        let events = read_events(w.path()).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].texts, [("config".to_string(), "train:\n  steps: 3\n".to_string())]);
        assert_eq!(events[1].step, 1);
        assert_eq!(
            events[1].scalars,
            [("train/loss".to_string(), 2.5), ("train/learning_rate".to_string(), 1e-4)]
        );
        assert_eq!((events[2].step, events[2].scalars[0].1), (300, 1.25));
    }
}
