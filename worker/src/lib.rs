//! The worker: loads a model's weights, keeps its KV cache and runs the forward pass
//! through `tessera-kernels`, then samples the next tokens.

pub mod sampling;
