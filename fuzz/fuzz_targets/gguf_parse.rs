//! Fuzzes the GGUF reader: any input must parse or fail with an error, never panic,
//! read out of bounds or allocate without bound; what parses must keep the reader's
//! promises (tensor bytes inside the file, sized by type and dims) and be safe to hand to
//! the config and weight readers.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_model::config::ModelConfig;
use tessera_model::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::from_bytes(data.to_vec()) else { return };
    for t in g.tensors() {
        assert_eq!(g.tensor_data(t).len(), t.n_bytes);
        assert_eq!(Some(t.n_bytes), t.ty.bytes_for(t.n_elements() as usize));
        assert_eq!((t.offset - g.data_offset()) % g.alignment(), 0);
        assert!(g.tensor(&t.name).is_some());
    }
    let _ = ModelConfig::from_gguf(&g);
    let files = tessera_model::weights::ModelFiles::Gguf(g);
    for name in ["token_embd.weight", "output.weight", "blk.0.attn_q.weight", "output_norm.weight"] {
        let _ = files.tensor(name);
    }
});
