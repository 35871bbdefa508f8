//! The streaming engine: host RAM holds the model; the device borrows one layer at a time.
//! `plan` builds the step (and an evaluation) as data and checks it for hazards; `exec` runs it
//! on a [`Device`], one dispatcher per queue; `slots` says what each weight slot holds, region
//! by region; `sizes` sizes every buffer, and `memory` says before allocating what the run will
//! need; `options` holds what a run chooses, and `resolve` turns `engine.recompute` and
//! `engine.weight_upload` into settings for a machine; `phases` times the step by phase and
//! counts its FLOPs; `head_tiles` applies an LM head too large for a weight slot in vocabulary
//! tiles; `trace` records when a run's ops ran.
//!
//! [`Device`]: horizon_backend::Device

pub mod chunking;
pub mod exec;
pub mod head_tiles;
pub mod memory;
pub mod options;
pub mod phases;
pub mod plan;
pub mod resolve;
pub mod sizes;
pub mod slots;
pub mod trace;
