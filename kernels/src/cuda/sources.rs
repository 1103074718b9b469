//! The CUDA C sources, embedded in the binary at build time so a deployed worker needs no
//! source tree. Each module is `common.cuh` followed by one `.cu` file (the two sampling modules
//! put `sampling_shared.cuh` before theirs); the concatenation is what NVRTC compiles and what
//! the cache key hashes.

const COMMON: &str = include_str!("../../cuda/common.cuh");

/// (module name, source body) of every module, in load order.
pub const MODULES: &[(&str, &str)] = &[
    ("norm", include_str!("../../cuda/norm.cu")),
    ("activation", include_str!("../../cuda/activation.cu")),
    ("embedding", include_str!("../../cuda/embedding.cu")),
    ("inputs", include_str!("../../cuda/inputs.cu")),
    ("rope", include_str!("../../cuda/rope.cu")),
    ("attention", include_str!("../../cuda/attention.cu")),
    ("qkv", include_str!("../../cuda/qkv.cu")),
    ("init", include_str!("../../cuda/init.cu")),
    ("sampling", concat!(include_str!("../../cuda/sampling_shared.cuh"), include_str!("../../cuda/sampling.cu"))),
    (
        "sampling_split",
        concat!(include_str!("../../cuda/sampling_shared.cuh"), include_str!("../../cuda/sampling_split.cu")),
    ),
    ("gemv", include_str!("../../cuda/gemv.cu")),
    ("allreduce_oneshot", include_str!("../../cuda/allreduce_oneshot.cu")),
    ("token_mask", include_str!("../../cuda/token_mask.cu")),
];

/// The full text NVRTC compiles for a module body.
pub fn full_source(body: &str) -> String {
    let mut s = String::with_capacity(COMMON.len() + body.len() + 1);
    s.push_str(COMMON);
    s.push('\n');
    s.push_str(body);
    s
}
