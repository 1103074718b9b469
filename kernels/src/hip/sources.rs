//! The text hipRTC compiles for a module: kernels/hip/compat.h, then exactly what NVRTC gets
//! for CUDA (common.cuh, the sampling modules' shared header, the .cu file; see
//! crate::cuda::sources). One set of kernel sources serves both platforms.

/// The CUDA -> HIP mappings (warp shuffles without masks, WARP_SIZE, __syncwarp).
pub const COMPAT: &str = include_str!("../../hip/compat.h");

/// (module name, source body) of every module, the same list and order as CUDA's.
pub fn modules() -> &'static [(&'static str, &'static str)] {
    crate::cuda::sources::MODULES
}

/// The full text hipRTC compiles for a module body.
pub fn full_source(body: &str) -> String {
    let cuda = crate::cuda::sources::full_source(body);
    let mut s = String::with_capacity(COMPAT.len() + cuda.len() + 1);
    s.push_str(COMPAT);
    s.push('\n');
    s.push_str(&cuda);
    s
}

#[cfg(test)]
mod tests {
    /// kernels/hip/check_sources.sh lists the modules for hipcc by hand; it must name the same
    /// ones, in the same order, as the loader.
    #[test]
    fn check_script_lists_the_loaders_modules() {
        let script = include_str!("../../hip/check_sources.sh");
        let line = script.lines().find(|l| l.starts_with("modules=(")).expect("modules=( line in check_sources.sh");
        let listed: Vec<&str> = line.trim_start_matches("modules=(").trim_end_matches(')').split_whitespace().collect();
        let loaded: Vec<&str> = super::modules().iter().map(|&(m, _)| m).collect();
        assert_eq!(listed, loaded);
        // The sampling modules take sampling_shared.cuh in both.
        for &(m, body) in super::modules() {
            let shared = body.contains("#define NO_TOKEN");
            assert_eq!(shared, m.starts_with("sampling"), "{m}: sampling_shared.cuh placement");
        }
    }

    #[test]
    fn compat_comes_first_and_defines_the_warp_width() {
        let s = super::full_source("__global__ void k() {}");
        assert!(s.starts_with(super::COMPAT));
        let compat_at = s.find("#define WARP_SIZE __AMDGCN_WAVEFRONT_SIZE").expect("compat's WARP_SIZE");
        let common_at = s.find("#ifndef WARP_SIZE").expect("common.cuh's default");
        assert!(compat_at < common_at, "the HIP width must be defined before common.cuh's default");
    }
}
