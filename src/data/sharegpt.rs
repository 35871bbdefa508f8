//! The `sharegpt` format: `{"conversations": [{"from": "human" | "gpt" | "system", "value"},
//! ...]}`, the layout of many chat datasets on the Hugging Face Hub; read into chat messages
//! (`human`/`user` -> `user`, `gpt`/`assistant` -> `assistant`, `system` -> `system`, `tool` /
//! `function_response` / `observation` -> `tool`) and then trained as the chat format is.

use anyhow::{Result, bail};

use crate::data::chat::{load_conversations, turns};
use crate::data::records::{JsonObject, LoadReport, OnError};
use crate::data::source::{Fields, Source};
use crate::data::store::RowStore;
use crate::tokenizer::{Message, Tokenizer};

/// The fields of a ShareGPT record (`from` and `value` are those of each turn).
pub const SHAREGPT_FIELDS: Fields =
    Fields { required: &["conversations"], optional: &[], nested: &["from", "value"] };

/// The chat role of a ShareGPT `from`, or an error naming it.
pub fn sharegpt_role(from: &str) -> Result<&'static str> {
    Ok(match from {
        "human" | "user" => "user",
        "gpt" | "assistant" | "chatgpt" | "bing" | "bard" => "assistant",
        "system" => "system",
        "tool" | "function_response" | "observation" => "tool",
        other => bail!(
            "unknown \"from\" {other:?}: expected human, user, gpt, assistant, system or tool"
        ),
    })
}

/// The messages of a ShareGPT record, under the column names of `src`.
pub fn sharegpt_messages(obj: &JsonObject, src: &Source) -> Result<Vec<Message>> {
    let c = &src.columns;
    let list = c.name("conversations");
    turns(obj, list, c.name("from"), c.name("value"))?
        .into_iter()
        .enumerate()
        .map(|(i, (from, value))| {
            let role = sharegpt_role(from).map_err(|e| anyhow::anyhow!("{list}[{i}]: {e}"))?;
            Ok(Message::new(role, value))
        })
        .collect()
}

/// Load a ShareGPT dataset: the chat format's rows (see [`super::chat::load_chat`]).
pub fn load_sharegpt(
    src: &Source,
    tok: &dyn Tokenizer,
    max_seq_len: usize,
    train_on_prompt: bool,
    on_error: OnError,
) -> Result<(RowStore, LoadReport)> {
    let read = |obj: &JsonObject| sharegpt_messages(obj, src);
    load_conversations(
        src,
        &SHAREGPT_FIELDS,
        "sharegpt",
        tok,
        max_seq_len,
        train_on_prompt,
        on_error,
        read,
    )
}
