//! Reading GGUF files: header, metadata and tensors, with every size checked against the
//! file before anything is read, so a broken file gives an error that names the problem.

use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// An opened GGUF file: its parsed header and a reader for tensor data.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
    file_len: u64,
}

impl GgufFile {
    /// Opens and parses the header; checks that every tensor's data lies inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let open_err = |source| ModelError::Open {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(open_err)?;
        let file_len = file.metadata().map_err(open_err)?.len();
        let mut reader = BufReader::new(file);
        let invalid = |reason: String| ModelError::InvalidGguf {
            path: path.to_path_buf(),
            reason,
        };
        // The header parser validates lengths against the remaining bytes; a panic from a
        // pathological input is still turned into an error rather than taking the process down.
        let parsed =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(&mut reader)))
                .map_err(|_| invalid("the header could not be parsed".into()))?;
        let content = parsed.map_err(|e| invalid(e.to_string()))?;
        let file = Self {
            path: path.to_path_buf(),
            content,
            reader,
            file_len,
        };
        file.check_tensor_bounds()?;
        Ok(file)
    }

    fn check_tensor_bounds(&self) -> Result<()> {
        for (name, info) in &self.content.tensor_infos {
            let elems = info.shape.elem_count() as u64;
            let block = info.ggml_dtype.block_size() as u64;
            if block == 0 || !elems.is_multiple_of(block) {
                return Err(ModelError::InvalidGguf {
                    path: self.path.clone(),
                    reason: format!(
                        "tensor `{name}` has {elems} elements, not a multiple of its type's block size {block}"
                    ),
                });
            }
            let size = (elems / block).checked_mul(info.ggml_dtype.type_size() as u64);
            let end = size
                .and_then(|s| s.checked_add(info.offset))
                .and_then(|s| s.checked_add(self.content.tensor_data_offset));
            match end {
                Some(end) if end <= self.file_len => {}
                Some(end) => {
                    return Err(ModelError::Truncated {
                        path: self.path.clone(),
                        tensor: name.clone(),
                        needed: end,
                        file_len: self.file_len,
                    })
                }
                None => {
                    return Err(ModelError::InvalidGguf {
                        path: self.path.clone(),
                        reason: format!("tensor `{name}` has an impossible size or offset"),
                    })
                }
            }
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn required(&self, key: &str) -> Result<&Value> {
        self.metadata(key).ok_or_else(|| ModelError::MissingKey {
            key: key.to_string(),
        })
    }

    pub fn get_string(&self, key: &str) -> Result<&str> {
        self.required(key)?
            .to_string()
            .map(|s| s.as_str())
            .map_err(|_| wrong_type(key, "string"))
    }

    pub fn opt_string(&self, key: &str) -> Result<Option<&str>> {
        self.metadata(key)
            .map(|v| {
                v.to_string()
                    .map(|s| s.as_str())
                    .map_err(|_| wrong_type(key, "string"))
            })
            .transpose()
    }

    pub fn get_usize(&self, key: &str) -> Result<usize> {
        value_to_u64(self.required(key)?)
            .map(|v| v as usize)
            .ok_or_else(|| wrong_type(key, "unsigned integer"))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.metadata(key)
            .map(|v| {
                value_to_u64(v)
                    .map(|v| v as usize)
                    .ok_or_else(|| wrong_type(key, "unsigned integer"))
            })
            .transpose()
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.metadata(key)
            .map(|v| {
                value_to_f64(v)
                    .map(|v| v as f32)
                    .ok_or_else(|| wrong_type(key, "number"))
            })
            .transpose()
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.metadata(key)
            .map(|v| v.to_bool().map_err(|_| wrong_type(key, "bool")))
            .transpose()
    }

    pub fn string_array(&self, key: &str) -> Result<Vec<String>> {
        let values = self
            .required(key)?
            .to_vec()
            .map_err(|_| wrong_type(key, "array of strings"))?;
        values
            .iter()
            .map(|v| {
                v.to_string()
                    .cloned()
                    .map_err(|_| wrong_type(key, "array of strings"))
            })
            .collect()
    }

    pub fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(value) = self.metadata(key) else {
            return Ok(None);
        };
        let values = value
            .to_vec()
            .map_err(|_| wrong_type(key, "array of integers"))?;
        values
            .iter()
            .map(|v| value_to_i64(v).ok_or_else(|| wrong_type(key, "array of integers")))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub fn opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        let Some(value) = self.metadata(key) else {
            return Ok(None);
        };
        let values = value
            .to_vec()
            .map_err(|_| wrong_type(key, "array of numbers"))?;
        values
            .iter()
            .map(|v| {
                value_to_f64(v)
                    .map(|x| x as f32)
                    .ok_or_else(|| wrong_type(key, "array of numbers"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Shape of a tensor in GGUF order reversed to row-major (`[rows, cols]` for a matrix),
    /// and its type, or `None` when the file lacks it.
    pub fn tensor_info(&self, name: &str) -> Option<(Vec<usize>, GgmlDType)> {
        self.content
            .tensor_infos
            .get(name)
            .map(|i| (i.shape.dims().to_vec(), i.ggml_dtype))
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.content.tensor_infos.keys().map(|s| s.as_str())
    }

    /// Reads one tensor's data.
    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(ModelError::MissingTensor {
                name: name.to_string(),
            });
        }
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|source| ModelError::Tensor {
                name: name.to_string(),
                source,
            })
    }

    /// Reads a tensor and checks its row-major shape.
    pub fn tensor_with_shape(&mut self, name: &str, expected: &[usize]) -> Result<QTensor> {
        let t = self.tensor(name)?;
        if t.shape().dims() != expected {
            return Err(ModelError::BadShape {
                name: name.to_string(),
                actual: t.shape().dims().to_vec(),
                expected: expected.to_vec(),
            });
        }
        Ok(t)
    }
}

fn wrong_type(key: &str, expected: &'static str) -> ModelError {
    ModelError::WrongType {
        key: key.to_string(),
        expected,
    }
}

fn value_to_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

fn value_to_u64(v: &Value) -> Option<u64> {
    value_to_i64(v).and_then(|x| u64::try_from(x).ok())
}

fn value_to_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => Some(*x as f64),
        Value::F64(x) => Some(*x),
        other => value_to_i64(other).map(|x| x as f64),
    }
}
