//! The GPU architecture a kernel module is compiled for, e.g. `sm_90a` on Hopper.
//!
//! NVRTC takes it as `--gpu-architecture=sm_XY[a]` and it is half of the on-disk cache key,
//! so it is parsed and printed in one place. Pure Rust: tested without a GPU.

use std::fmt;

use crate::KernelError;

/// `sm_<major><minor>` with the optional arch-specific `a` suffix (wgmma, setmaxnreg on
/// sm_90a); the `a` variant runs only on that exact major.minor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
    /// `true` for the `a` (arch-specific feature set) variant.
    pub specific: bool,
}

impl Arch {
    /// The target Tessera compiles for on a device of compute capability `major.minor`:
    /// the `a` variant from Hopper (9.0) on, since that is what unlocks its instructions
    /// and the module never leaves the machine that compiled it.
    pub fn for_compute_capability(major: u32, minor: u32) -> Self {
        Arch { major, minor, specific: major >= 9 }
    }

    /// Parses `sm_90a`, `sm_90`, `sm_80`, `sm_120a`, `compute_90a` (the PTX spelling).
    /// The last digit is the minor version, the digits before it the major.
    pub fn parse(s: &str) -> Result<Self, KernelError> {
        let bad = |why: &str| KernelError::Unsupported { op: "arch", ty: format!("{s:?}: {why}") };
        let digits = s
            .strip_prefix("sm_")
            .or_else(|| s.strip_prefix("compute_"))
            .ok_or_else(|| bad("expected sm_<digits>[a]"))?;
        let (digits, specific) = match digits.strip_suffix('a') {
            Some(d) => (d, true),
            None => (digits, false),
        };
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("expected at least two digits"));
        }
        let (maj, min) = digits.split_at(digits.len() - 1);
        let major: u32 = maj.parse().map_err(|_| bad("major version out of range"))?;
        let minor: u32 = min.parse().map_err(|_| bad("minor version out of range"))?;
        if major == 0 {
            return Err(bad("major version 0"));
        }
        Ok(Arch { major, minor, specific })
    }

    /// The NVRTC option selecting this target (SASS, not PTX).
    pub fn nvrtc_option(&self) -> String {
        format!("--gpu-architecture={self}")
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}{}", self.major, self.minor, if self.specific { "a" } else { "" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_round_trip() {
        for (s, major, minor, specific) in [
            ("sm_90a", 9, 0, true),
            ("sm_90", 9, 0, false),
            ("sm_80", 8, 0, false),
            ("sm_120a", 12, 0, true),
            ("sm_86", 8, 6, false),
        ] {
            let a = Arch::parse(s).unwrap();
            assert_eq!((a.major, a.minor, a.specific), (major, minor, specific), "{s}");
            assert_eq!(a.to_string(), s);
        }
        assert_eq!(Arch::parse("compute_90a").unwrap().to_string(), "sm_90a");
    }

    #[test]
    fn rejects_malformed() {
        for s in ["", "sm_", "sm_9", "sm_9x", "sm90", "gfx942", "sm_a", "sm_00", "sm_99999999999999999990"] {
            assert!(Arch::parse(s).is_err(), "{s:?} should be rejected");
        }
    }

    #[test]
    fn compute_capability_picks_the_specific_variant_from_hopper() {
        assert_eq!(Arch::for_compute_capability(9, 0).to_string(), "sm_90a");
        assert_eq!(Arch::for_compute_capability(8, 9).to_string(), "sm_89");
        assert_eq!(Arch::for_compute_capability(10, 0).nvrtc_option(), "--gpu-architecture=sm_100a");
    }
}
