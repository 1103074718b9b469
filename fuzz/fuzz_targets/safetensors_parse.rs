//! Fuzzes the safetensors header reader: any input must parse or fail with an error;
//! what parses must hold every tensor's bytes inside the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_model::safetensors::SafeTensorsFile;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = SafeTensorsFile::from_bytes(data.to_vec()) else { return };
    for t in f.tensors().values() {
        assert_eq!(f.tensor_data(t).len(), t.n_bytes);
        let _ = t.ggml_type();
    }
});
