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
    // transformers 5's own layout (`save_original_format=False`): every expert's gate
    // and up in one tensor, gate first, and the downs in another.
    match rest {
        "mlp.experts.gate_up_proj" => return Some(format!("blk.{layer}.ffn_gate_up_exps.weight")),
        "mlp.experts.down_proj" => return Some(format!("blk.{layer}.ffn_down_exps.weight")),
        _ => {}
    }
    let (module, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    if let Some(expert) = expert_name(module) {
        return Some(format!("blk.{layer}.{expert}.{kind}"));
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
        // A mixture of experts' router: Qwen3-MoE, Mixtral.
        "mlp.gate" | "block_sparse_moe.gate" => "ffn_gate_inp",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{kind}"))
}

/// Expert `e`'s matrices, one tensor each as released checkpoints store them:
/// `mlp.experts.{e}.{gate,up,down}_proj` (Qwen3-MoE) and
/// `block_sparse_moe.experts.{e}.{w1,w3,w2}` (Mixtral) are `ffn_{gate,up,down}.{e}`.
fn expert_name(module: &str) -> Option<String> {
    let rest = module
        .strip_prefix("mlp.experts.")
        .or_else(|| module.strip_prefix("block_sparse_moe.experts."))?;
    let (expert, matrix) = rest.split_once('.')?;
    let expert: usize = expert.parse().ok()?;
    let gguf = match matrix {
        "gate_proj" | "w1" => "ffn_gate",
        "up_proj" | "w3" => "ffn_up",
        "down_proj" | "w2" => "ffn_down",
        _ => return None,
    };
    Some(format!("{gguf}.{expert}"))
}

/// The layer modules [`gguf_name`] maps, for naming a missing tensor as the checkpoint
/// would hold it.
const LAYER_MODULES: [&str; 17] = [
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.qkv_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
    "mlp.gate",
    "block_sparse_moe.gate",
];

/// The Hugging Face names [`gguf_name`] maps to `gguf` (a fused and an unfused
/// checkpoint may hold either of two): what to tell a user whose checkpoint lacks it.
pub fn hf_names(gguf: &str, sandwich_norms: bool) -> Vec<String> {
    let globals = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ];
    let layer = gguf
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .map(|(l, _)| l);
    let kinds = ["weight", "bias"];
    // An expert's index, for its candidates (`blk.N.ffn_gate.E.weight`).
    let expert = gguf.split('.').nth(3).and_then(|e| e.parse::<usize>().ok());
    let expert_modules = expert.into_iter().flat_map(|e| {
        ["gate_proj", "up_proj", "down_proj"]
            .map(|m| format!("mlp.experts.{e}.{m}"))
            .into_iter()
            .chain(["w1", "w2", "w3"].map(|m| format!("block_sparse_moe.experts.{e}.{m}")))
    });
    let modules: Vec<String> = LAYER_MODULES
        .iter()
        .map(|m| m.to_string())
        .chain(expert_modules)
        .collect();
    let candidates = globals.iter().map(|g| g.to_string()).chain(
        layer
            .into_iter()
            .flat_map(|l| modules.iter().map(move |m| format!("model.layers.{l}.{m}")))
            .flat_map(|m| kinds.iter().map(move |k| format!("{m}.{k}"))),
    );
    candidates
        .filter(|hf| gguf_name(hf, sandwich_norms).as_deref() == Some(gguf))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{gguf_name, hf_names};

    #[test]
    fn a_gguf_name_goes_back_to_the_checkpoints() {
        assert_eq!(
            hf_names("blk.0.attn_q.weight", false),
            ["model.layers.0.self_attn.q_proj.weight"]
        );
        assert_eq!(
            hf_names("blk.2.ffn_up.weight", false),
            [
                "model.layers.2.mlp.up_proj.weight",
                "model.layers.2.mlp.gate_up_proj.weight"
            ]
        );
        assert_eq!(hf_names("output.weight", false), ["lm_head.weight"]);
        assert!(hf_names("rope_freqs.weight", false).is_empty());
        assert_eq!(
            hf_names("blk.1.ffn_down.5.weight", false),
            [
                "model.layers.1.mlp.experts.5.down_proj.weight",
                "model.layers.1.block_sparse_moe.experts.5.w2.weight"
            ]
        );
        assert_eq!(
            hf_names("blk.0.ffn_gate_inp.weight", false),
            [
                "model.layers.0.mlp.gate.weight",
                "model.layers.0.block_sparse_moe.gate.weight"
            ]
        );
    }

    #[test]
    fn maps_experts_and_routers() {
        let n = |s| gguf_name(s, false);
        assert_eq!(
            n("model.layers.2.mlp.experts.7.gate_proj.weight").unwrap(),
            "blk.2.ffn_gate.7.weight"
        );
        assert_eq!(
            n("model.layers.0.block_sparse_moe.experts.3.w3.weight").unwrap(),
            "blk.0.ffn_up.3.weight"
        );
        assert_eq!(
            n("model.layers.0.block_sparse_moe.experts.3.w2.weight").unwrap(),
            "blk.0.ffn_down.3.weight"
        );
        assert_eq!(
            n("model.layers.4.mlp.gate.weight").unwrap(),
            "blk.4.ffn_gate_inp.weight"
        );
        assert_eq!(
            n("model.layers.3.mlp.experts.gate_up_proj").unwrap(),
            "blk.3.ffn_gate_up_exps.weight"
        );
        assert_eq!(
            n("model.layers.3.mlp.experts.down_proj").unwrap(),
            "blk.3.ffn_down_exps.weight"
        );
        assert_eq!(n("model.layers.0.mlp.experts.x.gate_proj.weight"), None);
        assert_eq!(n("model.layers.0.mlp.experts.1.act.weight"), None);
    }

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
