//! The AMD GPU target a module is compiled for: the processor (`gfx90a`, `gfx942`, `gfx1100`)
//! and the target features the runtime reports after it (`gfx90a:sramecc+:xnack-`).
//!
//! hipRTC is given the bare processor, so the code object runs whatever the device's xnack
//! and sramecc modes are ("any" in LLVM's terms); the processor is also the cache key's arch.
//! The processor decides the wavefront width the kernels are compiled for (GCN and CDNA:
//! 64 lanes; RDNA, gfx10 and later: 32, the compiler's default there). Pure Rust: tested
//! without a GPU.

use std::fmt;

use crate::KernelError;

/// A parsed AMD target id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GfxArch {
    /// `gfx` followed by the version digits, e.g. `gfx90a`.
    processor: String,
    /// Features as reported, e.g. `["sramecc+", "xnack-"]` (not part of the compile target).
    features: Vec<String>,
}

impl GfxArch {
    /// Parses `gfx90a`, `gfx90a:sramecc+:xnack-`, `gfx1100`, `gfx942:xnack+`. The processor
    /// is `gfx` and 3 or 4 lowercase hex digits (the last two may be hex: `gfx90a`, `gfx90c`);
    /// each feature is a name followed by `+` or `-`.
    pub fn parse(s: &str) -> Result<Self, KernelError> {
        let bad = |why: &str| KernelError::Unsupported { op: "gfx arch", ty: format!("{s:?}: {why}") };
        let s = s.trim_end_matches('\0').trim();
        let mut parts = s.split(':');
        let processor = parts.next().unwrap_or_default();
        let digits = processor.strip_prefix("gfx").ok_or_else(|| bad("expected gfx<version>"))?;
        if !(3..=4).contains(&digits.len())
            || !digits.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            || !digits.as_bytes()[0].is_ascii_digit()
        {
            return Err(bad("expected 3 or 4 version digits after gfx"));
        }
        let mut features = Vec::new();
        for f in parts {
            let name = f.strip_suffix('+').or_else(|| f.strip_suffix('-')).ok_or_else(|| bad("a feature lacks +/-"))?;
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(bad("malformed feature"));
            }
            features.push(f.to_string());
        }
        Ok(GfxArch { processor: processor.to_string(), features })
    }

    /// `gfx90a`: what hipRTC compiles for and the cache key holds.
    pub fn processor(&self) -> &str {
        &self.processor
    }

    pub fn features(&self) -> &[String] {
        &self.features
    }

    /// The major version: 9 for `gfx90a` and `gfx942`, 11 for `gfx1100`.
    pub fn major(&self) -> u32 {
        let digits = &self.processor[3..];
        // 4 digits: a two-digit major (gfx10xx, gfx11xx, gfx12xx).
        let major = if digits.len() == 4 { &digits[..2] } else { &digits[..1] };
        major.parse().unwrap_or(0)
    }

    /// Lanes per wavefront the kernels are compiled for on this processor.
    pub fn wavefront_size(&self) -> u32 {
        if self.major() >= 10 {
            32
        } else {
            64
        }
    }

    /// The hipRTC option selecting the target.
    pub fn hiprtc_option(&self) -> String {
        format!("--gpu-architecture={}", self.processor)
    }

    /// Finds the target id in raw `hipDeviceProp_t` bytes: the first `gfx...` string, ended by a
    /// NUL, that parses. The struct's layout differs between ROCm releases (5.x and 6.x moved
    /// `gcnArchName`), so the loader reads it without a hard-coded offset; the name field
    /// ("AMD Instinct MI210") holds no `gfx`.
    pub fn find_in_properties(props: &[u8]) -> Option<GfxArch> {
        let mut at = 0;
        while let Some(i) = props[at..].windows(3).position(|w| w == b"gfx") {
            let start = at + i;
            let end = props[start..].iter().position(|&b| b == 0).map_or(props.len(), |n| start + n);
            if let Ok(text) = std::str::from_utf8(&props[start..end]) {
                if let Ok(arch) = GfxArch::parse(text) {
                    return Some(arch);
                }
            }
            at = start + 3;
        }
        None
    }
}

impl fmt::Display for GfxArch {
    /// The full target id as the runtime reports it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.processor)?;
        for feat in &self.features {
            write!(f, ":{feat}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_target_ids() {
        let a = GfxArch::parse("gfx90a:sramecc+:xnack-").unwrap();
        assert_eq!(a.processor(), "gfx90a");
        assert_eq!(a.features(), ["sramecc+", "xnack-"]);
        assert_eq!(a.to_string(), "gfx90a:sramecc+:xnack-");
        assert_eq!(a.hiprtc_option(), "--gpu-architecture=gfx90a");
        for (s, proc_, major, wave) in [
            ("gfx90a", "gfx90a", 9, 64),
            ("gfx942:sramecc+:xnack-", "gfx942", 9, 64),
            ("gfx908:xnack+", "gfx908", 9, 64),
            ("gfx1100", "gfx1100", 11, 32),
            ("gfx1030", "gfx1030", 10, 32),
            ("gfx803", "gfx803", 8, 64),
        ] {
            let a = GfxArch::parse(s).unwrap();
            assert_eq!((a.processor(), a.major(), a.wavefront_size()), (proc_, major, wave), "{s}");
        }
    }

    #[test]
    fn rejects_malformed() {
        for s in ["", "gfx", "gfx9", "sm_90a", "gfx90a:xnack", "gfx90a:", "gfx12345", "gfxa0a", "GFX90A", "gfx90g"] {
            assert!(GfxArch::parse(s).is_err(), "{s:?} should be rejected");
        }
    }

    #[test]
    fn finds_the_arch_in_property_bytes() {
        // A property block: a device name, padding, then the arch string at an arbitrary
        // offset, as both the ROCm 5 and 6 layouts have it somewhere after the name.
        let mut props = vec![0u8; 1472];
        props[..18].copy_from_slice(b"AMD Instinct MI210");
        props[200..204].copy_from_slice(&1234u32.to_le_bytes());
        let arch = b"gfx90a:sramecc+:xnack-";
        props[1160..1160 + arch.len()].copy_from_slice(arch);
        assert_eq!(GfxArch::find_in_properties(&props).unwrap().to_string(), "gfx90a:sramecc+:xnack-");
        // A stray "gfx" that does not parse is skipped.
        props[40..46].copy_from_slice(b"gfx!!\0");
        assert_eq!(GfxArch::find_in_properties(&props).unwrap().processor(), "gfx90a");
        assert!(GfxArch::find_in_properties(&[0u8; 64]).is_none());
    }
}
