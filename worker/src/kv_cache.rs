//! Paged KV memory of one worker on the CPU backend.
//!
//! KV lives in fixed-size blocks; a sequence's block table (owned by whoever schedules,
//! the coordinator in the cluster) maps position `p` to block `table[p / block_size]`,
//! slot `p % block_size`. Blocks never move, so sequences can share prefix blocks.
//! K and V are held in f16, as llama.cpp's default cache: half the memory of f32, and
//! the rounding the engine's attention (`attention_f16`) is built around.

use half::f16;

/// KV cache for every layer.
pub struct KvCache {
    /// Per layer: key cache, `[num_blocks, block_size, n_kv_heads, head_dim]` f16.
    pub k: Vec<Vec<f16>>,
    /// Per layer: value cache, same shape as `k`.
    pub v: Vec<Vec<f16>>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvCache {
    /// Allocates `num_blocks` blocks of `block_size` positions for `num_layers` layers.
    pub fn new(num_layers: usize, num_blocks: usize, block_size: usize, n_kv_heads: usize, head_dim: usize) -> Self {
        let per_layer = num_blocks * block_size * n_kv_heads * head_dim;
        KvCache {
            k: (0..num_layers).map(|_| vec![f16::ZERO; per_layer]).collect(),
            v: (0..num_layers).map(|_| vec![f16::ZERO; per_layer]).collect(),
            num_blocks,
            block_size,
            n_kv_heads,
            head_dim,
        }
    }

    /// Bytes one block takes over all layers (K and V), for sizing the cache from a budget.
    pub fn bytes_per_block(num_layers: usize, block_size: usize, n_kv_heads: usize, head_dim: usize) -> usize {
        2 * num_layers * block_size * n_kv_heads * head_dim * std::mem::size_of::<f16>()
    }

    /// Number of blocks a context of `len` positions needs.
    pub fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.block_size)
    }
}
