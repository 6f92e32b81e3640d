//! lantern-engine
