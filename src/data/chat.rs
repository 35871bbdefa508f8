//! The `chat` format: `{"messages": [{"role", "content"}, ...]}` records rendered with the
//! model's own chat template; loss only on assistant turns (their content and the end marker
//! the template writes after it) unless `train_on_prompt`.

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::data::pretokenized::Row;
use crate::data::records::{
    LoadReport, OnError, Outcome, check_max_seq_len, example_from_spans, finish_load, read_jsonl,
};
use crate::tokenizer::{Message, Tokenizer};

/// Load a chat dataset. Rows longer than `max_seq_len` are truncated (counted in the report).
pub fn load_chat(
    path: &Path,
    tok: &dyn Tokenizer,
    max_seq_len: usize,
    train_on_prompt: bool,
    on_error: OnError,
) -> Result<(Vec<Row>, LoadReport)> {
    check_max_seq_len(max_seq_len)?;
    let Some(template) = tok.chat() else {
        bail!(
            "data.format chat ({}): the tokenizer has no chat template\nhint: give the tokenizer directory a tokenizer_config.json with chat_template (or chat_template.jinja)",
            path.display()
        );
    };
    let mut report = LoadReport::default();
    let mut truncated = 0;
    let rows = read_jsonl(path, on_error, &mut report, |obj| {
        let messages = obj.get("messages").context("missing field `messages`")?;
        let messages: Vec<Message> = serde_json::from_value(messages.clone())
            .context("`messages` must be a list of {\"role\", \"content\"} objects")?;
        if !messages.iter().any(|m| m.role == "assistant") {
            return Ok(Outcome::Skip("no assistant message: nothing to learn".to_string()));
        }
        let (text, spans) = template.render_with_assistant_spans(&messages)?;
        let mut row = example_from_spans(tok, &text, &spans, train_on_prompt, false)?;
        if row.input_ids.len() > max_seq_len {
            row.input_ids.truncate(max_seq_len);
            row.labels.truncate(max_seq_len);
            truncated += 1;
        }
        Ok(Outcome::Keep(row))
    })?;
    finish_load(path, rows, report, truncated)
}
