//! The vocabulary of the real models as the grammar sees it, and constraints walking it.

use lantern_guided::{Guide, GuidedVocab};
use lantern_model::default_model::{ensure_default_model, ensure_gemma3_270m};
use lantern_model::{GgufFile, ModelTokenizer};
use rand::{Rng, SeedableRng};

fn tokenizer(path: std::path::PathBuf) -> ModelTokenizer {
    ModelTokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap()
}

/// Concatenated token bytes spell what the tokenizer decodes, on random token runs.
fn check_token_bytes(tok: &ModelTokenizer, seed: u64) {
    let bytes = tok.token_bytes();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut checked = 0;
    while checked < 200 {
        let ids: Vec<u32> = (0..rng.gen_range(1..6))
            .map(|_| rng.gen_range(0..tok.vocab_size() as u32))
            .collect();
        if ids.iter().any(|&t| bytes[t as usize].1) {
            continue;
        }
        let spelled: Vec<u8> = ids
            .iter()
            .flat_map(|&t| bytes[t as usize].0.clone())
            .collect();
        let Ok(spelled) = String::from_utf8(spelled) else {
            continue;
        };
        let decoded = tok.decode(&ids, false).unwrap();
        // SentencePiece decoding drops one leading space of the whole text.
        assert!(
            decoded == spelled || Some(decoded.as_str()) == spelled.strip_prefix(' '),
            "{ids:?}: {decoded:?} vs {spelled:?}"
        );
        checked += 1;
    }
}

#[test]
fn token_bytes_spell_the_decoded_text() {
    check_token_bytes(&tokenizer(ensure_default_model().unwrap()), 1);
    check_token_bytes(&tokenizer(ensure_gemma3_270m().unwrap()), 2);
}

#[test]
fn a_choice_walks_to_one_of_its_strings_and_finishes() {
    let tok = tokenizer(ensure_default_model().unwrap());
    let vocab = GuidedVocab::new(&tok, tok.vocab_size()).unwrap();
    let choices = vec!["alpha beta".to_string(), "gamma".to_string()];
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for _ in 0..10 {
        let mut c = vocab.compile(&Guide::Choice(choices.clone())).unwrap();
        let mut out = Vec::new();
        while !c.is_finished() {
            let mask = c.compute_mask().unwrap();
            let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
                .filter(|&t| mask.is_allowed(t))
                .collect();
            assert!(!allowed.is_empty());
            let t = allowed[rng.gen_range(0..allowed.len())];
            c.consume(t).unwrap();
            if tok.stop_ids().contains(&t) {
                break;
            }
            out.push(t);
            assert!(out.len() < 20, "{out:?}");
        }
        let text = tok.decode(&out, true).unwrap();
        assert!(choices.contains(&text), "{text:?}");
    }
    let e = vocab.compile(&Guide::Regex("(".into())).unwrap_err();
    assert!(
        matches!(e, lantern_guided::GuidedError::InvalidGrammar(_)),
        "{e}"
    );
}
