//! The GGUF header (metadata and tensor table), read by lantern itself so that every count,
//! length, dimension and offset is checked against the bytes the file really has before
//! anything is allocated. candle then only reads tensor data, from ranges checked here.
//!
//! Rules (those of llama.cpp's reader, plus a budget): a count or length never exceeds what
//! the rest of the file could hold; arrays nest at most [`MAX_ARRAY_DEPTH`] deep; the
//! metadata takes at most [`MAX_METADATA_BYTES`] in memory; keys and tensor names are
//! unique; a tensor has at most 4 dimensions, rows that are whole blocks of its type, an
//! offset aligned to `general.alignment` (a power of two), and data inside the file that
//! overlaps no other tensor's.
//!
//! Tensors of a type lantern widens at load ([`WidenedType`]: IQ4_NL, IQ4_XS, MXFP4) are listed
//! in the [`Content`] as the tensors they become (Q8_0, Q5_0), and in [`Header::widened`] with
//! their type in the file; their sizes and blocks are checked as the file stores them.

use crate::iquants::WidenedType;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use candle_core::quantized::GgmlDType;
use std::collections::HashMap;
use std::io::Read;

/// Arrays of arrays are legal GGUF, but no model needs more than this.
pub const MAX_ARRAY_DEPTH: usize = 2;
/// Memory the parsed metadata may take (tokenizer arrays of the largest vocabularies take
/// tens of MiB); past it the file is refused before the allocation.
pub const MAX_METADATA_BYTES: u64 = 256 << 20;
/// GGML's limit on tensor dimensions.
pub const MAX_TENSOR_DIMS: u32 = 4;
const DEFAULT_ALIGNMENT: u64 = 32;
/// Bytes a `Value` takes in memory besides a string's characters.
const VALUE_BYTES: u64 = std::mem::size_of::<Value>() as u64;

/// What is wrong with a GGUF header.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufProblem {
    #[error("the file ends inside {what} (at byte {offset})")]
    Truncated { what: String, offset: u64 },
    #[error("magic bytes {0:#010x} are not GGUF's")]
    BadMagic(u32),
    #[error("GGUF version {0} is not supported (supported: 1, 2, 3)")]
    UnsupportedVersion(u32),
    #[error("the header declares {count} {what}, more than the {remaining} bytes left in the file could hold")]
    CountTooLarge {
        what: &'static str,
        count: u64,
        remaining: u64,
    },
    #[error("{what} is {len} bytes long, more than the {remaining} bytes left in the file")]
    StringTooLong {
        what: String,
        len: u64,
        remaining: u64,
    },
    #[error("metadata `{key}` has unknown value type {value_type}")]
    UnknownValueType { key: String, value_type: u32 },
    #[error("metadata `{key}` is an array of {len} elements, more than the {remaining} bytes left in the file could hold")]
    ArrayTooLong {
        key: String,
        len: u64,
        remaining: u64,
    },
    #[error("metadata `{key}` nests arrays deeper than {MAX_ARRAY_DEPTH} levels")]
    NestedTooDeep { key: String },
    #[error("metadata `{key}` holds a boolean of value {byte} (expected 0 or 1)")]
    BadBool { key: String, byte: u8 },
    #[error("metadata `{0}` appears twice")]
    DuplicateKey(String),
    #[error("metadata `{key}` would take more than {MAX_METADATA_BYTES} bytes of memory")]
    MetadataTooLarge { key: String },
    #[error("`general.alignment` is {0}; it must be a power of two no larger than 2^31")]
    BadAlignment(String),
    #[error("tensor `{tensor}` has {dims} dimensions (at most {MAX_TENSOR_DIMS})")]
    TooManyDims { tensor: String, dims: u32 },
    #[error("tensor `{tensor}` has dimensions {dims:?}, too many elements")]
    TooManyElements { tensor: String, dims: Vec<u64> },
    #[error("tensor `{tensor}` has unknown type {ggml_type}")]
    UnknownTensorType { tensor: String, ggml_type: u32 },
    /// A type ggml has and lantern does not read: the file is fine, lantern is not.
    #[error("tensor `{tensor}` is of type {type_name}, which lantern does not read yet")]
    UnreadType {
        tensor: String,
        type_name: &'static str,
    },
    #[error("tensor `{tensor}` has rows of {row} elements, not whole blocks of {block} of its type {dtype}")]
    PartialBlock {
        tensor: String,
        row: u64,
        block: u64,
        dtype: String,
    },
    #[error(
        "tensor `{tensor}` starts at offset {offset}, not a multiple of the alignment {alignment}"
    )]
    Misaligned {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensor `{tensor}` has an offset {offset} beyond any file")]
    OffsetOverflow { tensor: String, offset: u64 },
    #[error("tensors `{first}` and `{second}` overlap in the file")]
    Overlap { first: String, second: String },
    #[error("tensor `{0}` appears twice")]
    DuplicateTensor(String),
}

/// A tensor whose data runs past the end of the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPastEnd {
    pub tensor: String,
    pub needed: u64,
}

/// Why a header was refused: a problem in the header, or tensor data past the end.
#[derive(Debug, Clone, PartialEq)]
pub enum HeaderError {
    Invalid(GgufProblem),
    PastEnd(TensorPastEnd),
}

impl From<GgufProblem> for HeaderError {
    fn from(p: GgufProblem) -> Self {
        Self::Invalid(p)
    }
}

/// A checked header: what candle reads, and the tensors widened at load.
pub struct Header {
    pub content: Content,
    /// Tensors stored as a type lantern widens (listed in `content` as their Q8_0 form).
    pub widened: HashMap<String, WidenedType>,
}

/// A tensor's entry: as candle sees it, and its type in the file where widened.
type Entry = (String, TensorInfo, Option<WidenedType>);

/// Reads and checks the header of a GGUF file of `file_len` bytes from its start.
pub fn read_header<R: Read>(reader: R, file_len: u64) -> Result<Header, HeaderError> {
    let mut r = Reader {
        inner: reader,
        pos: 0,
        len: file_len,
        metadata_bytes: 0,
    };
    let magic = r.u32("the magic bytes")?;
    if magic != 0x4655_4747 {
        return Err(GgufProblem::BadMagic(magic).into());
    }
    let magic = match r.u32("the version")? {
        1 => VersionedMagic::GgufV1,
        2 => VersionedMagic::GgufV2,
        3 => VersionedMagic::GgufV3,
        v => return Err(GgufProblem::UnsupportedVersion(v).into()),
    };
    let wide = !matches!(magic, VersionedMagic::GgufV1);
    let prefix = if wide { 8 } else { 4 };
    let tensor_count = r.length(wide, "the tensor count")?;
    let kv_count = r.length(wide, "the metadata count")?;
    // A metadata entry takes at least a key length, a type and one byte; a tensor entry a
    // name length, a dimension count, a type and an offset.
    r.check_count("metadata entries", kv_count, prefix + 4 + 1)?;
    r.check_count("tensors", tensor_count, prefix + 4 + 4 + 8)?;

    let mut metadata = HashMap::new();
    for i in 0..kv_count {
        let key = r.string(wide, &format!("the name of metadata entry {i}"))?;
        let value_type = r.u32(&format!("the type of `{key}`"))?;
        let value = r.value(wide, &key, value_type, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(GgufProblem::DuplicateKey(key).into());
        }
    }
    let mut entries: Vec<Entry> = Vec::new();
    for i in 0..tensor_count {
        let name = r.string(wide, &format!("the name of tensor {i}"))?;
        let (info, widened) = r.tensor_info(wide, &name)?;
        entries.push((name, info, widened));
    }
    let alignment = alignment(&metadata)?;
    let tensor_data_offset = r
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| GgufProblem::BadAlignment(alignment.to_string()))?;
    check_tensor_data(&entries, alignment, tensor_data_offset, file_len)?;
    let mut tensor_infos = HashMap::with_capacity(entries.len());
    let mut widened = HashMap::new();
    for (name, info, stored) in entries {
        if tensor_infos.contains_key(&name) {
            return Err(GgufProblem::DuplicateTensor(name).into());
        }
        if let Some(stored) = stored {
            widened.insert(name.clone(), stored);
        }
        tensor_infos.insert(name, info);
    }
    Ok(Header {
        content: Content {
            magic,
            metadata,
            tensor_infos,
            tensor_data_offset,
        },
        widened,
    })
}

/// `general.alignment`: an unsigned power of two (32 when absent).
fn alignment(metadata: &HashMap<String, Value>) -> Result<u64, GgufProblem> {
    let value = match metadata.get("general.alignment") {
        None => return Ok(DEFAULT_ALIGNMENT),
        Some(Value::U8(v)) => *v as u64,
        Some(Value::U16(v)) => *v as u64,
        Some(Value::U32(v)) => *v as u64,
        Some(Value::U64(v)) => *v,
        Some(other) => return Err(GgufProblem::BadAlignment(format!("{other:?}"))),
    };
    if value.is_power_of_two() && value <= u32::MAX as u64 {
        Ok(value)
    } else {
        Err(GgufProblem::BadAlignment(value.to_string()))
    }
}

/// Weights per block and bytes per block of a tensor's type in the file.
fn block_of(dtype: GgmlDType, widened: Option<WidenedType>) -> (u64, u64) {
    match widened {
        Some(w) => (w.block_size() as u64, w.type_size() as u64),
        None => (dtype.block_size() as u64, dtype.type_size() as u64),
    }
}

/// Bytes of a tensor's data in the file: whole blocks of its type.
pub fn data_bytes(info: &TensorInfo, widened: Option<WidenedType>) -> u64 {
    let (block, size) = block_of(info.ggml_dtype, widened);
    (info.shape.elem_count() as u64 / block) * size
}

/// Every tensor aligned, inside the file, and apart from the others.
fn check_tensor_data(
    entries: &[Entry],
    alignment: u64,
    data_start: u64,
    file_len: u64,
) -> Result<(), HeaderError> {
    let mut ranges: Vec<(u64, u64, &str)> = Vec::with_capacity(entries.len());
    for (name, info, widened) in entries {
        if info.offset % alignment != 0 {
            return Err(GgufProblem::Misaligned {
                tensor: name.clone(),
                offset: info.offset,
                alignment,
            }
            .into());
        }
        let start =
            data_start
                .checked_add(info.offset)
                .ok_or_else(|| GgufProblem::OffsetOverflow {
                    tensor: name.clone(),
                    offset: info.offset,
                })?;
        // `data_bytes` is at most `i64::MAX` (checked when the dimensions were read).
        let end = start
            .checked_add(data_bytes(info, *widened))
            .ok_or_else(|| GgufProblem::OffsetOverflow {
                tensor: name.clone(),
                offset: info.offset,
            })?;
        if end > file_len {
            return Err(HeaderError::PastEnd(TensorPastEnd {
                tensor: name.clone(),
                needed: end,
            }));
        }
        ranges.push((start, end, name));
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let ((_, end, first), (start, _, second)) = (pair[0], pair[1]);
        if start < end {
            return Err(GgufProblem::Overlap {
                first: first.to_string(),
                second: second.to_string(),
            }
            .into());
        }
    }
    Ok(())
}

/// GGML's tensor type numbers (ggml.h), for the types candle reads.
fn ggml_dtype(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// The names of ggml's other tensor types (ggml.h), which a valid file may hold but
/// lantern does not read yet (the i-quants it does not widen, ternary types).
fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        _ => return None,
    })
}

/// A reader that knows its position and what is left, and names what it was reading
/// when the file ends.
struct Reader<R> {
    inner: R,
    pos: u64,
    len: u64,
    metadata_bytes: u64,
}

impl<R: Read> Reader<R> {
    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufProblem> {
        let mut buf = [0u8; N];
        self.inner
            .read_exact(&mut buf)
            .map_err(|_| GgufProblem::Truncated {
                what: what.to_string(),
                offset: self.pos,
            })?;
        self.pos += N as u64;
        Ok(buf)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufProblem> {
        self.bytes(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufProblem> {
        self.bytes(what).map(u64::from_le_bytes)
    }

    /// A length or count: 32 bits in version 1, 64 after.
    fn length(&mut self, wide: bool, what: &str) -> Result<u64, GgufProblem> {
        if wide {
            self.u64(what)
        } else {
            self.u32(what).map(u64::from)
        }
    }

    fn check_count(
        &self,
        what: &'static str,
        count: u64,
        min_bytes: u64,
    ) -> Result<(), GgufProblem> {
        let remaining = self.remaining();
        if count.saturating_mul(min_bytes) > remaining {
            return Err(GgufProblem::CountTooLarge {
                what,
                count,
                remaining,
            });
        }
        Ok(())
    }

    fn string(&mut self, wide: bool, what: &str) -> Result<String, GgufProblem> {
        let len = self.length(wide, what)?;
        let remaining = self.remaining();
        if len > remaining {
            return Err(GgufProblem::StringTooLong {
                what: what.to_string(),
                len,
                remaining,
            });
        }
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|_| GgufProblem::Truncated {
                what: what.to_string(),
                offset: self.pos,
            })?;
        self.pos += len;
        // Writers sometimes end strings with NULs, and some files hold invalid UTF-8:
        // llama.cpp accepts both, so lantern does too.
        while buf.last() == Some(&0) {
            buf.pop();
        }
        Ok(String::from_utf8(buf).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into()))
    }

    /// Counts `bytes` of memory against the metadata budget.
    fn charge(&mut self, key: &str, bytes: u64) -> Result<(), GgufProblem> {
        self.metadata_bytes = self.metadata_bytes.saturating_add(bytes);
        if self.metadata_bytes > MAX_METADATA_BYTES {
            return Err(GgufProblem::MetadataTooLarge {
                key: key.to_string(),
            });
        }
        Ok(())
    }

    fn value(
        &mut self,
        wide: bool,
        key: &str,
        value_type: u32,
        depth: usize,
    ) -> Result<Value, GgufProblem> {
        let what = || format!("the value of `{key}`");
        Ok(match value_type {
            0 => Value::U8(u8::from_le_bytes(self.bytes(&what())?)),
            1 => Value::I8(i8::from_le_bytes(self.bytes(&what())?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes(&what())?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes(&what())?)),
            4 => Value::U32(u32::from_le_bytes(self.bytes(&what())?)),
            5 => Value::I32(i32::from_le_bytes(self.bytes(&what())?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes(&what())?)),
            7 => match self.bytes::<1>(&what())?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                byte => {
                    return Err(GgufProblem::BadBool {
                        key: key.to_string(),
                        byte,
                    })
                }
            },
            8 => {
                let s = self.string(wide, &what())?;
                self.charge(key, s.len() as u64)?;
                Value::String(s)
            }
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufProblem::NestedTooDeep {
                        key: key.to_string(),
                    });
                }
                let element_type = self.u32(&what())?;
                let len = self.length(wide, &what())?;
                let min_bytes = match element_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 => {
                        if wide {
                            8
                        } else {
                            4
                        }
                    }
                    9 => 4 + if wide { 8 } else { 4 },
                    10..=12 => 8,
                    other => {
                        return Err(GgufProblem::UnknownValueType {
                            key: key.to_string(),
                            value_type: other,
                        })
                    }
                };
                let remaining = self.remaining();
                if len.saturating_mul(min_bytes) > remaining {
                    return Err(GgufProblem::ArrayTooLong {
                        key: key.to_string(),
                        len,
                        remaining,
                    });
                }
                self.charge(key, len.saturating_mul(VALUE_BYTES))?;
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(wide, key, element_type, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.bytes(&what())?)),
            11 => Value::I64(i64::from_le_bytes(self.bytes(&what())?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes(&what())?)),
            other => {
                return Err(GgufProblem::UnknownValueType {
                    key: key.to_string(),
                    value_type: other,
                })
            }
        })
    }

    fn tensor_info(
        &mut self,
        wide: bool,
        name: &str,
    ) -> Result<(TensorInfo, Option<WidenedType>), GgufProblem> {
        let what = format!("the entry of tensor `{name}`");
        let n_dims = self.u32(&what)?;
        if n_dims > MAX_TENSOR_DIMS {
            return Err(GgufProblem::TooManyDims {
                tensor: name.to_string(),
                dims: n_dims,
            });
        }
        // GGUF lists dimensions innermost first: `dims[0]` is the row length.
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.length(wide, &what)?);
        }
        let type_id = self.u32(&what)?;
        let widened = WidenedType::from_ggml(type_id);
        let dtype = match widened {
            Some(w) => Some(w.target()),
            None => ggml_dtype(type_id),
        };
        let dtype = dtype.ok_or_else(|| match ggml_type_name(type_id) {
            Some(type_name) => GgufProblem::UnreadType {
                tensor: name.to_string(),
                type_name,
            },
            None => GgufProblem::UnknownTensorType {
                tensor: name.to_string(),
                ggml_type: type_id,
            },
        })?;
        // The element count and the byte size must both fit in `i64`, as ggml requires.
        let max = i64::MAX as u64;
        let elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= max && usize::try_from(n).is_ok());
        // As stored, and as held in memory (a widened type's Q8_0 form is about twice).
        let (block, type_size) = block_of(dtype, widened);
        let in_memory = (dtype.block_size() as u64, dtype.type_size() as u64);
        let bytes = elements
            .and_then(|n| {
                let stored = (n / block).checked_mul(type_size)?;
                let held = (n / in_memory.0).checked_mul(in_memory.1)?;
                Some(stored.max(held))
            })
            .filter(|&b| b <= max);
        if bytes.is_none() {
            return Err(GgufProblem::TooManyElements {
                tensor: name.to_string(),
                dims,
            });
        }
        let row = dims.first().copied().unwrap_or(1);
        if row % block != 0 {
            return Err(GgufProblem::PartialBlock {
                tensor: name.to_string(),
                row,
                block,
                dtype: widened.map_or_else(|| format!("{dtype:?}"), |w| w.name().to_string()),
            });
        }
        let offset = self.u64(&what)?;
        let shape: Vec<usize> = dims.iter().rev().map(|&d| d as usize).collect();
        let info = TensorInfo {
            ggml_dtype: dtype,
            shape: candle_core::Shape::from(shape),
            offset,
        };
        Ok((info, widened))
    }
}
