//! The `preference` format: a prompt with two completions, the chosen and the rejected,
//! tokenized exactly as TRL 1.16's `DPOTrainer._prepare_dataset` does, for preference training
//! (DPO). `../shared/fixtures-dpo/README.md` states TRL's rules; this file implements them.
//!
//! Each record's form is found from its fields, as TRL's `is_conversational` and
//! `maybe_extract_prompt` find it:
//! - pretokenized: `prompt_input_ids`, `chosen_input_ids`, `rejected_input_ids` (the completions
//!   without the prompt), used as written;
//! - standard text: `prompt`, `chosen`, `rejected` strings. The EOS token's text is appended to
//!   `chosen` and `rejected` unless they end with it; then `prompt`, `prompt + chosen` and
//!   `prompt + rejected` are tokenized with the special tokens the tokenizer adds
//!   ([`Tokenizer::encode_with_special_tokens`]: Llama's BOS), each as one string, so a token
//!   may straddle the prompt/completion boundary;
//! - conversational: lists of `{role, content}` messages (`thinking` too, where the template
//!   reads it). The chat template renders the prompt
//!   (with the generation prompt), `prompt + chosen` and `prompt + rejected`, tokenized without
//!   special tokens; no EOS is appended (the template closes the turn, and what it writes after
//!   the end-of-turn token is part of the completion too);
//! - implicit prompt: no `prompt` (absent or null). The prompt is the longest common prefix of
//!   `chosen` and `rejected`: of messages, or of characters, moved back one character when the
//!   one before the first difference is a space (TRL's `extract_prompt`, quirk included: when one
//!   is a prefix of the other, the prompt stops one element short of the shorter).
//!
//! Split: with `p`, `pc`, `pr` the three tokenizations, `n = min(common_prefix(p, pc),
//! common_prefix(p, pr))`; the prompt is `p[..n]`, the completions `pc[n..]` and `pr[n..]`.
//!
//! Rows: pair `i` gives row `2i` = prompt + chosen and row `2i + 1` = prompt + rejected, labels
//! -100 on the prompt and the ids on the completion (unshifted: the training shift makes
//! position `t - 1` score token `t`, TRL's rule for completion log-probabilities).
//! Truncation (TRL's `keep_start`): a record whose prompt alone has `>= max_length` tokens is
//! left out (listed in the report's skipped), and each sequence is cut to its first `max_length`
//! tokens (the completion loses its end, EOS included).
//!
//! Where this differs from TRL: `tools` and `chat_template_kwargs` are refused on a
//! conversational record (TRL passes them to the template; ignored on text records, as TRL does);
//! records whose `chosen` or `rejected` is empty cannot have their prompt extracted (TRL crashes);
//! when they differ at their first element, the extracted prompt is empty (TRL's index -1 would
//! take all of `chosen` but its last character); forms are found per record, not from the first
//! record; an empty completion is an error rather than a pair trained on nothing.

use anyhow::{Result, anyhow, bail};
use serde_json::Value;

use super::chat::messages;
use super::pretokenized::{IGNORE_INDEX, Row};
use super::records::{LoadReport, OnError, Outcome, carries_loss, finish_load, token_i32};
use super::source::{Columns, Fields, JsonObject, Loc, Source, json_kind, read_records_into};
use super::store::{RowStore, RowStoreWriter};
use crate::tokenizer::{ChatTemplate, Message, Tokenizer};

/// The fields of a preference record (`role`, `content` and the optional `thinking` are those of
/// each message). None is required: which are needed depends on the record's form.
pub const PREFERENCE_FIELDS: Fields = Fields {
    required: &[],
    optional: &[
        "prompt",
        "chosen",
        "rejected",
        "prompt_input_ids",
        "chosen_input_ids",
        "rejected_input_ids",
        "tools",
        "chat_template_kwargs",
    ],
    nested: &["role", "content", "thinking"],
};

/// What loading a preference dataset made of its records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreferenceReport {
    /// `rows` (two per pair), `records` (pairs), `skipped` (records whose prompt alone reaches
    /// `max_length`, and under [`OnError::Skip`] the unusable ones), `truncated` (sequences cut to
    /// `max_length`), `no_loss` (pairs with a sequence that scores no token).
    pub load: LoadReport,
    /// Pairs given as standard text.
    pub standard: usize,
    /// Pairs given as conversations.
    pub conversational: usize,
    /// Pairs given as token ids.
    pub pretokenized: usize,
    /// Pairs whose prompt was extracted from `chosen` and `rejected` (also counted in their form).
    pub implicit_prompt: usize,
    /// Pairs whose chosen completion equals the rejected one (the same ids): kept, as TRL keeps
    /// them, but they teach nothing (their DPO margin is 0 whatever the model).
    pub same_completions: Vec<Loc>,
    /// Pairs whose tokenized prompt is not a prefix of prompt + completion (a token merges
    /// across the boundary, or the template renders the prompt alone differently): the
    /// completion starts where they diverge (TRL warns).
    pub split_moved: Vec<Loc>,
    /// The largest token id of the kept rows, and the first record holding it (the caller
    /// checks it against the model's vocabulary).
    pub largest_id: Option<(i32, Loc)>,
}

impl PreferenceReport {
    /// One line for the run summary, e.g. `8 pairs (16 rows): 8 conversational; 1 skipped
    /// (first: FILE:3: ...)`.
    pub fn summary(&self) -> String {
        let l = &self.load;
        let mut s = format!("{} pairs ({} rows):", l.records, l.rows);
        let forms = [
            (self.standard, "standard text"),
            (self.conversational, "conversational"),
            (self.pretokenized, "pretokenized"),
            (self.implicit_prompt, "with an implicit prompt"),
        ];
        let forms: Vec<String> =
            forms.iter().filter(|(n, _)| *n > 0).map(|(n, what)| format!("{n} {what}")).collect();
        s += &format!(" {}", forms.join(", "));
        if let Some((loc, reason)) = l.skipped.first() {
            s += &format!("; {} skipped (first: {loc}: {reason})", l.skipped.len());
        }
        if l.truncated > 0 {
            s += &format!("; {} sequences truncated", l.truncated);
        }
        s
    }

    /// The warnings to show beside the summary: pairs with equal completions, pairs whose
    /// prompt/completion boundary moved, pairs with a sequence that scores no token.
    pub fn warnings(&self) -> Vec<String> {
        let list = |locs: &[Loc], what: &str| {
            locs.first().map(|first| format!("{} pairs {what} (first: {first})", locs.len()))
        };
        [
            list(&self.same_completions, "have a chosen equal to their rejected: no signal"),
            list(
                &self.split_moved,
                "have a tokenized prompt that is not a prefix of prompt + completion: the \
                 completion starts where they diverge",
            ),
            list(&self.load.no_loss, "have a sequence without a scored completion token"),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// Loads a `preference` dataset (see the module doc): for pair `i`, rows `2i` (prompt + chosen)
/// and `2i + 1` (prompt + rejected). `tok` is needed for text and conversational records only.
///
/// Errors (`FILE:LINE: <what>` under [`OnError::Fail`], listed in the report's skipped under
/// [`OnError::Skip`]): a missing or mistyped field, fields mixing text and conversations, a
/// text record without a tokenizer (or without EOS; a conversation without a chat template),
/// `tools` or `chat_template_kwargs` on a conversation, an empty completion, an id that is not
/// a non-negative integer. Then: `max_length < 2`, no row at all, or no row that carries a
/// loss. The field names are `src.columns`' mapping of these. Ids are not checked against a
/// vocabulary here (the model's may be larger than the tokenizer's): the report's `largest_id`
/// says where the largest is.
pub fn load_preference(
    src: &Source,
    tok: Option<&dyn Tokenizer>,
    max_length: usize,
    on_error: OnError,
) -> Result<(RowStore, PreferenceReport)> {
    if max_length < 2 {
        bail!(
            "dpo.max_length = {max_length} is too short: a sequence needs a prompt token and a \
             completion token"
        );
    }
    let mut loader = Loader {
        tok,
        names: Names::new(&src.columns),
        max_length,
        eos_text: None,
        rep: PreferenceReport::default(),
        truncated: 0,
    };
    let mut load = LoadReport::default();
    let mut out = RowStoreWriter::new()?;
    let build = |obj: &JsonObject, loc: &Loc| loader.build(obj, loc);
    read_records_into(src, &PREFERENCE_FIELDS, on_error, &mut load, build, |[c, r]| {
        out.push(&c)?;
        out.push(&r)
    })?;
    load.no_loss = std::mem::take(&mut loader.rep.load.no_loss);
    let (rows, load) = finish_load(src, out.finish()?, load, loader.truncated)?;
    Ok((rows, PreferenceReport { load, ..loader.rep }))
}

/// The file's names of the format's fields (`data.columns`).
struct Names<'a> {
    /// `prompt`, `chosen`, `rejected`.
    text: [&'a str; 3],
    /// `prompt_input_ids`, `chosen_input_ids`, `rejected_input_ids`.
    ids: [&'a str; 3],
    role: &'a str,
    content: &'a str,
    thinking: &'a str,
    tools: &'a str,
    kwargs: &'a str,
}

impl<'a> Names<'a> {
    fn new(c: &'a Columns) -> Self {
        Names {
            text: ["prompt", "chosen", "rejected"].map(|f| c.name(f)),
            ids: ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"].map(|f| c.name(f)),
            role: c.name("role"),
            content: c.name("content"),
            thinking: c.name("thinking"),
            tools: c.name("tools"),
            kwargs: c.name("chat_template_kwargs"),
        }
    }
}

/// A pair as token ids: the prompt, and the two completions without it.
#[derive(Debug, PartialEq, Eq)]
struct PairIds {
    prompt: Vec<i32>,
    chosen: Vec<i32>,
    rejected: Vec<i32>,
}

/// One record's pair, its prompt extracted if it was implicit.
enum Pair<'a> {
    Ids(PairIds),
    Text { prompt: &'a str, chosen: &'a str, rejected: &'a str },
    Chat { prompt: Vec<Message>, chosen: Vec<Message>, rejected: Vec<Message> },
}

/// The state of a load: what every record needs, and the counts so far.
struct Loader<'a> {
    tok: Option<&'a dyn Tokenizer>,
    names: Names<'a>,
    max_length: usize,
    /// The EOS token's text, found at the first standard-text record.
    eos_text: Option<String>,
    /// The counts; `load.no_loss` only (the rest of `load` is filled by the record loop).
    rep: PreferenceReport,
    /// Sequences cut to `max_length`.
    truncated: usize,
}

impl Loader<'_> {
    /// The two rows of one record.
    fn build(&mut self, obj: &JsonObject, loc: &Loc) -> Result<Outcome<[Row; 2]>> {
        let (pair, implicit) = read_pair(obj, &self.names)?;
        let form = match pair {
            Pair::Ids(_) => Form::Pretokenized,
            Pair::Text { .. } => Form::Standard,
            Pair::Chat { .. } => Form::Conversational,
        };
        let (ids, moved) = self.tokenize(pair)?;
        if ids.chosen.is_empty() || ids.rejected.is_empty() {
            let which = if ids.chosen.is_empty() { "chosen" } else { "rejected" };
            bail!("the {which} completion is empty (no token after the prompt)");
        }
        if ids.prompt.len() >= self.max_length {
            return Ok(Outcome::Skip(format!(
                "the prompt alone has {} tokens, reaching dpo.max_length = {}",
                ids.prompt.len(),
                self.max_length
            )));
        }
        let rows = [&ids.chosen, &ids.rejected].map(|c| sequence(&ids.prompt, c, self.max_length));
        self.truncated += rows.iter().filter(|(_, cut)| *cut).count();
        let rows = rows.map(|(row, _)| row);
        let rep = &mut self.rep;
        *match form {
            Form::Pretokenized => &mut rep.pretokenized,
            Form::Standard => &mut rep.standard,
            Form::Conversational => &mut rep.conversational,
        } += 1;
        rep.implicit_prompt += usize::from(implicit);
        let flags = [
            (moved, &mut rep.split_moved),
            (ids.chosen == ids.rejected, &mut rep.same_completions),
            (!rows.iter().all(carries_loss), &mut rep.load.no_loss),
        ];
        for (flag, list) in flags {
            if flag {
                list.push(loc.clone());
            }
        }
        let largest = rows.iter().flat_map(|r| r.input_ids.iter().copied()).max();
        if let Some(id) = largest
            && rep.largest_id.as_ref().is_none_or(|(top, _)| id > *top)
        {
            rep.largest_id = Some((id, loc.clone()));
        }
        Ok(Outcome::Keep(rows))
    }

    /// The pair's ids, and whether the prompt/completion boundary moved into the prompt.
    fn tokenize(&mut self, pair: Pair) -> Result<(PairIds, bool)> {
        match pair {
            Pair::Ids(ids) => Ok((ids, false)),
            Pair::Text { prompt, chosen, rejected } => {
                let tok = need_tokenizer(self.tok, "standard-text")?;
                if self.eos_text.is_none() {
                    self.eos_text = Some(eos_text_of(tok)?);
                }
                let eos = self.eos_text.as_deref().expect("set above");
                split(tokenize_text(tok, eos, [prompt, chosen, rejected])?)
            }
            Pair::Chat { prompt, chosen, rejected } => {
                let tok = need_tokenizer(self.tok, "conversational")?;
                let Some(template) = tok.chat() else {
                    bail!(
                        "a conversational record needs a chat template, and the tokenizer has \
                         none (give its directory a chat_template)"
                    );
                };
                split(tokenize_chat(tok, template, &prompt, [&chosen, &rejected])?)
            }
        }
    }
}

/// A record's form.
#[derive(Clone, Copy)]
enum Form {
    Pretokenized,
    Standard,
    Conversational,
}

/// `prompt + completion` cut to its first `max_length` tokens, labels -100 on the prompt; and
/// whether it was cut.
fn sequence(prompt: &[i32], completion: &[i32], max_length: usize) -> (Row, bool) {
    let mut input_ids = [prompt, completion].concat();
    let mut labels = vec![IGNORE_INDEX; prompt.len()];
    labels.extend_from_slice(completion);
    let cut = input_ids.len() > max_length;
    input_ids.truncate(max_length);
    labels.truncate(max_length);
    (Row { input_ids, labels }, cut)
}

/// The tokenizer a text record needs, or an error saying so.
fn need_tokenizer<'a>(tok: Option<&'a dyn Tokenizer>, form: &str) -> Result<&'a dyn Tokenizer> {
    tok.ok_or_else(|| {
        anyhow!(
            "a {form} record needs a tokenizer, and none was given (pretokenized records hold \
             prompt_input_ids, chosen_input_ids and rejected_input_ids)"
        )
    })
}

/// The EOS token's text (as `tokenizer.eos_token`), checked to encode back to the EOS id.
fn eos_text_of(tok: &dyn Tokenizer) -> Result<String> {
    let Some(eos) = tok.eos_id() else {
        bail!("the tokenizer has no EOS token, which ends a standard-text chosen and rejected");
    };
    let text = tok.decode(&[eos], false)?;
    if tok.encode(&text)? != [eos] {
        bail!("the EOS token (id {eos}) decodes to {text:?}, which does not encode back to it");
    }
    Ok(text)
}

/// Standard text: `tokenizer(prompt)`, `tokenizer(prompt + chosen)`,
/// `tokenizer(prompt + rejected)` with special tokens, the EOS text `eos` appended to each
/// completion that does not end with it.
fn tokenize_text(
    tok: &dyn Tokenizer,
    eos: &str,
    [prompt, chosen, rejected]: [&str; 3],
) -> Result<[Vec<u32>; 3]> {
    let full = |c: &str| {
        let text =
            if c.ends_with(eos) { format!("{prompt}{c}") } else { format!("{prompt}{c}{eos}") };
        tok.encode_with_special_tokens(&text)
    };
    Ok([tok.encode_with_special_tokens(prompt)?, full(chosen)?, full(rejected)?])
}

/// Conversations: the prompt rendered with the generation prompt, prompt + chosen and prompt +
/// rejected without; tokenized without special tokens.
fn tokenize_chat(
    tok: &dyn Tokenizer,
    template: &ChatTemplate,
    prompt: &[Message],
    [chosen, rejected]: [&[Message]; 2],
) -> Result<[Vec<u32>; 3]> {
    let full = |c: &[Message]| tok.encode(&template.render(&[prompt, c].concat(), false)?);
    Ok([tok.encode(&template.render(prompt, true)?)?, full(chosen)?, full(rejected)?])
}

/// TRL's split of `[p, pc, pr]`: the prompt is their common start `p[..n]`, `n =
/// min(common_prefix(p, pc), common_prefix(p, pr))`; and whether `n < p.len()`.
fn split([p, pc, pr]: [Vec<u32>; 3]) -> Result<(PairIds, bool)> {
    let common = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let n = common(&p, &pc).min(common(&p, &pr));
    let ids = |x: &[u32]| x.iter().map(|&id| token_i32(id)).collect::<Result<Vec<i32>>>();
    let pair = PairIds { prompt: ids(&p[..n])?, chosen: ids(&pc[n..])?, rejected: ids(&pr[n..])? };
    Ok((pair, n < p.len()))
}

/// A text field as read: absent (or null), a string, or a list of messages.
enum Field<'a> {
    Absent,
    Text(&'a str),
    Chat(Vec<Message>),
}

impl Field<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Field::Absent => "absent",
            Field::Text(_) => "a string",
            Field::Chat(_) => "a list of messages",
        }
    }
}

/// The field `key` of `obj`.
fn field<'a>(obj: &'a JsonObject, key: &str, n: &Names) -> Result<Field<'a>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Field::Absent),
        Some(Value::String(s)) => Ok(Field::Text(s)),
        Some(Value::Array(_)) => {
            Ok(Field::Chat(messages(obj, key, [n.role, n.content, n.thinking])?))
        }
        Some(other) => bail!(
            "field \"{key}\" is {}, expected a string or a list of messages",
            json_kind(other)
        ),
    }
}

/// Whether `obj` has `key` with a value other than null.
fn present(obj: &JsonObject, key: &str) -> bool {
    !matches!(obj.get(key), None | Some(Value::Null))
}

/// The pair a record holds (its form found from its fields), and whether its prompt was
/// implicit.
fn read_pair<'a>(obj: &'a JsonObject, n: &Names) -> Result<(Pair<'a>, bool)> {
    if n.ids.iter().any(|k| present(obj, k)) {
        let [p, c, r] = n.ids;
        let ids = PairIds {
            prompt: id_list(obj, p)?,
            chosen: id_list(obj, c)?,
            rejected: id_list(obj, r)?,
        };
        return Ok((Pair::Ids(ids), false));
    }
    let [p, c, r] = n.text;
    let fields = [(p, field(obj, p, n)?), (c, field(obj, c, n)?), (r, field(obj, r, n)?)];
    for (key, f) in &fields[1..] {
        if matches!(f, Field::Absent) {
            bail!(
                "missing field \"{key}\" (a preference record has {c} and {r}, with or without \
                 {p}; or {}, {} and {})",
                n.ids[0],
                n.ids[1],
                n.ids[2]
            );
        }
    }
    let present: Vec<_> = fields.iter().filter(|(_, f)| !matches!(f, Field::Absent)).collect();
    if let Some((key, f)) = present.iter().find(|(_, f)| f.kind() != present[0].1.kind()) {
        let (first, k0) = (present[0].0, present[0].1.kind());
        bail!(
            "field \"{first}\" is {k0} but \"{key}\" is {}: a record is all text or all \
             conversation",
            f.kind()
        );
    }
    let [(_, prompt), (_, chosen), (_, rejected)] = fields;
    let implicit = matches!(prompt, Field::Absent);
    let pair = match (prompt, chosen, rejected) {
        (prompt, Field::Text(chosen), Field::Text(rejected)) => match prompt {
            Field::Text(prompt) => Pair::Text { prompt, chosen, rejected },
            _ => implicit_text(chosen, rejected, n)?,
        },
        (prompt, Field::Chat(chosen), Field::Chat(rejected)) => {
            refuse_template_extras(obj, n)?;
            match prompt {
                Field::Chat(prompt) => Pair::Chat { prompt, chosen, rejected },
                _ => implicit_chat(chosen, rejected, n)?,
            }
        }
        _ => unreachable!("the kinds were checked to agree, and chosen and rejected are present"),
    };
    Ok((pair, implicit))
}

/// Refuses `tools` and `chat_template_kwargs` (other than null, or an empty object).
fn refuse_template_extras(obj: &JsonObject, n: &Names) -> Result<()> {
    for key in [n.tools, n.kwargs] {
        match obj.get(key) {
            None | Some(Value::Null) => {}
            Some(Value::Object(m)) if m.is_empty() => {}
            Some(_) => bail!(
                "field \"{key}\" is not supported: conversations are rendered without tools \
                 or chat_template_kwargs"
            ),
        }
    }
    Ok(())
}

/// The list of token ids `obj[key]`.
fn id_list(obj: &JsonObject, key: &str) -> Result<Vec<i32>> {
    let items = match obj.get(key) {
        None | Some(Value::Null) => bail!("missing field \"{key}\""),
        Some(Value::Array(items)) => items,
        Some(other) => {
            bail!("field \"{key}\" is {}, expected a list of token ids", json_kind(other))
        }
    };
    let id = |(j, v): (usize, &Value)| {
        v.as_i64()
            .and_then(|x| i32::try_from(x).ok())
            .filter(|&x| x >= 0)
            .ok_or_else(|| anyhow!("{key}[{j}] = {v} is not a token id (an integer >= 0)"))
    };
    items.iter().enumerate().map(id).collect()
}

/// TRL's `extract_prompt`: where the implicit prompt ends, an index into both `chosen` and
/// `rejected`; `None` when either is empty. The first index where they differ, one less when the
/// element before it is a space; when one is a prefix of the other, the last index of the
/// shorter (Python's loop variable after the loop).
fn implicit_prompt_end<T: PartialEq>(
    chosen: &[T],
    rejected: &[T],
    is_space: impl Fn(&T) -> bool,
) -> Option<usize> {
    let m = chosen.len().min(rejected.len());
    if m == 0 {
        return None;
    }
    match (0..m).find(|&i| chosen[i] != rejected[i]) {
        Some(i) if i > 0 && is_space(&chosen[i - 1]) => Some(i - 1),
        Some(i) => Some(i),
        None => Some(m - 1),
    }
}

/// The error for a record whose prompt cannot be extracted.
fn empty_completion(chosen_empty: bool, n: &Names) -> anyhow::Error {
    let key = if chosen_empty { n.text[1] } else { n.text[2] };
    anyhow!(
        "field \"{key}\" is empty, so no prompt can be extracted from it (and no {} given)",
        n.text[0]
    )
}

/// A standard-text record without a prompt, split at the end of the common prefix (in
/// characters, as Python indexes strings).
fn implicit_text<'a>(chosen: &'a str, rejected: &'a str, n: &Names) -> Result<Pair<'a>> {
    let (c, r): (Vec<char>, Vec<char>) = (chosen.chars().collect(), rejected.chars().collect());
    let end = implicit_prompt_end(&c, &r, |&ch| ch == ' ')
        .ok_or_else(|| empty_completion(c.is_empty(), n))?;
    // The characters before `end` are the same in both, so is their length in bytes.
    let at = chosen.char_indices().nth(end).map_or(chosen.len(), |(b, _)| b);
    Ok(Pair::Text { prompt: &chosen[..at], chosen: &chosen[at..], rejected: &rejected[at..] })
}

/// A conversational record without a prompt, split after the common messages.
fn implicit_chat<'a>(
    mut chosen: Vec<Message>,
    mut rejected: Vec<Message>,
    n: &Names,
) -> Result<Pair<'a>> {
    let end = implicit_prompt_end(&chosen, &rejected, |_| false)
        .ok_or_else(|| empty_completion(chosen.is_empty(), n))?;
    let (chosen_rest, rejected_rest) = (chosen.split_off(end), rejected.split_off(end));
    Ok(Pair::Chat { prompt: chosen, chosen: chosen_rest, rejected: rejected_rest })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end(c: &str, r: &str) -> Option<usize> {
        let (c, r): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
        implicit_prompt_end(&c, &r, |&ch| ch == ' ')
    }

    #[test]
    fn implicit_prompt_is_trls_extract_prompt() {
        assert_eq!(end("The sky is blue.", "The sky is green."), Some(10));
        assert_eq!(end("ab", "ax"), Some(1));
        // Python's loop variable after a loop without a difference: the last index.
        assert_eq!(end("ab", "abc"), Some(1));
        assert_eq!(end("same", "same"), Some(3));
        // Different from the start: an empty prompt (TRL would look at chosen[-1]).
        assert_eq!(end("x ", "y"), Some(0));
        assert_eq!(end("", "y"), None);
        // Characters, not bytes.
        assert_eq!(end("é a", "é b"), Some(1));
    }

    #[test]
    fn split_at_the_shorter_common_prefix() {
        let (ids, moved) = split([vec![1, 2, 3], vec![1, 2, 3, 4], vec![1, 2, 5, 6]]).unwrap();
        assert_eq!(ids, PairIds { prompt: vec![1, 2], chosen: vec![3, 4], rejected: vec![5, 6] });
        assert!(moved);
        let (ids, moved) = split([vec![1], vec![1, 4], vec![1, 5]]).unwrap();
        assert_eq!((ids.prompt, moved), (vec![1], false));
    }
}
