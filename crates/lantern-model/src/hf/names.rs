//! Hugging Face tensor names to llama.cpp's GGUF names (as `convert_hf_to_gguf.py` maps them).

/// The GGUF name of a Hugging Face tensor, or `None` for tensors GGUF does not keep
/// (rotary caches and the like). `post_attention_norm`: `post_attention_layernorm` is
/// GGUF's `post_attention_norm` (Gemma's norm after attention; gpt-oss's norm before the
/// experts, as llama.cpp's converter names it), not `ffn_norm`.
pub fn gguf_name(hf: &str, post_attention_norm: bool) -> Option<String> {
    let hf = hf.strip_prefix("language_model.").unwrap_or(hf);
    // GPT-2's original checkpoints hold its names without `transformer.`.
    let gpt2 = match hf.strip_prefix("transformer.") {
        Some(_) => GPT2.gguf_name(hf),
        None => GPT2.gguf_name(&format!("transformer.{hf}")),
    };
    // OPT as OPTForCausalLM saves it, or as OPTModel does (without `model.`).
    let opt = match hf.strip_prefix("decoder.") {
        Some(_) => OPT.gguf_name(&format!("model.{hf}")),
        None => OPT.gguf_name(hf),
    };
    if let Some(name) = gpt2
        .or_else(|| GPT_NEOX.gguf_name(hf))
        .or_else(|| PHI2.gguf_name(hf))
        .or(opt)
    {
        return Some(name);
    }
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        // StarCoder 2's final LayerNorm.
        "model.norm.bias" => return Some("output_norm.bias".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    // transformers 5's own layout (`save_original_format=False`): every expert's gate
    // and up in one tensor, gate first, and the downs in another.
    // gpt-oss's are laid out `[experts, in, out]`, gate and up interleaved, with biases
    // (see `HfConfig::transposes`).
    let whole = match rest {
        "mlp.experts.gate_up_proj" => "ffn_gate_up_exps.weight",
        "mlp.experts.down_proj" => "ffn_down_exps.weight",
        "mlp.experts.gate_up_proj_bias" => "ffn_gate_up_exps.bias",
        // MXFP4 checkpoints' packed codes (their `_scales` are read with them).
        "mlp.experts.gate_up_proj_blocks" => "ffn_gate_up_exps.weight",
        "mlp.experts.down_proj_blocks" => "ffn_down_exps.weight",
        "mlp.experts.down_proj_bias" => "ffn_down_exps.bias",
        // gpt-oss's per-head attention sinks.
        "self_attn.sinks" => "attn_sinks.weight",
        _ => "",
    };
    if !whole.is_empty() {
        return Some(format!("blk.{layer}.{whole}"));
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
        // GLM-4's norms after attention and after the MLP.
        "post_self_attn_layernorm" => "post_attention_norm",
        "post_mlp_layernorm" => "post_ffw_norm",
        "post_attention_layernorm" if post_attention_norm => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.gate_up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        // StarCoder 2's un-gated MLP.
        "mlp.c_fc" => "ffn_up",
        "mlp.c_proj" => "ffn_down",
        // A mixture of experts' router: Qwen3-MoE, Mixtral, gpt-oss.
        "mlp.gate" | "block_sparse_moe.gate" | "mlp.router" => "ffn_gate_inp",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{kind}"))
}

/// A checkpoint family whose names are a plain table: its global tensors and, under
/// `{layer_prefix}.{N}.`, its layer modules, each with its GGUF name (the `.weight` or
/// `.bias` suffix kept).
struct NameTable {
    globals: &'static [(&'static str, &'static str)],
    layer_prefix: &'static str,
    layers: &'static [(&'static str, &'static str)],
}

/// GPT-2, as transformers saves it (`transformer.`; the original checkpoints hold the
/// same names bare, see [`gguf_name`]).
const GPT2: NameTable = NameTable {
    globals: &[
        ("transformer.wte.weight", "token_embd.weight"),
        ("transformer.wpe.weight", "position_embd.weight"),
        ("transformer.ln_f.weight", "output_norm.weight"),
        ("transformer.ln_f.bias", "output_norm.bias"),
    ],
    layer_prefix: "transformer.h",
    layers: &[
        ("ln_1", "attn_norm"),
        ("attn.c_attn", "attn_qkv"),
        ("attn.c_proj", "attn_output"),
        ("ln_2", "ffn_norm"),
        ("mlp.c_fc", "ffn_up"),
        ("mlp.c_proj", "ffn_down"),
    ],
};

/// GPT-NeoX (Pythia).
const GPT_NEOX: NameTable = NameTable {
    globals: &[
        ("gpt_neox.embed_in.weight", "token_embd.weight"),
        ("gpt_neox.final_layer_norm.weight", "output_norm.weight"),
        ("gpt_neox.final_layer_norm.bias", "output_norm.bias"),
        ("embed_out.weight", "output.weight"),
    ],
    layer_prefix: "gpt_neox.layers",
    layers: &[
        ("input_layernorm", "attn_norm"),
        ("attention.query_key_value", "attn_qkv"),
        ("attention.dense", "attn_output"),
        ("post_attention_layernorm", "ffn_norm"),
        ("mlp.dense_h_to_4h", "ffn_up"),
        ("mlp.dense_4h_to_h", "ffn_down"),
    ],
};

/// Phi-2 (transformers' `phi`; the names it shares with Llama's map the same).
const PHI2: NameTable = NameTable {
    globals: &[
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.final_layernorm.weight", "output_norm.weight"),
        ("model.final_layernorm.bias", "output_norm.bias"),
        ("lm_head.weight", "output.weight"),
        ("lm_head.bias", "output.bias"),
    ],
    layer_prefix: "model.layers",
    layers: &[
        ("input_layernorm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.dense", "attn_output"),
        ("mlp.fc1", "ffn_up"),
        ("mlp.fc2", "ffn_down"),
    ],
};

/// OPT (its position table read from row 2, see `HfConfig::skipped_rows`).
const OPT: NameTable = NameTable {
    globals: &[
        ("model.decoder.embed_tokens.weight", "token_embd.weight"),
        (
            "model.decoder.embed_positions.weight",
            "position_embd.weight",
        ),
        (
            "model.decoder.final_layer_norm.weight",
            "output_norm.weight",
        ),
        ("model.decoder.final_layer_norm.bias", "output_norm.bias"),
        ("lm_head.weight", "output.weight"),
    ],
    layer_prefix: "model.decoder.layers",
    layers: &[
        ("self_attn_layer_norm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.out_proj", "attn_output"),
        ("final_layer_norm", "ffn_norm"),
        ("fc1", "ffn_up"),
        ("fc2", "ffn_down"),
    ],
};

impl NameTable {
    /// The GGUF name of `hf` by this table, if it names one of its tensors.
    fn gguf_name(&self, hf: &str) -> Option<String> {
        if let Some((_, gguf)) = self.globals.iter().find(|(name, _)| *name == hf) {
            return Some(gguf.to_string());
        }
        let rest = hf.strip_prefix(self.layer_prefix)?.strip_prefix('.')?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (module, kind) = rest.rsplit_once('.')?;
        if kind != "weight" && kind != "bias" {
            return None;
        }
        let (_, gguf) = self.layers.iter().find(|(m, _)| *m == module)?;
        Some(format!("blk.{layer}.{gguf}.{kind}"))
    }
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

/// StarCoder 2's un-gated MLP.
const STARCODER2_MLP: [&str; 2] = ["mlp.c_fc", "mlp.c_proj"];

/// The layer modules [`gguf_name`] maps, for naming a missing tensor as the checkpoint
/// would hold it.
const LAYER_MODULES: [&str; 21] = [
    "input_layernorm",
    "post_self_attn_layernorm",
    "post_mlp_layernorm",
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
    "mlp.c_fc",
    "mlp.c_proj",
    "mlp.gate",
    "block_sparse_moe.gate",
];

/// The Hugging Face names [`gguf_name`] maps to `gguf` (a fused and an unfused
/// checkpoint may hold either of two) in a checkpoint of GGUF architecture `arch`: what to
/// tell a user whose checkpoint lacks it.
pub fn hf_names(gguf: &str, arch: &str, post_attention_norm: bool) -> Vec<String> {
    let layer = gguf
        .strip_prefix("blk.")
        .and_then(|rest| rest.split_once('.'))
        .map(|(l, _)| l);
    let table = match arch {
        "gpt2" => Some(&GPT2),
        "gptneox" => Some(&GPT_NEOX),
        "phi2" => Some(&PHI2),
        "opt" => Some(&OPT),
        _ => None,
    };
    let (globals, layer_prefix, modules): (Vec<&str>, &str, Vec<String>) = match table {
        Some(t) => (
            t.globals.iter().map(|(hf, _)| *hf).collect(),
            t.layer_prefix,
            t.layers.iter().map(|(m, _)| m.to_string()).collect(),
        ),
        None => {
            // An expert's index, for its candidates (`blk.N.ffn_gate.E.weight`).
            let expert = gguf.split('.').nth(3).and_then(|e| e.parse::<usize>().ok());
            let expert_modules = expert.into_iter().flat_map(|e| {
                ["gate_proj", "up_proj", "down_proj"]
                    .map(|m| format!("mlp.experts.{e}.{m}"))
                    .into_iter()
                    .chain(["w1", "w2", "w3"].map(|m| format!("block_sparse_moe.experts.{e}.{m}")))
            });
            (
                vec![
                    "model.embed_tokens.weight",
                    "model.norm.weight",
                    "model.norm.bias",
                    "lm_head.weight",
                ],
                "model.layers",
                LAYER_MODULES
                    .iter()
                    // StarCoder 2's MLP names are no other family's.
                    .filter(|m| arch == "starcoder2" || !STARCODER2_MLP.contains(m))
                    .map(|m| m.to_string())
                    .chain(expert_modules)
                    .collect(),
            )
        }
    };
    let layer_modules = layer.into_iter().flat_map(|l| {
        modules
            .iter()
            .map(move |m| format!("{layer_prefix}.{l}.{m}"))
    });
    let candidates = globals
        .iter()
        .map(|g| g.to_string())
        .chain(layer_modules.flat_map(|m| ["weight", "bias"].map(|k| format!("{m}.{k}"))));
    candidates
        .filter(|hf| gguf_name(hf, post_attention_norm).as_deref() == Some(gguf))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{gguf_name, hf_names};

    #[test]
    fn a_gguf_name_goes_back_to_the_checkpoints() {
        assert_eq!(
            hf_names("blk.0.attn_q.weight", "llama", false),
            ["model.layers.0.self_attn.q_proj.weight"]
        );
        assert_eq!(
            hf_names("blk.2.ffn_up.weight", "llama", false),
            [
                "model.layers.2.mlp.up_proj.weight",
                "model.layers.2.mlp.gate_up_proj.weight"
            ]
        );
        assert_eq!(
            hf_names("output.weight", "llama", false),
            ["lm_head.weight"]
        );
        assert!(hf_names("rope_freqs.weight", "llama", false).is_empty());
        assert_eq!(
            hf_names("blk.1.ffn_down.5.weight", "qwen3moe", false),
            [
                "model.layers.1.mlp.experts.5.down_proj.weight",
                "model.layers.1.block_sparse_moe.experts.5.w2.weight"
            ]
        );
        assert_eq!(
            hf_names("blk.0.ffn_gate_inp.weight", "qwen3moe", false),
            [
                "model.layers.0.mlp.gate.weight",
                "model.layers.0.block_sparse_moe.gate.weight"
            ]
        );
    }

    #[test]
    fn maps_gpt2_and_gpt_neox_names() {
        let n = |s| gguf_name(s, false);
        // GPT-2 as transformers saves it and as the original checkpoints hold it.
        for prefix in ["transformer.", ""] {
            let name = |rest: &str| gguf_name(&format!("{prefix}{rest}"), false);
            assert_eq!(name("wpe.weight").unwrap(), "position_embd.weight");
            assert_eq!(name("h.1.attn.c_attn.bias").unwrap(), "blk.1.attn_qkv.bias");
            assert_eq!(
                name("h.0.mlp.c_proj.weight").unwrap(),
                "blk.0.ffn_down.weight"
            );
            assert_eq!(name("ln_f.bias").unwrap(), "output_norm.bias");
            // The causal-mask buffers of older checkpoints are not weights.
            assert_eq!(name("h.0.attn.bias"), None);
            assert_eq!(name("h.0.attn.masked_bias"), None);
        }
        assert_eq!(
            n("gpt_neox.layers.3.attention.query_key_value.weight").unwrap(),
            "blk.3.attn_qkv.weight"
        );
        assert_eq!(n("embed_out.weight").unwrap(), "output.weight");
        assert_eq!(
            n("gpt_neox.layers.0.post_attention_layernorm.bias").unwrap(),
            "blk.0.ffn_norm.bias"
        );
        assert_eq!(n("gpt_neox.layers.0.attention.rotary_emb.inv_freq"), None);
        assert_eq!(
            hf_names("blk.2.ffn_up.bias", "gptneox", false),
            ["gpt_neox.layers.2.mlp.dense_h_to_4h.bias"]
        );
        assert_eq!(
            hf_names("position_embd.weight", "gpt2", false),
            ["transformer.wpe.weight"]
        );
    }

    #[test]
    fn maps_phi2_names() {
        let n = |s| gguf_name(s, false);
        assert_eq!(n("model.final_layernorm.bias").unwrap(), "output_norm.bias");
        assert_eq!(n("lm_head.bias").unwrap(), "output.bias");
        assert_eq!(
            n("model.layers.1.self_attn.dense.bias").unwrap(),
            "blk.1.attn_output.bias"
        );
        assert_eq!(
            n("model.layers.0.mlp.fc1.weight").unwrap(),
            "blk.0.ffn_up.weight"
        );
        assert_eq!(
            n("model.layers.0.mlp.fc2.bias").unwrap(),
            "blk.0.ffn_down.bias"
        );
        // Shared with Llama's names, mapped the same.
        assert_eq!(
            n("model.layers.0.input_layernorm.bias").unwrap(),
            "blk.0.attn_norm.bias"
        );
        assert_eq!(hf_names("output.bias", "phi2", false), ["lm_head.bias"]);
        assert_eq!(
            hf_names("blk.3.ffn_down.weight", "phi2", false),
            ["model.layers.3.mlp.fc2.weight"]
        );
    }

    #[test]
    fn maps_starcoder2_names() {
        let n = |s| gguf_name(s, false);
        assert_eq!(
            n("model.layers.1.mlp.c_fc.bias").unwrap(),
            "blk.1.ffn_up.bias"
        );
        assert_eq!(n("model.norm.bias").unwrap(), "output_norm.bias");
        assert_eq!(
            hf_names("blk.2.ffn_down.weight", "starcoder2", false),
            [
                "model.layers.2.mlp.down_proj.weight",
                "model.layers.2.mlp.c_proj.weight"
            ]
        );
    }

    #[test]
    fn maps_opt_names_with_or_without_model_prefix() {
        for prefix in ["model.", ""] {
            let n = |rest: &str| gguf_name(&format!("{prefix}{rest}"), false);
            assert_eq!(
                n("decoder.embed_positions.weight").unwrap(),
                "position_embd.weight"
            );
            assert_eq!(
                n("decoder.layers.1.self_attn.out_proj.bias").unwrap(),
                "blk.1.attn_output.bias"
            );
            assert_eq!(
                n("decoder.layers.0.final_layer_norm.weight").unwrap(),
                "blk.0.ffn_norm.weight"
            );
            assert_eq!(
                n("decoder.final_layer_norm.bias").unwrap(),
                "output_norm.bias"
            );
        }
        assert_eq!(
            hf_names("blk.0.ffn_up.weight", "opt", false),
            ["model.decoder.layers.0.fc1.weight"]
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
        // gpt-oss: router with a bias, stacked experts with biases, sinks.
        for (hf, gguf) in [
            (
                "model.layers.2.mlp.router.weight",
                "blk.2.ffn_gate_inp.weight",
            ),
            ("model.layers.2.mlp.router.bias", "blk.2.ffn_gate_inp.bias"),
            (
                "model.layers.2.mlp.experts.gate_up_proj_bias",
                "blk.2.ffn_gate_up_exps.bias",
            ),
            (
                "model.layers.2.mlp.experts.down_proj_bias",
                "blk.2.ffn_down_exps.bias",
            ),
            ("model.layers.2.self_attn.sinks", "blk.2.attn_sinks.weight"),
        ] {
            assert_eq!(n(hf).as_deref(), Some(gguf), "{hf}");
        }
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
