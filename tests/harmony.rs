//! gpt-oss's harmony chat format through Horizon's chat support (issue 49): the real
//! `chat_template.jinja` of `openai/gpt-oss-20b` on a small test tokenizer with harmony's special
//! tokens (tests/fixtures/tokenizers/gpt-oss, written by the ignored `make_gpt_oss_fixture`).
//! Renders are checked byte for byte against `transformers`' `apply_chat_template`
//! (`expected_renders.json`, written by the fixture's `make_expected_renders.py`); loss
//! masks cover each answer's final channel and its closing token, nothing of the prompt; chat
//! SFT and preference (DPO) data load through the template.

use std::path::{Path, PathBuf};

use horizon::data::{OnError, Row, load_chat, load_preference};
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
    let split = Split::new(
        SplitPattern::Regex(O200K_SPLIT.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
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

/// What each answer of `messages` trains on: its final channel and the token that closes it,
/// `<|end|>` for an earlier answer and `<|return|>` for the conversation's last (as the template
/// writes a training render).
fn final_channels(messages: &[Message]) -> Vec<String> {
    let last = messages.iter().rposition(|m| m.role == "assistant");
    (messages.iter().enumerate())
        .filter(|(_, m)| m.role == "assistant")
        .map(|(i, m)| {
            let close =
                if Some(i) == last && i + 1 == messages.len() { "<|return|>" } else { "<|end|>" };
            format!("{}{close}", m.content)
        })
        .collect()
}

/// The test tokenizer gives `transformers`' ids for every training render, harmony's special
/// tokens each one token.
#[test]
fn render_ids_match_transformers() {
    let tok = load();
    let specials = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"];
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["render_ids"].clone()).unwrap();
        let got = tok.encode(case["render"].as_str().unwrap()).unwrap();
        assert_eq!(got, want, "{name}");
        for special in specials {
            let id = tok.token_to_id(special).unwrap();
            let text = case["render"].as_str().unwrap();
            let count = got.iter().filter(|&&t| t == id).count();
            assert_eq!(count, text.matches(special).count(), "{name}: {special}");
        }
    }
}

/// The loss spans of every conversation are its answers' final channels with their closing
/// tokens, in a text that is the plain render: never the headers, the analysis channel of the
/// last answer, or anything of the prompt.
#[test]
fn spans_are_the_final_channels() {
    let chat = fixed_now(&load());
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let messages = messages(&case);
        let (text, spans) = chat.render_with_assistant_spans(&messages).unwrap();
        assert_eq!(text, case["render"].as_str().unwrap(), "{name}");
        let got: Vec<&str> = spans.iter().map(|s| &text[s.clone()]).collect();
        assert_eq!(got, final_channels(&messages), "{name}");
        for span in &spans {
            assert!(text[..span.start].ends_with("<|channel|>final<|message|>"), "{name}");
        }
    }
}

/// Positions trained (label = id) as runs of decoded text; checks every other label is -100.
fn trained_runs(tok: &HfTokenizer, row: &Row) -> Vec<String> {
    let mut runs: Vec<Vec<u32>> = Vec::new();
    let mut inside = false;
    for (&id, &label) in row.input_ids.iter().zip(&row.labels) {
        if label == -100 {
            inside = false;
            continue;
        }
        assert_eq!(label, id, "a trained label is its own token");
        if !inside {
            runs.push(Vec::new());
        }
        runs.last_mut().unwrap().push(id as u32);
        inside = true;
    }
    runs.iter().map(|ids| tok.decode(ids, false).unwrap()).collect()
}

fn jsonl(dir: &Path, name: &str, records: &[Value]) -> PathBuf {
    let path = dir.join(name);
    let text: String = records.iter().map(|r| r.to_string() + "\n").collect();
    std::fs::write(&path, text).unwrap();
    path
}

/// Chat SFT data through the template and the test tokenizer: each row trains exactly the
/// tokens of its answers' final channels and their closing tokens (`<|end|>`, and `<|return|>`
/// on the last), every prompt token masked; the row is the template's render; with
/// `train_on_prompt` every token is trained.
#[test]
fn chat_sft_trains_the_final_channels_only() {
    let tok = load();
    let dir = tempfile::tempdir().unwrap();
    let records: Vec<Value> = cases()
        .iter()
        .filter(|c| c["messages"].as_array().unwrap().iter().any(|m| m["role"] == "assistant"))
        .map(|c| serde_json::json!({"messages": c["messages"]}))
        .collect();
    let path = jsonl(dir.path(), "chat.jsonl", &records);
    let (store, report) =
        load_chat(&path.as_path().into(), &tok, 4096, false, OnError::Fail).unwrap();
    let rows = store.to_rows().unwrap();
    assert_eq!(rows.len(), records.len(), "{report:?}");
    let fixed = fixed_now(&tok);
    for (row, record) in rows.iter().zip(&records) {
        let messages = messages(record);
        let render = fixed.render(&messages, false).unwrap();
        let ids: Vec<u32> = row.input_ids.iter().map(|&id| id as u32).collect();
        // The same text but for the date in the system message, today's here.
        let text = tok.decode(&ids, false).unwrap();
        let tail = |t: &str| t[t.find("<|end|>").unwrap()..].to_string();
        assert_eq!(tail(&text), tail(&render));
        let special = |t: &str| tok.token_to_id(t).unwrap() as i32;
        for t in ["<|start|>", "<|message|>", "<|channel|>", "<|end|>"] {
            assert!(row.input_ids.contains(&special(t)), "{t} is one token");
        }
        assert_eq!(trained_runs(&tok, row), final_channels(&messages), "{render}");
    }
    let (store, _) = load_chat(&path.as_path().into(), &tok, 4096, true, OnError::Fail).unwrap();
    for row in store.to_rows().unwrap() {
        assert_eq!(row.labels, row.input_ids);
    }
}

/// What the template refuses is a load error naming the file, the line and the template's
/// message, not a panic: an answer with harmony's channel tags in its content, a tool answer
/// without a tool call before it; a role no template knows is refused before rendering, and a
/// `thinking` that is not a string as the record is read.
#[test]
fn refused_conversations_are_errors_naming_the_line() {
    let tok = load();
    let dir = tempfile::tempdir().unwrap();
    let q = serde_json::json!({"role": "user", "content": "q"});
    let bad = [
        (
            serde_json::json!({"role": "assistant", "content": "<|channel|>final<|message|>x"}),
            "passed a message containing <|channel|> tags in the content field",
        ),
        (
            serde_json::json!({"role": "tool", "content": "42"}),
            "no previous assistant message with a tool call",
        ),
        (serde_json::json!({"role": "bot", "content": "x"}), "role 'bot' is not one of"),
        (
            serde_json::json!({"role": "assistant", "content": "x", "thinking": 7}),
            "messages[1]: field \"thinking\" is a number, expected a string",
        ),
    ];
    for (n, (message, want)) in bad.into_iter().enumerate() {
        let answer = serde_json::json!({"role": "assistant", "content": "a"});
        let good = serde_json::json!({"messages": [q, answer]});
        let record = serde_json::json!({"messages": [q, message, answer]});
        let path = jsonl(dir.path(), &format!("bad{n}.jsonl"), &[good, record]);
        let err = load_chat(&path.as_path().into(), &tok, 4096, false, OnError::Fail)
            .map(|_| ())
            .unwrap_err();
        let err = format!("{err:#}");
        assert!(err.contains(want), "{err}");
        assert!(err.contains(&format!("bad{n}.jsonl:2")), "{err}");
    }
}

/// Preference (DPO) data with conversations renders through the same template, as TRL
/// tokenizes it: the prompt rendered with the generation prompt (`<|start|>assistant`) is
/// masked; each completion is what follows it in the prompt + answer render, the answer's
/// channel header, its final channel and `<|return|>` (and before them the analysis channel
/// when the answer has `thinking`: the template writes it for the last answer).
#[test]
fn preference_pairs_render_through_the_template() {
    let tok = load();
    let dir = tempfile::tempdir().unwrap();
    let record = serde_json::json!({
        "prompt": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "chosen": [{"role": "assistant", "thinking": "2+2 = 4.", "content": "It is 4."}],
        "rejected": [{"role": "assistant", "content": "It is 5."}],
    });
    let path = jsonl(dir.path(), "pref.jsonl", &[record]);
    let (store, report) =
        load_preference(&path.as_path().into(), Some(&tok), 4096, OnError::Fail).unwrap();
    let rows = store.to_rows().unwrap();
    assert_eq!((rows.len(), report.load.records), (2, 1));
    let [chosen, rejected] = [&rows[0], &rows[1]];
    assert_eq!(
        trained_runs(&tok, chosen),
        [
            "<|channel|>analysis<|message|>2+2 = 4.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
        ]
    );
    assert_eq!(trained_runs(&tok, rejected), ["<|channel|>final<|message|>It is 5.<|return|>"]);
    // The prompt is the same tokens in both, and ends with the generation prompt.
    let prompt_len = chosen.labels.iter().position(|&l| l != -100).unwrap();
    assert_eq!(rejected.labels.iter().position(|&l| l != -100).unwrap(), prompt_len);
    assert_eq!(chosen.input_ids[..prompt_len], rejected.input_ids[..prompt_len]);
    let prompt: Vec<u32> = chosen.input_ids[..prompt_len].iter().map(|&id| id as u32).collect();
    let prompt = tok.decode(&prompt, false).unwrap();
    assert!(
        prompt.ends_with("<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant"),
        "{prompt}"
    );
    assert!(
        prompt.contains("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"),
        "{prompt}"
    );
}
