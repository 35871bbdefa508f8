//! The memory plan: before anything is allocated, the bytes a run needs on the host (by kind)
//! and on the device, checked against the device budget and the host's available memory.

use std::fmt;

use anyhow::{Result, bail};

use crate::engine::head_tiles::HeadTiling;
use crate::engine::sizes::Sizes;

/// Bytes by kind, host and device.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    pub host: Vec<(&'static str, u64)>,
    pub device: Vec<(&'static str, u64)>,
    /// Parameters of the model.
    pub params: u64,
    /// The device budget (`device.memory`), if one was given.
    pub device_budget: Option<u64>,
    /// The host memory available to this run (MemAvailable), if known.
    pub host_available: Option<u64>,
    /// The device pool lives in host RAM (CPU backend): counted in the host total too.
    pub device_in_host_ram: bool,
    /// Of the host bytes, those page-locked ([`Sizes::pinned_bytes`]): a part of `host`, not
    /// more; 0 when the device pins nothing (CPU backend).
    pub pinned: u64,
    /// How the LM head is applied: whole, or in vocabulary tiles through the weight slots.
    pub head: HeadTiling,
    /// Chunks each chunked sparse layer's experts stream in (1: every layer whole).
    pub expert_chunks: usize,
    /// The row length the buffers are sized for.
    pub seq_len: usize,
    /// Where that length comes from, as the run says it (the data's longest row, or
    /// `train.max_seq_len`); printed with the plan.
    pub seq_len_from: Option<String>,
}

impl MemoryPlan {
    pub fn new(sizes: &Sizes, device_budget: Option<u64>, device_in_host_ram: bool) -> Self {
        MemoryPlan {
            host: sizes.host_bytes().iter().map(|&(k, b)| (k, b as u64)).collect(),
            device: sizes.device_bytes().iter().map(|&(k, b)| (k, b as u64)).collect(),
            params: sizes.params as u64,
            device_budget,
            host_available: host_available_bytes(),
            device_in_host_ram,
            pinned: sizes.pinned_bytes() as u64,
            head: sizes.head,
            expert_chunks: sizes.expert_chunks,
            seq_len: sizes.seq_len,
            seq_len_from: None,
        }
    }

    /// The plan with a host line of the run's own (`None`: as it is).
    pub fn with_host(mut self, line: Option<(&'static str, u64)>) -> Self {
        self.host.extend(line);
        self
    }

    /// The plan, saying where its row length comes from.
    pub fn sized_for(mut self, why: impl Into<String>) -> Self {
        self.seq_len_from = Some(why.into());
        self
    }

    pub fn device_total(&self) -> u64 {
        self.device.iter().map(|(_, b)| b).sum()
    }

    /// Host bytes, the CPU backend's device pool included.
    pub fn host_total(&self) -> u64 {
        let own: u64 = self.host.iter().map(|(_, b)| b).sum();
        own + if self.device_in_host_ram { self.device_total() } else { 0 }
    }

    /// The pool capacity to ask for: the budget, or exactly the plan.
    pub fn device_capacity(&self) -> u64 {
        self.device_budget.unwrap_or_else(|| self.device_total())
    }

    /// Refuse, with the numbers, a plan the device or the host cannot hold.
    pub fn check(&self) -> Result<()> {
        if let Some(budget) = self.device_budget
            && self.device_total() > budget
        {
            bail!(
                "the plan needs {} of device memory but device.memory is {}\n{self}hint: raise device.memory, or lower train.micro_batch_size, the length of the rows (at most train.max_seq_len) or engine.checkpoint_every",
                gib(self.device_total()),
                gib(budget)
            );
        }
        if let Some(avail) = self.host_available
            && self.host_total() > avail
        {
            bail!(
                "the plan needs {} of host memory but only {} is available\n{self}hint: a smaller model, or a machine with more RAM",
                gib(self.host_total()),
                gib(avail)
            );
        }
        Ok(())
    }
}

/// `1.23 GiB`.
pub fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per_param = |b: u64| b as f64 / self.params.max(1) as f64;
        writeln!(f, "memory plan ({} parameters):", self.params)?;
        match &self.seq_len_from {
            Some(why) => writeln!(f, "  sized for rows of {} tokens: {why}", self.seq_len)?,
            None => writeln!(f, "  sized for rows of {} tokens", self.seq_len)?,
        }
        writeln!(f, "  host:")?;
        for (k, b) in &self.host {
            writeln!(f, "    {:<70} {:>14}  {:>6.2} B/param", k, gib(*b), per_param(*b))?;
        }
        if self.device_in_host_ram {
            writeln!(
                f,
                "    {:<70} {:>14}",
                "device pool (cpu backend: in host RAM)",
                gib(self.device_total())
            )?;
        }
        writeln!(
            f,
            "    {:<70} {:>14}  {:>6.2} B/param",
            "total",
            gib(self.host_total()),
            per_param(self.host_total())
        )?;
        if self.pinned > 0 {
            let what = "of which pinned (page-locked): checkpoints, slabs, staging, head grads";
            writeln!(f, "    {:<70} {:>14}", what, gib(self.pinned))?;
        } else {
            writeln!(
                f,
                "    of which pinned (page-locked): none (this device's staging is plain memory)"
            )?;
        }
        if let Some(a) = self.host_available {
            writeln!(f, "    {:<70} {:>14}", "available", gib(a))?;
        }
        writeln!(f, "  device:")?;
        let head = if self.head.is_whole() {
            format!("whole (V = {} fits in a weight slot)", self.head.vocab)
        } else {
            format!(
                "{} tiles of {} vocabulary rows (V = {}), two passes",
                self.head.tiles(),
                self.head.rows,
                self.head.vocab
            )
        };
        writeln!(f, "    LM head: {head}")?;
        if self.expert_chunks > 1 {
            writeln!(
                f,
                "    routed experts: {} chunks a sparse layer, through two expert slots \
                 (engine.expert_chunk); the layer slots hold the trunks",
                self.expert_chunks
            )?;
        }
        writeln!(
            f,
            "    held-out eval: forward only, in micro-batch 0's buffers, the slots and the \
             scratch below (no more bytes)"
        )?;
        for (k, b) in &self.device {
            writeln!(f, "    {:<70} {:>14}", k, gib(*b))?;
        }
        writeln!(f, "    {:<70} {:>14}", "total", gib(self.device_total()))?;
        if let Some(b) = self.device_budget {
            writeln!(f, "    {:<70} {:>14}", "budget (device.memory)", gib(b))?;
        }
        Ok(())
    }
}

/// MemAvailable from /proc/meminfo, where there is one.
pub fn host_available_bytes() -> Option<u64> {
    proc_kib("/proc/meminfo", "MemAvailable:")
}

/// The process's peak resident set (VmHWM), where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_kib("/proc/self/status", "VmHWM:")
}

/// The `key: N kB` line of a /proc file, in bytes.
fn proc_kib(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
