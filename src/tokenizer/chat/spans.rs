//! The assistant spans of a rendered conversation (the loss mask of a chat row) in a constant
//! number of renders, whatever the number of turns.
//!
//! The definition (kept as [`prefix_spans`], the reference and the fallback): for assistant
//! message i, the span runs from the end of `render(messages[..i], add_generation_prompt=true)`
//! to the end of `render(messages[..=i])`. Rendering those prefixes for every turn is quadratic
//! in the turns; the search below gets the same spans from one extra render of the whole
//! conversation and a fixed number of prefix renders:
//!
//! - Templates with `{% generation %}` blocks: one render with each block's text wrapped in
//!   markers gives the blocks' byte ranges, as `transformers`' `AssistantTracker` records them
//!   (`return_assistant_tokens_mask`, TRL's `assistant_only_loss`). For these templates the spans
//!   are the blocks' text, HF's semantics, not the prefix definition.
//! - Other templates ("marked" render): every message's content is wrapped in private-use
//!   markers that carry its index; with the markers taken out the text must equal the plain
//!   render byte for byte, and every content must appear once, whole and in order (a template
//!   that rewrites content, such as trimming it or cutting `<think>` out of history, fails this).
//!   The prefix renders of a turn are then the full text up to the end of the previous message's
//!   content plus a fixed tail (that message's end marker and the generation prompt), and up to
//!   the end of the turn's content plus a fixed tail (its end marker). The tails are learned
//!   from exact prefix renders of the first assistant turn after each role, checked in the text
//!   at every turn, and the last derived span is compared with its exact prefix renders. Any
//!   failed check, and any error, falls back to [`prefix_spans`] (which then gives the error).
//!   This is exact for templates that render each message the same whatever follows it (all
//!   the fixtures' families); a template that changed a middle turn only, with the first and
//!   last turns and every turn's surroundings unchanged, would go unnoticed.
//! - Harmony templates (gpt-oss; the source writes [`HARMONY_FINAL`]): one render with each
//!   assistant content wrapped in markers. Each answer's span is its final channel: the content,
//!   which must follow the final-channel header, and the token that closes it (`<|end|>` for an
//!   earlier answer, `<|return|>` for the conversation's last, as the template writes them).
//!   Every prompt token is masked, the headers
//!   `<|start|>assistant<|channel|>final<|message|>` included, and so is the analysis channel
//!   (`thinking`) that the template writes before the last answer only: issue 49 trains "the
//!   assistant's final channel with the prompt masked", and every answer is trained alike,
//!   whether or not it is the last. The prefix definition does not apply to these templates:
//!   rendered as the last turn an answer ends in `<|return|>` and carries its analysis, rendered
//!   before another turn it ends in `<|end|>` without it, so no earlier answer is a prefix.

use std::ops::Range;

use anyhow::{Context, Result, bail};

use super::{ChatTemplate, Marking, Message, ROLES};

/// The harmony format's final-channel header: an answer's text follows it.
pub(super) const HARMONY_FINAL: &str = "<|channel|>final<|message|>";
/// The tokens that close an answer's final channel: another message follows, or the
/// conversation ends (the last answer of a training render). (`<|call|>` closes a tool call,
/// which is never in the final channel.)
const HARMONY_CLOSES: [&str; 2] = ["<|end|>", "<|return|>"];

/// Below this many assistant messages, rendering every prefix costs no more than the marked
/// search (which renders twice plus twice per learned tail and twice to verify).
pub(super) const MARKED_MIN_TURNS: usize = 3;

/// How the spans of a conversation were found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Path {
    /// `{% generation %}` blocks (HF semantics).
    Generation,
    /// Harmony's final channels.
    Harmony,
    /// The marked render, a constant number of renders.
    Marked,
    /// Every prefix rendered (the definition): a short conversation, or a check failed.
    Prefix,
}

/// The rendered conversation, its assistant spans until one ends at or past byte `cut(text)`,
/// and how they were found. The marked search is tried from `min_turns` assistant messages on.
pub(super) fn search(
    template: &ChatTemplate,
    messages: &[Message],
    cut: impl FnOnce(&str) -> usize,
    min_turns: usize,
) -> Result<(String, Vec<Range<usize>>, Path)> {
    let text = template.render(messages, false)?;
    let cut = cut(&text);
    if template.generation {
        let spans = generation_spans(template, messages, &text, cut)?;
        return Ok((text, spans, Path::Generation));
    }
    if template.harmony {
        let spans = harmony_spans(template, messages, &text, cut)?;
        return Ok((text, spans, Path::Harmony));
    }
    let turns = messages.iter().filter(|m| m.role == "assistant").count();
    if turns >= min_turns
        && let Some(spans) = marked_spans(template, messages, &text, cut)
    {
        return Ok((text, spans, Path::Marked));
    }
    let spans = prefix_spans(template, messages, &text, cut)?;
    Ok((text, spans, Path::Prefix))
}

/// The definition: each assistant span from its two prefix renders, until one ends at or past
/// `cut`. Quadratic in the turns; the reference the other paths are tested against.
pub(super) fn prefix_spans(
    template: &ChatTemplate,
    messages: &[Message],
    text: &str,
    cut: usize,
) -> Result<Vec<Range<usize>>> {
    let mut spans: Vec<Range<usize>> = Vec::new();
    for i in assistant_turns(messages) {
        if spans.last().is_some_and(|s| s.end >= cut) {
            break;
        }
        spans.push(exact_turn(template, messages, i, text)?.span);
    }
    Ok(spans)
}

/// The indices of the assistant messages.
fn assistant_turns(messages: &[Message]) -> impl Iterator<Item = usize> + '_ {
    messages.iter().enumerate().filter(|(_, m)| m.role == "assistant").map(|(i, _)| i)
}

/// One assistant turn by the definition, with the two prefix renders it comes from.
struct ExactTurn {
    span: Range<usize>,
    /// `render(messages[..i], add_generation_prompt=true)`.
    prompt: String,
    /// `render(messages[..=i], false)`.
    through: String,
}

/// Assistant message `i`'s span by its two prefix renders; errors if they are not prefixes of
/// `text`, the whole conversation's render.
fn exact_turn(
    template: &ChatTemplate,
    messages: &[Message],
    i: usize,
    text: &str,
) -> Result<ExactTurn> {
    let prompt = template
        .render(&messages[..i], true)
        .with_context(|| format!("message {i}: rendering the prompt before it"))?;
    let through = template
        .render(&messages[..=i], false)
        .with_context(|| format!("message {i}: rendering the conversation through it"))?;
    if !through.starts_with(&prompt) || !text.starts_with(&through) {
        bail!(
            "message {i}: the chat template is not prefix-stable (rendering the conversation up \
             to this assistant turn, with the generation prompt, is not a prefix of rendering it \
             in full), so the assistant's text cannot be located for the loss mask"
        );
    }
    Ok(ExactTurn { span: prompt.len()..through.len(), prompt, through })
}

/// The text of the `{% generation %}` blocks, in order, until one ends at or past `cut`: one
/// render with the blocks wrapped in markers.
fn generation_spans(
    template: &ChatTemplate,
    messages: &[Message],
    text: &str,
    cut: usize,
) -> Result<Vec<Range<usize>>> {
    let markers = Markers::chosen(template, messages, "the chat template's generation blocks")?;
    let marked = template.render_marked(messages, false, Marking::Generation(&markers))?;
    let Some((stripped, mut spans)) = markers.parse_generation(&marked) else {
        bail!("the chat template's {{% generation %}} blocks could not be located in its text");
    };
    if stripped != text {
        bail!(
            "the chat template renders differently when its {{% generation %}} blocks are \
             tracked, so they cannot be located for the loss mask"
        );
    }
    if let Some(n) = spans.iter().position(|s| s.end >= cut) {
        spans.truncate(n + 1);
    }
    Ok(spans)
}

/// The final channel of each answer, with its closing token, until one ends at or past `cut`:
/// one render with the assistant contents wrapped in markers (see the module doc).
fn harmony_spans(
    template: &ChatTemplate,
    messages: &[Message],
    text: &str,
    cut: usize,
) -> Result<Vec<Range<usize>>> {
    let markers = Markers::chosen(template, messages, "the answers")?;
    let marked = template.render_marked(messages, false, Marking::AssistantContents(&markers))?;
    let answers: Vec<bool> = messages.iter().map(|m| m.role == "assistant").collect();
    let located = markers.parse_marked(&marked, &answers);
    let Some((stripped, contents)) = located.filter(|(stripped, _)| stripped == text) else {
        bail!(
            "the chat template (harmony) does not write each answer's content once, as it is, \
             so the final channels cannot be located for the loss mask"
        );
    };
    let mut spans: Vec<Range<usize>> = Vec::new();
    for (i, content) in contents.into_iter().enumerate() {
        let Some(content) = content else { continue };
        if spans.last().is_some_and(|s| s.end >= cut) {
            break;
        }
        if !stripped[..content.start].ends_with(HARMONY_FINAL) {
            bail!(
                "message {i}: the chat template (harmony) does not write this answer in the final \
                 channel (after {HARMONY_FINAL}), so there is no final channel to train on"
            );
        }
        let after = &stripped[content.end..];
        let Some(close) = HARMONY_CLOSES.iter().find(|c| after.starts_with(**c)) else {
            bail!(
                "message {i}: the chat template (harmony) does not close this answer with one of \
                 {}",
                HARMONY_CLOSES.join(", ")
            );
        };
        spans.push(content.start..content.end + close.len());
    }
    Ok(spans)
}

/// The spans by the marked render (see the module doc), or `None` where a check fails and the
/// caller falls back to [`prefix_spans`].
fn marked_spans(
    template: &ChatTemplate,
    messages: &[Message],
    text: &str,
    cut: usize,
) -> Option<Vec<Range<usize>>> {
    let markers = Markers::choose(template, messages)?;
    let marked = template.render_marked(messages, false, Marking::Contents(&markers)).ok()?;
    let (stripped, contents) = markers.parse_contents(&marked, messages.len())?;
    if stripped != text {
        return None;
    }
    let mut tails = Tails::default();
    let mut spans: Vec<Range<usize>> = Vec::new();
    let mut last_derived = None;
    for i in assistant_turns(messages) {
        if spans.last().is_some_and(|s| s.end >= cut) {
            break;
        }
        let after = if i == 0 { None } else { Some(&messages[i - 1].role) };
        let slot =
            ROLES.iter().position(|role| after.is_some_and(|r| r == role)).map_or(0, |n| n + 1);
        let before = if i == 0 { 0 } else { contents[i - 1].end };
        let span = if tails.prompt[slot].is_some() {
            last_derived = Some((i, spans.len()));
            tails.derive(text, slot, before, contents[i].end)?
        } else {
            let exact = exact_turn(template, messages, i, text).ok()?;
            tails.learn(&exact, slot, before, contents[i].end)?;
            exact.span
        };
        spans.push(span);
    }
    if let Some((i, n)) = last_derived {
        let exact = exact_turn(template, messages, i, text).ok()?;
        if exact.span != spans[n] {
            return None;
        }
    }
    Some(spans)
}

/// What a template writes after a message's content in a prefix render, learned from exact
/// prefix renders.
#[derive(Default)]
struct Tails {
    /// After the content of the message before an assistant turn, through the generation
    /// prompt, by that message's role: none (the turn is the first message), then each of
    /// [`ROLES`]. For none, the whole prompt.
    prompt: [Option<String>; ROLES.len() + 1],
    /// After an assistant's content, through the end of the conversation (its end marker).
    turn: Option<String>,
}

impl Tails {
    /// Learns the tails from an exact turn whose previous message's content ends at byte
    /// `before` and whose own content ends at `end`; `None` if the renders do not reach there.
    fn learn(&mut self, exact: &ExactTurn, slot: usize, before: usize, end: usize) -> Option<()> {
        self.prompt[slot] = Some(exact.prompt.get(before..)?.to_string());
        if self.turn.is_none() {
            self.turn = Some(exact.through.get(end..)?.to_string());
        }
        Some(())
    }

    /// The span of a turn from the learned tails, if `text` has them where they go.
    fn derive(&self, text: &str, slot: usize, before: usize, end: usize) -> Option<Range<usize>> {
        let (prompt, turn) = (self.prompt[slot].as_deref()?, self.turn.as_deref()?);
        let span = before + prompt.len()..end + turn.len();
        let fits = text.get(before..)?.starts_with(prompt)
            && text.get(end..)?.starts_with(turn)
            && span.start <= span.end;
        fits.then_some(span)
    }
}

/// First code point of the blocks of marker characters: Supplementary Private Use Area-B,
/// which text almost never uses.
const MARKER_PLANE: u32 = 0x10_0000;
/// Code points in one block of markers, and blocks to choose from.
const BLOCK: u32 = 32;
const BLOCKS: usize = 64;
/// Offsets in a block: a content starts, a content ends, a message index ends, a generation
/// block starts, a generation block ends; from `DIGITS` on, 16 hexadecimal digits.
const CONTENT_START: u32 = 0;
const CONTENT_END: u32 = 1;
const INDEX_END: u32 = 2;
const GENERATION_START: u32 = 3;
const GENERATION_END: u32 = 4;
const DIGITS: u32 = 16;

/// A block of private-use characters that occurs in none of a render's inputs (the contents,
/// the special tokens, the template), so that in the output each one is a marker.
pub(super) struct Markers {
    base: u32,
}

impl Markers {
    /// [`Markers::choose`], or an error saying the conversation leaves none to mark `what` with.
    fn chosen(template: &ChatTemplate, messages: &[Message], what: &str) -> Result<Markers> {
        Markers::choose(template, messages).with_context(|| {
            format!(
                "the conversation uses every private-use character the loss-mask search could \
                 mark {what} with"
            )
        })
    }

    /// The first block none of whose characters the inputs use; `None` if they use every one.
    fn choose(template: &ChatTemplate, messages: &[Message]) -> Option<Markers> {
        let mut used = [false; BLOCKS];
        let specials = [template.source.as_str(), &template.bos_token, &template.eos_token];
        let texts = messages.iter().flat_map(|m| [Some(m.content.as_str()), m.thinking.as_deref()]);
        let inputs = specials.into_iter().chain(texts.flatten());
        for c in inputs.flat_map(str::chars) {
            let block = (c as u32).checked_sub(MARKER_PLANE).map(|o| (o / BLOCK) as usize);
            if let Some(slot) = block.and_then(|b| used.get_mut(b)) {
                *slot = true;
            }
        }
        let free = used.iter().position(|&u| !u)?;
        Some(Markers { base: MARKER_PLANE + free as u32 * BLOCK })
    }

    fn char(&self, offset: u32) -> char {
        char::from_u32(self.base + offset).expect("the marker blocks are valid code points")
    }

    /// The marker offset of `c`, if it is one of this block's.
    fn offset(&self, c: char) -> Option<u32> {
        (c as u32).checked_sub(self.base).filter(|&o| o < BLOCK)
    }

    /// Message `index`'s content between its start and end markers.
    pub(super) fn wrap_content(&self, index: usize, content: &str) -> String {
        let digits: String = format!("{index:x}")
            .chars()
            .map(|d| self.char(DIGITS + d.to_digit(16).expect("hex digit")))
            .collect();
        let end = self.char(INDEX_END);
        let (start_mark, end_mark) = (self.char(CONTENT_START), self.char(CONTENT_END));
        format!("{start_mark}{digits}{end}{content}{end_mark}{digits}{end}")
    }

    /// The markers around a generation block's text.
    pub(super) fn generation(&self) -> (char, char) {
        (self.char(GENERATION_START), self.char(GENERATION_END))
    }

    /// The text without markers, and the byte range in it of each of `count` messages'
    /// content; `None` unless every content is there once, whole, in message order.
    fn parse_contents(&self, marked: &str, count: usize) -> Option<(String, Vec<Range<usize>>)> {
        let (text, ranges) = self.parse_marked(marked, &vec![true; count])?;
        Some((text, ranges.into_iter().collect::<Option<_>>()?))
    }

    /// The text without markers, and the byte range in it of the content of each message that
    /// `wanted` says was marked (`None` for the others); `None` unless every marked content is
    /// there once, whole, in message order, and no other is.
    fn parse_marked(
        &self,
        marked: &str,
        wanted: &[bool],
    ) -> Option<(String, Vec<Option<Range<usize>>>)> {
        let count = wanted.len();
        let mut text = String::with_capacity(marked.len());
        let (mut starts, mut ends) = (vec![None; count], vec![None; count]);
        let mut chars = marked.chars();
        while let Some(c) = chars.next() {
            let kind = match self.offset(c) {
                None => {
                    text.push(c);
                    continue;
                }
                Some(CONTENT_START) => &mut starts,
                Some(CONTENT_END) => &mut ends,
                Some(_) => return None,
            };
            let mut index = 0usize;
            loop {
                match self.offset(chars.next()?)? {
                    INDEX_END => break,
                    d if d >= DIGITS => {
                        index = index.checked_mul(16)?.checked_add((d - DIGITS) as usize)?
                    }
                    _ => return None,
                }
            }
            if kind.get_mut(index)?.replace(text.len()).is_some() {
                return None;
            }
        }
        let ranges: Vec<Option<Range<usize>>> = (starts.into_iter().zip(ends).zip(wanted))
            .map(|((s, e), &want)| match (s, e, want) {
                (Some(s), Some(e), true) => Some(Some(s..e)),
                (None, None, false) => Some(None),
                _ => None,
            })
            .collect::<Option<_>>()?;
        let present: Vec<&Range<usize>> = ranges.iter().flatten().collect();
        let ordered = present.iter().all(|r| r.start <= r.end)
            && present.windows(2).all(|w| w[0].end <= w[1].start);
        ordered.then_some((text, ranges))
    }

    /// The text without markers, and the byte range in it of each generation block (nested
    /// ones too), in order of their start; `None` if the markers do not pair up.
    fn parse_generation(&self, marked: &str) -> Option<(String, Vec<Range<usize>>)> {
        let mut text = String::with_capacity(marked.len());
        let (mut open, mut spans) = (Vec::new(), Vec::new());
        for c in marked.chars() {
            match self.offset(c) {
                None => text.push(c),
                Some(GENERATION_START) => open.push(text.len()),
                Some(GENERATION_END) => spans.push(open.pop()?..text.len()),
                Some(_) => return None,
            }
        }
        spans.sort_by_key(|s: &Range<usize>| s.start);
        open.is_empty().then_some((text, spans))
    }
}

/// `source` with HF's `{% generation %}` / `{% endgeneration %}` tags (whitespace control
/// kept) turned into a `{% filter %}` block of [`super::GENERATION_FILTER`], and whether it had
/// any. Line numbers are unchanged, so syntax errors still point at the source's lines.
pub(super) fn rewrite_generation_tags(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let (mut rest, mut found) = (source, false);
    while let Some(at) = rest.find("{%") {
        let (head, tag) = rest.split_at(at + 2);
        out.push_str(head);
        let inner = tag.strip_prefix(['-', '+']).unwrap_or(tag);
        let word_at = tag.len() - inner.trim_start().len();
        let word = tag[word_at..]
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .next()
            .unwrap_or_default();
        let after = tag[word_at + word.len()..].trim_start();
        let closes = after.strip_prefix(['-', '+']).unwrap_or(after).starts_with("%}");
        let replacement = match word {
            "generation" if closes => format!("filter {}", super::GENERATION_FILTER),
            "endgeneration" if closes => "endfilter".to_string(),
            _ => {
                rest = tag;
                continue;
            }
        };
        out.push_str(&tag[..word_at]);
        out.push_str(&replacement);
        rest = &tag[word_at + word.len()..];
        found = true;
    }
    out.push_str(rest);
    (out, found)
}

#[cfg(test)]
mod tests {
    use std::path::Path as FsPath;

    use super::*;
    use crate::tokenizer::{ByteTokenizer, HfTokenizer, Tokenizer};

    /// The templates of the tokenizer fixtures, and templates written here in the shape of
    /// the families the fixtures lack, each with what it exercises.
    fn templates() -> Vec<(&'static str, ChatTemplate)> {
        let fixture = |name: &str| {
            let dir = FsPath::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers");
            let tok = HfTokenizer::from_dir(&dir.join(name)).unwrap();
            ChatTemplate::new(tok.chat().unwrap().source(), tok.bos_token(), tok.eos_token())
                .unwrap()
        };
        let inline = |source: &str| ChatTemplate::new(source, "<s>", "</s>").unwrap();
        let byte = ByteTokenizer::new();
        let byte = byte.chat_template();
        vec![
            ("byte (ChatML, EOS ends turns)", inline(byte.source())),
            ("qwen2 (Qwen2.5, default system)", fixture("qwen2")),
            ("qwen2-transformers5", fixture("qwen2-transformers5")),
            ("llama3 (trims content)", fixture("llama3")),
            ("chatml (dpo fixture)", inline(CHATML)),
            ("mistral (no generation prompt)", inline(MISTRAL)),
            (
                "mistral, space before answers",
                inline(&MISTRAL.replace("{{ message", "{{ ' ' + message")),
            ),
            ("gemma (system in first turn, trims)", inline(GEMMA)),
            ("qwen3 (cuts <think> from history)", inline(QWEN3)),
            ("length at the end (not prefix-stable)", inline(LENGTH_AT_END)),
        ]
    }

    /// ChatML as the DPO fixture (shared/fixtures-dpo) ships it.
    const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    /// Mistral-7B-Instruct's shape: `[INST] ... [/INST]`, answers end in EOS, roles must
    /// alternate, and `add_generation_prompt` is ignored.
    const MISTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% else %}{{ raise_exception('only user and assistant roles') }}{% endif %}{% endfor %}";

    /// Gemma 3's shape: the system message goes into the first user turn, `model` for
    /// `assistant`, contents trimmed, roles must alternate.
    const GEMMA: &str = "{{ bos_token }}{%- if messages and messages[0]['role'] == 'system' -%}{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}{%- for message in turns -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception('roles must alternate') }}{%- endif -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}";

    /// Qwen3's shape: history answers lose their `<think>` part; an answer after the last user
    /// message gets a (possibly empty) think block.
    const QWEN3: &str = "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set content = m.content %}{%- set think = '' %}{%- if '</think>' in content %}{%- set think = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{{- '<|im_start|>assistant\\n' }}{%- if loop.index0 > ns.last_user %}{{- '<think>\\n' + think + '\\n</think>\\n\\n' }}{%- endif %}{{- content + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    /// Writes the number of messages last: no prefix render is a prefix of the full one.
    const LENGTH_AT_END: &str =
        "{% for m in messages %}{{ m.role }}: {{ m.content }};{% endfor %}{{ messages|length }}";

    fn conversation(turns: &[(&str, &str)]) -> Vec<Message> {
        turns.iter().map(|(role, content)| Message::new(role, content)).collect()
    }

    /// Varied conversations: with and without a system message, many turns, consecutive
    /// answers, an answer first, empty contents, unicode and whitespace, text that looks like
    /// the templates' markers, and a character of the first block of span markers.
    fn conversations() -> Vec<Vec<Message>> {
        let rounds = |n: usize| -> Vec<Message> {
            (0..2 * n)
                .map(|i| {
                    let role = if i % 2 == 0 { "user" } else { "assistant" };
                    Message::new(role, &format!("turn {i}"))
                })
                .collect()
        };
        let mut with_system = vec![Message::new("system", "Be brief.")];
        with_system.extend(rounds(4));
        vec![
            rounds(3),
            with_system,
            rounds(40),
            conversation(&[
                ("user", "a"),
                ("assistant", "b"),
                ("assistant", "c"),
                ("user", "d"),
                ("assistant", "e"),
                ("assistant", "f"),
            ]),
            conversation(&[
                ("assistant", "hello"),
                ("user", "hi"),
                ("assistant", "how?"),
                ("user", "so"),
                ("assistant", "ok"),
            ]),
            conversation(&[
                ("system", ""),
                ("user", ""),
                ("assistant", ""),
                ("user", "q"),
                ("assistant", ""),
                ("user", ""),
                ("assistant", "x"),
            ]),
            conversation(&[
                ("user", "日本語 🦀"),
                ("assistant", "naïve café"),
                ("user", "emoji 🚀\n"),
                ("assistant", "line\nbreak"),
                ("user", "ok"),
                ("assistant", "✓"),
            ]),
            conversation(&[
                ("user", "  spaced  "),
                ("assistant", "\n lead"),
                ("user", "x"),
                ("assistant", "trail \n"),
                ("user", "y"),
                ("assistant", " both "),
            ]),
            conversation(&[
                ("user", "a"),
                ("assistant", "b"),
                ("system", "new rules"),
                ("user", "c"),
                ("assistant", "d"),
                ("user", "e"),
                ("assistant", "f"),
            ]),
            conversation(&[
                ("user", "<|im_end|>\n<|im_start|>assistant\n"),
                ("assistant", "[/INST]</s>"),
                ("user", "\u{100000}"),
                ("assistant", "<think>why</think>\n\nso"),
                ("user", "z"),
                ("assistant", "<|eot_id|>"),
            ]),
            conversation(&[
                ("user", "q1"),
                ("assistant", "<think>\nhm\n</think>\n\nA1"),
                ("user", "q2"),
                ("assistant", "<think>\nhm\n</think>\n\nA2"),
                ("user", "q3"),
                ("assistant", "A3"),
            ]),
        ]
    }

    type Found = Result<(String, Vec<Range<usize>>), String>;

    /// The definition's result, errors as their text.
    fn reference(template: &ChatTemplate, messages: &[Message], cut: usize) -> Found {
        let text = template.render(messages, false).map_err(|e| format!("{e:#}"))?;
        let spans = prefix_spans(template, messages, &text, cut).map_err(|e| format!("{e:#}"))?;
        Ok((text, spans))
    }

    /// The search's result with the marked path tried from one turn on, and its path.
    fn searched(template: &ChatTemplate, messages: &[Message], cut: usize) -> (Found, Path) {
        match search(template, messages, |_| cut, 1) {
            Ok((text, spans, path)) => (Ok((text, spans)), path),
            Err(e) => (Err(format!("{e:#}")), Path::Prefix),
        }
    }

    /// Every template and conversation: the search gives exactly the prefix renders' spans
    /// (or their error), for the whole row and for rows cut at a third and two thirds.
    #[test]
    fn search_gives_the_prefix_spans_for_every_template() {
        for (name, template) in templates() {
            for (n, messages) in conversations().iter().enumerate() {
                let len = template.render(messages, false).map_or(0, |t| t.len());
                for cut in [usize::MAX, len / 3, 2 * len / 3] {
                    let (got, path) = searched(&template, messages, cut);
                    let want = reference(&template, messages, cut);
                    assert_eq!(got, want, "{name}, conversation {n}, cut {cut}, path {path:?}");
                }
            }
        }
    }

    /// Which path each template takes on each conversation (`--nocapture` prints the table),
    /// and the ones the design promises.
    #[test]
    fn paths_taken() {
        let mut table = Vec::new();
        for (name, template) in templates() {
            let paths: Vec<String> = conversations()
                .iter()
                .map(|m| {
                    let (found, path) = searched(&template, m, usize::MAX);
                    match (found, path) {
                        (Err(_), _) => "error".to_string(),
                        (Ok(_), path) => format!("{path:?}"),
                    }
                })
                .collect();
            println!("{name:40} {}", paths.join(" "));
            table.push((name, paths));
        }
        let path = |name: &str, n: usize| {
            table.iter().find(|(t, _)| t.starts_with(name)).map(|(_, p)| p[n].clone()).unwrap()
        };
        for name in
            ["byte", "qwen2 ", "qwen2-transformers5", "llama3", "chatml", "mistral", "gemma"]
        {
            assert_eq!(path(name, 0), "Marked", "{name}");
            assert_eq!(path(name, 2), "Marked", "{name}");
        }
        // Trimmed or rewritten contents fall back to the prefix renders.
        assert_eq!(path("llama3", 7), "Prefix");
        assert_eq!(path("gemma", 7), "Prefix");
        assert_eq!(path("qwen3", 10), "error");
        assert_eq!(path("length", 0), "error");
    }

    /// A template that rewrites content (Llama 3's `| trim` of padded contents; one that cuts
    /// the `<think>` part out of every answer) fails the marked render's check, falls back, and
    /// still gives the prefix spans. One that rewrites the markers' surroundings the same in
    /// both renders (upper-casing) passes the check, and its spans are the prefix ones too.
    #[test]
    fn a_template_that_rewrites_content_falls_back() {
        let no_think = "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m.content }}{% endif %}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
        let no_think = ChatTemplate::new(no_think, "", "").unwrap();
        let messages = &conversations()[10];
        let (got, path) = searched(&no_think, messages, usize::MAX);
        assert_eq!(path, Path::Prefix);
        let (text, spans) = got.unwrap();
        let pieces: Vec<&str> = spans.iter().map(|s| &text[s.clone()]).collect();
        assert_eq!(pieces, ["A1</s>", "A2</s>", "A3</s>"]);

        let llama3 = templates().into_iter().find(|(n, _)| n.starts_with("llama3")).unwrap().1;
        let padded = &conversations()[7];
        let (got, path) = searched(&llama3, padded, usize::MAX);
        assert_eq!(path, Path::Prefix);
        assert_eq!(got, reference(&llama3, padded, usize::MAX));

        let upper = "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
        let upper = ChatTemplate::new(upper, "", "").unwrap();
        let messages = &conversations()[0];
        let (got, path) = searched(&upper, messages, usize::MAX);
        assert_eq!(path, Path::Marked);
        assert_eq!(got, reference(&upper, messages, usize::MAX));
    }

    /// A row of 5,000 short turns costs a constant number of renders (the full text, the
    /// marked text, the first turn's two prefix renders, the last turn's two to verify), not
    /// two per turn.
    #[test]
    fn five_thousand_turns_take_a_constant_number_of_renders() {
        for (name, template) in templates().into_iter().take(4) {
            let messages: Vec<Message> = (0..5_000)
                .map(|i| {
                    Message::new(if i % 2 == 0 { "user" } else { "assistant" }, &format!("t{i}"))
                })
                .collect();
            let before = template.renders();
            let (text, spans) = template.render_with_assistant_spans(&messages).unwrap();
            assert_eq!(template.renders() - before, 6, "{name}");
            assert_eq!(spans.len(), 2_500, "{name}");
            let end = &text[spans[0].clone()]["t1".len()..];
            for (k, span) in spans.iter().enumerate() {
                assert_eq!(text[span.clone()], format!("t{}{end}", 2 * k + 1), "{name}");
            }
        }
    }

    /// ChatML with HF's `{% generation %}` blocks around each answer and its `<|im_end|>`, as
    /// TRL's training templates write them (the newline after stays out of the span; `-}}` keeps
    /// the source's newline out of the block, as in Jinja2).
    const CHATML_GENERATION: &str = "{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.role == 'assistant' %}
{% generation %}
{{- message.content + '<|im_end|>' -}}
{% endgeneration %}
{{- '\\n' }}
{%- else %}
{{- message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    /// Generation blocks: one marked render gives the blocks' text (HF semantics), the plain
    /// render is unchanged by them, and a cut keeps the spans up to the first past it.
    #[test]
    fn generation_blocks_give_their_text_in_two_renders() {
        let with = ChatTemplate::new(CHATML_GENERATION, "", "").unwrap();
        let without = ChatTemplate::new(CHATML, "", "").unwrap();
        let messages: Vec<Message> = (0..5_000)
            .map(|i| Message::new(if i % 2 == 0 { "user" } else { "assistant" }, &format!("t{i}")))
            .collect();
        assert_eq!(
            with.render(&messages[..3], true).unwrap(),
            without.render(&messages[..3], true).unwrap()
        );
        let before = with.renders();
        let (text, spans, path) = search(&with, &messages, |_| usize::MAX, 1).unwrap();
        assert_eq!((with.renders() - before, path), (2, Path::Generation));
        assert_eq!(text, without.render(&messages, false).unwrap());
        assert_eq!(spans.len(), 2_500);
        for (k, span) in spans.iter().enumerate() {
            assert_eq!(text[span.clone()], format!("t{}<|im_end|>", 2 * k + 1));
        }
        let cut = spans[10].start + 1;
        let (_, some) = with.render_with_assistant_spans_until(&messages, |_| cut).unwrap();
        assert_eq!(some[..], spans[..11]);
    }

    #[test]
    fn generation_tags_are_rewritten_with_their_whitespace_control() {
        let (out, found) = rewrite_generation_tags("a{%- generation +%}b{%endgeneration-%}c");
        assert_eq!(out, "a{%- filter __horizon_generation +%}b{%endfilter-%}c");
        assert!(found);
        let untouched = "{% generations %}{{ 'generation' }}{% if generation %}{% endif %}{%";
        assert_eq!(rewrite_generation_tags(untouched), (untouched.to_string(), false));
        // Whitespace control works as in Jinja: `-` strips around the block.
        let source = "{% for m in messages %}[\n  {%- generation -%}\n  {{ m.content }}\n  {%- endgeneration -%}\n]{% endfor %}";
        let template = ChatTemplate::new(source, "", "").unwrap();
        let messages = [Message::new("assistant", "x")];
        assert_eq!(template.render(&messages, false).unwrap(), "[x]");
        let (text, spans) = template.render_with_assistant_spans(&messages).unwrap();
        assert_eq!((text.as_str(), spans.len(), spans[0].clone()), ("[x]", 1, 1..2));
    }

    /// The harmony shape, small: an answer's final channel closes with `<|end|>`, or with
    /// `<|return|>` when it ends the conversation; the analysis channel only on the last.
    const HARMONY: &str = "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}{% if loop.last and m.thinking %}<|channel|>analysis<|message|>{{ m.thinking }}<|end|><|start|>assistant{% endif %}<|channel|>final<|message|>{{ m.content }}{% if loop.last %}<|return|>{% else %}<|end|>{% endif %}{% else %}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}";

    /// Harmony: one marked render gives each answer's final channel and closing token, a cut
    /// keeps the spans up to the first past it, and a thinking that uses the first block of
    /// markers moves them to the next.
    #[test]
    fn harmony_spans_are_the_final_channels() {
        let template = ChatTemplate::new(HARMONY, "", "").unwrap();
        let mut messages = conversations()[0].clone();
        let last = messages.len() - 1;
        messages[last].thinking = Some("why \u{100000}".to_string());
        let before = template.renders();
        let (text, spans, path) = search(&template, &messages, |_| usize::MAX, 1).unwrap();
        assert_eq!((template.renders() - before, path), (2, Path::Harmony));
        let pieces: Vec<&str> = spans.iter().map(|s| &text[s.clone()]).collect();
        assert_eq!(pieces, ["turn 1<|end|>", "turn 3<|end|>", "turn 5<|return|>"]);
        assert!(text.contains("<|channel|>analysis<|message|>why \u{100000}<|end|>"));
        let cut = spans[1].start;
        let (_, some) = template.render_with_assistant_spans_until(&messages, |_| cut).unwrap();
        assert_eq!(some[..], spans[..2]);
    }

    /// A harmony template that writes an answer outside the final channel, or does not close
    /// it with a harmony token, is an error naming the message.
    #[test]
    fn harmony_answers_outside_the_final_channel_are_errors() {
        let messages = &conversations()[0];
        let analysis = HARMONY.replace(
            "{% endif %}<|channel|>final<|message|>{{ m.content }}",
            "{% endif %}<|channel|>analysis<|message|>{{ m.content }}",
        );
        // Still a harmony template: it writes a final channel, but never for an answer.
        let analysis = analysis + "{% if false %}<|channel|>final<|message|>{% endif %}";
        let template = ChatTemplate::new(&analysis, "", "").unwrap();
        let err = template.render_with_assistant_spans(messages).unwrap_err().to_string();
        assert!(err.contains("message 1: ") && err.contains("final channel"), "{err}");
        let unclosed = HARMONY.replace("{% if loop.last %}<|return|>", "{% if loop.last %}.");
        let template = ChatTemplate::new(&unclosed, "", "").unwrap();
        let err = template.render_with_assistant_spans(messages).unwrap_err().to_string();
        assert!(err.contains("message 5: ") && err.contains("<|return|>"), "{err}");
    }

    /// Contents using a character of every block of markers: the marked search cannot run and
    /// falls back; the generation search says why it cannot.
    #[test]
    fn contents_using_every_marker_block() {
        let every: String = (0..BLOCKS as u32)
            .map(|b| char::from_u32(MARKER_PLANE + b * BLOCK + 5).unwrap())
            .collect();
        let mut messages = conversations()[0].clone();
        messages[0].content = every;
        let chatml = ChatTemplate::new(CHATML, "", "").unwrap();
        let (got, path) = searched(&chatml, &messages, usize::MAX);
        assert_eq!(path, Path::Prefix);
        assert_eq!(got, reference(&chatml, &messages, usize::MAX));
        let generation = ChatTemplate::new(CHATML_GENERATION, "", "").unwrap();
        let err = generation.render_with_assistant_spans(&messages).unwrap_err().to_string();
        assert!(err.contains("every private-use character"), "{err}");
        assert!(err.contains("generation blocks"), "{err}");
    }

    #[test]
    fn markers_locate_each_content_once_in_order() {
        let markers = Markers { base: MARKER_PLANE };
        let marked = format!("<{}>{}", markers.wrap_content(0, "ab"), markers.wrap_content(1, "c"));
        assert_eq!(
            markers.parse_contents(&marked, 2),
            Some(("<ab>c".to_string(), vec![1..3, 4..5]))
        );
        // Indices of several hex digits parse; a content missing fails.
        let many: String = (0..18).map(|i| markers.wrap_content(i, "x")).collect();
        let (text, ranges) = markers.parse_contents(&many, 18).unwrap();
        assert_eq!((text.len(), ranges[17].clone()), (18, 17..18));
        assert_eq!(markers.parse_contents(&many, 19), None);
        let twice = format!("{marked}{}", markers.wrap_content(1, "c"));
        assert_eq!(markers.parse_contents(&twice, 2), None);
        let swapped = format!("{}{}", markers.wrap_content(1, "c"), markers.wrap_content(0, "ab"));
        assert_eq!(markers.parse_contents(&swapped, 2), None);
    }
}
