//! lantern-model
