//! The weights of a Hugging Face directory: `model.safetensors`, or the shards that
//! `model.safetensors.index.json` lists, memory-mapped; every tensor's bytes checked to lie
//! inside its file before anything is read.

use crate::error::{ModelError, Result};
use ::safetensors::tensor::{Dtype, SafeTensors};
use candle_core::{DType, Device, Tensor};
use memmap2::Mmap;
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Where one tensor's bytes are.
#[derive(Debug, Clone)]
pub struct StoredTensor {
    shard: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// Every tensor of the checkpoint, by its Hugging Face name.
pub struct SafetensorsWeights {
    shards: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, StoredTensor>,
    /// Tensors of a type lantern does not read (bool masks and other buffers older
    /// GPT-2 and Pythia checkpoints keep), by name, with their type: an error only
    /// where the model needs one.
    unreadable: HashMap<String, String>,
}

impl SafetensorsWeights {
    /// Opens `model.safetensors`, or the shards of `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            shard_files(dir, &index)?
        } else {
            return Err(ModelError::InvalidHf {
                path: dir.to_path_buf(),
                reason: "neither model.safetensors nor model.safetensors.index.json is there"
                    .into(),
            });
        };
        let mut weights = Self {
            shards: Vec::new(),
            tensors: HashMap::new(),
            unreadable: HashMap::new(),
        };
        for path in files {
            weights.add_shard(path)?;
        }
        Ok(weights)
    }

    fn add_shard(&mut self, path: PathBuf) -> Result<()> {
        let open_err = |source| ModelError::Open {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(open_err)?;
        // SAFETY: the map is read-only; a file changed under a running server is the
        // operator's fault, as with any memory-mapped model.
        let mmap = unsafe { Mmap::map(&file) }.map_err(open_err)?;
        let invalid = |reason: String| ModelError::InvalidHf {
            path: path.clone(),
            reason,
        };
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| invalid(e.to_string()))?;
        let data_start = 8usize
            .checked_add(header_len)
            .ok_or_else(|| invalid("header length overflows".into()))?;
        let shard = self.shards.len();
        for (name, info) in metadata.tensors() {
            let dtype = match info.dtype {
                Dtype::F32 => DType::F32,
                Dtype::F16 => DType::F16,
                Dtype::BF16 => DType::BF16,
                // MXFP4 checkpoints' packed codes and scales (gpt-oss); an error where
                // another tensor the model needs is of it (see `HfDirectory::open`).
                Dtype::U8 => DType::U8,
                other => {
                    self.unreadable.insert(name, format!("{other:?}"));
                    continue;
                }
            };
            let (begin, end) = info.data_offsets;
            let elems = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let size = elems.and_then(|e| e.checked_mul(dtype.size_in_bytes()));
            let start = data_start.checked_add(begin);
            let stop = data_start.checked_add(end);
            match (size, start, stop) {
                (Some(size), Some(start), Some(stop))
                    if stop >= start && stop - start == size && stop <= mmap.len() => {}
                _ => {
                    return Err(ModelError::Truncated {
                        path: path.clone(),
                        tensor: name,
                        needed: stop.unwrap_or(usize::MAX) as u64,
                        file_len: mmap.len() as u64,
                    })
                }
            }
            let stored = StoredTensor {
                shard,
                dtype,
                shape: info.shape.clone(),
                start: data_start + begin,
                end: data_start + end,
            };
            if self.tensors.insert(name.clone(), stored).is_some() {
                return Err(invalid(format!("tensor `{name}` is stored twice")));
            }
        }
        self.shards.push((path, mmap));
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&StoredTensor> {
        self.tensors.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    /// The tensors of types lantern does not read, with their types.
    pub fn unreadable(&self) -> impl Iterator<Item = (&String, &String)> {
        self.unreadable.iter()
    }

    /// The tensor's bytes as stored.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let stored = self.get(name).ok_or_else(|| ModelError::MissingTensor {
            name: name.to_string(),
        })?;
        Ok(&self.shards[stored.shard].1[stored.start..stored.end])
    }

    /// The tensor as it is stored (its own dtype), on the CPU.
    pub fn load(&self, name: &str) -> Result<Tensor> {
        let stored = self.get(name).ok_or_else(|| ModelError::MissingTensor {
            name: name.to_string(),
        })?;
        let bytes = &self.shards[stored.shard].1[stored.start..stored.end];
        Tensor::from_raw_buffer(bytes, stored.dtype, &stored.shape, &Device::Cpu).map_err(
            |source| ModelError::Tensor {
                name: name.to_string(),
                source,
            },
        )
    }
}

/// The distinct shard files the index's `weight_map` names, each checked to exist.
fn shard_files(dir: &Path, index: &Path) -> Result<Vec<PathBuf>> {
    let invalid = |reason: String| ModelError::InvalidHf {
        path: index.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|source| ModelError::Open {
        path: index.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| invalid("`weight_map` is missing or not an object".into()))?;
    let mut names = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| invalid(format!("the shard of `{tensor}` is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(invalid(format!(
                "shard `{file}` is not a file in the directory"
            )));
        }
        names.insert(file.to_string());
    }
    names
        .into_iter()
        .map(|name| {
            let path = dir.join(&name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(invalid(format!("shard `{name}` is missing")))
            }
        })
        .collect()
}
