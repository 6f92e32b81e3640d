//! The capture viewer: one HTML page (heatmap, layer and head selectors), shared by
//! `lantern attn view`, the server's `GET /v1/captures/{id}/view` and the Python
//! package's `to_html()`.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde_json::{json, Value};

use crate::result::CaptureResult;

/// The page. Its one copy lives in the Python package, which must ship it as package
/// data; the Rust side compiles it in from there.
pub const VIEW_TEMPLATE: &str = include_str!("../../../clients/python/lantern_attn/view.html");
/// Where the page's data goes: the capture itself, or where to fetch it.
const DATA_SLOT: &str = "/*LANTERN_CAPTURE_JSON*/";

/// The page with its data in the slot. Inside `<script>`, a `</script>` in a token must
/// not end the element: `<` only occurs in JSON strings, where `\u003c` means the same.
fn page(data: Value) -> String {
    let data = data.to_string().replace('<', "\\u003c");
    VIEW_TEMPLATE.replacen(DATA_SLOT, &data, 1)
}

/// Little-endian f32 bytes, base64.
fn f32_base64(values: &[f32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    BASE64.encode(bytes)
}

/// The page with the capture inside (no network): values as base64 little-endian f32,
/// top-k indices as base64 little-endian i32 (the page scatters them into dense maps);
/// key statistics and span masses as `{layer_idx, stat, shape, values}`, values likewise.
pub fn embedded_page(result: &CaptureResult, source: &str) -> String {
    let layers: Vec<Value> = result
        .layers
        .iter()
        .map(|layer| {
            let indices = layer.indices.as_ref().map(|indices| {
                let bytes: Vec<u8> = indices.iter().flat_map(|i| i.to_le_bytes()).collect();
                BASE64.encode(bytes)
            });
            json!({
                "layer_idx": layer.layer_idx,
                "shape": layer.shape,
                "values": f32_base64(&layer.values),
                "indices": indices,
            })
        })
        .collect();
    let stats: Vec<Value> = result
        .stats
        .iter()
        .map(|s| {
            json!({
                "layer_idx": s.layer_idx,
                "stat": s.stat.as_str(),
                "shape": s.shape,
                "values": f32_base64(&s.values),
            })
        })
        .collect();
    let span_mass: Vec<Value> = result
        .span_mass
        .iter()
        .map(|s| {
            json!({
                "layer_idx": s.layer_idx,
                "stat": "span_mass",
                "shape": s.shape,
                "values": f32_base64(&s.values),
            })
        })
        .collect();
    page(json!({
        "source": source,
        "meta": result.meta,
        "layers": layers,
        "stats": stats,
        "span_mass": span_mass,
    }))
}

/// The page that fetches its capture, as safetensors, from `url` (relative to the page).
pub fn fetching_page(url: &str, source: &str) -> String {
    page(json!({ "source": source, "url": url }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_data_goes_in_the_slot_and_cannot_close_the_script() {
        assert_eq!(VIEW_TEMPLATE.matches(DATA_SLOT).count(), 1);
        let page = fetching_page("../cap-1", "</script><b>");
        assert!(!page.contains(DATA_SLOT));
        assert!(page.contains(r#""url":"../cap-1""#));
        assert!(page.contains(r"\u003c/script>\u003cb>"));
        assert!(!page.contains("</script><b>"));
    }
}
