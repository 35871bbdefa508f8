//! The byte-level tokenizer for models trained from scratch: ids 0..=255 are the bytes of the UTF-8
//! text, then three special tokens. Ships a ChatML-like chat template so chat data works too.

use std::ops::Range;

use anyhow::Result;

use super::Tokenizer;
use super::chat::ChatTemplate;

/// Id of `<|bos|>`.
pub const BOS_ID: u32 = 256;
/// Id of `<|eos|>`.
pub const EOS_ID: u32 = 257;
/// Id of `<|pad|>`.
pub const PAD_ID: u32 = 258;
/// The special tokens, in id order from 256.
pub const SPECIALS: [&str; 3] = ["<|bos|>", "<|eos|>", "<|pad|>"];

/// ChatML-like: `<|bos|>` opens the conversation, `<|im_start|>{role}\n` opens a turn and `<|eos|>`
/// ends it (so a model stops generating after its turn). `<|im_start|>` is plain bytes.
pub const CHAT_TEMPLATE: &str = "{{- bos_token }}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
";

/// Bytes as tokens. Like a Hugging Face tokenizer, `encode` recognises the special-token strings
/// in the text (so a rendered chat template's `<|eos|>` becomes [`EOS_ID`]); every other byte is
/// its own id, so `decode(encode(s), false) == s` for every `s`.
#[derive(Debug)]
pub struct ByteTokenizer {
    chat: ChatTemplate,
}

impl Default for ByteTokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl ByteTokenizer {
    pub fn new() -> Self {
        let chat = ChatTemplate::new(CHAT_TEMPLATE, SPECIALS[0], SPECIALS[1])
            .expect("the built-in byte chat template compiles");
        Self { chat }
    }

    /// The built-in chat template ([`CHAT_TEMPLATE`]).
    pub fn chat_template(&self) -> &ChatTemplate {
        &self.chat
    }

    /// This tokenizer as Hugging Face files, `(tokenizer.json, tokenizer_config.json)`, so that
    /// an exported model carries it: a byte-level BPE without merges whose vocabulary lists the
    /// 256 bytes in id order (GPT-2's byte-to-character map), the specials as added tokens, and
    /// the chat template. `transformers` and [`super::HfTokenizer`] then give the same ids.
    pub fn hf_files() -> (serde_json::Value, serde_json::Value) {
        let vocab: serde_json::Map<String, serde_json::Value> =
            (0..=255u8).map(|b| (byte_char(b).to_string(), serde_json::Value::from(b))).collect();
        let added: Vec<serde_json::Value> = SPECIALS
            .iter()
            .zip(BOS_ID..)
            .map(|(s, id)| {
                serde_json::json!({"id": id, "content": s, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": false, "use_regex": false});
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": byte_level, "post_processor": null,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []}
        });
        let config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
            "eos_token": SPECIALS[1], "pad_token": SPECIALS[2], "add_bos_token": false,
            "clean_up_tokenization_spaces": false, "chat_template": CHAT_TEMPLATE
        });
        (tokenizer, config)
    }
}

/// GPT-2's printable character for byte `b` (`bytes_to_unicode`): printable Latin-1 bytes stand
/// for themselves, the others for 256, 257, ... in byte order.
fn byte_char(b: u8) -> char {
    let printable = |x: u8| (b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || x >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("256..324 are valid chars")
}

/// The special token starting at `bytes[0]`, if any: (id, length in bytes).
fn special_at(bytes: &[u8]) -> Option<(u32, usize)> {
    if bytes.first() != Some(&b'<') {
        return None;
    }
    SPECIALS
        .iter()
        .zip(BOS_ID..)
        .find(|(s, _)| bytes.starts_with(s.as_bytes()))
        .map(|(s, id)| (id, s.len()))
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode_with_offsets(text)?.0)
    }

    fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<Range<usize>>)> {
        let bytes = text.as_bytes();
        let mut ids = Vec::with_capacity(bytes.len());
        let mut offsets = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let (id, len) = special_at(&bytes[i..]).unwrap_or((u32::from(bytes[i]), 1));
            ids.push(id);
            offsets.push(i..i + len);
            i += len;
        }
        Ok((ids, offsets))
    }

    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match id {
                0..=255 => bytes.push(id as u8),
                BOS_ID..=PAD_ID if skip_special => {}
                BOS_ID..=PAD_ID => {
                    bytes.extend_from_slice(SPECIALS[(id - BOS_ID) as usize].as_bytes())
                }
                _ => anyhow::bail!(
                    "token id {id} is outside the byte tokenizer's vocabulary (0..{})",
                    self.vocab_size()
                ),
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn vocab_size(&self) -> usize {
        256 + SPECIALS.len()
    }

    fn bos_id(&self) -> Option<u32> {
        Some(BOS_ID)
    }

    fn eos_id(&self) -> Option<u32> {
        Some(EOS_ID)
    }

    fn pad_id(&self) -> Option<u32> {
        Some(PAD_ID)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(pos) = SPECIALS.iter().position(|s| *s == token) {
            return Some(BOS_ID + pos as u32);
        }
        match token.as_bytes() {
            [b] => Some(u32::from(*b)),
            _ => None,
        }
    }

    fn chat(&self) -> Option<&ChatTemplate> {
        Some(&self.chat)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specials_in_text_become_their_ids() {
        let tok = ByteTokenizer::new();
        let (ids, offsets) = tok.encode_with_offsets("a<|eos|><|x").unwrap();
        assert_eq!(ids, [97, EOS_ID, 60, 124, 120]);
        assert_eq!(offsets, [0..1, 1..8, 8..9, 9..10, 10..11]);
    }

    #[test]
    fn hf_files_give_the_same_ids() {
        let dir = tempfile::tempdir().unwrap();
        let (tok, cfg) = ByteTokenizer::hf_files();
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let hf = crate::tokenizer::HfTokenizer::from_dir(dir.path()).unwrap();
        let ours = ByteTokenizer::new();
        let all_bytes: String = (0..128u8).map(char::from).collect();
        for text in ["47+38=85<|eos|>", "héllo wörld ✓ 🙂\n\t", "<|bos|>a<|pad|>", &all_bytes]
        {
            let want = ours.encode(text).unwrap();
            assert_eq!(hf.encode(text).unwrap(), want, "{text:?}");
            assert_eq!(hf.decode(&want, false).unwrap(), text);
        }
        assert_eq!(hf.eos_id(), Some(EOS_ID));
        assert_eq!(hf.vocab_size(), ours.vocab_size());
        let msgs = [super::super::Message::new("user", "1+1=")];
        assert_eq!(
            hf.chat().unwrap().render(&msgs, true).unwrap(),
            ours.chat().unwrap().render(&msgs, true).unwrap()
        );
    }

    #[test]
    fn decode_rejects_ids_outside_the_vocabulary() {
        let err = ByteTokenizer::new().decode(&[259], false).unwrap_err().to_string();
        assert!(err.contains("259"), "{err}");
    }
}
