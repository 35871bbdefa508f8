//! Hugging Face tokenizers: `tokenizer.json` through the `tokenizers` crate, with the special
//! tokens and the chat template from `tokenizer_config.json` (or `chat_template.jinja`).

use std::ops::Range;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;

use super::Tokenizer;
use super::chat::ChatTemplate;

/// A special token: its text and id.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Special {
    text: String,
    id: u32,
}

/// The text of a special token, `""` when there is none (as HF templates see a missing token).
fn text_of(special: &Option<Special>) -> &str {
    special.as_ref().map_or("", |s| s.text.as_str())
}

/// A model directory's tokenizer.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// One past the largest id (added tokens included).
    vocab_size: usize,
    bos: Option<Special>,
    eos: Option<Special>,
    pad: Option<Special>,
    add_bos_token: bool,
    /// `(add BOS, add EOS)` when `transformers` 5 rebuilds the post-processor from the config
    /// (it sets `add_bos_token` or `add_eos_token`, or `tokenizer.json` has no post-processor);
    /// `None`: `tokenizer.json`'s post-processor adds the special tokens.
    rebuilt_specials: Option<(bool, bool)>,
    chat: Option<ChatTemplate>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("pad", &self.pad)
            .field("add_bos_token", &self.add_bos_token)
            .field("rebuilt_specials", &self.rebuilt_specials)
            .field("chat", &self.chat)
            .finish_non_exhaustive()
    }
}

/// The fields of `tokenizer_config.json` that Horizon reads (the file has many more).
#[derive(Debug, Default, Deserialize)]
struct RawTokenizerConfig {
    #[serde(default)]
    bos_token: Option<RawToken>,
    #[serde(default)]
    eos_token: Option<RawToken>,
    #[serde(default)]
    pad_token: Option<RawToken>,
    #[serde(default)]
    chat_template: Option<RawChatTemplate>,
    #[serde(default)]
    add_bos_token: Option<bool>,
    #[serde(default)]
    add_eos_token: Option<bool>,
}

/// A special token as `tokenizer_config.json` writes it: a string, or an `AddedToken` object.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawToken {
    Text(String),
    Added { content: String },
}

impl RawToken {
    fn content(&self) -> &str {
        match self {
            RawToken::Text(s) | RawToken::Added { content: s } => s,
        }
    }
}

/// `chat_template`: one template, or a list of named ones (`default`, `tool_use`, ...).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawChatTemplate {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Debug, Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

impl RawTokenizerConfig {
    /// The chat template to use: the one, or the one named `default`.
    fn chat_template(&self, file: &Path) -> Result<Option<&str>> {
        match &self.chat_template {
            None => Ok(None),
            Some(RawChatTemplate::One(source)) => Ok(Some(source)),
            Some(RawChatTemplate::Named(list)) => match list.iter().find(|t| t.name == "default") {
                Some(t) => Ok(Some(&t.template)),
                None => bail!(
                    "{}: chat_template lists templates named {:?} but none named \"default\"",
                    file.display(),
                    list.iter().map(|t| t.name.as_str()).collect::<Vec<_>>()
                ),
            },
        }
    }
}

impl HfTokenizer {
    /// Loads `dir/tokenizer.json`, and if present `dir/tokenizer_config.json` (special tokens,
    /// `add_bos_token`, chat template) and `dir/chat_template.jinja` (which, as in `transformers`,
    /// takes precedence over the config's `chat_template`).
    pub fn from_dir(dir: &Path) -> Result<HfTokenizer> {
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            bail!(
                "{}: not found (a Hugging Face model directory has its tokenizer in tokenizer.json)",
                file.display()
            );
        }
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| anyhow!("{}: not a valid tokenizer: {e}", file.display()))?;

        let config_file = dir.join("tokenizer_config.json");
        let config: RawTokenizerConfig = if config_file.is_file() {
            let text = std::fs::read_to_string(&config_file)
                .with_context(|| format!("reading {}", config_file.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("parsing {}", config_file.display()))?
        } else {
            RawTokenizerConfig::default()
        };
        let special = |key: &str, raw: &Option<RawToken>| -> Result<Option<Special>> {
            let Some(raw) = raw else { return Ok(None) };
            let text = raw.content().to_string();
            let id = inner.token_to_id(&text).with_context(|| {
                format!(
                    "{}: {key} {text:?} is not a token of {}",
                    config_file.display(),
                    file.display()
                )
            })?;
            Ok(Some(Special { text, id }))
        };
        let bos = special("bos_token", &config.bos_token)?;
        let eos = special("eos_token", &config.eos_token)?;
        let pad = special("pad_token", &config.pad_token)?;

        // Without `add_bos_token` in the config, the tokenizer's post-processor decides, as for
        // `transformers`' fast tokenizers: does encoding with special tokens start with BOS?
        let add_bos_token = match (config.add_bos_token, &bos) {
            (Some(add), _) => add,
            (None, None) => false,
            (None, Some(bos)) => {
                let encoding = inner
                    .encode("", true)
                    .map_err(|e| anyhow!("{}: encoding \"\": {e}", file.display()))?;
                encoding.get_ids().first() == Some(&bos.id)
            }
        };

        // transformers 5 (`TokenizersBackend.__init__`) replaces the post-processor with
        // `[BOS] $A [EOS]` per `add_bos_token` / `add_eos_token` (each default false) when the
        // config names either, or when tokenizer.json has none.
        let rebuild = config.add_bos_token.is_some()
            || config.add_eos_token.is_some()
            || inner.get_post_processor().is_none();
        let rebuilt_specials = rebuild
            .then(|| (config.add_bos_token == Some(true), config.add_eos_token == Some(true)));

        let jinja_file = dir.join("chat_template.jinja");
        let source = if jinja_file.is_file() {
            let source = std::fs::read_to_string(&jinja_file)
                .with_context(|| format!("reading {}", jinja_file.display()))?;
            Some((source, jinja_file))
        } else {
            config.chat_template(&config_file)?.map(|s| (s.to_string(), config_file.clone()))
        };
        let chat = match source {
            None => None,
            Some((source, from)) => {
                let template = ChatTemplate::new(&source, text_of(&bos), text_of(&eos))
                    .with_context(|| format!("{}: chat_template", from.display()))?;
                Some(template)
            }
        };

        let vocab_size = inner.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1);
        Ok(HfTokenizer { inner, vocab_size, bos, eos, pad, add_bos_token, rebuilt_specials, chat })
    }

    /// The chat template's Jinja source, if the model ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat.as_ref().map(ChatTemplate::source)
    }

    /// The BOS token's text (`""` when the model has none), as templates see it.
    pub fn bos_token(&self) -> &str {
        text_of(&self.bos)
    }

    /// The EOS token's text (`""` when the model has none), as templates see it.
    pub fn eos_token(&self) -> &str {
        text_of(&self.eos)
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding =
            self.inner.encode_fast(text, false).map_err(|e| anyhow!("encoding text: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }

    fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>> {
        let Some((add_bos, add_eos)) = self.rebuilt_specials else {
            let encoding =
                self.inner.encode_fast(text, true).map_err(|e| anyhow!("encoding text: {e}"))?;
            return Ok(encoding.get_ids().to_vec());
        };
        let bos = self.bos_id().filter(|_| add_bos);
        let eos = self.eos_id().filter(|_| add_eos);
        Ok(bos.into_iter().chain(self.encode(text)?).chain(eos).collect())
    }

    fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<Range<usize>>)> {
        // `encode` (not `encode_char_offsets`) reports byte offsets into `text`.
        let encoding = self.inner.encode(text, false).map_err(|e| anyhow!("encoding text: {e}"))?;
        let offsets = encoding.get_offsets().iter().map(|&(start, end)| start..end).collect();
        Ok((encoding.get_ids().to_vec(), offsets))
    }

    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| anyhow!("decoding token ids: {e}"))
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn bos_id(&self) -> Option<u32> {
        self.bos.as_ref().map(|s| s.id)
    }

    fn eos_id(&self) -> Option<u32> {
        self.eos.as_ref().map(|s| s.id)
    }

    fn pad_id(&self) -> Option<u32> {
        self.pad.as_ref().map(|s| s.id)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn add_bos_token(&self) -> bool {
        self.add_bos_token
    }

    fn chat(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_special_tokens_are_strings_objects_or_null() {
        let config: RawTokenizerConfig = serde_json::from_str(
            r#"{"bos_token": null, "eos_token": {"content": "</s>", "lstrip": false},
                "pad_token": "<pad>", "model_max_length": 4096}"#,
        )
        .unwrap();
        assert!(config.bos_token.is_none());
        assert_eq!(config.eos_token.unwrap().content(), "</s>");
        assert_eq!(config.pad_token.unwrap().content(), "<pad>");
    }

    #[test]
    fn config_named_chat_templates_use_default() {
        let config: RawTokenizerConfig = serde_json::from_str(
            r#"{"chat_template": [{"name": "tool_use", "template": "T"},
                                  {"name": "default", "template": "D"}]}"#,
        )
        .unwrap();
        assert_eq!(config.chat_template(Path::new("c.json")).unwrap(), Some("D"));

        let config: RawTokenizerConfig =
            serde_json::from_str(r#"{"chat_template": [{"name": "rag", "template": "R"}]}"#)
                .unwrap();
        let err = config.chat_template(Path::new("c.json")).unwrap_err().to_string();
        assert!(err.contains("c.json") && err.contains("\"default\""), "{err}");
    }
}
