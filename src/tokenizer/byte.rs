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
    fn decode_rejects_ids_outside_the_vocabulary() {
        let err = ByteTokenizer::new().decode(&[259], false).unwrap_err().to_string();
        assert!(err.contains("259"), "{err}");
    }
}
