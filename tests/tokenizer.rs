//! Tokenizers and chat templates on the committed fixtures of tests/fixtures/tokenizers: a
//! Llama-3-style and a Qwen2-style byte-level BPE `tokenizer.json` (small, trained here by
//! `make_fixture_tokenizers`) with the real models' `tokenizer_config.json` special tokens and chat
//! templates; and the byte tokenizer with its built-in template.

use std::path::{Path, PathBuf};

use horizon::tokenizer::{ByteTokenizer, ChatTemplate, HfTokenizer, Message, Tokenizer};

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers").join(name)
}

fn load(name: &str) -> HfTokenizer {
    HfTokenizer::from_dir(&fixture_dir(name)).unwrap()
}

fn msg(role: &str, content: &str) -> Message {
    Message::new(role, content)
}

/// Texts every tokenizer must round-trip: ASCII, accents, CJK, emoji, whitespace runs.
const TEXTS: [&str; 5] = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, crème brûlée — déjà vu",
    "日本語のテキストと中文",
    "crab 🦀 and rocket 🚀!",
    "  two spaces,\ttab\nnew line\n\n",
];

#[test]
fn hf_round_trips_ascii_and_non_ascii() {
    for name in ["llama3", "qwen2"] {
        let tok = load(name);
        for text in TEXTS {
            let ids = tok.encode(text).unwrap();
            assert!(!ids.is_empty());
            assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()), "{name}: {ids:?}");
            assert_eq!(tok.decode(&ids, false).unwrap(), text, "{name}: ids {ids:?}");
            let (ids_with_offsets, _) = tok.encode_with_offsets(text).unwrap();
            assert_eq!(ids_with_offsets, ids, "{name}: encode and encode_with_offsets differ");
        }
    }
}

#[test]
fn hf_llama3_special_tokens() {
    let tok = load("llama3");
    let id = |t: &str| tok.token_to_id(t).unwrap_or_else(|| panic!("{t} is not a token"));
    assert_eq!(tok.bos_id(), Some(id("<|begin_of_text|>")));
    assert_eq!(tok.eos_id(), Some(id("<|eot_id|>")));
    assert_eq!(tok.pad_id(), None);
    assert_eq!(tok.bos_token(), "<|begin_of_text|>");
    assert_eq!(tok.eos_token(), "<|eot_id|>");
    assert_eq!(tok.token_to_id("<|no such token|>"), None);
    // The specials follow the trained vocabulary: the last is the largest id.
    assert_eq!(tok.vocab_size(), id("<|eot_id|>") as usize + 1);
    // encode adds no BOS, though the post-processor would (and so add_bos_token says yes).
    assert_ne!(tok.encode("Hello").unwrap()[0], id("<|begin_of_text|>"));
    assert!(tok.add_bos_token());
    // Special tokens written in the text are single ids; skip_special drops them in decode.
    let ids = tok.encode("<|start_header_id|>user<|end_header_id|>hi<|eot_id|>").unwrap();
    assert_eq!(ids[0], id("<|start_header_id|>"));
    assert_eq!(*ids.last().unwrap(), id("<|eot_id|>"));
    assert_eq!(tok.decode(&ids, true).unwrap(), "userhi");
}

#[test]
fn hf_qwen2_special_tokens() {
    let tok = load("qwen2");
    let id = |t: &str| tok.token_to_id(t).unwrap_or_else(|| panic!("{t} is not a token"));
    assert_eq!(tok.bos_id(), None); // "bos_token": null
    assert_eq!(tok.eos_id(), Some(id("<|im_end|>")));
    assert_eq!(tok.pad_id(), Some(id("<|endoftext|>")));
    assert_eq!(tok.bos_token(), "");
    assert!(!tok.add_bos_token());
    assert_eq!(tok.encode("<|im_start|>").unwrap(), [id("<|im_start|>")]);
}

/// Offsets are byte ranges of the text (not char ranges): they lie on char boundaries, run in
/// order, cover the text, and each token's range holds that token's text.
#[test]
fn hf_offsets_are_byte_ranges() {
    for name in ["llama3", "qwen2"] {
        let tok = load(name);
        for text in TEXTS.iter().chain(&["<|im_start|>é<|eot_id|>🦀"]) {
            let (ids, offsets) = tok.encode_with_offsets(text).unwrap();
            assert_eq!(ids.len(), offsets.len());
            let (mut start, mut end) = (0, 0);
            for (id, range) in ids.iter().zip(&offsets) {
                let piece = text.get(range.clone()).unwrap_or_else(|| {
                    panic!("{name}: {range:?} is not a byte range of {text:?} (token {id})")
                });
                assert!(range.start >= start, "{name}: {text:?}: {range:?} out of order");
                assert!(range.start <= end, "{name}: {text:?}: gap before {range:?}");
                start = range.start;
                end = end.max(range.end);
                // A token that is whole characters decodes to exactly its piece of the text.
                if let Ok(decoded) = tok.decode(&[*id], false)
                    && !decoded.contains('\u{fffd}')
                {
                    assert_eq!(decoded, piece, "{name}: token {id} at {range:?} of {text:?}");
                }
            }
            assert_eq!(end, text.len(), "{name}: offsets do not cover {text:?}");
        }
        // "é" is one char and two bytes: the offsets end at 2, not 1.
        let (_, offsets) = tok.encode_with_offsets("é").unwrap();
        assert_eq!(offsets.last().unwrap().end, 2, "{name}: {offsets:?}");
    }
    // Qwen2 normalizes to NFC: "e" + U+0301 becomes "é", and the offsets still index the input.
    let text = "cafe\u{301} ok";
    let (ids, offsets) = load("qwen2").encode_with_offsets(text).unwrap();
    assert_eq!(load("qwen2").decode(&ids, false).unwrap(), "café ok");
    assert_eq!(offsets.last().unwrap().end, text.len());
    assert!(offsets.iter().all(|r| text.is_char_boundary(r.start) && text.is_char_boundary(r.end)));
}

#[test]
fn missing_tokenizer_json_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = HfTokenizer::from_dir(dir.path()).unwrap_err().to_string();
    let file = dir.path().join("tokenizer.json");
    assert!(err.contains(&file.display().to_string()) && err.contains("not found"), "{err}");

    std::fs::write(&file, "{\"model\": 3}").unwrap();
    let err = HfTokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains(&file.display().to_string()) && err.contains("not a valid"), "{err}");
}

#[test]
fn unknown_special_token_in_config_names_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(fixture_dir("qwen2").join("tokenizer.json"), dir.path().join("tokenizer.json"))
        .unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"eos_token": "</s>"}"#).unwrap();
    let err = format!("{:#}", HfTokenizer::from_dir(dir.path()).unwrap_err());
    assert!(err.contains("tokenizer_config.json") && err.contains("eos_token"), "{err}");
}

#[test]
fn chat_template_jinja_file_takes_precedence() {
    let dir = tempfile::tempdir().unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture_dir("qwen2").join(file), dir.path().join(file)).unwrap();
    }
    std::fs::write(dir.path().join("chat_template.jinja"), "{{ messages[0].content }}!").unwrap();
    let tok = HfTokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.chat_template(), Some("{{ messages[0].content }}!"));
    assert_eq!(tok.chat().unwrap().render(&[msg("user", "hi")], false).unwrap(), "hi!");

    std::fs::write(dir.path().join("chat_template.jinja"), "{% for %}").unwrap();
    let err = format!("{:#}", HfTokenizer::from_dir(dir.path()).unwrap_err());
    assert!(err.contains("chat_template.jinja") && err.contains("does not compile"), "{err}");
}

fn conversation() -> Vec<Message> {
    vec![
        msg("system", "You are terse."),
        msg("user", "What is 2+2?"),
        msg("assistant", "4"),
        msg("user", "And in French?"),
        msg("assistant", "quatre ✓"),
    ]
}

#[test]
fn llama3_chat_template_renders_as_meta_ships_it() {
    let tok = load("llama3");
    let chat = tok.chat().unwrap();
    assert!(tok.chat_template().unwrap().contains("<|start_header_id|>"));
    let got = chat.render(&conversation(), false).unwrap();
    let want = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>\
                <|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>\
                <|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>\
                <|start_header_id|>user<|end_header_id|>\n\nAnd in French?<|eot_id|>\
                <|start_header_id|>assistant<|end_header_id|>\n\nquatre ✓<|eot_id|>";
    assert_eq!(got, want);

    // The template trims content; the generation prompt opens an assistant turn.
    let got = chat.render(&[msg("user", "  Hi!\n")], true).unwrap();
    let want = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>\
                <|start_header_id|>assistant<|end_header_id|>\n\n";
    assert_eq!(got, want);
}

#[test]
fn qwen2_chat_template_renders_as_qwen_ships_it() {
    let tok = load("qwen2");
    let chat = tok.chat().unwrap();
    let got = chat.render(&conversation(), false).unwrap();
    let want = "<|im_start|>system\nYou are terse.<|im_end|>\n\
                <|im_start|>user\nWhat is 2+2?<|im_end|>\n\
                <|im_start|>assistant\n4<|im_end|>\n\
                <|im_start|>user\nAnd in French?<|im_end|>\n\
                <|im_start|>assistant\nquatre ✓<|im_end|>\n";
    assert_eq!(got, want);

    // Without a system message the template adds its default one.
    let got = chat.render(&[msg("user", "Hi!")], true).unwrap();
    let want = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
                assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(got, want);
}

/// The assistant spans are the assistant's content plus the end marker, and the tokens whose
/// offsets fall in them decode to exactly that text.
#[test]
fn assistant_spans_are_content_and_end_marker() {
    for (name, end) in [("llama3", "<|eot_id|>"), ("qwen2", "<|im_end|>\n")] {
        let tok = load(name);
        let (text, spans) =
            tok.chat().unwrap().render_with_assistant_spans(&conversation()).unwrap();
        assert_eq!(text, tok.chat().unwrap().render(&conversation(), false).unwrap());
        let pieces: Vec<&str> = spans.iter().map(|s| &text[s.clone()]).collect();
        assert_eq!(pieces, [format!("4{end}"), format!("quatre ✓{end}")], "{name}");

        let (ids, offsets) = tok.encode_with_offsets(&text).unwrap();
        let in_span = |r: &std::ops::Range<usize>| {
            spans.iter().any(|s| s.start <= r.start && r.end <= s.end && r.start < r.end)
        };
        let trained: Vec<u32> =
            ids.iter().zip(&offsets).filter(|(_, r)| in_span(r)).map(|(&id, _)| id).collect();
        assert_eq!(tok.decode(&trained, false).unwrap(), pieces.concat(), "{name}");
    }
}

#[test]
fn bad_role_names_the_message_and_role() {
    let tok = load("qwen2");
    let messages = [msg("user", "hi"), msg("assistant", "hello"), msg("bot", "?")];
    let err = tok.chat().unwrap().render(&messages, false).unwrap_err().to_string();
    assert_eq!(err, "message 2: role 'bot' is not one of system, developer, user, assistant, tool");
    let err = tok.chat().unwrap().render_with_assistant_spans(&messages).unwrap_err().to_string();
    assert_eq!(err, "message 2: role 'bot' is not one of system, developer, user, assistant, tool");
}

#[test]
fn template_syntax_error_is_clear() {
    let err = ChatTemplate::new("{% for m in messages %}\n{{ m.content }\n{% endfor %}", "", "")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "chat template does not compile: syntax error: unexpected `}`, expected end of variable \
         block, at line 2:\n  | {{ m.content }"
    );
}

#[test]
fn template_that_is_not_prefix_stable_names_the_message() {
    // Writes the number of messages at the end: a shorter conversation is not a prefix.
    let chat = ChatTemplate::new(
        "{% for m in messages %}{{ m.content }};{% endfor %}{{ messages|length }}",
        "",
        "",
    )
    .unwrap();
    let messages = [msg("user", "a"), msg("assistant", "b")];
    let err = chat.render_with_assistant_spans(&messages).unwrap_err().to_string();
    assert!(err.starts_with("message 1: the chat template is not prefix-stable"), "{err}");
}

#[test]
fn raise_exception_reaches_the_caller() {
    let chat = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}",
        "",
        "",
    )
    .unwrap();
    let err = chat.render(&[msg("assistant", "x")], false).unwrap_err().to_string();
    assert!(err.contains("first must be user"), "{err}");
}

#[test]
fn messages_deserialize_strictly() {
    let m: Message = serde_json::from_str(r#"{"role": "user", "content": "hi"}"#).unwrap();
    assert_eq!(m, msg("user", "hi"));
    assert!(serde_json::from_str::<Message>(r#"{"role": "user", "text": "hi"}"#).is_err());
}

#[test]
fn byte_tokenizer_round_trips_and_has_fixed_ids() {
    let tok = ByteTokenizer::new();
    assert_eq!(tok.vocab_size(), 259);
    assert_eq!((tok.bos_id(), tok.eos_id(), tok.pad_id()), (Some(256), Some(257), Some(258)));
    assert_eq!(tok.token_to_id("<|eos|>"), Some(257));
    assert_eq!(tok.token_to_id("a"), Some(97));
    assert_eq!(tok.token_to_id("ab"), None);
    for text in TEXTS.iter().chain(&["<|bos|>x<|eos|><|pad|>"]) {
        let (ids, offsets) = tok.encode_with_offsets(text).unwrap();
        assert_eq!(tok.encode(text).unwrap(), ids);
        assert_eq!(tok.decode(&ids, false).unwrap(), *text);
        for (id, range) in ids.iter().zip(&offsets) {
            match id {
                0..=255 => assert_eq!(text.as_bytes()[range.clone()], [*id as u8]),
                _ => assert_eq!(
                    &text[range.clone()],
                    ["<|bos|>", "<|eos|>", "<|pad|>"][*id as usize - 256]
                ),
            }
        }
    }
    assert_eq!(tok.encode("é").unwrap(), [0xc3, 0xa9]);
    assert_eq!(tok.decode(&[256, 104, 105, 257, 258], true).unwrap(), "hi");
    // A cut multi-byte char decodes lossily.
    assert_eq!(tok.decode(&[0xc3], false).unwrap(), "\u{fffd}");
}

#[test]
fn byte_tokenizer_chat_template() {
    let tok = ByteTokenizer::new();
    let chat = tok.chat().unwrap();
    let messages = [msg("user", "Hi"), msg("assistant", "Hello!")];
    let got = chat.render(&messages, false).unwrap();
    assert_eq!(got, "<|bos|><|im_start|>user\nHi<|eos|><|im_start|>assistant\nHello!<|eos|>");
    let got = chat.render(&messages[..1], true).unwrap();
    assert_eq!(got, "<|bos|><|im_start|>user\nHi<|eos|><|im_start|>assistant\n");

    let (text, spans) = chat.render_with_assistant_spans(&messages).unwrap();
    assert_eq!(spans.len(), 1);
    assert_eq!(&text[spans[0].clone()], "Hello!<|eos|>");
    // The EOS that ends the assistant turn is the EOS id, and the text starts with BOS.
    let ids = tok.encode(&text).unwrap();
    assert_eq!((ids[0], *ids.last().unwrap()), (256, 257));
}

/// Regenerates tests/fixtures/tokenizers/{llama3,qwen2}/tokenizer.json and tokenizer_config.json:
/// `cargo test --test tokenizer -- --ignored make_fixture_tokenizers`. A byte-level BPE trained on
/// a few lines of text (so the files stay small), pre-tokenized with the models' own split regex,
/// special tokens appended after the vocabulary as the real models have them.
#[test]
#[ignore]
fn make_fixture_tokenizers() {
    use tokenizers::decoders::DecoderWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::normalizers::{NFC, NormalizerWrapper};
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::processors::PostProcessorWrapper;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::{AddedToken, SplitDelimiterBehavior, TokenizerImpl};

    type Bpe = TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >;

    const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const CORPUS: &str = "The quick brown fox jumps over the lazy dog. What is the answer?
You are a helpful assistant. The user asks a question and the assistant answers it.
Hello! How are you today? I am fine, thank you. And you?
What is 2+2? It is 4. What is 10 times 12? It is 120.
naïve café, crème brûlée, déjà vu, à la carte, quatre, cinq, six, sept.
日本語のテキストと中文的文本。こんにちは世界。你好世界。
crab 🦀 rocket 🚀 sparkles ✨ check ✓
fn main() { println!(\"hello, world\"); }
def add(a, b):\n    return a + b
Translate to French: the cat is on the table. Le chat est sur la table.";

    let train = |split: &str, nfc: bool, specials: &[&str]| -> Bpe {
        let mut tok = Bpe::new(BPE::default());
        if nfc {
            tok.with_normalizer(Some(NormalizerWrapper::NFC(NFC))).unwrap();
        }
        let split =
            Split::new(SplitPattern::Regex(split.into()), SplitDelimiterBehavior::Isolated, false)
                .unwrap();
        tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(
            tokenizers::pre_tokenizers::sequence::Sequence::new(vec![
                PreTokenizerWrapper::Split(split),
                PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
            ]),
        )));
        tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
        let mut trainer = BpeTrainerBuilder::new()
            .vocab_size(500)
            .min_frequency(2)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        tok.train(&mut trainer, std::iter::repeat_n(CORPUS.lines(), 4).flatten()).unwrap();
        let added: Vec<AddedToken> = specials.iter().map(|s| AddedToken::from(*s, true)).collect();
        tok.add_special_tokens(added).unwrap();
        tok
    };

    // Llama 3: BOS added by the post-processor (TemplateProcessing), EOS of the instruct model is
    // <|eot_id|>, no pad token.
    let mut llama3 = train(
        LLAMA3_SPLIT,
        false,
        &[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
    );
    let bos = llama3.token_to_id("<|begin_of_text|>").unwrap();
    let template = TemplateProcessing::builder()
        .try_single("<|begin_of_text|> $A")
        .unwrap()
        .try_pair("<|begin_of_text|> $A <|begin_of_text|>:1 $B:1")
        .unwrap()
        .special_tokens(vec![("<|begin_of_text|>", bos)])
        .build()
        .unwrap();
    llama3.with_post_processor(Some(PostProcessorWrapper::Sequence(
        tokenizers::processors::sequence::Sequence::new(vec![
            PostProcessorWrapper::ByteLevel(ByteLevel::new(true, false, true)),
            PostProcessorWrapper::Template(template),
        ]),
    )));
    let llama3_config = serde_json::json!({
        "bos_token": "<|begin_of_text|>",
        "clean_up_tokenization_spaces": true,
        "eos_token": "<|eot_id|>",
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": LLAMA3_TEMPLATE,
    });

    // Qwen2: NFC, no BOS, EOS <|im_end|>, pad <|endoftext|>.
    let mut qwen2 = train(QWEN2_SPLIT, true, &["<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
    qwen2.with_post_processor(Some(PostProcessorWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    ))));
    let qwen2_config = serde_json::json!({
        "add_prefix_space": false,
        "bos_token": null,
        "chat_template": QWEN2_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    });

    for (name, tok, config) in [("llama3", &llama3, llama3_config), ("qwen2", &qwen2, qwen2_config)]
    {
        let dir = fixture_dir(name);
        std::fs::create_dir_all(&dir).unwrap();
        tok.save(dir.join("tokenizer.json"), true).unwrap();
        let config = serde_json::to_string_pretty(&config).unwrap() + "\n";
        std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
    }
}

/// Meta-Llama-3-8B-Instruct's chat template, as shipped.
const LLAMA3_TEMPLATE: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

/// Qwen2.5-Instruct's chat template, as shipped (tool calling included).
const QWEN2_TEMPLATE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

/// A chat template that would loop for ever (here: ten thousand million iterations) is stopped
/// by an instruction budget scaled by the conversation's size, with an error saying so
/// (issue 45).
#[test]
fn a_runaway_chat_template_runs_out_of_its_budget() {
    let chat = ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0].content }}{% endfor %}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    let messages = vec![Message::new("user", "hi")];
    let err = chat.render(&messages, false).unwrap_err().to_string();
    assert!(err.contains("instruction budget"), "{err}");
}

/// The loss spans of a conversation of thousands of turns are searched only as far as the row
/// is kept (`max_seq_len`): the spans found up to a cut are the full search's first ones,
/// every one that starts before the cut and at most one more (issue 45; it re-rendered every
/// prefix of the whole conversation, quadratic in its turns).
#[test]
fn the_span_search_stops_past_the_cut() {
    let tok = ByteTokenizer::new();
    let chat = tok.chat().unwrap();
    let messages: Vec<Message> = (0..400)
        .map(|i| Message::new(if i % 2 == 0 { "user" } else { "assistant" }, &format!("turn {i}")))
        .collect();
    let (text, all) = chat.render_with_assistant_spans(&messages).unwrap();
    assert_eq!(all.len(), 200);
    let cut = 300;
    let (text_cut, some) = chat.render_with_assistant_spans_until(&messages, |_| cut).unwrap();
    assert_eq!(text_cut, text);
    let before = all.iter().filter(|s| s.start < cut).count();
    assert!(some.len() >= before && some.len() <= before + 1, "{} of {}", some.len(), all.len());
    assert_eq!(some[..], all[..some.len()]);
}
