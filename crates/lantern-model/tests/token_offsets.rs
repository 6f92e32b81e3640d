//! Each prompt token's bytes of the prompt text (what character spans of a capture are
//! resolved with): the tokens' own bytes spell the text exactly, on both real
//! tokenizers (SmolLM2's byte-level BPE, Gemma 3's SentencePiece with byte fallback),
//! for ASCII, accents, CJK, emoji split into byte tokens, newlines and runs of spaces;
//! and each chat message's content is found in the rendered conversation.

use lantern_model::chat::ChatRenderOptions;
use lantern_model::default_model::{ensure_default_model, ensure_gemma3_270m};
use lantern_model::prompt::{locate_messages, tokenize_chat_rendered};
use lantern_model::{ChatMessage, ChatTemplate, GgufFile, ModelTokenizer, WeightSource};
use std::path::Path;

const GEMMA3_TEMPLATE: &str = "{{ bos_token }}{%- for message in messages -%}{{ '<start_of_turn>' + message['role'] + '\n' }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

fn load(path: &Path) -> (ModelTokenizer, ChatTemplate) {
    let gguf = GgufFile::open(path).unwrap();
    let tokenizer = ModelTokenizer::from_gguf(&gguf).unwrap();
    let source = gguf
        .opt_string("tokenizer.chat_template")
        .unwrap()
        .unwrap_or(GEMMA3_TEMPLATE);
    let template = ChatTemplate::new(
        source,
        tokenizer.bos_token().unwrap_or(""),
        tokenizer.eos_token().unwrap_or(""),
    )
    .unwrap();
    (tokenizer, template)
}

const TEXTS: [&str; 7] = [
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé — «quotes» and ½",
    "東京は日本の首都です。",
    "Emoji: 😀🚀 and 👩‍👩‍👧 family, flag 🇫🇷!",
    "  leading spaces\n\n\ttabs   and runs    of spaces  ",
    "😀",
    "<|im_start|>user\nspelled control text",
];

fn check_spells(tokenizer: &ModelTokenizer, text: &str, ids: &[u32]) {
    let ranges = tokenizer
        .token_byte_ranges(text, ids)
        .unwrap_or_else(|| panic!("no byte ranges for {text:?}"));
    assert_eq!(ranges.len(), ids.len());
    let mut at = 0;
    for (r, &id) in ranges.iter().zip(ids) {
        assert_eq!(r.start, at, "{text:?}: token {id} starts at {}", r.start);
        at = r.end;
        if r.is_empty() {
            continue;
        }
        // What a token covers is its own text, up to a word-start space.
        let bytes = &tokenizer.token_bytes()[id as usize].0;
        let covered = &text.as_bytes()[r.clone()];
        assert!(
            bytes == covered || (bytes[0] == b' ' && &bytes[1..] == covered),
            "{text:?}: token {id} covers {covered:?}, spells {bytes:?}"
        );
    }
    assert_eq!(at, text.len());
}

fn check_model(path: &Path) {
    let (tokenizer, template) = load(path);
    for text in TEXTS {
        for add_special in [true, false] {
            let ids = tokenizer.encode(text, add_special).unwrap();
            check_spells(&tokenizer, text, &ids);
        }
    }
    // A text the tokens do not spell is refused rather than guessed at.
    let ids = tokenizer.encode("hello world", false).unwrap();
    assert!(tokenizer.token_byte_ranges("hello there", &ids).is_none());

    let messages = [
        ChatMessage::new("system", "Answer from the passages. 📚"),
        ChatMessage::new("user", "Passage 1: Paris is in France.\nWho? 🇫🇷"),
        ChatMessage::new("assistant", "Paris"),
        ChatMessage::new("user", "user"),
    ];
    let (ids, rendered) = tokenize_chat_rendered(
        Some(&template),
        &tokenizer,
        &messages,
        &ChatRenderOptions::default(),
        true,
        1 << 20,
    )
    .unwrap();
    check_spells(&tokenizer, &rendered.text, &ids);
    let located = locate_messages(&rendered, &messages);
    for (m, range) in messages.iter().zip(&located) {
        let range = range.clone().expect("every content is written as it is");
        assert_eq!(&rendered.text[range], m.content);
    }
    // In order: the last "user" is the fourth message's content, not a role name.
    let last = located[3].clone().unwrap();
    assert!(last.start > located[2].clone().unwrap().end);
}

#[test]
fn smollm2_tokens_spell_the_prompt() {
    check_model(&ensure_default_model().unwrap());
}

#[test]
fn gemma3_tokens_spell_the_prompt() {
    check_model(&ensure_gemma3_270m().unwrap());
}
