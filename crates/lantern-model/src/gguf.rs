//! Reading GGUF files: header, metadata and tensors, with every size checked against the
//! file before anything is read, so a broken file gives an error that names the problem.

use crate::error::{ModelError, Result};
use crate::source::WeightSource;
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
}

impl WeightSource for GgufFile {
    fn metadata(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn tensor_info(&self, name: &str) -> Option<(Vec<usize>, GgmlDType)> {
        self.content
            .tensor_infos
            .get(name)
            .map(|i| (i.shape.dims().to_vec(), i.ggml_dtype))
    }

    fn tensor_names(&self) -> Vec<String> {
        self.content.tensor_infos.keys().cloned().collect()
    }

    fn tensor(&mut self, name: &str) -> Result<QTensor> {
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
}
