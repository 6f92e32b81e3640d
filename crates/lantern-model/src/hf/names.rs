//! Hugging Face tensor names to llama.cpp's GGUF names (as `convert_hf_to_gguf.py` maps them).

/// The GGUF name of a Hugging Face tensor, or `None` for tensors GGUF does not keep
/// (rotary caches and the like). `sandwich_norms`: Gemma's `post_attention_layernorm` is
/// the norm after attention, not the one before the MLP.
pub fn gguf_name(hf: &str, sandwich_norms: bool) -> Option<String> {
    let hf = hf.strip_prefix("language_model.").unwrap_or(hf);
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let gguf = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.qkv_proj" => "attn_qkv",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "post_attention_layernorm" if sandwich_norms => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.gate_up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{kind}"))
}

#[cfg(test)]
mod tests {
    use super::gguf_name;

    #[test]
    fn maps_layers_and_globals() {
        let n = |s| gguf_name(s, false);
        assert_eq!(n("model.embed_tokens.weight").unwrap(), "token_embd.weight");
        assert_eq!(
            n("model.layers.3.self_attn.q_proj.bias").unwrap(),
            "blk.3.attn_q.bias"
        );
        assert_eq!(
            n("model.layers.0.post_attention_layernorm.weight").unwrap(),
            "blk.0.ffn_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.0.post_attention_layernorm.weight", true).unwrap(),
            "blk.0.post_attention_norm.weight"
        );
        assert_eq!(
            n("model.layers.1.mlp.gate_up_proj.weight").unwrap(),
            "blk.1.ffn_up.weight"
        );
        assert_eq!(n("model.layers.1.self_attn.rotary_emb.inv_freq"), None);
        assert_eq!(n("model.layers.x.mlp.up_proj.weight"), None);
    }
}
