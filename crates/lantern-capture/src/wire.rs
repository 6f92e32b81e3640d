//! Wire formats of a finished capture (docs/capture-format.md), both ways:
//!
//! - JSON: `{"attn_capture_data": [one object per layer], "attn_capture_meta": meta}`,
//!   each layer's values little-endian in the delivered dtype, gzip-compressed, then
//!   base64 (standard alphabet); top-k indices likewise as int32.
//! - safetensors: tensors `layer.{L}` (F32 or F16) and `layer.{L}.indices` (I32, top-k
//!   only), `__metadata__` with `format` and `lantern.capture` (the meta as JSON).
//!
//! Readers check everything that comes from outside: the meta, each shape against the
//! meta and against the length of its data, and the encodings.

use std::io::{Read, Write};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;
use half::f16;
use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::{json, Value};

use crate::error::CaptureError;
use crate::result::{CaptureMeta, CaptureResult, LayerMap, CAPTURE_FORMAT};
use crate::spans::LayerSpanMass;
use crate::spec::CaptureDtype;
use crate::stats::{KeyStat, LayerStat};

/// The only JSON encoding of the data.
pub const ENCODING: &str = "gzip+base64";
/// `__metadata__` key of the meta in a safetensors file.
pub const META_KEY: &str = "lantern.capture";

fn malformed(message: impl Into<String>) -> CaptureError {
    CaptureError::Malformed(message.into())
}

/// The response fields of an inline capture: `attn_capture_data` and
/// `attn_capture_meta` (whose `dtype` is set to `dtype`).
pub fn to_json(result: &CaptureResult, dtype: CaptureDtype) -> Value {
    let meta = meta_for(&result.meta, dtype);
    let mut fields = json!({
        "attn_capture_data": layers_to_json(&result.layers, dtype),
        "attn_capture_meta": serde_json::to_value(&meta).expect("CaptureMeta serializes"),
    });
    if !result.stats.is_empty() {
        fields["attn_capture_stats_data"] = Value::Array(stats_to_json(&result.stats));
    }
    if !result.meta.spans.is_empty() {
        fields["attn_capture_span_data"] = Value::Array(span_mass_to_json(&result.span_mass));
    }
    fields
}

/// The name of the span masses (`stat` inline, `layer.{L}.span_mass` in safetensors).
pub const SPAN_MASS: &str = "span_mass";

/// One `attn_capture_span_data` object per layer, in order: `[rows, groups, spans + 1]`
/// float32, gzip+base64 as the maps are.
pub fn span_mass_to_json(masses: &[LayerSpanMass]) -> Vec<Value> {
    masses
        .iter()
        .map(|m| float32_entry(m.layer_idx, SPAN_MASS, &m.shape, &m.values))
        .collect()
}

/// An inline float32 array of one layer (a statistic, span masses): always float32
/// (sums of many probabilities), gzip+base64 as the maps are.
fn float32_entry(layer_idx: usize, stat: &str, shape: &[usize], values: &[f32]) -> Value {
    json!({
        "layer_idx": layer_idx,
        "stat": stat,
        "shape": shape,
        "dtype": "float32",
        "encoding": ENCODING,
        "data": gzip_base64(&values_to_bytes(values, CaptureDtype::Float32)),
    })
}

/// The values of the float32 entries of `field` (`data`, its JSON), one per `expected`
/// `(layer, stat, shape)` in order, each checked against what the meta implies.
fn float32_entries(
    field: &str,
    data: Option<&Value>,
    expected: &[(usize, &str, Vec<usize>)],
) -> Result<Vec<Vec<f32>>, CaptureError> {
    let entries = match data {
        None if expected.is_empty() => return Ok(Vec::new()),
        None => {
            return Err(malformed(format!(
                "the meta implies {field}, and there is none"
            )))
        }
        Some(data) => data
            .as_array()
            .ok_or_else(|| malformed(format!("{field} is not an array")))?,
    };
    if entries.len() != expected.len() {
        return Err(malformed(format!(
            "{field} has {} entries, the meta implies {}",
            entries.len(),
            expected.len()
        )));
    }
    entries
        .iter()
        .zip(expected)
        .map(|(entry, (layer_idx, stat, shape))| {
            let at = format!("{field} (layer {layer_idx}, {stat})");
            if entry["layer_idx"].as_u64() != Some(*layer_idx as u64)
                || entry["stat"].as_str() != Some(*stat)
                || entry["dtype"].as_str() != Some("float32")
                || entry["encoding"].as_str() != Some(ENCODING)
            {
                return Err(malformed(format!(
                    "{at}: expected layer_idx {layer_idx}, stat {stat:?}, dtype \"float32\", encoding {ENCODING:?}"
                )));
            }
            let dims: Option<Vec<usize>> = entry["shape"].as_array().and_then(|d| {
                d.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect()
            });
            if dims.as_ref() != Some(shape) {
                return Err(malformed(format!(
                    "{at}: shape {} does not match the meta, which implies {shape:?}",
                    entry["shape"]
                )));
            }
            let count = shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .filter(|&n| n.checked_mul(4).is_some())
                .ok_or_else(|| malformed(format!("{at}: shape {shape:?} is too large")))?;
            let text = entry["data"]
                .as_str()
                .ok_or_else(|| malformed(format!("{at}: data is not a string")))?;
            let bytes =
                unbase64_gunzip(text, count * 4).map_err(|e| malformed(format!("{at}: {e}")))?;
            Ok(values_from_bytes(&bytes, CaptureDtype::Float32))
        })
        .collect()
}

/// The span masses a meta implies, layer by layer, with their shapes.
fn expected_span_mass(meta: &CaptureMeta) -> Result<Vec<(usize, [usize; 3])>, CaptureError> {
    if meta.spans.is_empty() {
        return Ok(Vec::new());
    }
    if meta.stats_groups.len() != meta.layers.len() {
        return Err(malformed(format!(
            "attn_capture_meta.stats_groups has {} layers, layers lists {}",
            meta.stats_groups.len(),
            meta.layers.len()
        )));
    }
    let rows = meta.row_positions.len();
    Ok(meta
        .layers
        .iter()
        .zip(&meta.stats_groups)
        .map(|(&layer_idx, groups)| (layer_idx, [rows, groups.len(), meta.spans.len() + 1]))
        .collect())
}

/// The span masses the meta lists, from `attn_capture_span_data` entries.
fn span_mass_from_json(
    data: Option<&Value>,
    meta: &CaptureMeta,
) -> Result<Vec<LayerSpanMass>, CaptureError> {
    let expected = expected_span_mass(meta)?;
    let wanted: Vec<_> = expected
        .iter()
        .map(|&(layer_idx, shape)| (layer_idx, SPAN_MASS, shape.to_vec()))
        .collect();
    let values = float32_entries("attn_capture_span_data", data, &wanted)?;
    Ok(expected
        .into_iter()
        .zip(values)
        .map(|((layer_idx, shape), values)| LayerSpanMass {
            layer_idx,
            shape,
            values,
        })
        .collect())
}

/// One `attn_capture_stats_data` object per layer and statistic, in order: always
/// float32 (sums of many probabilities), gzip+base64 as the maps are.
pub fn stats_to_json(stats: &[LayerStat]) -> Vec<Value> {
    stats
        .iter()
        .map(|s| float32_entry(s.layer_idx, s.stat.as_str(), &s.shape, &s.values))
        .collect()
}

/// The statistics the meta lists, from `attn_capture_stats_data` entries.
fn stats_from_json(
    data: Option<&Value>,
    meta: &CaptureMeta,
) -> Result<Vec<LayerStat>, CaptureError> {
    let expected = expected_stats(meta)?;
    let wanted: Vec<_> = expected
        .iter()
        .map(|&(layer_idx, stat, shape)| (layer_idx, stat.as_str(), shape.to_vec()))
        .collect();
    let values = float32_entries("attn_capture_stats_data", data, &wanted)?;
    Ok(expected
        .into_iter()
        .zip(values)
        .map(|((layer_idx, stat, shape), values)| LayerStat {
            layer_idx,
            stat,
            shape,
            values,
        })
        .collect())
}

/// The statistics a meta implies, in their delivered order (layer by layer, each in
/// the meta's order), with their shapes: `[groups, keys]`, `[groups, blocks]`.
fn expected_stats(meta: &CaptureMeta) -> Result<Vec<(usize, KeyStat, [usize; 2])>, CaptureError> {
    if meta.stats.is_empty() {
        return Ok(Vec::new());
    }
    let stats = meta
        .stats
        .iter()
        .map(|s| KeyStat::parse(s).map_err(|e| malformed(format!("attn_capture_meta.stats: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    if meta.stats_groups.len() != meta.layers.len() {
        return Err(malformed(format!(
            "attn_capture_meta.stats_groups has {} layers, layers lists {}",
            meta.stats_groups.len(),
            meta.layers.len()
        )));
    }
    let keys = meta.key_positions.len();
    let block_size = meta.block_size.filter(|&b| b > 0).ok_or_else(|| {
        malformed("attn_capture_meta.block_size is missing or 0 in a capture with stats")
    })?;
    let mut expected = Vec::new();
    for (&layer_idx, groups) in meta.layers.iter().zip(&meta.stats_groups) {
        for &stat in &stats {
            let width = match stat {
                KeyStat::BlockMass => keys.div_ceil(block_size),
                KeyStat::KeyMass | KeyStat::KeyMax => keys,
            };
            expected.push((layer_idx, stat, [groups.len(), width]));
        }
    }
    Ok(expected)
}

/// One `attn_capture_data` object per layer, in order.
pub fn layers_to_json(layers: &[LayerMap], dtype: CaptureDtype) -> Vec<Value> {
    layers
        .iter()
        .map(|layer| {
            let mut object = json!({
                "layer_idx": layer.layer_idx,
                "shape": layer.shape,
                "dtype": dtype.as_str(),
                "encoding": ENCODING,
                "data": gzip_base64(&values_to_bytes(&layer.values, dtype)),
            });
            if let Some(indices) = &layer.indices {
                object["indices"] = json!(gzip_base64(&indices_to_bytes(indices)));
                object["indices_dtype"] = json!("int32");
            }
            object
        })
        .collect()
}

/// Reads a response (or any object) carrying `attn_capture_data` and
/// `attn_capture_meta`.
pub fn from_json(value: &Value) -> Result<CaptureResult, CaptureError> {
    let object = value.as_object().ok_or_else(|| {
        malformed("expected a JSON object with attn_capture_data and attn_capture_meta")
    })?;
    let meta_value = object
        .get("attn_capture_meta")
        .ok_or_else(|| malformed("no attn_capture_meta field"))?;
    let meta = parse_meta(meta_value.clone())?;
    let Some(data) = object.get("attn_capture_data") else {
        let hint = if object.contains_key("attn_capture_id") {
            ": the capture was delivered by reference; fetch GET /v1/captures/{id} (a safetensors file)"
        } else if object.contains_key("attn_capture_path") {
            ": the capture was delivered as a file; read the safetensors file at attn_capture_path"
        } else {
            ""
        };
        return Err(malformed(format!("no attn_capture_data field{hint}")));
    };
    let entries = data
        .as_array()
        .ok_or_else(|| malformed("attn_capture_data is not an array"))?;
    let map_layers = if meta.maps { meta.layers.len() } else { 0 };
    if entries.len() != map_layers {
        return Err(malformed(format!(
            "attn_capture_data has {} layers, the meta implies {map_layers} (maps: {})",
            entries.len(),
            meta.maps
        )));
    }
    let dtype = meta_dtype(&meta)?;
    let layers = entries
        .iter()
        .zip(&meta.layers)
        .map(|(entry, &layer_idx)| layer_from_json(entry, layer_idx, dtype, &meta))
        .collect::<Result<Vec<_>, _>>()?;
    let stats = stats_from_json(object.get("attn_capture_stats_data"), &meta)?;
    let span_mass = span_mass_from_json(object.get("attn_capture_span_data"), &meta)?;
    Ok(CaptureResult {
        meta,
        layers,
        stats,
        span_mass,
    })
}

fn layer_from_json(
    entry: &Value,
    layer_idx: usize,
    dtype: CaptureDtype,
    meta: &CaptureMeta,
) -> Result<LayerMap, CaptureError> {
    let at = format!("attn_capture_data (layer {layer_idx})");
    let field = |name: &str| {
        entry
            .get(name)
            .ok_or_else(|| malformed(format!("{at}: no {name:?} field")))
    };
    let string = |name: &str| {
        field(name)?
            .as_str()
            .ok_or_else(|| malformed(format!("{at}: {name:?} is not a string")))
    };
    if field("layer_idx")?.as_u64() != Some(layer_idx as u64) {
        return Err(malformed(format!(
            "{at}: layer_idx is {}, the meta lists layer {layer_idx} here",
            field("layer_idx")?
        )));
    }
    let shape = parse_shape(field("shape")?).map_err(|e| malformed(format!("{at}: {e}")))?;
    let entry_dtype = string("dtype")?;
    if entry_dtype != dtype.as_str() {
        return Err(malformed(format!(
            "{at}: dtype {entry_dtype:?} differs from the meta's {:?}",
            dtype.as_str()
        )));
    }
    let encoding = string("encoding")?;
    if encoding != ENCODING {
        return Err(malformed(format!(
            "{at}: unknown encoding {encoding:?} (expected {ENCODING:?})"
        )));
    }
    let count = element_count(shape).map_err(|e| malformed(format!("{at}: {e}")))?;
    let bytes = unbase64_gunzip(string("data")?, count * dtype.size_bytes() as usize)
        .map_err(|e| malformed(format!("{at}: data: {e}")))?;
    let values = values_from_bytes(&bytes, dtype);
    let indices = match meta.top_k {
        None => None,
        Some(_) => {
            let indices_dtype = string("indices_dtype")?;
            if indices_dtype != "int32" {
                return Err(malformed(format!(
                    "{at}: indices_dtype is {indices_dtype:?}, expected \"int32\""
                )));
            }
            let bytes = unbase64_gunzip(string("indices")?, count * 4)
                .map_err(|e| malformed(format!("{at}: indices: {e}")))?;
            Some(indices_from_bytes(&bytes).map_err(|e| malformed(format!("{at}: {e}")))?)
        }
    };
    let layer = LayerMap {
        layer_idx,
        shape,
        values,
        indices,
    };
    check_shape(&layer, meta)?;
    Ok(layer)
}

/// The capture as a safetensors file; the meta's `dtype` is set to `dtype`.
///
/// Written here rather than by `safetensors::serialize`, for two reasons: the file is
/// the same bytes every time (safetensors writes `__metadata__` from a `HashMap`, whose
/// order changes from one map to the next), and the tensors are written straight into
/// the file's one buffer (no copy of each tensor, no second copy of the file), so
/// encoding holds no more than the capture's admission figure allows.
pub fn to_safetensors(
    result: &CaptureResult,
    dtype: CaptureDtype,
) -> Result<Vec<u8>, CaptureError> {
    let meta = meta_for(&result.meta, dtype);
    let meta_json = serde_json::to_string(&meta)
        .map_err(|e| malformed(format!("the meta does not serialize: {e}")))?;
    let values_dtype = match dtype {
        CaptureDtype::Float32 => "F32",
        CaptureDtype::Float16 => "F16",
    };
    // 4-byte tensors first (indices, f32 values), then f16 ones, so every tensor starts
    // aligned to its element size, as safetensors orders them.
    let mut tensors: Vec<(String, &str, Vec<usize>, SafetensorsData)> = Vec::new();
    for layer in &result.layers {
        if let Some(indices) = &layer.indices {
            let name = format!("layer.{}.indices", layer.layer_idx);
            let data = SafetensorsData::Indices(indices);
            tensors.push((name, "I32", layer.shape.to_vec(), data));
        }
    }
    for layer in &result.layers {
        let name = format!("layer.{}", layer.layer_idx);
        let data = SafetensorsData::Values(&layer.values, dtype);
        tensors.push((name, values_dtype, layer.shape.to_vec(), data));
    }
    for s in &result.stats {
        let name = format!("layer.{}.{}", s.layer_idx, s.stat.as_str());
        let data = SafetensorsData::Values(&s.values, CaptureDtype::Float32);
        tensors.push((name, "F32", s.shape.to_vec(), data));
    }
    for m in &result.span_mass {
        let name = format!("layer.{}.{SPAN_MASS}", m.layer_idx);
        let data = SafetensorsData::Values(&m.values, CaptureDtype::Float32);
        tensors.push((name, "F32", m.shape.to_vec(), data));
    }
    tensors.sort_by_key(|(_, dtype, _, _)| *dtype == "F16");
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        json!({"format": CAPTURE_FORMAT, META_KEY: meta_json}),
    );
    let mut offset = 0usize;
    for (name, tensor_dtype, shape, data) in &tensors {
        let elements: usize = shape.iter().product();
        if elements != data.len() {
            return Err(malformed(format!(
                "{name}: shape {shape:?} holds {elements} values, the map has {}",
                data.len()
            )));
        }
        let size = if *tensor_dtype == "F16" { 2 } else { 4 };
        let end = offset + elements * size;
        header.insert(
            name.clone(),
            json!({"dtype": tensor_dtype, "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    // serde_json keeps insertion order (`preserve_order`) or sorts keys: either way one
    // capture always gives the same header.
    let mut header = Value::Object(header).to_string();
    // Padded with spaces to a multiple of 8, as safetensors pads, so the data is aligned.
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut out = Vec::with_capacity(8 + header.len() + offset);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for (_, _, _, data) in &tensors {
        data.write_to(&mut out);
    }
    debug_assert_eq!(out.len(), 8 + header.len() + offset);
    Ok(out)
}

/// A tensor's elements, written little-endian in their wire type.
enum SafetensorsData<'a> {
    Values(&'a [f32], CaptureDtype),
    Indices(&'a [u32]),
}

impl SafetensorsData<'_> {
    fn len(&self) -> usize {
        match self {
            Self::Values(v, _) => v.len(),
            Self::Indices(i) => i.len(),
        }
    }

    fn write_to(&self, out: &mut Vec<u8>) {
        match *self {
            Self::Values(values, CaptureDtype::Float32) => {
                out.extend(values.iter().flat_map(|v| v.to_le_bytes()))
            }
            Self::Values(values, CaptureDtype::Float16) => {
                out.extend(values.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()))
            }
            Self::Indices(indices) => out.extend(
                indices
                    .iter()
                    .flat_map(|&i| i32::try_from(i).unwrap_or(i32::MAX).to_le_bytes()),
            ),
        }
    }
}

/// Reads a safetensors capture file.
pub fn from_safetensors(bytes: &[u8]) -> Result<CaptureResult, CaptureError> {
    let not_safetensors =
        |e: safetensors::SafeTensorError| malformed(format!("not a safetensors file: {e}"));
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(not_safetensors)?;
    let tensors = SafeTensors::deserialize(bytes).map_err(not_safetensors)?;
    let meta_json = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .ok_or_else(|| {
            malformed(format!(
                "the safetensors file has no {META_KEY:?} metadata: not a lantern capture"
            ))
        })?;
    let meta_value: Value = serde_json::from_str(meta_json)
        .map_err(|e| malformed(format!("{META_KEY} metadata is not JSON: {e}")))?;
    let meta = parse_meta(meta_value)?;
    let dtype = meta_dtype(&meta)?;
    let map_layers = if meta.maps { &meta.layers[..] } else { &[] };
    let layers = map_layers
        .iter()
        .map(|&layer_idx| {
            let name = format!("layer.{layer_idx}");
            let view = tensors.tensor(&name).map_err(|_| {
                malformed(format!("no tensor {name:?} for captured layer {layer_idx}"))
            })?;
            let shape = shape3(view.shape()).map_err(|e| malformed(format!("{name}: {e}")))?;
            let values = match (view.dtype(), dtype) {
                (Dtype::F32, CaptureDtype::Float32) | (Dtype::F16, CaptureDtype::Float16) => {
                    values_from_bytes(view.data(), dtype)
                }
                (other, _) => {
                    return Err(malformed(format!(
                        "{name} is {other:?}, the meta says {}",
                        dtype.as_str()
                    )))
                }
            };
            let indices = match meta.top_k {
                None => None,
                Some(_) => {
                    let index_name = format!("{name}.indices");
                    let view = tensors.tensor(&index_name).map_err(|_| {
                        malformed(format!("no tensor {index_name:?} (the capture is top-k)"))
                    })?;
                    if view.dtype() != Dtype::I32 || view.shape() != shape {
                        return Err(malformed(format!(
                            "{index_name} is {:?} {:?}, expected I32 {:?}",
                            view.dtype(),
                            view.shape(),
                            shape
                        )));
                    }
                    Some(
                        indices_from_bytes(view.data())
                            .map_err(|e| malformed(format!("{index_name}: {e}")))?,
                    )
                }
            };
            let layer = LayerMap {
                layer_idx,
                shape,
                values,
                indices,
            };
            check_shape(&layer, &meta)?;
            Ok(layer)
        })
        .collect::<Result<Vec<_>, _>>()?;
    // A layer's float32 tensor `layer.{L}.{stat}` of `shape`.
    let float32 = |layer_idx: usize, stat: &str, shape: &[usize]| {
        let name = format!("layer.{layer_idx}.{stat}");
        let view = tensors
            .tensor(&name)
            .map_err(|_| malformed(format!("no tensor {name:?}: the meta lists {stat}")))?;
        if view.dtype() != Dtype::F32 || view.shape() != shape {
            return Err(malformed(format!(
                "{name} is {:?} {:?}, expected F32 {shape:?}",
                view.dtype(),
                view.shape()
            )));
        }
        Ok(values_from_bytes(view.data(), CaptureDtype::Float32))
    };
    let stats = expected_stats(&meta)?
        .into_iter()
        .map(|(layer_idx, stat, shape)| {
            Ok(LayerStat {
                layer_idx,
                stat,
                shape,
                values: float32(layer_idx, stat.as_str(), &shape)?,
            })
        })
        .collect::<Result<Vec<_>, CaptureError>>()?;
    let span_mass = expected_span_mass(&meta)?
        .into_iter()
        .map(|(layer_idx, shape)| {
            Ok(LayerSpanMass {
                layer_idx,
                shape,
                values: float32(layer_idx, SPAN_MASS, &shape)?,
            })
        })
        .collect::<Result<Vec<_>, CaptureError>>()?;
    Ok(CaptureResult {
        meta,
        layers,
        stats,
        span_mass,
    })
}

fn meta_for(meta: &CaptureMeta, dtype: CaptureDtype) -> CaptureMeta {
    CaptureMeta {
        dtype: dtype.as_str().to_string(),
        ..meta.clone()
    }
}

fn parse_meta(value: Value) -> Result<CaptureMeta, CaptureError> {
    let meta: CaptureMeta =
        serde_json::from_value(value).map_err(|e| malformed(format!("attn_capture_meta: {e}")))?;
    if meta.format != CAPTURE_FORMAT {
        return Err(malformed(format!(
            "format is {:?}, expected {CAPTURE_FORMAT:?}",
            meta.format
        )));
    }
    Ok(meta)
}

fn meta_dtype(meta: &CaptureMeta) -> Result<CaptureDtype, CaptureError> {
    CaptureDtype::parse(&meta.dtype).map_err(|e| malformed(format!("attn_capture_meta.dtype: {e}")))
}

/// The shape a layer must have by the meta: rows, heads (1 after a reduction), keys
/// (at most `k` with top-k).
fn check_shape(layer: &LayerMap, meta: &CaptureMeta) -> Result<(), CaptureError> {
    let heads = if meta.reduce == "none" {
        meta.heads.len()
    } else {
        1
    };
    let keys = meta.key_positions.len();
    let keys = meta.top_k.map_or(keys, |k| k.min(keys));
    let expected = [meta.row_positions.len(), heads, keys];
    if layer.shape != expected {
        return Err(malformed(format!(
            "layer {}: shape {:?} does not match the meta, which implies {expected:?} \
             (rows = row_positions, heads, keys)",
            layer.layer_idx, layer.shape
        )));
    }
    Ok(())
}

fn parse_shape(value: &Value) -> Result<[usize; 3], String> {
    let dims = value
        .as_array()
        .ok_or_else(|| format!("shape {value} is not an array"))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| format!("shape {value} is not a list of sizes"))?;
    shape3(&dims)
}

fn shape3(dims: &[usize]) -> Result<[usize; 3], String> {
    <[usize; 3]>::try_from(dims).map_err(|_| format!("shape {dims:?} is not [rows, heads, keys]"))
}

fn element_count(shape: [usize; 3]) -> Result<usize, String> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n.checked_mul(4).is_some())
        .ok_or_else(|| format!("shape {shape:?} is too large"))
}

fn values_to_bytes(values: &[f32], dtype: CaptureDtype) -> Vec<u8> {
    match dtype {
        CaptureDtype::Float32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        CaptureDtype::Float16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

/// `bytes` has a length that is a multiple of the element size (checked by callers).
fn values_from_bytes(bytes: &[u8], dtype: CaptureDtype) -> Vec<f32> {
    match dtype {
        CaptureDtype::Float32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        CaptureDtype::Float16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

/// Key positions as int32 (positions are far below 2^31).
fn indices_to_bytes(indices: &[u32]) -> Vec<u8> {
    indices
        .iter()
        .flat_map(|&i| i32::try_from(i).unwrap_or(i32::MAX).to_le_bytes())
        .collect()
}

fn indices_from_bytes(bytes: &[u8]) -> Result<Vec<u32>, String> {
    bytes
        .chunks_exact(4)
        .map(|b| {
            let i = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            u32::try_from(i).map_err(|_| format!("negative key position {i}"))
        })
        .collect()
}

fn gzip_base64(bytes: &[u8]) -> String {
    let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
    // Writing to a Vec cannot fail.
    encoder.write_all(bytes).expect("gzip into memory");
    BASE64.encode(encoder.finish().expect("gzip into memory"))
}

/// Decodes base64, then gunzips exactly `expected_len` bytes (never more: a
/// decompression bomb stops there).
fn unbase64_gunzip(text: &str, expected_len: usize) -> Result<Vec<u8>, String> {
    let compressed = BASE64
        .decode(text)
        .map_err(|e| format!("not valid base64: {e}"))?;
    let limit = u64::try_from(expected_len)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    let mut bytes = Vec::new();
    GzDecoder::new(compressed.as_slice())
        .take(limit)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("not valid gzip: {e}"))?;
    match bytes.len().cmp(&expected_len) {
        std::cmp::Ordering::Equal => Ok(bytes),
        std::cmp::Ordering::Greater => Err(format!(
            "more than the {expected_len} bytes that the shape and dtype need"
        )),
        std::cmp::Ordering::Less => Err(format!(
            "{} bytes, the shape and dtype need {expected_len}",
            bytes.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::result::{AbsentRow, LayerAttentionInfo, TokenInfo};
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// A capture of `n` positions (rows `1..n`), layers 0 and 3, heads 0..3, causal
    /// maps with random values; `top_k` keeps the k largest per row.
    fn random_capture(seed: u64, n: usize, reduce: &str, top_k: Option<usize>) -> CaptureResult {
        let mut rng = StdRng::seed_from_u64(seed);
        let layers = vec![0, 3];
        let head_list = vec![0, 1, 2];
        let heads = if reduce == "none" { head_list.len() } else { 1 };
        let rows: Vec<usize> = (1..n).collect();
        let maps = layers
            .iter()
            .map(|&layer_idx| {
                let mut values = vec![0f32; rows.len() * heads * n];
                for (ri, &pos) in rows.iter().enumerate() {
                    for h in 0..heads {
                        let row = &mut values[(ri * heads + h) * n..][..n];
                        row[..=pos].iter_mut().for_each(|v| *v = rng.gen::<f32>());
                        let sum: f32 = row.iter().sum();
                        row.iter_mut().for_each(|v| *v /= sum);
                    }
                }
                let (shape, values, indices) = match top_k {
                    None => ([rows.len(), heads, n], values, None),
                    Some(k) => {
                        let k = k.min(n);
                        let (mut vals, mut idx) = (Vec::new(), Vec::new());
                        for row in values.chunks(n) {
                            let mut order: Vec<usize> = (0..n).collect();
                            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                            vals.extend(order[..k].iter().map(|&j| row[j]));
                            idx.extend(order[..k].iter().map(|&j| j as u32));
                        }
                        ([rows.len(), heads, k], vals, Some(idx))
                    }
                };
                LayerMap {
                    layer_idx,
                    shape,
                    values,
                    indices,
                }
            })
            .collect();
        let meta = CaptureMeta {
            format: CAPTURE_FORMAT.to_string(),
            prompt_len: n - 2,
            total_len: n,
            tokens: (0..n)
                .map(|i| TokenInfo {
                    id: i as u32 + 100,
                    text: format!(" tok{i}"),
                })
                .collect(),
            layers: layers.clone(),
            heads: head_list,
            reduce: reduce.to_string(),
            top_k,
            dtype: "float32".to_string(),
            row_positions: rows,
            key_positions: (0..n).collect(),
            absent_rows: vec![AbsentRow {
                position: 0,
                reason: "not asked".into(),
            }],
            layer_attention: layers
                .iter()
                .map(|&layer_idx| LayerAttentionInfo {
                    layer_idx,
                    scale: 0.125,
                    sliding_window: None,
                    chunk_size: None,
                    logits_soft_cap: Some(30.0),
                    has_sinks: false,
                    num_heads: 9,
                    num_kv_heads: 3,
                })
                .collect(),
            maps: true,
            stats: Vec::new(),
            stats_heads: None,
            stats_groups: Vec::new(),
            block_size: None,
            spans: Vec::new(),
            span_offsets: None,
            span_messages: None,
            span_prompt: None,
        };
        CaptureResult {
            meta,
            layers: maps,
            stats: Vec::new(),
            span_mass: Vec::new(),
        }
    }

    /// `result` with key statistics of every layer (two kv groups, blocks of 4 keys),
    /// with or without its maps.
    fn with_stats(mut result: CaptureResult, maps: bool) -> CaptureResult {
        let keys = result.meta.key_positions.len();
        let mut rng = StdRng::seed_from_u64(99);
        result.meta.maps = maps;
        if !maps {
            result.layers.clear();
        }
        result.meta.stats = vec!["key_mass".into(), "block_mass".into()];
        result.meta.stats_heads = Some("kv".into());
        result.meta.block_size = Some(4);
        result.meta.stats_groups = result
            .meta
            .layers
            .iter()
            .map(|_| vec![vec![0, 1], vec![3]])
            .collect();
        result.stats = result
            .meta
            .layers
            .iter()
            .flat_map(|&layer_idx| {
                let blocks = keys.div_ceil(4);
                [(KeyStat::KeyMass, keys), (KeyStat::BlockMass, blocks)].map(|(stat, width)| {
                    LayerStat {
                        layer_idx,
                        stat,
                        shape: [2, width],
                        values: (0..2 * width).map(|_| rng.gen_range(0.0..3.0)).collect(),
                    }
                })
            })
            .collect();
        result
    }

    #[test]
    fn key_statistics_round_trip_in_both_formats_with_and_without_maps() {
        for maps in [true, false] {
            let result = with_stats(random_capture(5, 11, "none", None), maps);
            let json = to_json(&result, CaptureDtype::Float32);
            assert_eq!(
                json["attn_capture_stats_data"].as_array().unwrap().len(),
                2 * 2
            );
            assert_eq!(from_json(&json).unwrap(), result);
            let bytes = to_safetensors(&result, CaptureDtype::Float32).unwrap();
            assert_eq!(from_safetensors(&bytes).unwrap(), result);
            let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
            let names: Vec<_> = header.tensors().keys().cloned().collect();
            assert!(names.contains(&"layer.3.key_mass".to_string()), "{names:?}");
            assert_eq!(names.iter().any(|n| n == "layer.3"), maps, "{names:?}");
        }
        // A meta that lists stats the data does not carry is refused.
        let result = with_stats(random_capture(5, 11, "none", None), true);
        let mut json = to_json(&result, CaptureDtype::Float32);
        json.as_object_mut()
            .unwrap()
            .remove("attn_capture_stats_data");
        assert!(from_json(&json).is_err());
    }

    /// `result` with span masses of every layer (two spans, two groups), with or
    /// without its maps and key statistics.
    fn with_spans(mut result: CaptureResult, maps: bool, stats: bool) -> CaptureResult {
        use crate::spans::SpanInfo;
        if stats {
            result = with_stats(result, maps);
        } else {
            result.meta.maps = maps;
            if !maps {
                result.layers.clear();
            }
            result.meta.stats_heads = Some("kv".into());
            result.meta.stats_groups = result
                .meta
                .layers
                .iter()
                .map(|_| vec![vec![0, 1], vec![3]])
                .collect();
        }
        let mut rng = StdRng::seed_from_u64(7);
        let prompt = result.meta.prompt_len;
        result.meta.spans = vec![
            SpanInfo {
                label: "doc 1".into(),
                tokens: [0, 2],
                message: None,
                chars: Some([0, 9]),
                prompt_chars: Some([0, 9]),
                cuts_token: Some(true),
            },
            SpanInfo {
                label: "tail".into(),
                tokens: [2, 3],
                message: None,
                chars: None,
                prompt_chars: None,
                cuts_token: None,
            },
        ];
        result.meta.span_offsets = Some((0..prompt).map(|i| [4 * i, 4 * i + 4]).collect());
        let rows = result.meta.row_positions.len();
        result.span_mass = result
            .meta
            .layers
            .iter()
            .map(|&layer_idx| LayerSpanMass {
                layer_idx,
                shape: [rows, 2, 3],
                values: (0..rows * 6).map(|_| rng.gen_range(0.0..1.0)).collect(),
            })
            .collect();
        result
    }

    #[test]
    fn span_masses_round_trip_in_both_formats() {
        for (maps, stats) in [(true, false), (false, false), (false, true), (true, true)] {
            let result = with_spans(random_capture(5, 11, "none", None), maps, stats);
            let json = to_json(&result, CaptureDtype::Float32);
            let text = serde_json::to_string(&json).unwrap();
            let back = from_json(&serde_json::from_str(&text).unwrap()).unwrap();
            assert_eq!(back, result);
            let rows = result.meta.row_positions.len();
            assert_eq!(
                json["attn_capture_span_data"][1]["shape"],
                json!([rows, 2, 3])
            );
            assert_eq!(json["attn_capture_span_data"][1]["stat"], "span_mass");
            let bytes = to_safetensors(&result, CaptureDtype::Float32).unwrap();
            assert_eq!(from_safetensors(&bytes).unwrap(), result);
            let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
            let names: Vec<_> = header.tensors().keys().cloned().collect();
            assert!(
                names.contains(&"layer.3.span_mass".to_string()),
                "{names:?}"
            );
            assert_eq!(names.iter().any(|n| n == "layer.3"), maps, "{names:?}");
        }
        // Data that the meta does not match is refused.
        let result = with_spans(random_capture(5, 11, "none", None), false, false);
        let good = to_json(&result, CaptureDtype::Float32);
        let mut missing = good.clone();
        missing
            .as_object_mut()
            .unwrap()
            .remove("attn_capture_span_data");
        assert!(json_error(&missing).contains("attn_capture_span_data"));
        let mut shape = good.clone();
        shape["attn_capture_span_data"][0]["shape"][2] = json!(2);
        assert!(json_error(&shape).contains("does not match"));
        // A capture without spans carries none of their keys.
        let plain = to_json(&random_capture(5, 11, "none", None), CaptureDtype::Float32);
        assert!(plain.get("attn_capture_span_data").is_none());
        let meta = plain["attn_capture_meta"].as_object().unwrap();
        assert!(meta.keys().all(|k| !k.starts_with("span")), "{meta:?}");
    }

    /// `result` as f16 would deliver it.
    fn rounded_to_f16(result: &CaptureResult) -> CaptureResult {
        let mut out = result.clone();
        out.meta.dtype = "float16".into();
        for layer in &mut out.layers {
            layer
                .values
                .iter_mut()
                .for_each(|v| *v = f16::from_f32(*v).to_f32());
        }
        out
    }

    fn cases() -> Vec<CaptureResult> {
        vec![
            random_capture(1, 9, "none", None),
            random_capture(2, 17, "mean_heads", None),
            random_capture(3, 12, "none", Some(4)),
            random_capture(4, 5, "max_heads", Some(8)),
        ]
    }

    #[test]
    fn json_round_trips() {
        for result in cases() {
            let value = to_json(&result, CaptureDtype::Float32);
            // Through text, as a client would see it.
            let text = serde_json::to_string(&value).unwrap();
            let back = from_json(&serde_json::from_str(&text).unwrap()).unwrap();
            assert_eq!(back, result);
            let back = from_json(&to_json(&result, CaptureDtype::Float16)).unwrap();
            assert_eq!(back, rounded_to_f16(&result));
        }
    }

    #[test]
    fn safetensors_round_trips() {
        for result in cases() {
            let bytes = to_safetensors(&result, CaptureDtype::Float32).unwrap();
            assert_eq!(from_safetensors(&bytes).unwrap(), result);
            let bytes = to_safetensors(&result, CaptureDtype::Float16).unwrap();
            assert_eq!(from_safetensors(&bytes).unwrap(), rounded_to_f16(&result));
        }
    }

    #[test]
    fn safetensors_bytes_are_the_same_every_time() {
        // A capture written twice (the server's and `lantern generate --capture`'s of one
        // request) must be the same file, byte for byte.
        let result = random_capture(1, 9, "none", None);
        let first = to_safetensors(&result, CaptureDtype::Float32).unwrap();
        for _ in 0..16 {
            assert_eq!(
                to_safetensors(&result, CaptureDtype::Float32).unwrap(),
                first
            );
        }
    }

    #[test]
    fn json_layout_follows_the_contract() {
        let result = random_capture(5, 6, "none", Some(2));
        let value = to_json(&result, CaptureDtype::Float16);
        assert_eq!(value["attn_capture_meta"]["dtype"], "float16");
        let layer = &value["attn_capture_data"][1];
        assert_eq!(layer["layer_idx"], 3);
        assert_eq!(layer["shape"], json!([5, 3, 2]));
        assert_eq!(layer["dtype"], "float16");
        assert_eq!(layer["encoding"], "gzip+base64");
        assert_eq!(layer["indices_dtype"], "int32");
        let raw = unbase64_gunzip(layer["data"].as_str().unwrap(), 5 * 3 * 2 * 2).unwrap();
        let first = f16::from_le_bytes([raw[0], raw[1]]).to_f32();
        assert_eq!(first, f16::from_f32(result.layers[1].values[0]).to_f32());
        let dense = to_json(&random_capture(5, 6, "none", None), CaptureDtype::Float32);
        assert!(dense["attn_capture_data"][0].get("indices").is_none());
    }

    #[test]
    fn safetensors_layout_follows_the_contract() {
        let result = random_capture(6, 7, "none", Some(3));
        let bytes = to_safetensors(&result, CaptureDtype::Float16).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let metadata = header.metadata().as_ref().unwrap();
        assert_eq!(metadata["format"], CAPTURE_FORMAT);
        let meta: CaptureMeta = serde_json::from_str(&metadata[META_KEY]).unwrap();
        assert_eq!(meta.dtype, "float16");
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = tensors.names();
        names.sort();
        assert_eq!(
            names,
            ["layer.0", "layer.0.indices", "layer.3", "layer.3.indices"]
        );
        let t = tensors.tensor("layer.3").unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::F16, &[6, 3, 3][..]));
        assert_eq!(
            tensors.tensor("layer.0.indices").unwrap().dtype(),
            Dtype::I32
        );
    }

    fn json_error(value: &Value) -> String {
        match from_json(value) {
            Err(CaptureError::Malformed(message)) => message,
            other => panic!("expected Malformed, got {other:?}"),
        }
    }

    fn data0(v: &mut Value) -> &mut Value {
        &mut v["attn_capture_data"][0]
    }

    #[test]
    fn malformed_json_is_an_error() {
        let result = random_capture(7, 8, "none", Some(3));
        let good = to_json(&result, CaptureDtype::Float32);
        let edit = |f: &dyn Fn(&mut Value)| {
            let mut v = good.clone();
            f(&mut v);
            json_error(&v)
        };

        assert!(json_error(&json!([1, 2])).contains("JSON object"));
        assert!(
            edit(&|v| drop(v.as_object_mut().unwrap().remove("attn_capture_meta")))
                .contains("attn_capture_meta")
        );
        let e = edit(&|v| {
            let o = v.as_object_mut().unwrap();
            o.remove("attn_capture_data");
            o.insert("attn_capture_id".into(), json!("cap-0"));
        });
        assert!(e.contains("by reference"), "{e}");
        assert!(edit(&|v| v["attn_capture_meta"]["format"] = json!("other")).contains("format"));
        assert!(edit(&|v| v["attn_capture_meta"]["dtype"] = json!("int8")).contains("dtype"));
        assert!(edit(&|v| v["attn_capture_meta"]["layers"] = json!([0])).contains("2 layers"));
        assert!(edit(&|v| data0(v)["layer_idx"] = json!(5)).contains("layer_idx"));
        assert!(edit(&|v| data0(v)["dtype"] = json!("float16")).contains("dtype"));
        assert!(edit(&|v| data0(v)["encoding"] = json!("raw")).contains("encoding"));
        assert!(edit(&|v| data0(v)["shape"] = json!([7, 3])).contains("shape"));
        assert!(edit(&|v| data0(v)["shape"] = json!([7, -3, 3])).contains("shape"));
        let huge = usize::MAX / 2;
        assert!(edit(&|v| data0(v)["shape"] = json!([huge, huge, 3])).contains("too large"));
        assert!(edit(&|v| data0(v)["data"] = json!("not base64!")).contains("base64"));
        let e = edit(&|v| {
            let data = data0(v)["data"].as_str().unwrap();
            let raw = BASE64.decode(data).unwrap();
            data0(v)["data"] = json!(BASE64.encode(&raw[..raw.len() / 2]));
        });
        assert!(e.contains("gzip") || e.contains("bytes"), "{e}");
        assert!(edit(&|v| data0(v)["data"] = json!(BASE64.encode(b"plain"))).contains("gzip"));
        // Consistent with its data, but not with the meta.
        let e = edit(&|v| {
            data0(v)["shape"] = json!([7, 1, 9]);
            data0(v)["indices"] = json!(gzip_base64(&[0u8; 7 * 9 * 4]));
        });
        assert!(e.contains("does not match the meta"), "{e}");
        // Data for another shape.
        let e = edit(&|v| data0(v)["shape"] = json!([7, 3, 2]));
        assert!(e.contains("more than"), "{e}");
        let e = edit(&|v| data0(v)["shape"] = json!([7, 3, 4]));
        assert!(e.contains("need"), "{e}");
        assert!(
            edit(&|v| drop(data0(v).as_object_mut().unwrap().remove("indices")))
                .contains("indices")
        );
        let e =
            edit(&|v| data0(v)["indices"] = json!(gzip_base64(&(-1i32).to_le_bytes().repeat(63))));
        assert!(e.contains("negative"), "{e}");
    }

    #[test]
    fn malformed_safetensors_is_an_error() {
        let result = random_capture(8, 6, "none", Some(2));
        let good = to_safetensors(&result, CaptureDtype::Float32).unwrap();
        let error = |bytes: &[u8]| match from_safetensors(bytes) {
            Err(CaptureError::Malformed(message)) => message,
            other => panic!("expected Malformed, got {other:?}"),
        };
        assert!(error(b"").contains("not a safetensors"));
        assert!(error(&good[..good.len() - 1]).contains("not a safetensors"));
        assert!(error(b"{\"a\": 1}").contains("not a safetensors"));

        // Well-formed safetensors that are not captures, or inconsistent ones.
        use safetensors::tensor::TensorView;
        let write = |tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)>, meta: Option<String>| {
            let views: Vec<_> = tensors
                .iter()
                .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
                .collect();
            let metadata =
                meta.map(|m| std::collections::HashMap::from([(META_KEY.to_string(), m)]));
            safetensors::serialize(views, metadata).unwrap()
        };
        let meta = serde_json::to_string(&result.meta).unwrap();
        let values = |n: usize| vec![0u8; n * 4];
        let e = error(&write(
            vec![("layer.0", Dtype::F32, vec![5, 3, 2], values(30))],
            None,
        ));
        assert!(e.contains("metadata"), "{e}");
        let e = error(&write(vec![], Some("{".into())));
        assert!(e.contains("not JSON"), "{e}");
        let e = error(&write(vec![], Some(meta.clone())));
        assert!(e.contains("layer.0"), "{e}");
        let e = error(&write(
            vec![("layer.0", Dtype::F16, vec![5, 3, 2], values(15))],
            Some(meta.clone()),
        ));
        assert!(e.contains("F16"), "{e}");
        let e = error(&write(
            vec![("layer.0", Dtype::F32, vec![5, 3, 2], values(30))],
            Some(meta.clone()),
        ));
        assert!(e.contains("indices"), "{e}");
        let e = error(&write(
            vec![
                ("layer.0", Dtype::F32, vec![5, 3, 2], values(30)),
                ("layer.0.indices", Dtype::F32, vec![5, 3, 2], values(30)),
            ],
            Some(meta.clone()),
        ));
        assert!(e.contains("expected I32"), "{e}");
        let e = error(&write(
            vec![
                ("layer.0", Dtype::F32, vec![5, 6], values(30)),
                ("layer.0.indices", Dtype::I32, vec![5, 6], values(30)),
            ],
            Some(meta.clone()),
        ));
        assert!(e.contains("not [rows, heads, keys]"), "{e}");
        let e = error(&write(
            vec![
                ("layer.0", Dtype::F32, vec![3, 5, 2], values(30)),
                ("layer.0.indices", Dtype::I32, vec![3, 5, 2], values(30)),
            ],
            Some(meta),
        ));
        assert!(e.contains("does not match the meta"), "{e}");
    }

    #[test]
    fn random_bytes_never_panic() {
        let mut rng = StdRng::seed_from_u64(9);
        let good =
            to_safetensors(&random_capture(10, 5, "none", None), CaptureDtype::Float16).unwrap();
        for _ in 0..300 {
            let mut bytes = good.clone();
            for _ in 0..rng.gen_range(1..4) {
                let i = rng.gen_range(0..bytes.len());
                bytes[i] = rng.gen();
            }
            let _ = from_safetensors(&bytes);
            let cut = rng.gen_range(0..bytes.len());
            let _ = from_safetensors(&bytes[..cut]);
        }
    }
}
