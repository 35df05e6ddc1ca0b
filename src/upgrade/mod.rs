//! The upgrade engine.

pub mod machine;
