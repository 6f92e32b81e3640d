//! Reading GGUF files: the metadata and tensors of a file whose header
//! [`crate::gguf_header`] has checked, so a broken file gives an error that names the
//! problem.

use crate::error::{ModelError, Result};
use crate::gguf_header::{read_header, GgufProblem, HeaderError, TensorPastEnd};
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
}

impl GgufFile {
    /// Opens the file and reads its header (see [`crate::gguf_header`]): every tensor's
    /// data is known to lie inside the file before any is read.
    pub fn open(path: &Path) -> Result<Self> {
        let open_err = |source| ModelError::Open {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(open_err)?;
        let file_len = file.metadata().map_err(open_err)?.len();
        let mut reader = BufReader::new(file);
        let content = read_header(&mut reader, file_len).map_err(|e| match e {
            HeaderError::Invalid(GgufProblem::UnreadType { tensor, type_name }) => {
                ModelError::UnreadGgufType {
                    path: path.to_path_buf(),
                    tensor,
                    type_name,
                }
            }
            HeaderError::Invalid(problem) => ModelError::InvalidGguf {
                path: path.to_path_buf(),
                problem,
            },
            HeaderError::PastEnd(TensorPastEnd { tensor, needed }) => ModelError::Truncated {
                path: path.to_path_buf(),
                tensor,
                needed,
                file_len,
            },
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
        })
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
