//! Peak memory of reading a large Parquet dataset through the data loader's record path (a
//! benchmark, not a test).
//!
//! ```text
//! cargo run --release --example parquet_rss -- write /tmp/sharegpt-1g.parquet 1024
//! cargo run --release --example parquet_rss -- read /tmp/sharegpt-1g.parquet [tokenize]
//! ```
//!
//! `write` makes a ShareGPT-layout file (`conversations: list<struct<from, value>>`, snappy, row
//! groups of 20 000 rows as `datasets` writes them) of about the given size in MiB, from
//! pseudo-random words. `read` streams every row through `read_records` and the ShareGPT parser
//! (with `tokenize`: also the chat template and the byte tokenizer, as `load_sharegpt` does),
//! keeping nothing, and prints the rows, the time and the peak RSS (`VmHWM`) above the RSS
//! before reading. The rows a training run keeps cost 8 bytes per token beyond this (ids and
//! labels as `i32`).
//!
//! Measured once (a shared 2-core VM, `cargo run --example`, i.e. the dev profile: dependencies
//! optimised): 1 074 632 205 bytes, 2 240 000 rows in 112 row groups; `read`: 20.0 s, peak RSS
//! 11.4 MiB (7.0 MiB above the 4.4 MiB before reading); `read ... tokenize` (2.54 G tokens):
//! 108.6 s, peak RSS 11.7 MiB (7.2 MiB above).

#[path = "../tests/parquet_writer/mod.rs"]
mod parquet_writer;

use std::path::Path;
use std::time::Instant;

use horizon::data::records::{Outcome, example_from_spans};
use horizon::data::sharegpt::{SHAREGPT_FIELDS, sharegpt_messages};
use horizon::data::{LoadReport, OnError, Source, read_records};
use horizon::tokenizer::{ByteTokenizer, Tokenizer};
use parquet_writer::{Col, Writer};
use serde_json::{Map, Value, json};

fn vm_kib(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().strip_suffix("kB")?.trim().parse().ok())
        .unwrap_or(0)
}

fn write(path: &Path, mib: u64) {
    const WORDS: [&str; 16] = [
        "the", "model", "streams", "one", "layer", "at", "a", "time", "host", "memory", "holds",
        "weights", "gradient", "token", "batch", "loss",
    ];
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut word = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let w = WORDS[(seed % 16) as usize];
        // A number now and then keeps the text from compressing too well.
        if seed.is_multiple_of(5) { format!("{w}{}", seed % 10007) } else { w.to_string() }
    };
    let mut text = |n: usize| (0..n).map(|_| word()).collect::<Vec<_>>().join(" ");
    let cols = [Col::Structs("conversations", &["from", "value"]), Col::Str("id")];
    let mut w = Writer::create(path, &cols);
    let (mut rows, t0) = (0u64, Instant::now());
    loop {
        let group: Vec<Map<String, Value>> = (0..20_000)
            .map(|i| {
                let conv = json!([
                    {"from": "system", "value": text(8)},
                    {"from": "human", "value": text(40)},
                    {"from": "gpt", "value": text(120)},
                ]);
                let Value::Object(m) =
                    json!({"conversations": conv, "id": format!("r{}", rows + i)})
                else {
                    unreachable!()
                };
                m
            })
            .collect();
        w.row_group(&group);
        rows += group.len() as u64;
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if size >= mib << 20 {
            break;
        }
    }
    w.close();
    let size = std::fs::metadata(path).unwrap().len();
    println!(
        "wrote {} ({:.1} MiB, {rows} rows) in {:.1} s",
        path.display(),
        size as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
}

fn read(path: &Path, tokenize: bool) {
    let tok = ByteTokenizer::new();
    let template = tok.chat().expect("the byte tokenizer has a chat template");
    let before = vm_kib("VmRSS:");
    let (t0, mut report) = (Instant::now(), LoadReport::default());
    let src = Source::from(path);
    let (mut turns, mut tokens) = (0usize, 0usize);
    let kept = read_records(&src, &SHAREGPT_FIELDS, OnError::Fail, &mut report, |obj, _| {
        let messages = sharegpt_messages(obj, &src)?;
        turns += messages.len();
        if tokenize {
            let (text, spans) = template.render_with_assistant_spans(&messages)?;
            tokens += example_from_spans(&tok, &text, &spans, false, false)?.input_ids.len();
        }
        Ok(Outcome::Keep(()))
    })
    .unwrap_or_else(|e| panic!("{e:#}"));
    let secs = t0.elapsed().as_secs_f64();
    let peak = vm_kib("VmHWM:");
    let size = std::fs::metadata(path).unwrap().len();
    println!(
        "read {} ({:.1} MiB): {} rows, {turns} turns{} in {secs:.1} s ({:.0} MiB/s); RSS before \
         {:.1} MiB, peak {:.1} MiB, peak above before {:.1} MiB",
        path.display(),
        size as f64 / (1 << 20) as f64,
        kept.len(),
        if tokenize { format!(", {tokens} tokens") } else { String::new() },
        size as f64 / (1 << 20) as f64 / secs,
        before as f64 / 1024.0,
        peak as f64 / 1024.0,
        peak.saturating_sub(before) as f64 / 1024.0,
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["write", path, mib] => write(Path::new(path), mib.parse().expect("size in MiB")),
        ["read", path] => read(Path::new(path), false),
        ["read", path, "tokenize"] => read(Path::new(path), true),
        _ => eprintln!("usage: parquet_rss write PATH MIB | parquet_rss read PATH [tokenize]"),
    }
}
