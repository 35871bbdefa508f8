//! Tokenizers: Hugging Face `tokenizer.json` (through the `tokenizers` crate) and a byte-level
//! tokenizer for models trained from scratch; chat templates (Jinja, through `minijinja`).

pub mod byte;
pub mod chat;
pub mod hf;

pub use byte::ByteTokenizer;
pub use chat::{ChatTemplate, Message};
pub use hf::HfTokenizer;

use anyhow::Result;

/// Text <-> token ids.
pub trait Tokenizer: Send + Sync {
    /// Token ids of `text`, without adding BOS/EOS (datasets add them explicitly).
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// Token ids of `text` as `transformers`' `tokenizer(text)` gives them
    /// (`add_special_tokens=True`): with whatever the post-processor adds (Llama: BOS in front;
    /// some configurations also EOS at the end). By default BOS when [`Tokenizer::add_bos_token`].
    fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>> {
        let bos = self.bos_id().filter(|_| self.add_bos_token());
        Ok(bos.into_iter().chain(self.encode(text)?).collect())
    }
    /// Token ids of `text` and, for each, the byte range of `text` it covers (for loss masks).
    fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<std::ops::Range<usize>>)>;
    /// Text of `ids` (special tokens skipped when `skip_special`).
    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String>;
    /// Size of the id space (the model's vocabulary must be at least this).
    fn vocab_size(&self) -> usize;
    fn bos_id(&self) -> Option<u32>;
    fn eos_id(&self) -> Option<u32>;
    fn pad_id(&self) -> Option<u32>;
    /// Id of a token string (special tokens included), if it exists.
    fn token_to_id(&self, token: &str) -> Option<u32>;
    /// Whether a plain-text document starts with BOS for this model (HF `add_bos_token`, or what
    /// the tokenizer's post-processor adds). Chat templates write their own BOS.
    fn add_bos_token(&self) -> bool {
        false
    }
    /// The chat template conversations are rendered with, if the tokenizer has one.
    fn chat(&self) -> Option<&ChatTemplate> {
        None
    }
}
