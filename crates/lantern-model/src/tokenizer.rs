//! The tokenizer stored in a GGUF file, rebuilt as a `tokenizers::Tokenizer`.

use crate::chat::ChatSegment;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::source::WeightSource;
use aho_corasick::{AhoCorasick, MatchKind};
use std::sync::OnceLock;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::NormalizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;
const TOKEN_TYPE_NORMAL: i64 = 1;

/// A model's tokenizer with the special tokens the model defines.
pub struct ModelTokenizer {
    inner: Tokenizer,
    tokens: Vec<String>,
    bos: Option<(u32, String)>,
    eos: Option<(u32, String)>,
    /// The padding token the model file names (reported, never used: lantern does not pad).
    pad: Option<(u32, String)>,
    stop_ids: Vec<u32>,
    add_bos: bool,
    special: Vec<bool>,
    /// Finds control tokens written in text (leftmost-longest, as the tokenizer does).
    control: Option<ControlTokens>,
    /// The tokenizer with control-token parsing off, built the first time text that
    /// spells a control token has to be tokenized as text.
    plain: OnceLock<Tokenizer>,
    pieces: PieceEncoding,
}

/// The control tokens of a vocabulary and a matcher over their texts.
struct ControlTokens {
    matcher: AhoCorasick,
    ids: Vec<u32>,
}

impl ControlTokens {
    fn new(tokens: &[String], special: &[bool]) -> Result<Option<Self>> {
        let (ids, texts): (Vec<u32>, Vec<&str>) = tokens
            .iter()
            .zip(special)
            .enumerate()
            .filter(|(_, (text, &is_special))| is_special && !text.is_empty())
            .map(|(id, (text, _))| (id as u32, text.as_str()))
            .unzip();
        if ids.is_empty() {
            return Ok(None);
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&texts)
            .map_err(|e| ModelError::Tokenizer(format!("control tokens: {e}")))?;
        Ok(Some(Self { matcher, ids }))
    }
}

/// A stretch of a prompt to tokenize: ordinary text, or one control token.
enum Piece {
    Text(String),
    Control(u32),
}

/// How the vocabulary's pieces spell bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceEncoding {
    /// GPT-2's byte-to-character map (`Ġ` is a space).
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xXX>` a raw byte.
    SentencePiece,
}

impl ModelTokenizer {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let kind = gguf.get_string("tokenizer.ggml.model")?;
        let tokens = gguf.string_array("tokenizer.ggml.tokens")?;
        let token_types = gguf
            .opt_int_array("tokenizer.ggml.token_type")?
            .unwrap_or_default();
        check_vocabulary(&tokens, &token_types)?;
        let (inner, pieces) = match kind {
            "gpt2" => (byte_level_bpe(gguf, &tokens)?, PieceEncoding::ByteLevel),
            "llama" => (
                sentencepiece_bpe(gguf, &tokens, &token_types)?,
                PieceEncoding::SentencePiece,
            ),
            other => {
                return Err(ModelError::Tokenizer(format!(
                    "tokenizer model `{other}` is not supported (supported: gpt2, llama)"
                )))
            }
        };
        let mut tokenizer = Self::with_specials(inner, tokens, &token_types, pieces)?;
        let vocab = tokenizer.tokens.len();
        let id_of = |key: &str| special_id(gguf, key, vocab);
        let named = |id: Option<u32>, tokens: &[String]| {
            id.and_then(|id| tokens.get(id as usize).map(|t| (id, t.clone())))
        };
        tokenizer.bos = named(id_of("tokenizer.ggml.bos_token_id")?, &tokenizer.tokens);
        tokenizer.eos = named(id_of("tokenizer.ggml.eos_token_id")?, &tokenizer.tokens);
        tokenizer.pad = named(id_of("tokenizer.ggml.padding_token_id")?, &tokenizer.tokens);
        tokenizer.add_bos = gguf
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false);
        let mut stop_ids: Vec<u32> = [
            id_of("tokenizer.ggml.eos_token_id")?,
            id_of("tokenizer.ggml.eot_token_id")?,
        ]
        .into_iter()
        .flatten()
        .collect();
        harmony_stops(&tokenizer.tokens, &tokenizer.special, &mut stop_ids);
        stop_ids.dedup();
        tokenizer.stop_ids = stop_ids;
        Ok(tokenizer)
    }

    fn with_specials(
        mut inner: Tokenizer,
        tokens: Vec<String>,
        token_types: &[i64],
        pieces: PieceEncoding,
    ) -> Result<Self> {
        let mut special = vec![false; tokens.len()];
        let mut added = Vec::new();
        // `check_vocabulary` made the two arrays equally long (or the types empty).
        for ((token, &ty), is_special) in tokens.iter().zip(token_types).zip(&mut special) {
            if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
                *is_special = ty == TOKEN_TYPE_CONTROL;
                // Matched in the raw text, before any normalizer (SentencePiece's
                // user-defined symbols, such as Gemma's runs of spaces and newlines).
                added.push(
                    AddedToken::from(token.clone(), ty == TOKEN_TYPE_CONTROL).normalized(false),
                );
            }
        }
        inner
            .add_special_tokens(added)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let control = ControlTokens::new(&tokens, &special)?;
        Ok(Self {
            inner,
            tokens,
            bos: None,
            eos: None,
            pad: None,
            stop_ids: Vec::new(),
            add_bos: false,
            control,
            plain: OnceLock::new(),
            special,
            pieces,
        })
    }

    /// The same tokenizer naming `pad` as its padding token.
    pub(crate) fn with_pad(mut self, pad: Option<(u32, String)>) -> Self {
        self.pad = pad;
        self
    }

    /// A tokenizer built elsewhere (a Hugging Face directory's `tokenizer.json`).
    pub(crate) fn from_parts(
        inner: Tokenizer,
        tokens: Vec<String>,
        special: Vec<bool>,
        bos: Option<(u32, String)>,
        eos: Option<(u32, String)>,
        stop_ids: Vec<u32>,
        add_bos: bool,
    ) -> Result<Self> {
        let control = ControlTokens::new(&tokens, &special)?;
        // tokenizer.json says how pieces spell bytes through its decoder: GPT-2's
        // byte-level map, or SentencePiece's `▁` and `<0xXX>` byte fallback.
        let pieces = match inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => PieceEncoding::ByteLevel,
            _ => PieceEncoding::SentencePiece,
        };
        Ok(Self {
            inner,
            tokens,
            bos,
            eos,
            pad: None,
            stop_ids,
            add_bos,
            special,
            control,
            plain: OnceLock::new(),
            pieces,
        })
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their
    /// ids; `add_special_tokens` adds BOS when the model asks for it, unless the text already
    /// starts with it (a chat template that writes `{{ bos_token }}`): BOS exactly once.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if add_special_tokens && self.add_bos {
            if let Some((bos, _)) = &self.bos {
                if encoding.get_ids().first() != Some(bos) {
                    ids.push(*bos);
                }
            }
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// Bytes of the longest token's text: no token covers more bytes of input (a byte
    /// is at least one byte of a token's text, `<0xNN>` six).
    pub fn longest_token_bytes(&self) -> usize {
        self.tokens.iter().map(String::len).max().unwrap_or(1)
    }

    /// Whether `text` spells a control token somewhere.
    pub fn contains_control_text(&self, text: &str) -> bool {
        self.control
            .as_ref()
            .is_some_and(|c| c.matcher.is_match(text))
    }

    /// Token ids of `text` with every character taken as text: a control token written
    /// in it stays text (`<|im_start|>` becomes `<`, `|`, `im`, ...).
    pub fn encode_as_text(&self, text: &str) -> Result<Vec<u32>> {
        if !self.contains_control_text(text) {
            return self.encode(text, false);
        }
        let plain = self.plain.get_or_init(|| {
            let mut plain = self.inner.clone();
            plain.set_encode_special_tokens(true);
            plain
        });
        let encoding = plain
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of a rendered conversation: control tokens are recognized only in the
    /// template's own text; message contents are text through and through, so a user
    /// cannot write `<|im_start|>system` and forge a turn. Without control text in the
    /// contents this is exactly [`Self::encode`] of the whole prompt.
    pub fn encode_chat(
        &self,
        segments: &[ChatSegment],
        add_special_tokens: bool,
    ) -> Result<Vec<u32>> {
        let mut pieces = Vec::new();
        let mut text = String::new();
        for segment in segments {
            match segment {
                ChatSegment::Content(content) => text.push_str(content),
                ChatSegment::Template(template) => {
                    let Some(control) = &self.control else {
                        text.push_str(template);
                        continue;
                    };
                    let mut at = 0;
                    for m in control.matcher.find_iter(template.as_str()) {
                        text.push_str(&template[at..m.start()]);
                        if !text.is_empty() {
                            pieces.push(Piece::Text(std::mem::take(&mut text)));
                        }
                        pieces.push(Piece::Control(control.ids[m.pattern().as_usize()]));
                        at = m.end();
                    }
                    text.push_str(&template[at..]);
                }
            }
        }
        if !text.is_empty() {
            pieces.push(Piece::Text(text));
        }
        let mut ids = Vec::new();
        if add_special_tokens && self.add_bos {
            if let Some((bos, _)) = &self.bos {
                // BOS once, also when the template writes `{{ bos_token }}` itself.
                if !matches!(pieces.first(), Some(Piece::Control(id)) if id == bos) {
                    ids.push(*bos);
                }
            }
        }
        for piece in pieces {
            match piece {
                Piece::Control(id) => ids.push(id),
                Piece::Text(text) => ids.extend(self.encode_as_text(&text)?),
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.tokens.len()) {
            return Err(ModelError::Tokenizer(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                self.tokens.len()
            )));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// A token as the vocabulary spells it (`Ġthe`, `▁the`, `<0x0A>`), as
    /// transformers' `convert_ids_to_tokens` gives it; `None` outside the vocabulary.
    pub fn token_piece(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The text of a single token as it would be printed (special tokens included).
    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id], false).unwrap_or_default()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos.as_ref().map(|(_, t)| t.as_str())
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos.as_ref().map(|(_, t)| t.as_str())
    }

    pub fn pad_token(&self) -> Option<&str> {
        self.pad.as_ref().map(|(_, t)| t.as_str())
    }

    /// Whether encoding a prompt with special tokens puts BOS in front of it.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// The tokenizer's model: byte-level BPE (GPT-2's) or SentencePiece BPE.
    pub fn kind(&self) -> &'static str {
        match self.pieces {
            PieceEncoding::ByteLevel => "byte-level BPE",
            PieceEncoding::SentencePiece => "SentencePiece BPE",
        }
    }

    /// Ids that end a generation (EOS, and EOT where the model has one).
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The raw bytes each token stands for, by id (what a grammar matches generated text
    /// against), and whether it is a special (control) token, which spells no text.
    pub fn token_bytes(&self) -> Vec<(Vec<u8>, bool)> {
        let byte_of_char = byte_level_chars();
        (0..self.tokens.len())
            .map(|id| self.piece_bytes(id as u32, &byte_of_char))
            .collect()
    }

    /// The raw bytes token `id` stands for (a control token: its text), and whether it
    /// is a control token. `byte_of_char` is [`byte_level_chars`].
    fn piece_bytes(
        &self,
        id: u32,
        byte_of_char: &std::collections::HashMap<char, u8>,
    ) -> (Vec<u8>, bool) {
        let Some(piece) = self.tokens.get(id as usize) else {
            return (Vec::new(), false);
        };
        if self.is_special(id) {
            return (piece.as_bytes().to_vec(), true);
        }
        let bytes = match self.pieces {
            PieceEncoding::ByteLevel => piece
                .chars()
                .map(|c| byte_of_char.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                // Added tokens are stored as plain text.
                .unwrap_or_else(|| piece.as_bytes().to_vec()),
            PieceEncoding::SentencePiece => sentencepiece_byte(piece)
                .map(|b| vec![b])
                .unwrap_or_else(|| piece.replace('▁', " ").into_bytes()),
        };
        (bytes, false)
    }

    /// Each token's bytes of `text`, where `ids` are `text` tokenized ([`Self::encode`],
    /// or [`Self::encode_chat`] of a rendered conversation): the tokens' own bytes, laid
    /// end to end, spell `text`. A token that spells nothing there (a BOS the tokenizer
    /// added) has an empty range; a word-start space the tokenizer put in front of a
    /// piece of text (SentencePiece's `▁`) is not in the text, so its token starts after
    /// it. Exact by construction: `None` when the tokens do not spell `text` (a
    /// normalizer that changes the text), never a guess.
    pub fn token_byte_ranges(
        &self,
        text: &str,
        ids: &[u32],
    ) -> Option<Vec<std::ops::Range<usize>>> {
        let byte_of_char = byte_level_chars();
        let text = text.as_bytes();
        let mut at = 0;
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            let (bytes, special) = self.piece_bytes(id, &byte_of_char);
            let rest = &text[at..];
            let len = if !bytes.is_empty() && rest.starts_with(&bytes) {
                bytes.len()
            } else if bytes.first() == Some(&b' ') && rest.starts_with(&bytes[1..]) {
                bytes.len() - 1
            } else if special {
                0
            } else {
                return None;
            };
            out.push(at..at + len);
            at += len;
        }
        (at == text.len()).then_some(out)
    }
}

/// GPT-2's byte-level alphabet, reversed: printable bytes stand for themselves, the
/// others are shifted to U+0100 and up, in byte order.
fn byte_level_chars() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                let c = char::from_u32(next).unwrap_or('\0');
                next += 1;
                (c, b)
            }
        })
        .collect()
}

/// The byte a SentencePiece byte-fallback piece (`<0x0A>`) stands for.
fn sentencepiece_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// Work (bytes hashed) that building SentencePiece merges may take: the sum over normal
/// tokens of their squared length. Real vocabularies need a few times 10^7.
const MAX_MERGE_WORK: u64 = 1 << 30;

/// A vocabulary lantern can build a tokenizer from: some tokens, and a type for each token
/// when the file gives types.
fn check_vocabulary(tokens: &[String], token_types: &[i64]) -> Result<()> {
    if tokens.is_empty() {
        return Err(ModelError::Tokenizer(
            "`tokenizer.ggml.tokens` is empty".into(),
        ));
    }
    if !token_types.is_empty() && token_types.len() != tokens.len() {
        return Err(ModelError::Tokenizer(format!(
            "`tokenizer.ggml.token_type` has {} entries for {} tokens",
            token_types.len(),
            tokens.len()
        )));
    }
    if u32::try_from(tokens.len()).is_err() {
        return Err(ModelError::Tokenizer(format!(
            "{} tokens do not fit 32-bit token ids",
            tokens.len()
        )));
    }
    Ok(())
}

/// A special token's id from `key`, which must name a token of the vocabulary.
fn special_id(gguf: &GgufFile, key: &str, vocab: usize) -> Result<Option<u32>> {
    match gguf.opt_usize(key)? {
        Some(id) if id < vocab => Ok(Some(id as u32)),
        Some(id) => Err(ModelError::Tokenizer(format!(
            "`{key}` is {id}, outside the vocabulary of {vocab} tokens"
        ))),
        None => Ok(None),
    }
}

/// GPT-2 style byte-level BPE, with the pre-tokenizer named by `tokenizer.ggml.pre`.
fn byte_level_bpe(gguf: &GgufFile, tokens: &[String]) -> Result<Tokenizer> {
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = gguf
        .string_array("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| ModelError::Tokenizer(format!("invalid merge entry `{m}`")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let pre = gguf.opt_string("tokenizer.ggml.pre")?.unwrap_or("gpt2");
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tokenizer)
}

/// SentencePiece BPE (`tokenizer.ggml.model` = `llama`: Llama 2, Gemma): spaces become `▁`,
/// adjacent pieces merge while their concatenation is a token, the highest-scoring
/// concatenation first (the file's scores rank the merges), and characters outside the
/// vocabulary fall back to their `<0xXX>` byte tokens.
fn sentencepiece_bpe(gguf: &GgufFile, tokens: &[String], token_types: &[i64]) -> Result<Tokenizer> {
    let scores = gguf
        .opt_f32_array("tokenizer.ggml.scores")?
        .ok_or_else(|| ModelError::Tokenizer("`tokenizer.ggml.scores` is missing".into()))?;
    if scores.len() != tokens.len() {
        return Err(ModelError::Tokenizer(format!(
            "`tokenizer.ggml.scores` has {} entries for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    let is_normal = |id: usize| {
        token_types
            .get(id)
            .is_none_or(|&ty| ty == TOKEN_TYPE_NORMAL)
    };
    let work = tokens
        .iter()
        .enumerate()
        .filter(|&(id, _)| is_normal(id))
        .map(|(_, t)| (t.len() as u64).saturating_mul(t.len() as u64))
        .fold(0u64, u64::saturating_add);
    if work > MAX_MERGE_WORK {
        return Err(ModelError::Tokenizer(format!(
            "the tokens of `tokenizer.ggml.tokens` are too long to build merges from \
             (the sum of their squared lengths is {work}, lantern's limit {MAX_MERGE_WORK})"
        )));
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    // Every split of a normal token into two tokens is a merge, ranked by the token's score.
    let mut ranked: Vec<(f32, u32, &str, &str)> = Vec::new();
    for ((id, token), &score) in tokens.iter().enumerate().zip(&scores) {
        if !is_normal(id) {
            continue;
        }
        for (at, _) in token.char_indices().skip(1) {
            let (left, right) = token.split_at(at);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                ranked.push((score, id as u32, left, right));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let merges = ranked
        .into_iter()
        .map(|(_, _, l, r)| (l.to_string(), r.to_string()))
        .collect();
    let unk = special_id(gguf, "tokenizer.ggml.unknown_token_id", tokens.len())?
        .and_then(|id| tokens.get(id as usize).cloned());
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if gguf
        .opt_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true)
    {
        normalizers.push(Prepend::new("▁".into()).into());
    }
    normalizers.push(
        Replace::new(" ", "▁")
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?
            .into(),
    );
    tokenizer
        .with_normalizer(Some(NormalizerSequence::new(normalizers)))
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ")
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?
            .into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ];
    if gguf
        .opt_bool("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true)
    {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(tokenizer)
}

/// gpt-oss's vocabulary (o200k_harmony) ends a turn with `<|return|>` or, for a tool call,
/// `<|call|>`; its files name only the first as EOS, so the second stops generation too
/// where both are control tokens. `<|end|>` ends a message but not the reply (the
/// final channel's message follows the analysis one): a file that names it EOT does
/// not stop there. Both are llama.cpp's rules.
fn harmony_stops(tokens: &[String], special: &[bool], stop_ids: &mut Vec<u32>) {
    let control = |name: &str| {
        let id = tokens.iter().position(|t| t == name)?;
        special
            .get(id)
            .copied()
            .unwrap_or(false)
            .then_some(id as u32)
    };
    let Some(call) = control("<|return|>").and(control("<|call|>")) else {
        return;
    };
    stop_ids.push(call);
    if let Some(end) = control("<|end|>") {
        stop_ids.retain(|&id| id != end);
    }
}

/// The pre-tokenizers of the byte-level BPE vocabularies lantern knows, as their
/// `tokenizer.json` files define them.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    // GPT-4o's (o200k: gpt-oss): words split at case changes, with their contractions.
    const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    // Qwen 2/2.5/3: Llama 3's pattern with every digit on its own.
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
    Ok(match pre {
        // GPT-2's own split, as llama.cpp names it for GPT-2 (`gpt-2`), Pythia and OLMo 1
        // (`olmo`: the GPT-NeoX-20B tokenizer), MPT and Phi-2.
        "gpt2" | "default" | "gpt-2" | "olmo" | "mpt" | "phi-2" => byte_level(true).into(),
        // SmolLM, StarCoder, Refact (Granite 3's, as llama.cpp's converter names it) and
        // Command R: every digit on its own, then GPT-2's byte-level split.
        "smollm" | "starcoder" | "refact" | "command-r" => Sequence::new(vec![Digits::new(true).into(), byte_level(true).into()]).into(),
        // `dbrx`: OLMo 2's (cl100k) tokenizer, split as Llama 3's; GLM-4's (`glm4`,
        // `chatglm-bpe`) too.
        "llama3" | "llama-bpe" | "smaug-bpe" | "dbrx" | "glm4" | "chatglm-bpe" | "qwen2"
        | "gpt-4o" => {
            let pattern = match pre {
                "qwen2" => QWEN2,
                "gpt-4o" => GPT4O,
                _ => LLAMA3,
            };
            let split = Split::new(
                SplitPattern::Regex(pattern.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
            Sequence::new(vec![split.into(), byte_level(false).into()]).into()
        }
        other => {
            return Err(ModelError::Tokenizer(format!(
                "pre-tokenizer `{other}` is not supported (supported: gpt2/gpt-2/olmo/mpt/phi-2, smollm/starcoder/refact/command-r, \
                 llama3/llama-bpe/smaug-bpe/dbrx/glm4/chatglm-bpe, qwen2, gpt-4o)"
            )))
        }
    })
}

/// Turns a growing list of token ids into text pieces as they become complete, holding back
/// bytes of a multi-byte character until its last byte arrives.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// New text made printable by the last token of `ids` (special tokens without text
    /// when `skip_special_tokens`).
    pub fn step(
        &mut self,
        tokenizer: &ModelTokenizer,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String> {
        let window =
            |range: std::ops::Range<usize>| tokenizer.decode(&ids[range], skip_special_tokens);
        let prefix = window(self.prefix_offset..self.read_offset)?;
        let full = window(self.prefix_offset..ids.len())?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let piece = match full.strip_prefix(prefix.as_str()) {
                Some(rest) => rest.to_string(),
                // The text of the window changed as it grew: a run of byte tokens that
                // was valid UTF-8 is not with the next byte, and decodes to replacement
                // characters as a whole. What was sent stays sent; the new text is what
                // follows as many characters as were sent (vLLM's rule).
                None => full.chars().skip(prefix.chars().count()).collect(),
            };
            self.prefix_offset = self.read_offset;
            self.read_offset = ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn pieces(pre: &str, text: &str) -> Vec<String> {
        let mut s = PreTokenizedString::from(text);
        pre_tokenizer(pre).unwrap().pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(p, _, _)| p.to_string())
            .collect()
    }

    #[test]
    fn llama3_groups_three_digits_and_qwen2_splits_every_digit() {
        // Byte-level symbols: a space is `Ġ`.
        assert_eq!(pieces("llama-bpe", "x 12345"), ["x", "Ġ", "123", "45"]);
        assert_eq!(
            pieces("qwen2", "x 12345"),
            ["x", "Ġ", "1", "2", "3", "4", "5"]
        );
        assert_eq!(
            pieces("qwen2", "Hello, world's"),
            ["Hello", ",", "Ġworld", "'s"]
        );
    }

    #[test]
    fn gpt2_style_names_split_as_gpt2_and_dbrx_as_llama3() {
        for pre in ["gpt-2", "olmo", "mpt", "phi-2"] {
            assert_eq!(pieces(pre, "x 12345"), ["x", "Ġ12345"], "{pre}");
            assert_eq!(pieces(pre, "it's  ok"), ["it", "'s", "Ġ", "Ġok"], "{pre}");
        }
        for pre in ["dbrx", "glm4", "chatglm-bpe"] {
            assert_eq!(pieces(pre, "x 12345"), pieces("llama3", "x 12345"), "{pre}");
        }
        // StarCoder's and Refact's (Granite 3's): every digit alone, as SmolLM's.
        for pre in ["starcoder", "refact", "command-r"] {
            assert_eq!(pieces(pre, "x 12345"), pieces("smollm", "x 12345"), "{pre}");
        }
        assert_eq!(pieces("refact", "x 12"), ["x", "Ġ", "1", "2"]);
    }

    #[test]
    fn gpt_4o_splits_at_case_changes_and_keeps_contractions() {
        // As the `tokenizers` library splits with o200k's pattern.
        assert_eq!(
            pieces("gpt-4o", "Hello World's CamelCASE x 12345"),
            [
                "Hello",
                "ĠWorld's",
                "ĠCamel",
                "CASE",
                "Ġx",
                "Ġ",
                "123",
                "45"
            ]
        );
        assert_eq!(pieces("gpt-4o", "JSONParser's ok"), ["JSONParser's", "Ġok"]);
        assert_eq!(pieces("gpt-4o", "a/b\n\n  c"), ["a", "/b", "ĊĊ", "Ġ", "Ġc"]);
        assert_ne!(pieces("llama3", "World's"), pieces("gpt-4o", "World's"));
    }

    #[test]
    fn harmony_vocabularies_stop_at_tool_calls_but_not_at_a_messages_end() {
        let tokens: Vec<String> = ["a", "<|return|>", "<|end|>", "<|call|>"]
            .map(String::from)
            .to_vec();
        let stops = |special: &[bool], tokens: &[String]| {
            // EOS `<|return|>`, and a file that names `<|end|>` its EOT.
            let mut stop_ids = vec![1, 2];
            harmony_stops(tokens, special, &mut stop_ids);
            stop_ids
        };
        assert_eq!(stops(&[false, true, true, true], &tokens), [1, 3]);
        // Plain text of the same spelling, or one of the two alone, is no harmony vocabulary.
        assert_eq!(stops(&[false, true, true, false], &tokens), [1, 2]);
        assert_eq!(stops(&[false, true, true], &tokens[..3]), [1, 2]);
    }

    #[test]
    fn unknown_pre_tokenizers_are_named() {
        let err = pre_tokenizer("deepseek-llm").unwrap_err().to_string();
        assert!(
            err.contains("deepseek-llm") && err.contains("qwen2"),
            "{err}"
        );
    }
}
