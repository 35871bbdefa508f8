//! The run layer: one file per `horizon` verb, and what the verbs share. A verb never imports
//! another verb.
//!
//! | verb | file |
//! |---|---|
//! | `horizon train` | [`train`] (with no config: [`default_job`]) |
//! | `horizon bench` | [`bench`] |
//! | `horizon export` (and `--merge`) | [`export`] |
//! | `horizon generate` | [`generate`] |
//! | `horizon plan` | [`plan`] |
//!
//! Shared: the YAML config ([`config`]), the model and weights in the host store ([`load`]), the
//! data ([`data`]), the streaming trainer ([`trainer`]) and its progress line ([`progress`]),
//! checkpoints ([`resume`]), the run directory's lock ([`lock`]), `summary.json` and
//! `metrics.jsonl` ([`summary`]), `training.png` ([`plot`]), HF directories out ([`hf_out`]),
//! the Generator ([`decode`]), the projection's printer ([`projection`]), and the reference
//! trainer the tests compare against ([`reference`]).

pub mod bench;
pub mod config;
pub mod data;
pub mod decode;
pub mod default_job;
pub mod dpo_config;
pub mod dpo_reference;
pub mod dpo_streamed;
pub mod dpo_train;
pub mod export;
pub mod generate;
pub mod hf_out;
pub mod load;
pub mod lock;
pub mod plan;
pub mod plot;
pub mod progress;
pub mod projection;
pub mod reference;
pub mod resume;
pub mod summary;
pub mod tensorboard;
pub mod train;
pub mod trainer;
