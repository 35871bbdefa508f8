//! Chat templates: render a conversation to text the way Hugging Face `apply_chat_template` does
//! (Jinja through `minijinja`), and find the byte ranges of the assistant turns for loss masks.
//!
//! HF conventions kept here: the variables `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token`; the `raise_exception(msg)` and `strftime_now(format)` functions; a `tojson` filter
//! that writes JSON as Python's `json.dumps(ensure_ascii=False)` does; `trim_blocks` and
//! `lstrip_blocks` on; and the Python string and dict methods templates commonly call (`strip`,
//! `startswith`, `split`, `items`, ...). A message is a map with `role`, `content` and, where the
//! data has it, `thinking` (the reasoning before the answer, as gpt-oss's harmony template reads
//! it: its analysis channel).

mod spans;
mod strftime;

use std::fmt::Write as _;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Result, bail};
use minijinja::value::{Kwargs, Value, ValueKind, from_args};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State};
use serde::Deserialize;

/// Name of the one template in a [`ChatTemplate`]'s environment; error messages show it.
const NAME: &str = "chat_template";

/// The filter that HF's `{% generation %}` blocks become (minijinja has no custom tags): a
/// `{% filter %}` block is a block tag as `generation` is, so whitespace control is unchanged.
/// It returns its body as is, or wrapped in markers when the span search renders.
const GENERATION_FILTER: &str = "__horizon_generation";

/// What a render wraps in marker characters (see [`spans`]).
#[derive(Clone, Copy)]
enum Marking<'a> {
    Plain,
    /// Each message's content, with its index.
    Contents(&'a spans::Markers),
    /// Each assistant message's content, with its index (the other messages as they are).
    AssistantContents(&'a spans::Markers),
    /// The text of each `{% generation %}` block.
    Generation(&'a spans::Markers),
}

/// The roles a message may have (`developer` is the harmony format's instructions, `tool` a
/// tool's answer; a template that has no place for a role says so through `raise_exception`).
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// One turn of a conversation, as in the OpenAI / HF `messages` format.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// One of [`ROLES`].
    pub role: String,
    /// The text of the turn (for gpt-oss's harmony template, an answer's final channel).
    pub content: String,
    /// The reasoning before an answer, given to the template as `thinking` when present (HF's
    /// name; gpt-oss's template writes it in the analysis channel of the conversation's last
    /// answer and drops it from earlier ones). Templates that do not read it ignore it.
    #[serde(default)]
    pub thinking: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.to_string(), content: content.to_string(), thinking: None }
    }

    /// This message with `thinking` (the reasoning before the answer).
    pub fn with_thinking(mut self, thinking: &str) -> Self {
        self.thinking = Some(thinking.to_string());
        self
    }
}

/// A compiled chat template with the special-token strings it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    /// Whether the source has `{% generation %}` blocks (rewritten to [`GENERATION_FILTER`]).
    generation: bool,
    /// Whether the template writes the harmony format (gpt-oss): answers in a final channel
    /// (see [`spans`] for their loss spans).
    harmony: bool,
    /// The time `strftime_now` formats; `None`: the clock's, as HF's `datetime.now()`.
    now: Option<i64>,
    /// Renders run so far (tests check the span search runs a constant number).
    renders: AtomicUsize,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source` (Jinja). A syntax error names the line and shows it.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("default delimiters are valid");
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |format: &str| strftime::format(format, now_seconds()));
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(python_method);
        env.add_filter(GENERATION_FILTER, |body: String| Value::from_safe_string(body));
        let (compiled, generation) = spans::rewrite_generation_tags(source);
        if let Err(err) = env.add_template_owned(NAME, compiled) {
            let what = match err.detail() {
                Some(detail) => format!("{}: {detail}", err.kind()),
                None => err.kind().to_string(),
            };
            let line = err.line().and_then(|n| Some((n, source.lines().nth(n.checked_sub(1)?)?)));
            match line {
                Some((n, text)) => {
                    bail!("chat template does not compile: {what}, at line {n}:\n  | {text}")
                }
                None => bail!("chat template does not compile: {what}"),
            }
        }
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            generation,
            harmony: source.contains(spans::HARMONY_FINAL),
            now: None,
            renders: AtomicUsize::new(0),
        })
    }

    /// This template with `strftime_now` formatting `seconds` since the Unix epoch (UTC)
    /// instead of the clock's time: renders that do not change with the day (tests, and data
    /// that must tokenize the same whenever it is loaded). gpt-oss's template writes the date
    /// in its system message.
    pub fn with_fixed_now(mut self, seconds: i64) -> Self {
        self.now = Some(seconds);
        self
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The conversation as text. With `add_generation_prompt`, ends with the header that opens an
    /// assistant turn (what a model is given before it generates).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_marked(messages, add_generation_prompt, Marking::Plain)
    }

    /// [`ChatTemplate::render`], with the contents or the generation blocks wrapped in marker
    /// characters when `marking` says so (for the span search). The instruction budget is that
    /// of the plain conversation.
    fn render_marked(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        marking: Marking,
    ) -> Result<String> {
        self.renders.fetch_add(1, Ordering::Relaxed);
        for (i, message) in messages.iter().enumerate() {
            if !ROLES.contains(&message.role.as_str()) {
                bail!("message {i}: role '{}' is not one of {}", message.role, ROLES.join(", "));
            }
        }
        let count = messages.len();
        let size: usize = count
            + messages
                .iter()
                .map(|m| (m.content.len() + m.thinking.as_ref().map_or(0, String::len)) / 64)
                .sum::<usize>();
        let messages: Vec<Value> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let content = match marking {
                    Marking::Contents(markers) => Value::from(markers.wrap_content(i, &m.content)),
                    Marking::AssistantContents(markers) if m.role == "assistant" => {
                        Value::from(markers.wrap_content(i, &m.content))
                    }
                    _ => Value::from(m.content.as_str()),
                };
                let mut pairs = vec![("role", Value::from(m.role.as_str())), ("content", content)];
                // Only when present: templates test `"thinking" in message`.
                if let Some(thinking) = &m.thinking {
                    pairs.push(("thinking", Value::from(thinking.as_str())));
                }
                Value::from_pairs(pairs)
            })
            .collect();
        let ctx = Value::from_pairs([
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
        ]);
        // A budget of template instructions scaled by the conversation, so that a template
        // that loops without end (or a row of absurd size) stops with an error.
        let budget = FUEL_BASE + FUEL_PER_MESSAGE * size as u64;
        let mut env = self.env.clone();
        env.set_fuel(Some(budget));
        if let Some(seconds) = self.now {
            env.add_function("strftime_now", move |format: &str| strftime::format(format, seconds));
        }
        if let Marking::Generation(markers) = marking {
            let (open, close) = markers.generation();
            env.add_filter(GENERATION_FILTER, move |body: String| {
                Value::from_safe_string(format!("{open}{body}{close}"))
            });
        }
        let template = env.get_template(NAME).expect("added in new");
        template.render(ctx).map_err(|err| match err.kind() {
            ErrorKind::OutOfFuel => anyhow::anyhow!(
                "rendering chat template: it ran past its instruction budget ({budget} for {} \
                 messages): a template that loops without end, or a conversation too large",
                count
            ),
            _ => anyhow::anyhow!("rendering chat template: {err}"),
        })
    }

    /// How many renders this template has run (the span search's tests count them).
    #[cfg(test)]
    fn renders(&self) -> usize {
        self.renders.load(Ordering::Relaxed)
    }

    /// The rendered conversation and the byte ranges of the text that belongs to assistant turns
    /// (the content the model must learn to produce, plus the turn's end marker/EOS that the
    /// template emits after it). By definition, for assistant message i,
    /// `render(messages[..i], add_generation_prompt=true)` gives the prompt prefix and
    /// `render(messages[..=i], false)` the text through the end of that turn; the assistant span
    /// is the difference. Errors if a prefix render is not a prefix of the full render (the
    /// template is not prefix-stable), naming the message index.
    ///
    /// A template with `{% generation %}` blocks (as `transformers`' `return_assistant_tokens_mask`
    /// and TRL's `assistant_only_loss` read them) gives instead the text of those blocks. Either
    /// way the work is a constant number of renders (`chat/spans.rs` says how, and when it falls
    /// back to rendering every prefix).
    pub fn render_with_assistant_spans(
        &self,
        messages: &[Message],
    ) -> Result<(String, Vec<Range<usize>>)> {
        self.render_with_assistant_spans_until(messages, |_| usize::MAX)
    }

    /// [`ChatTemplate::render_with_assistant_spans`], searching spans only until one ends at or
    /// past byte `cut(text)` of the rendered text (where a row is cut to `max_seq_len` tokens:
    /// later spans are never kept). `cut` is called once, with the rendered text.
    pub fn render_with_assistant_spans_until(
        &self,
        messages: &[Message],
        cut: impl FnOnce(&str) -> usize,
    ) -> Result<(String, Vec<Range<usize>>)> {
        let (text, spans, _) = spans::search(self, messages, cut, spans::MARKED_MIN_TURNS)?;
        Ok((text, spans))
    }
}

/// Template instructions a render may run: a base, and so many per message (and per 64 bytes
/// of content). HF's templates take tens to hundreds per message.
const FUEL_BASE: u64 = 1_000_000;
const FUEL_PER_MESSAGE: u64 = 20_000;

/// Seconds since the Unix epoch now (0 if the clock is before it).
fn now_seconds() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| d.as_secs() as i64)
}

/// `raise_exception(msg)`: the template rejects its input (HF's helper).
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("template raised: {msg}")))
}

/// `value | tojson(indent=None)` as HF's: `json.dumps(value, ensure_ascii=False, indent=indent)`.
/// (minijinja's own `tojson` escapes `<`, `>`, `&` and `'` for HTML, which changes the text.)
fn tojson(value: &Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(indent) => Some(indent),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    indent: Option<usize>,
    level: usize,
) -> Result<(), Error> {
    // Python's separators: ", " and ": " inline; "," and ": " with newlines when indenting.
    let open = |out: &mut String, bracket: char, depth: usize| {
        out.push(bracket);
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    let sep = |out: &mut String, depth: usize| match indent {
        Some(width) => {
            out.push_str(",\n");
            out.push_str(&" ".repeat(width * depth));
        }
        None => out.push_str(", "),
    };
    let close = |out: &mut String, bracket: char, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
        out.push(bracket);
    };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => match value.as_i64() {
            Some(n) if value.is_integer() => write!(out, "{n}").expect("String write"),
            _ => write!(out, "{:?}", f64::try_from(value.clone())?).expect("String write"),
        },
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            open(out, '{', level + 1);
            for (n, key) in keys.iter().enumerate() {
                if n > 0 {
                    sep(out, level + 1);
                }
                write_json_string(out, &key.to_string());
                out.push_str(": ");
                write_json(out, &value.get_item(key)?, indent, level + 1)?;
            }
            close(out, '}', level);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            open(out, '[', level + 1);
            for (n, item) in items.iter().enumerate() {
                if n > 0 {
                    sep(out, level + 1);
                }
                write_json(out, item, indent, level + 1)?;
            }
            close(out, ']', level);
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a value of kind {kind}"),
            ));
        }
    }
    Ok(())
}

/// A JSON string literal with non-ASCII kept as is (Python's `ensure_ascii=False`).
fn write_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => write!(out, "\\u{:04x}", c as u32).expect("String write"),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The Python `str` and `dict` methods that HF chat templates call (Jinja2 runs them natively).
fn python_method(
    _: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let strip_set = |chars: Option<&str>| -> Vec<char> {
            chars.map(|c| c.chars().collect()).unwrap_or_default()
        };
        let trimmed = |s: &str, chars: Option<&str>, start: bool, end: bool| -> String {
            let set = strip_set(chars);
            let pat = |c: char| if chars.is_some() { set.contains(&c) } else { c.is_whitespace() };
            let s = if start { s.trim_start_matches(pat) } else { s };
            let s = if end { s.trim_end_matches(pat) } else { s };
            s.to_string()
        };
        return Ok(match method {
            "strip" => Value::from(trimmed(s, from_args::<(Option<&str>,)>(args)?.0, true, true)),
            "lstrip" => Value::from(trimmed(s, from_args::<(Option<&str>,)>(args)?.0, true, false)),
            "rstrip" => Value::from(trimmed(s, from_args::<(Option<&str>,)>(args)?.0, false, true)),
            "startswith" => Value::from(s.starts_with(from_args::<(&str,)>(args)?.0)),
            "endswith" => Value::from(s.ends_with(from_args::<(&str,)>(args)?.0)),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "replace" => {
                let (old, new): (&str, &str) = from_args(args)?;
                Value::from(s.replace(old, new))
            }
            "split" => {
                let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
                let limit = maxsplit.filter(|&n| n >= 0).map(|n| n as usize + 1);
                let parts: Vec<Value> = match (sep, limit) {
                    (Some(sep), Some(limit)) => s.splitn(limit, sep).map(Value::from).collect(),
                    (Some(sep), None) => s.split(sep).map(Value::from).collect(),
                    (None, _) => s.split_whitespace().map(Value::from).collect(),
                };
                Value::from(parts)
            }
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        });
    }
    if value.kind() == ValueKind::Map {
        let keys = || -> Result<Vec<Value>, Error> { Ok(value.try_iter()?.collect()) };
        return Ok(match method {
            "keys" => {
                from_args::<()>(args)?;
                Value::from(keys()?)
            }
            "values" => {
                from_args::<()>(args)?;
                let values: Result<Vec<Value>, Error> =
                    keys()?.iter().map(|k| value.get_item(k)).collect();
                Value::from(values?)
            }
            "items" => {
                from_args::<()>(args)?;
                let items: Result<Vec<Value>, Error> = keys()?
                    .into_iter()
                    .map(|k| Ok(Value::from(vec![k.clone(), value.get_item(&k)?])))
                    .collect();
                Value::from(items?)
            }
            "get" => {
                let (key, default): (Value, Option<Value>) = from_args(args)?;
                match value.get_item(&key)? {
                    v if v.is_undefined() => default.unwrap_or(Value::from(())),
                    v => v,
                }
            }
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        });
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_one(source: &str) -> String {
        let template = ChatTemplate::new(source, "<s>", "</s>").unwrap();
        template.render(&[Message::new("user", "  Hi there  ")], false).unwrap()
    }

    #[test]
    fn python_string_methods() {
        let got = render_one(
            "{% for m in messages %}[{{ m.content.strip() }}|{{ m.content.lstrip() }}|\
             {{ m.content.strip(' H') }}|{{ m.content.strip().startswith('Hi') }}|\
             {{ m.content.split() | join(',') }}|{{ m.content.replace('Hi', 'Yo') }}|\
             {{ m.content.upper() }}]{% endfor %}",
        );
        assert_eq!(got, "[Hi there|Hi there  |i there|True|Hi,there|  Yo there  |  HI THERE  ]");
    }

    #[test]
    fn python_dict_methods() {
        let got = render_one(
            "{% for m in messages %}{% for k, v in m.items() %}{{ k }}={{ v | trim }};{% endfor %}\
             {{ m.get('name', 'anon') }}{% endfor %}",
        );
        assert_eq!(got, "role=user;content=Hi there;anon");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let got = render_one(
            "{{ {'a': [1, 2.5, none, true], 'b': '<é\"\n>'} | tojson }}\n\
             {{ {'a': [1]} | tojson(indent=2) }}",
        );
        assert_eq!(
            got,
            "{\"a\": [1, 2.5, null, true], \"b\": \"<é\\\"\\n>\"}\n{\n  \"a\": [\n    1\n  ]\n}"
        );
    }

    #[test]
    fn raise_exception_surfaces_the_message() {
        let template =
            ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = template.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("roles must alternate"), "{err}");
    }

    #[test]
    fn strftime_now_formats_the_fixed_or_the_current_time() {
        let source = "{{ strftime_now('%Y-%m-%d %H:%M') }}";
        let fixed = ChatTemplate::new(source, "", "").unwrap().with_fixed_now(1_754_413_449);
        assert_eq!(fixed.render(&[], false).unwrap(), "2025-08-05 17:04");
        let now = ChatTemplate::new(source, "", "").unwrap().render(&[], false).unwrap();
        assert!(now.len() == 16 && now.as_str() > "2025", "{now}");
        let bad = ChatTemplate::new("{{ strftime_now('%Q') }}", "", "").unwrap();
        let err = format!("{:#}", bad.render(&[], false).unwrap_err());
        assert!(err.contains("%Q is not a directive"), "{err}");
    }

    /// `thinking` is in a message's map only when it has one (templates test
    /// `"thinking" in message`); `developer` and `tool` are roles a template may take.
    #[test]
    fn thinking_only_when_given_and_every_role() {
        let template = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}:{{ 'thinking' in m }}:{{ m.thinking }};{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let messages = [
            Message::new("developer", "d"),
            Message::new("user", "u"),
            Message::new("assistant", "a").with_thinking("hm"),
            Message::new("tool", "t"),
        ];
        assert_eq!(
            template.render(&messages, false).unwrap(),
            "developer:False:;user:False:;assistant:True:hm;tool:False:;"
        );
        let err = template.render(&[Message::new("bot", "x")], false).unwrap_err().to_string();
        assert!(err.contains("role 'bot' is not one of system, developer, user"), "{err}");
    }

    #[test]
    fn loop_controls_as_hf() {
        let got = render_one(
            "{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}",
        );
        assert_eq!(got, "1");
    }

    #[test]
    fn trim_blocks_and_lstrip_blocks_as_hf() {
        let got = render_one(
            "{% for m in messages %}\n    {% if true %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}\n",
        );
        assert_eq!(got, "user\n");
    }
}
