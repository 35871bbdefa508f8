//! gpt-oss's harmony chat format through Horizon's chat support (issue 49): the real
//! `chat_template.jinja` of `openai/gpt-oss-20b` on a small test tokenizer with harmony's special
//! tokens (tests/fixtures/tokenizers/gpt-oss, written by the ignored `make_gpt_oss_fixture`).
//! Renders are checked byte for byte against `transformers`' `apply_chat_template`
//! (`expected_renders.json`, written by the fixture's `make_expected_renders.py`); loss
//! masks cover each answer's final channel and its closing token, nothing of the prompt; chat
//! SFT and preference (DPO) data load through the template.

use std::path::{Path, PathBuf};

use horizon::tokenizer::{ChatTemplate, HfTokenizer, Message, Tokenizer};
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/gpt-oss")
}

/// The date the expected renders were made with (`strftime_now` is fixed to it on both sides):
/// 2025-08-05 00:00:00 UTC.
const NOW: i64 = 1_754_352_000;

fn load() -> HfTokenizer {
    HfTokenizer::from_dir(&fixture_dir()).unwrap()
}

/// The tokenizer's chat template with `strftime_now` at [`NOW`].
fn fixed_now(tok: &HfTokenizer) -> ChatTemplate {
    let source = tok.chat().unwrap().source();
    ChatTemplate::new(source, tok.bos_token(), tok.eos_token()).unwrap().with_fixed_now(NOW)
}

/// A conversation of `expected_renders.json` as messages.
fn messages(case: &Value) -> Vec<Message> {
    case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let message = Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap());
            match m.get("thinking") {
                Some(t) => message.with_thinking(t.as_str().unwrap()),
                None => message,
            }
        })
        .collect()
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixture_dir().join("expected_renders.json")).unwrap();
    let json: Value = serde_json::from_str(&text).unwrap();
    json["cases"].as_array().unwrap().clone()
}

/// Every conversation renders as `transformers` renders it, byte for byte, with and without
/// the generation prompt.
#[test]
fn renders_match_transformers() {
    let tok = load();
    let chat = fixed_now(&tok);
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let messages = messages(&case);
        for (key, add) in [("render", false), ("render_generation_prompt", true)] {
            let want = case[key].as_str().unwrap();
            let got = chat.render(&messages, add).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            assert_eq!(got, want, "{name}, add_generation_prompt={add}");
        }
    }
}

/// Writes `tokenizer.json` and `tokenizer_config.json` of tests/fixtures/tokenizers/gpt-oss:
/// a byte-level BPE of 500 ids (256 bytes + 244 merges, trained on a few lines; the ids mean
/// nothing) behind o200k_harmony's pre-tokenizer (its split regex, then byte-level), then the
/// 21 special tokens of `openai/gpt-oss-20b` in their order, from id 500 (theirs start at
/// 199998), and its `tokenizer_config.json` with the ids moved by the same amount. The chat
/// template (`chat_template.jinja`) is the model's, copied as it is.
#[test]
#[ignore = "writes the fixture; run by hand"]
fn make_gpt_oss_fixture() {
    use tokenizers::decoders::DecoderWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::normalizers::NormalizerWrapper;
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::processors::PostProcessorWrapper;
    use tokenizers::{AddedToken, SplitDelimiterBehavior, TokenizerImpl};

    type Bpe = TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >;
    /// o200k_harmony's split regex, as gpt-oss's tokenizer.json has it.
    const O200K_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const CORPUS: &str = "You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: 2025-08-05
Reasoning: medium
# Valid channels: analysis, commentary, final. Channel must be included for every message.
# Instructions
Answer in French. Be brief.
The user asks what 2+2 is. It is 4. What is 10 times 12? It is 120.
Hello! How are you today? I am fine, thank you. And you?
naïve café, crème brûlée, déjà vu, à la carte.
日本語のテキストと中文的文本。こんにちは世界。
crab 🦀 rocket 🚀 sparkles ✨ check ✓";
    /// `openai/gpt-oss-20b`'s added tokens, ids 199998..=200018.
    const SPECIALS: [&str; 21] = [
        "<|startoftext|>",
        "<|endoftext|>",
        "<|reserved_200000|>",
        "<|reserved_200001|>",
        "<|return|>",
        "<|constrain|>",
        "<|reserved_200004|>",
        "<|channel|>",
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|reserved_200009|>",
        "<|reserved_200010|>",
        "<|reserved_200011|>",
        "<|call|>",
        "<|reserved_200013|>",
        "<|reserved_200014|>",
        "<|reserved_200015|>",
        "<|reserved_200016|>",
        "<|reserved_200017|>",
        "<|endofprompt|>",
    ];

    let mut tok = Bpe::new(BPE::default());
    let split =
        Split::new(SplitPattern::Regex(O200K_SPLIT.into()), SplitDelimiterBehavior::Isolated, false)
            .unwrap();
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(
        tokenizers::pre_tokenizers::sequence::Sequence::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
        ]),
    )));
    tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
    tok.with_post_processor(Some(PostProcessorWrapper::ByteLevel(ByteLevel::new(
        false, true, false,
    ))));
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(500)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    tok.train(&mut trainer, std::iter::repeat_n(CORPUS.lines(), 4).flatten()).unwrap();
    assert_eq!(tok.get_vocab_size(false), 500);
    let added: Vec<AddedToken> = SPECIALS.iter().map(|s| AddedToken::from(*s, true)).collect();
    tok.add_special_tokens(added).unwrap();

    let decoder: serde_json::Map<String, Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(n, s)| {
            let token = serde_json::json!({"content": s, "lstrip": false, "normalized": false,
                "rstrip": false, "single_word": false, "special": true});
            ((500 + n).to_string(), token)
        })
        .collect();
    let config = serde_json::json!({
        "added_tokens_decoder": decoder,
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|return|>",
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    let dir = fixture_dir();
    tok.save(dir.join("tokenizer.json"), true).unwrap();
    let config = serde_json::to_string_pretty(&config).unwrap() + "\n";
    std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
}
