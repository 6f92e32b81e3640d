//! Reading GGUF files: the metadata and tensors of a file whose header
//! [`crate::gguf_header`] has checked, so a broken file gives an error that names the
//! problem.

use crate::error::{ModelError, Result};
use crate::gguf_header::{data_bytes, read_header, GgufProblem, HeaderError, TensorPastEnd};
use crate::iquants::WidenedType;
use crate::source::WeightSource;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// An opened GGUF file: its parsed header and a reader for tensor data.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    /// Tensors stored as a type lantern widens to Q8_0 as it reads them.
    widened: HashMap<String, WidenedType>,
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
        let header = read_header(&mut reader, file_len).map_err(|e| match e {
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
        if !header.widened.is_empty() {
            let mut types: Vec<WidenedType> = header.widened.values().copied().collect();
            types.sort_unstable_by_key(|w| w.name());
            types.dedup();
            let widened: Vec<String> = types
                .iter()
                .map(|w| format!("{} to {:?}", w.name(), w.target()))
                .collect();
            tracing::info!(
                tensors = header.widened.len(),
                "{}: tensors widened as they load: {} (IQ4 about twice its size in the file, MXFP4 1.3 times)",
                path.display(),
                widened.join(", ")
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            content: header.content,
            widened: header.widened,
            reader,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A tensor stored as `stored`, read and widened to the tensor its entry lists
    /// (its range was checked to lie inside the file when the header was read).
    fn widened_tensor(&mut self, name: &str, stored: WidenedType) -> candle_core::Result<QTensor> {
        let info = &self.content.tensor_infos[name];
        let len = data_bytes(info, Some(stored)) as usize;
        let start = self.content.tensor_data_offset + info.offset;
        let mut bytes = vec![0u8; len];
        self.reader.seek(SeekFrom::Start(start))?;
        self.reader.read_exact(&mut bytes)?;
        let widened = stored
            .widen(&bytes)
            .map_err(|e| candle_core::Error::Msg(format!("tensor `{name}`: {e}")))?;
        let dims = info.shape.dims().to_vec();
        candle_core::quantized::ggml_file::qtensor_from_ggml(
            info.ggml_dtype,
            &widened,
            dims,
            &Device::Cpu,
        )
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
        let wrap = |source| ModelError::Tensor {
            name: name.to_string(),
            source,
        };
        match self.widened.get(name).copied() {
            Some(stored) => self.widened_tensor(name, stored).map_err(wrap),
            None => self
                .content
                .tensor(&mut self.reader, name, &Device::Cpu)
                .map_err(wrap),
        }
    }
}
