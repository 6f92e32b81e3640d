//! A corpus of malformed model files, built from two real ones (the synthetic tiny Llama
//! and llama.cpp's conversion of a tiny Gemma 3 in `tests/fixtures/gguf`): truncations at
//! many offsets, counts and lengths set huge, wrong value types, mismatched tokenizer
//! arrays, bad alignment and offsets, overflowing dimensions, broken chat templates.
//!
//! Each file is loaded in a child process (this test binary, re-run on one file) under an
//! address-space limit and a time limit, so an abort, an unbounded allocation or a hang
//! fails the case it belongs to. Every file must give an error that names its problem —
//! except broken chat templates, which load, warn, and fail chat requests only.

use lantern_model::synthetic::TinyLlama;
use lantern_model::{load_model, ChatMessage, LoadOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Env var that makes [`corpus_child`] load one file and report.
const CHILD_FILE: &str = "LANTERN_CORPUS_FILE";
/// Address space a child may add to what it had at start: an allocation past it fails.
const ADDRESS_SPACE_ALLOWANCE: u64 = 2 << 30;
/// Resident memory a child may reach in all (the models are under 1 MB; loading the
/// unbroken ones peaks near 10 MiB).
const MAX_PEAK_RSS_KB: u64 = 64 << 10;
/// Time one load may take.
const TIME_LIMIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------
// A GGUF file taken apart into entries that can be edited and written back.

const T_U8: u32 = 0;
const T_I32: u32 = 5;
const T_U32: u32 = 4;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;

#[derive(Clone)]
struct Kv {
    key: String,
    ty: u32,
    /// The value as stored, without its type.
    raw: Vec<u8>,
}

#[derive(Clone)]
struct TensorEntry {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    offset: u64,
}

#[derive(Clone)]
struct Gguf {
    version: u32,
    kvs: Vec<Kv>,
    tensors: Vec<TensorEntry>,
    /// Everything from the start of tensor data to the end of the file.
    data: Vec<u8>,
}

/// Where the fields of a written file lie, to patch them afterwards.
#[derive(Default)]
struct Marks {
    at: HashMap<String, usize>,
    header_end: usize,
    data_start: usize,
}

fn u32_at(b: &[u8], p: usize) -> u32 {
    u32::from_le_bytes(b[p..p + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], p: usize) -> u64 {
    u64::from_le_bytes(b[p..p + 8].try_into().unwrap())
}

/// Bytes a value of type `ty` takes at the start of `b`.
fn value_len(ty: u32, b: &[u8]) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        T_STRING => 8 + u64_at(b, 0) as usize,
        T_ARRAY => {
            let (elem, len) = (u32_at(b, 0), u64_at(b, 4));
            let mut p = 12;
            for _ in 0..len {
                p += value_len(elem, &b[p..]);
            }
            p
        }
        other => panic!("value type {other} in a fixture"),
    }
}

fn string_raw(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

fn array_raw(elem: u32, items: &[Vec<u8>]) -> Vec<u8> {
    let mut v = elem.to_le_bytes().to_vec();
    v.extend_from_slice(&(items.len() as u64).to_le_bytes());
    for item in items {
        v.extend_from_slice(item);
    }
    v
}

/// An array of `len` zero bytes.
fn zero_bytes_array(len: usize) -> Vec<u8> {
    let mut v = T_U8.to_le_bytes().to_vec();
    v.extend_from_slice(&(len as u64).to_le_bytes());
    v.resize(v.len() + len, 0);
    v
}

/// The elements of an array value, each as stored.
fn array_items(raw: &[u8]) -> (u32, Vec<Vec<u8>>) {
    let (elem, len) = (u32_at(raw, 0), u64_at(raw, 4));
    let mut p = 12;
    let mut items = Vec::new();
    for _ in 0..len {
        let n = value_len(elem, &raw[p..]);
        items.push(raw[p..p + n].to_vec());
        p += n;
    }
    (elem, items)
}

impl Gguf {
    fn parse(b: &[u8]) -> Self {
        assert_eq!(&b[..4], b"GGUF");
        let version = u32_at(b, 4);
        assert!(version >= 2, "fixtures are GGUF v2 or v3");
        let (n_tensors, n_kv) = (u64_at(b, 8), u64_at(b, 16));
        let mut p = 24;
        let read_string = |p: &mut usize| {
            let n = u64_at(b, *p) as usize;
            let s = String::from_utf8(b[*p + 8..*p + 8 + n].to_vec()).unwrap();
            *p += 8 + n;
            s
        };
        let mut kvs = Vec::new();
        for _ in 0..n_kv {
            let key = read_string(&mut p);
            let ty = u32_at(b, p);
            p += 4;
            let n = value_len(ty, &b[p..]);
            kvs.push(Kv {
                key,
                ty,
                raw: b[p..p + n].to_vec(),
            });
            p += n;
        }
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let name = read_string(&mut p);
            let n_dims = u32_at(b, p) as usize;
            p += 4;
            let dims = (0..n_dims).map(|i| u64_at(b, p + 8 * i)).collect();
            p += 8 * n_dims;
            let ty = u32_at(b, p);
            let offset = u64_at(b, p + 4);
            p += 12;
            tensors.push(TensorEntry {
                name,
                dims,
                ty,
                offset,
            });
        }
        let data_start = p.next_multiple_of(32);
        Self {
            version,
            kvs,
            tensors,
            data: b[data_start..].to_vec(),
        }
    }

    fn write(&self) -> (Vec<u8>, Marks) {
        let mut marks = Marks::default();
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        marks.at.insert("tensor_count".into(), b.len());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        marks.at.insert("kv_count".into(), b.len());
        b.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for kv in &self.kvs {
            marks.at.insert(format!("key:{}", kv.key), b.len());
            b.extend_from_slice(&string_raw(&kv.key));
            marks.at.insert(format!("type:{}", kv.key), b.len());
            b.extend_from_slice(&kv.ty.to_le_bytes());
            marks.at.insert(format!("value:{}", kv.key), b.len());
            b.extend_from_slice(&kv.raw);
        }
        for t in &self.tensors {
            marks.at.insert(format!("tensor:{}", t.name), b.len());
            b.extend_from_slice(&string_raw(&t.name));
            marks.at.insert(format!("ndims:{}", t.name), b.len());
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.ty.to_le_bytes());
            b.extend_from_slice(&t.offset.to_le_bytes());
        }
        marks.header_end = b.len();
        b.resize(b.len().next_multiple_of(32), 0);
        marks.data_start = b.len();
        b.extend_from_slice(&self.data);
        (b, marks)
    }

    fn bytes(&self) -> Vec<u8> {
        self.write().0
    }

    fn kv_mut(&mut self, key: &str) -> &mut Kv {
        self.kvs
            .iter_mut()
            .find(|kv| kv.key == key)
            .unwrap_or_else(|| panic!("fixture has no `{key}`"))
    }

    fn set(mut self, key: &str, ty: u32, raw: Vec<u8>) -> Self {
        match self.kvs.iter_mut().find(|kv| kv.key == key) {
            Some(kv) => {
                kv.ty = ty;
                kv.raw = raw;
            }
            None => self.kvs.push(Kv {
                key: key.into(),
                ty,
                raw,
            }),
        }
        self
    }

    fn set_u32(self, key: &str, v: u32) -> Self {
        self.set(key, T_U32, v.to_le_bytes().to_vec())
    }

    fn set_u64(self, key: &str, v: u64) -> Self {
        self.set(key, T_U64, v.to_le_bytes().to_vec())
    }

    fn set_str(self, key: &str, v: &str) -> Self {
        self.set(key, T_STRING, string_raw(v))
    }

    fn edit_array(mut self, key: &str, f: impl FnOnce(&mut u32, &mut Vec<Vec<u8>>)) -> Self {
        let kv = self.kv_mut(key);
        let (mut elem, mut items) = array_items(&kv.raw);
        f(&mut elem, &mut items);
        kv.raw = array_raw(elem, &items);
        self
    }

    fn tensor_mut(&mut self, index: usize) -> &mut TensorEntry {
        &mut self.tensors[index]
    }

    fn arch(&self) -> String {
        let kv = self
            .kvs
            .iter()
            .find(|kv| kv.key == "general.architecture")
            .unwrap();
        String::from_utf8(kv.raw[8..].to_vec()).unwrap()
    }
}

fn patch_u64(mut b: Vec<u8>, at: usize, v: u64) -> Vec<u8> {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    b
}

fn patch_u32(mut b: Vec<u8>, at: usize, v: u32) -> Vec<u8> {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    b
}

// ---------------------------------------------------------------------------------------
// The corpus.

/// What loading a case must give.
#[derive(Clone, Debug)]
enum Expect {
    /// An error whose message contains each of these (`a|b`: either).
    Error(Vec<String>),
    /// The model loads; chat rendering fails naming the chat template; raw prompts work.
    ChatBroken,
    /// The model loads (the unbroken fixtures).
    Loads,
}

struct Case {
    name: String,
    bytes: Vec<u8>,
    expect: Expect,
}

fn err<S: AsRef<str>>(words: &[S]) -> Expect {
    Expect::Error(words.iter().map(|w| w.as_ref().to_string()).collect())
}

fn fixture_bases() -> Vec<(&'static str, Gguf)> {
    let dir = tempfile::tempdir().unwrap();
    let llama = dir.path().join("llama.gguf");
    TinyLlama::default().write(&llama).unwrap();
    let gemma = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gguf/gemma3_text.q8_0.gguf");
    vec![
        ("llama", Gguf::parse(&std::fs::read(llama).unwrap())),
        ("gemma", Gguf::parse(&std::fs::read(gemma).unwrap())),
    ]
}

fn corpus() -> Vec<Case> {
    let mut cases = Vec::new();
    for (base_name, base) in fixture_bases() {
        let mut add = |name: &str, bytes: Vec<u8>, expect: Expect| {
            cases.push(Case {
                name: format!("{base_name}/{name}"),
                bytes,
                expect,
            })
        };
        let arch = base.arch();
        let key = |k: &str| format!("{arch}.{k}");
        let (whole, marks) = base.write();
        add("unchanged", whole.clone(), Expect::Loads);

        // Truncations: inside the header at many offsets, then inside the tensor data.
        for i in 0..14 {
            let cut = 1 + i * (marks.header_end - 1) / 14;
            add(
                &format!("cut at {cut} (header)"),
                whole[..cut].to_vec(),
                err(&["ends inside|bytes left"]),
            );
        }
        for i in 0..6 {
            let cut = marks.data_start + 1 + i * (whole.len() - marks.data_start - 2) / 6;
            add(
                &format!("cut at {cut} (data)"),
                whole[..cut].to_vec(),
                err(&["truncated", "tensor `"]),
            );
        }

        // The fixed header.
        add(
            "bad magic",
            patch_u32(whole.clone(), 0, 0x5855_4747),
            err(&["magic"]),
        );
        add(
            "version 0",
            patch_u32(whole.clone(), 4, 0),
            err(&["version 0"]),
        );
        add(
            "version 9",
            patch_u32(whole.clone(), 4, 9),
            err(&["version 9"]),
        );
        for (field, value) in [
            ("tensor_count", u64::MAX),
            ("kv_count", u64::MAX),
            ("kv_count", 1 << 40),
            ("tensor_count", 1 << 33),
        ] {
            add(
                &format!("{field} {value}"),
                patch_u64(whole.clone(), marks.at[field], value),
                err(&["declares", "more than"]),
            );
        }
        let kv_count = base.kvs.len() as u64;
        add(
            "one metadata entry too many",
            patch_u64(whole.clone(), marks.at["kv_count"], kv_count + 1),
            err::<&str>(&[]),
        );
        add(
            "one tensor too few",
            patch_u64(
                whole.clone(),
                marks.at["tensor_count"],
                base.tensors.len() as u64 - 1,
            ),
            err::<&str>(&[]),
        );

        // Metadata lengths, types and counts.
        let first_key = &base.kvs[0].key;
        add(
            "first key length huge",
            patch_u64(
                whole.clone(),
                marks.at[&format!("key:{first_key}")],
                u64::MAX,
            ),
            err(&["the name of metadata entry 0", "bytes long"]),
        );
        add(
            "architecture string length huge",
            patch_u64(
                whole.clone(),
                marks.at["value:general.architecture"],
                1 << 50,
            ),
            err(&["`general.architecture`", "bytes long"]),
        );
        add(
            "unknown value type",
            patch_u32(
                whole.clone(),
                marks.at[&format!("type:{}", key("block_count"))],
                99,
            ),
            err(&["unknown value type 99"]),
        );
        let tokens_at = marks.at["value:tokenizer.ggml.tokens"];
        add(
            "token array length huge",
            patch_u64(whole.clone(), tokens_at + 4, u64::MAX),
            err(&["`tokenizer.ggml.tokens`", "array of"]),
        );
        add(
            "token array length 2^31",
            patch_u64(whole.clone(), tokens_at + 4, 1 << 31),
            err(&["`tokenizer.ggml.tokens`", "array of"]),
        );
        add(
            "token array of unknown element type",
            patch_u32(whole.clone(), tokens_at, 77),
            err(&["`tokenizer.ggml.tokens`", "unknown value type 77"]),
        );
        let token_type_at = marks.at["value:tokenizer.ggml.token_type"];
        add(
            "token types of unknown element type",
            patch_u32(whole.clone(), token_type_at, 13),
            err(&["`tokenizer.ggml.token_type`", "unknown value type 13"]),
        );
        let nested = array_raw(
            T_ARRAY,
            &[array_raw(T_ARRAY, &[array_raw(T_U8, &[vec![1]])])],
        );
        add(
            "arrays nested three deep",
            base.clone().set("x.nested", T_ARRAY, nested).bytes(),
            err(&["`x.nested`", "nests arrays"]),
        );
        add(
            "boolean of value 7",
            base.clone()
                .set("tokenizer.ggml.add_bos_token", T_BOOL, vec![7])
                .bytes(),
            err(&["`tokenizer.ggml.add_bos_token`", "boolean of value 7"]),
        );
        let mut dup = base.clone();
        dup.kvs.push(dup.kvs[1].clone());
        add("duplicate key", dup.bytes(), err(&["appears twice"]));
        add(
            "metadata past the memory budget",
            base.clone()
                .set("x.big", T_ARRAY, zero_bytes_array(9 << 20))
                .bytes(),
            err(&["`x.big`", "bytes of memory"]),
        );

        // Values of the wrong type.
        let wrong_types: Vec<(String, u32, Vec<u8>)> = vec![
            (
                "general.architecture".into(),
                T_U32,
                7u32.to_le_bytes().to_vec(),
            ),
            (key("block_count"), T_STRING, string_raw("two")),
            (key("block_count"), T_F32, 2f32.to_le_bytes().to_vec()),
            (
                key("attention.head_count"),
                T_I32,
                (-4i32).to_le_bytes().to_vec(),
            ),
            (key("embedding_length"), T_BOOL, vec![1]),
            (
                key("attention.layer_norm_rms_epsilon"),
                T_STRING,
                string_raw("tiny"),
            ),
            (
                "tokenizer.ggml.model".into(),
                T_U32,
                1u32.to_le_bytes().to_vec(),
            ),
            (
                "tokenizer.ggml.tokens".into(),
                T_ARRAY,
                array_raw(T_U32, &[1u32.to_le_bytes().to_vec()]),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                T_ARRAY,
                array_raw(T_STRING, &[string_raw("normal")]),
            ),
            (
                "tokenizer.ggml.eos_token_id".into(),
                T_STRING,
                string_raw("</s>"),
            ),
            ("general.alignment".into(), T_STRING, string_raw("32")),
        ];
        for (k, ty, raw) in wrong_types {
            add(
                &format!("{k} of type {ty}"),
                base.clone().set(&k, ty, raw).bytes(),
                err(&[format!("`{k}`")]),
            );
        }

        // Hyper-parameters that do not fit the file.
        let block_count = format!("`{}`", key("block_count"));
        add(
            "block_count u64::MAX",
            base.clone().set_u64(&key("block_count"), u64::MAX).bytes(),
            err(&[&block_count]),
        );
        add(
            "block_count 10^9",
            base.clone()
                .set_u32(&key("block_count"), 1_000_000_000)
                .bytes(),
            err(&[&block_count]),
        );
        add(
            "block_count 0",
            base.clone().set_u32(&key("block_count"), 0).bytes(),
            err(&["non-zero"]),
        );
        add(
            "embedding_length huge",
            base.clone()
                .set_u64(&key("embedding_length"), 1 << 40)
                .bytes(),
            err(&["invalid model configuration"]),
        );
        add(
            "head_count 0",
            base.clone()
                .set_u32(&key("attention.head_count"), 0)
                .bytes(),
            err(&["attention heads"]),
        );
        add(
            "head_count_kv 3",
            base.clone()
                .set_u32(&key("attention.head_count_kv"), 3)
                .bytes(),
            err(&["cannot share 3 KV heads"]),
        );
        add(
            "feed_forward_length u64::MAX",
            base.clone()
                .set_u64(&key("feed_forward_length"), u64::MAX)
                .bytes(),
            err(&["feed_forward_length"]),
        );
        add(
            "vocab_size huge",
            base.clone().set_u64(&key("vocab_size"), 1 << 45).bytes(),
            err(&["vocab_size"]),
        );
        add(
            "key_length huge",
            base.clone()
                .set_u64(&key("attention.key_length"), 1 << 50)
                .bytes(),
            err(&["key_length"]),
        );
        add(
            "odd rotary dimension",
            base.clone()
                .set_u32(&key("rope.dimension_count"), 7)
                .bytes(),
            err(&["rotary dimension 7"]),
        );

        // Tokenizer arrays that do not agree.
        add(
            "token types longer than tokens",
            base.clone()
                .edit_array("tokenizer.ggml.token_type", |_, items| {
                    items.push(1i32.to_le_bytes().to_vec())
                })
                .bytes(),
            err(&["`tokenizer.ggml.token_type`", "entries for"]),
        );
        add(
            "token types shorter than tokens",
            base.clone()
                .edit_array("tokenizer.ggml.token_type", |_, items| {
                    items.truncate(items.len() / 2)
                })
                .bytes(),
            err(&["`tokenizer.ggml.token_type`", "entries for"]),
        );
        add(
            "no tokens",
            base.clone()
                .edit_array("tokenizer.ggml.tokens", |_, items| items.clear())
                .bytes(),
            err(&["`tokenizer.ggml.tokens` is empty"]),
        );
        add(
            "eos id outside the vocabulary",
            base.clone()
                .set_u32("tokenizer.ggml.eos_token_id", 999_999)
                .bytes(),
            err(&["`tokenizer.ggml.eos_token_id`", "outside the vocabulary"]),
        );
        add(
            "bos id u64::MAX",
            base.clone()
                .set_u64("tokenizer.ggml.bos_token_id", u64::MAX)
                .bytes(),
            err(&["`tokenizer.ggml.bos_token_id`"]),
        );
        add(
            "unknown tokenizer model",
            base.clone()
                .set_str("tokenizer.ggml.model", "unigram")
                .bytes(),
            err(&["`unigram` is not supported"]),
        );

        // Broken chat templates: the model loads, chat fails, raw prompts work.
        for (name, template) in [
            ("unclosed loop", "{% for m in messages %}{{ m.content }}"),
            ("unknown tag", "{% frobnicate %}"),
            ("unbalanced braces", "{{ messages[0].content "),
            ("raises", "{{ raise_exception('this model has no chat') }}"),
        ] {
            add(
                &format!("chat template: {name}"),
                base.clone()
                    .set_str("tokenizer.chat_template", template)
                    .bytes(),
                Expect::ChatBroken,
            );
        }
        add(
            "chat template of type u32",
            base.clone().set_u32("tokenizer.chat_template", 5).bytes(),
            Expect::ChatBroken,
        );

        // The tensor table.
        let first = base.tensors[0].name.clone();
        add(
            "tensor name length huge",
            patch_u64(whole.clone(), marks.at[&format!("tensor:{first}")], 1 << 62),
            err(&["the name of tensor 0", "bytes long"]),
        );
        for n_dims in [5, u32::MAX] {
            add(
                &format!("{n_dims} dimensions"),
                patch_u32(whole.clone(), marks.at[&format!("ndims:{first}")], n_dims),
                err(&[format!("{n_dims} dimensions")]),
            );
        }
        for dims in [
            vec![1 << 40, 1 << 40],
            vec![1 << 32, 1 << 32],
            vec![u64::MAX, 1],
        ] {
            let mut g = base.clone();
            g.tensor_mut(0).dims = dims.clone();
            add(
                &format!("dimensions {dims:?}"),
                g.bytes(),
                err(&["too many elements"]),
            );
        }
        let mut g = base.clone();
        let norm = g
            .tensors
            .iter()
            .position(|t| t.name.ends_with("attn_norm.weight"))
            .unwrap();
        g.tensor_mut(norm).dims = vec![0];
        add("a dimension of 0", g.bytes(), err(&["has shape"]));
        for ty in [99, 4] {
            let mut g = base.clone();
            g.tensor_mut(0).ty = ty;
            add(
                &format!("tensor type {ty}"),
                g.bytes(),
                err(&[format!("unknown type {ty}")]),
            );
        }
        // A type ggml has and lantern does not read: named, and not called invalid.
        let mut g = base.clone();
        g.tensor_mut(0).ty = 16;
        add(
            "tensor type IQ2_XXS",
            g.bytes(),
            err(&[
                "is of type IQ2_XXS, which lantern does not read yet",
                "Q4_K_M",
            ]),
        );
        let mut g = base.clone();
        g.tensor_mut(norm).ty = 12; // Q4_K: rows of 256
        add("rows not whole blocks", g.bytes(), err(&["whole blocks"]));
        let mut g = base.clone();
        g.tensor_mut(1).offset += 1;
        add("misaligned offset", g.bytes(), err(&["alignment"]));
        let mut g = base.clone();
        g.tensor_mut(1).offset = !31; // the largest aligned offset
        add(
            "offset beyond any file",
            g.bytes(),
            err(&["beyond any file"]),
        );
        let mut g = base.clone();
        g.tensor_mut(1).offset = 1 << 40;
        add("offset past the end", g.bytes(), err(&["truncated"]));
        let mut g = base.clone();
        let (a, b) = (g.tensors[0].offset, g.tensors[1].offset);
        let later = if a > b { 0 } else { 1 };
        g.tensor_mut(later).offset = a.min(b);
        add("overlapping tensors", g.bytes(), err(&["overlap"]));
        let mut g = base.clone();
        g.tensor_mut(1).name = first.clone();
        add("duplicate tensor name", g.bytes(), err(&["appears twice"]));
        for alignment in [0u32, 3, 48] {
            add(
                &format!("alignment {alignment}"),
                base.clone().set_u32("general.alignment", alignment).bytes(),
                err(&["`general.alignment`", "power of two"]),
            );
        }
        add(
            "alignment 2^40",
            base.clone().set_u64("general.alignment", 1 << 40).bytes(),
            err(&["power of two"]),
        );
        add(
            "alignment 1 MiB",
            base.clone().set_u32("general.alignment", 1 << 20).bytes(),
            err(&["truncated"]),
        );

        // Per-architecture keys.
        if base_name == "llama" {
            add(
                "merge without a space",
                base.clone()
                    .edit_array("tokenizer.ggml.merges", |elem, items| {
                        *elem = T_STRING;
                        items.push(string_raw("ab"))
                    })
                    .bytes(),
                err(&["invalid merge entry `ab`"]),
            );
            add(
                "unknown pre-tokenizer",
                base.clone()
                    .set_str("tokenizer.ggml.pre", "klingon")
                    .bytes(),
                err(&["pre-tokenizer `klingon`"]),
            );
        } else {
            add(
                "scores shorter than tokens",
                base.clone()
                    .edit_array("tokenizer.ggml.scores", |_, items| {
                        items.pop();
                    })
                    .bytes(),
                err(&["`tokenizer.ggml.scores` has"]),
            );
            add(
                "scores of strings",
                base.clone()
                    .set(
                        "tokenizer.ggml.scores",
                        T_ARRAY,
                        array_raw(T_STRING, &[string_raw("high")]),
                    )
                    .bytes(),
                err(&["`tokenizer.ggml.scores`"]),
            );
            add(
                "unknown token id outside the vocabulary",
                base.clone()
                    .set_u32("tokenizer.ggml.unknown_token_id", 1 << 30)
                    .bytes(),
                err(&["`tokenizer.ggml.unknown_token_id`"]),
            );
            add(
                "a token 40 KB long",
                base.clone()
                    .edit_array("tokenizer.ggml.tokens", |_, items| {
                        items[600] = string_raw(&"ab".repeat(20_000))
                    })
                    .bytes(),
                err(&["too long to build merges"]),
            );
            add(
                "sliding window 0",
                base.clone()
                    .set_u32(&key("attention.sliding_window"), 0)
                    .bytes(),
                err(&["sliding window of 0"]),
            );
            add(
                "sliding pattern of the wrong length",
                base.clone()
                    .set(
                        &key("attention.sliding_window_pattern"),
                        T_ARRAY,
                        array_raw(T_BOOL, &[vec![1], vec![0]]),
                    )
                    .bytes(),
                err(&["entries for"]),
            );
        }
    }
    cases
}

// ---------------------------------------------------------------------------------------
// Running the cases.

/// What a child reports: the outcome, then its peak resident memory.
fn child_report(path: &Path) -> String {
    match load_model(path, &LoadOptions::default()) {
        Err(e) => format!("error\t{e}"),
        Ok(loaded) => {
            let raw = loaded.tokenizer.encode("hello", true).is_ok();
            let chat = match &loaded.chat_template {
                None => "no template".to_string(),
                Some(t) => match t.render(&[ChatMessage::new("user", "hi")], true) {
                    Ok(_) => "renders".to_string(),
                    Err(e) => format!("fails\t{e}"),
                },
            };
            format!("loaded\traw={raw}\t{chat}")
        }
    }
}

fn status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Run by the parent in a child process: loads one file under an address-space limit.
#[test]
fn corpus_child() {
    let Ok(path) = std::env::var(CHILD_FILE) else {
        return;
    };
    let limit = status_kb("VmSize:") * 1024 + ADDRESS_SPACE_ALLOWANCE;
    let rlimit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: setrlimit only reads the struct passed by reference.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rlimit) }, 0);
    let report = child_report(Path::new(&path));
    println!(
        "CORPUS\t{}\t{}",
        status_kb("VmHWM:"),
        report.replace('\n', " ")
    );
}

struct Outcome {
    peak_kb: u64,
    report: String,
}

fn run_child(path: &Path) -> Result<Outcome, String> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "corpus_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_FILE, path)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the child: {e}"))?;
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if start.elapsed() > TIME_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("took longer than {TIME_LIMIT:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let output = child.wait_with_output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    // The harness prints `test corpus_child ... ` on the same line, before the report.
    let line = stdout
        .lines()
        .find_map(|l| l.find("CORPUS\t").map(|at| &l[at + "CORPUS\t".len()..]));
    match (status.success(), line) {
        (true, Some(line)) => {
            let (peak, report) = line.split_once('\t').unwrap_or(("0", line));
            Ok(Outcome {
                peak_kb: peak.parse().unwrap_or(0),
                report: report.to_string(),
            })
        }
        _ => Err(format!(
            "the child failed ({status}): {}{}",
            stdout.lines().rev().take(5).collect::<Vec<_>>().join(" | "),
            String::from_utf8_lossy(&output.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        )),
    }
}

fn check(case: &Case, outcome: &Outcome) -> Result<(), String> {
    if outcome.peak_kb > MAX_PEAK_RSS_KB {
        return Err(format!("peak resident memory {} KiB", outcome.peak_kb));
    }
    let report = &outcome.report;
    let ok = match &case.expect {
        Expect::Error(words) => {
            report.starts_with("error\t")
                && words
                    .iter()
                    .all(|w| w.split('|').any(|alt| report.contains(alt)))
        }
        Expect::ChatBroken => {
            report.starts_with("loaded\traw=true\tfails\t") && report.contains("chat template")
        }
        Expect::Loads => report.starts_with("loaded\traw=true\trenders"),
    };
    if ok {
        Ok(())
    } else {
        Err(format!("expected {:?}, got: {report}", case.expect))
    }
}

#[test]
fn every_malformed_file_gives_an_error_naming_its_problem_in_bounded_time_and_memory() {
    let cases = corpus();
    let malformed = cases
        .iter()
        .filter(|c| !matches!(c.expect, Expect::Loads))
        .count();
    assert!(malformed >= 60, "only {malformed} malformed files");
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let mut peak = 0;
    for (i, case) in cases.iter().enumerate() {
        let path: PathBuf = dir.path().join(format!("case{i}.gguf"));
        std::fs::write(&path, &case.bytes).unwrap();
        match run_child(&path).and_then(|o| {
            peak = peak.max(o.peak_kb);
            check(case, &o)
        }) {
            Ok(()) => {}
            Err(why) => failures.push(format!("{}: {why}", case.name)),
        }
        let _ = std::fs::remove_file(&path);
    }
    eprintln!(
        "{} cases ({malformed} malformed), largest peak resident memory {peak} KiB",
        cases.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
