//! User pins: `PATTERN=DEVICE`, as llama.cpp's `-ot`: the first pin whose regular expression
//! matches somewhere in a tensor's name decides that tensor's tier.

use std::fmt;
use std::str::FromStr;

use regex::Regex;
use serde::{Deserialize, Serialize};

/// Where a tensor (or expert) lives during decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Resident in VRAM, computed on the GPU.
    Vram,
    /// Kept in RAM or on the SSD, copied into a VRAM staging slot when needed, computed on the GPU.
    Stream,
    /// Kept in RAM or on the SSD, computed on the CPU.
    Cpu,
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Vram => "VRAM",
            Tier::Stream => "stream",
            Tier::Cpu => "CPU",
        })
    }
}

/// One `PATTERN=DEVICE` pin.
#[derive(Debug, Clone)]
pub struct Pin {
    pub pattern: Regex,
    pub tier: Tier,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PinError {
    #[error("pin `{0}`: expected PATTERN=DEVICE, for example 'blk\\.[0-9]+\\.ffn_.*_exps=cpu'")]
    Syntax(String),
    #[error("pin `{pin}`: unknown device `{device}`: use gpu (or vram), stream, or cpu")]
    Device { pin: String, device: String },
    #[error("pin `{pin}`: {error}")]
    Regex { pin: String, error: String },
}

impl FromStr for Pin {
    type Err = PinError;

    fn from_str(s: &str) -> Result<Pin, PinError> {
        // The device is after the last `=`: a pattern may hold `=` itself.
        let (pattern, device) = s
            .rsplit_once('=')
            .filter(|(p, d)| !p.is_empty() && !d.is_empty())
            .ok_or_else(|| PinError::Syntax(s.to_string()))?;
        let d = device.trim().to_ascii_lowercase();
        // llama.cpp writes backends as CUDA0, Vulkan0, ...: any GPU backend means VRAM here.
        let tier = if d == "cpu" {
            Tier::Cpu
        } else if d == "stream" {
            Tier::Stream
        } else if ["gpu", "vram", "cuda", "vulkan"].iter().any(|g| {
            d.strip_prefix(g)
                .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
        }) {
            Tier::Vram
        } else {
            return Err(PinError::Device {
                pin: s.to_string(),
                device: device.to_string(),
            });
        };
        let pattern = Regex::new(pattern).map_err(|e| PinError::Regex {
            pin: s.to_string(),
            error: e.to_string(),
        })?;
        Ok(Pin { pattern, tier })
    }
}

impl fmt::Display for Pin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let device = match self.tier {
            Tier::Vram => "gpu",
            Tier::Stream => "stream",
            Tier::Cpu => "cpu",
        };
        write!(f, "{}={device}", self.pattern.as_str())
    }
}

/// The tier the first matching pin gives `name`, and that pin's index.
pub fn pinned(pins: &[Pin], name: &str) -> Option<(usize, Tier)> {
    pins.iter()
        .enumerate()
        .find(|(_, p)| p.pattern.is_match(name))
        .map(|(i, p)| (i, p.tier))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llama_cpp_style_pins() {
        let p: Pin = r"blk\.[0-9]+\.ffn_.*_exps=CPU".parse().unwrap();
        assert_eq!(p.tier, Tier::Cpu);
        assert!(p.pattern.is_match("blk.12.ffn_up_exps.weight"));
        assert!(!p.pattern.is_match("blk.12.ffn_up.weight"));
        assert_eq!("output=CUDA0".parse::<Pin>().unwrap().tier, Tier::Vram);
        assert_eq!(
            "a=b=vulkan1".parse::<Pin>().unwrap().pattern.as_str(),
            "a=b"
        );
        assert_eq!("x=stream".parse::<Pin>().unwrap().tier, Tier::Stream);
        assert!(matches!("exps".parse::<Pin>(), Err(PinError::Syntax(_))));
        assert!(matches!(
            "exps=tpu".parse::<Pin>(),
            Err(PinError::Device { .. })
        ));
        assert!(matches!(
            "(=cpu".parse::<Pin>(),
            Err(PinError::Regex { .. })
        ));
        assert_eq!(p.to_string(), r"blk\.[0-9]+\.ffn_.*_exps=cpu");
    }

    #[test]
    fn first_matching_pin_wins() {
        let pins: Vec<Pin> = ["blk\\.0\\.=gpu", "exps=cpu"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(
            pinned(&pins, "blk.0.ffn_up_exps.weight"),
            Some((0, Tier::Vram))
        );
        assert_eq!(
            pinned(&pins, "blk.1.ffn_up_exps.weight"),
            Some((1, Tier::Cpu))
        );
        assert_eq!(pinned(&pins, "output.weight"), None);
    }
}
