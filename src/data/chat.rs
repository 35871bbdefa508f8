//! The `chat` format: `{"messages": [{"role", "content"}, ...]}` records rendered with the
//! model's own chat template; loss only on assistant turns (their content and the end marker
//! the template writes after it; for gpt-oss's harmony template, each answer's final channel)
//! unless `train_on_prompt`. A message may also have `thinking` (the reasoning before an
//! answer, which the template places: gpt-oss's analysis channel). The `sharegpt` format
//! ([`super::sharegpt`]) is the same once its turns are read.

use anyhow::{Result, bail};
use serde_json::Value;

use crate::data::pretokenized::Row;
use crate::data::records::{
    JsonObject, LoadReport, OnError, Outcome, carries_loss, check_max_seq_len,
    example_from_encoded, finish_load, opt_str_field, str_field,
};
use crate::data::source::{Fields, Loc, Source, json_kind, read_records_into};
use crate::data::store::{RowStore, RowStoreWriter};
use crate::tokenizer::{Message, Tokenizer};

/// The fields of a chat record (`role`, `content` and the optional `thinking` are those of each
/// message).
pub const CHAT_FIELDS: Fields =
    Fields { required: &["messages"], optional: &[], nested: &["role", "content", "thinking"] };

/// Load a chat dataset. Rows longer than `max_seq_len` are truncated (counted in the report).
pub fn load_chat(
    src: &Source,
    tok: &dyn Tokenizer,
    max_seq_len: usize,
    train_on_prompt: bool,
    on_error: OnError,
) -> Result<(RowStore, LoadReport)> {
    let c = &src.columns;
    let (list, role, content) = (c.name("messages"), c.name("role"), c.name("content"));
    let thinking = c.name("thinking");
    let read = |obj: &JsonObject| messages(obj, list, [role, content, thinking]);
    load_conversations(src, &CHAT_FIELDS, "chat", tok, max_seq_len, train_on_prompt, on_error, read)
}

/// The turns of `obj[list]`: `(obj[role], obj[content])` of each element, as strings; errors
/// name the field and the turn.
pub fn turns<'a>(
    obj: &'a JsonObject,
    list: &str,
    role: &str,
    content: &str,
) -> Result<Vec<(&'a str, &'a str)>> {
    (turn_objects(obj, list)?.into_iter().enumerate())
        .map(|(i, turn)| {
            let field =
                |key: &str| str_field(turn, key).map_err(|e| anyhow::anyhow!("{list}[{i}]: {e}"));
            Ok((field(role)?, field(content)?))
        })
        .collect()
}

/// The messages of `obj[list]`: each element's `role`, `content` and, if present (and not
/// null), `thinking`, under the names given; errors name the field and the turn.
pub fn messages(
    obj: &JsonObject,
    list: &str,
    [role, content, thinking]: [&str; 3],
) -> Result<Vec<Message>> {
    (turn_objects(obj, list)?.into_iter().enumerate())
        .map(|(i, turn)| {
            let at = |e: anyhow::Error| anyhow::anyhow!("{list}[{i}]: {e}");
            let message = Message::new(
                str_field(turn, role).map_err(at)?,
                str_field(turn, content).map_err(at)?,
            );
            Ok(match opt_str_field(turn, thinking).map_err(at)? {
                Some(thinking) => message.with_thinking(thinking),
                None => message,
            })
        })
        .collect()
}

/// The elements of `obj[list]`, each an object; errors name the field and the element.
fn turn_objects<'a>(obj: &'a JsonObject, list: &str) -> Result<Vec<&'a JsonObject>> {
    let items = match obj.get(list) {
        None => bail!("missing field \"{list}\""),
        Some(Value::Array(items)) => items,
        Some(other) => bail!("field \"{list}\" is {}, expected a list of turns", json_kind(other)),
    };
    (items.iter().enumerate())
        .map(|(i, item)| match item {
            Value::Object(turn) => Ok(turn),
            _ => bail!("{list}[{i}] is {}, expected an object", json_kind(item)),
        })
        .collect()
}

/// Load conversations that `read` turns into messages (roles as [`crate::tokenizer::chat::ROLES`]
/// lists them; the chat template says which it accepts), rendered and masked as the chat format
/// does.
#[allow(clippy::too_many_arguments)]
pub fn load_conversations(
    src: &Source,
    fields: &Fields,
    format: &str,
    tok: &dyn Tokenizer,
    max_seq_len: usize,
    train_on_prompt: bool,
    on_error: OnError,
    read: impl Fn(&JsonObject) -> Result<Vec<Message>>,
) -> Result<(RowStore, LoadReport)> {
    check_max_seq_len(max_seq_len)?;
    let Some(template) = tok.chat() else {
        bail!(
            "data.format {format} ({}): the tokenizer has no chat template\nhint: give the tokenizer directory a tokenizer_config.json with chat_template (or chat_template.jinja)",
            src.path.display()
        );
    };
    let mut report = LoadReport::default();
    let (mut truncated, mut no_loss) = (0, Vec::new());
    let mut out = RowStoreWriter::new()?;
    let build = |obj: &JsonObject, loc: &Loc| -> Result<Outcome<Row>> {
        let messages = read(obj)?;
        if !messages.iter().any(|m| m.role == "assistant") {
            return Ok(Outcome::Skip("no assistant message: nothing to learn".to_string()));
        }
        // Spans are searched only as far as the row is kept: where token max_seq_len starts.
        // The rendered text is tokenized once, for that and for the row.
        let mut encoded = None;
        let kept = |text: &str| {
            let e = tok.encode_with_offsets(text);
            let cut = match &e {
                Ok((_, offsets)) if offsets.len() > max_seq_len => offsets[max_seq_len].start,
                _ => usize::MAX,
            };
            encoded = Some(e);
            cut
        };
        let (text, spans) = template.render_with_assistant_spans_until(&messages, kept)?;
        let encoded = encoded.expect("the cut is asked for once")?;
        let mut row = example_from_encoded(tok, (&text, encoded), &spans, train_on_prompt, false)?;
        if row.input_ids.len() > max_seq_len {
            row.input_ids.truncate(max_seq_len);
            row.labels.truncate(max_seq_len);
            truncated += 1;
        }
        if !carries_loss(&row) {
            no_loss.push(loc.clone());
        }
        Ok(Outcome::Keep(row))
    };
    read_records_into(src, fields, on_error, &mut report, build, |r| out.push(&r))?;
    report.no_loss = no_loss;
    finish_load(src, out.finish()?, report, truncated)
}
