//! lantern-attn
