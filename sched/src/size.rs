//! Sizes as users write them: `8GiB`, `512 MiB`, `1.5GB`, `4096`.

use std::fmt;
use std::str::FromStr;

/// A number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("empty size")]
    Empty,
    #[error("`{0}` is not a size: expected a number with an optional unit (B, KB, KiB, MB, MiB, GB, GiB, TB, TiB)")]
    Invalid(String),
    #[error("`{0}` does not fit in 64 bits of bytes")]
    Overflow(String),
}

const UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("k", 1000),
    ("kb", 1000),
    ("kib", 1 << 10),
    ("m", 1000 * 1000),
    ("mb", 1000 * 1000),
    ("mib", 1 << 20),
    ("g", 1000 * 1000 * 1000),
    ("gb", 1000 * 1000 * 1000),
    ("gib", 1 << 30),
    ("t", 1000 * 1000 * 1000 * 1000),
    ("tb", 1000 * 1000 * 1000 * 1000),
    ("tib", 1 << 40),
];

impl FromStr for ByteSize {
    type Err = SizeError;

    fn from_str(s: &str) -> Result<Self, SizeError> {
        let t = s.trim();
        if t.is_empty() {
            return Err(SizeError::Empty);
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let unit = unit.trim().to_ascii_lowercase();
        let mult = if unit.is_empty() {
            1
        } else {
            UNITS
                .iter()
                .find(|(u, _)| *u == unit)
                .map(|&(_, m)| m)
                .ok_or_else(|| SizeError::Invalid(s.to_string()))?
        };
        if num.is_empty() || num.matches('.').count() > 1 {
            return Err(SizeError::Invalid(s.to_string()));
        }
        if let Some((whole, frac)) = num.split_once('.') {
            // Decimal fractions are exact to the byte: whole*mult + frac*mult/10^len.
            let whole: u64 = if whole.is_empty() {
                0
            } else {
                whole
                    .parse()
                    .map_err(|_| SizeError::Overflow(s.to_string()))?
            };
            let frac_digits = frac.len().min(18) as u32;
            let frac_val: u64 = if frac_digits == 0 {
                0
            } else {
                frac[..frac_digits as usize]
                    .parse()
                    .map_err(|_| SizeError::Invalid(s.to_string()))?
            };
            let frac_bytes = (u128::from(frac_val) * u128::from(mult)) / 10u128.pow(frac_digits);
            whole
                .checked_mul(mult)
                .and_then(|w| w.checked_add(u64::try_from(frac_bytes).ok()?))
                .map(ByteSize)
                .ok_or_else(|| SizeError::Overflow(s.to_string()))
        } else {
            let n: u64 = num
                .parse()
                .map_err(|_| SizeError::Overflow(s.to_string()))?;
            n.checked_mul(mult)
                .map(ByteSize)
                .ok_or_else(|| SizeError::Overflow(s.to_string()))
        }
    }
}

/// Written as a plain number of bytes (exact); read from a number or a string such as `"8GiB"`.
impl serde::Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ByteSize, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(b) => Ok(ByteSize(b)),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl fmt::Display for ByteSize {
    /// Binary units with two decimals (`7.45 GiB`), or plain bytes below 1 KiB.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        let units = [
            ("TiB", 1u64 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        match units.iter().find(|&&(_, m)| b >= m) {
            Some(&(name, m)) => write!(f, "{:.2} {name}", b as f64 / m as f64),
            None => write!(f, "{b} B"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_decimal_and_plain_sizes() {
        assert_eq!("8GiB".parse(), Ok(ByteSize(8 << 30)));
        assert_eq!("512 MiB".parse(), Ok(ByteSize(512 << 20)));
        assert_eq!("1.5GB".parse(), Ok(ByteSize(1_500_000_000)));
        assert_eq!("0.5GiB".parse(), Ok(ByteSize(1 << 29)));
        assert_eq!("4096".parse(), Ok(ByteSize(4096)));
        assert_eq!("24g".parse(), Ok(ByteSize(24_000_000_000)));
    }

    #[test]
    fn rejects_garbage_and_overflow() {
        assert_eq!("".parse::<ByteSize>(), Err(SizeError::Empty));
        assert!(matches!(
            "GiB".parse::<ByteSize>(),
            Err(SizeError::Invalid(_))
        ));
        assert!(matches!(
            "8 parsecs".parse::<ByteSize>(),
            Err(SizeError::Invalid(_))
        ));
        assert!(matches!(
            "1.2.3GB".parse::<ByteSize>(),
            Err(SizeError::Invalid(_))
        ));
        assert!(matches!(
            "-1".parse::<ByteSize>(),
            Err(SizeError::Invalid(_))
        ));
        assert!(matches!(
            "20000000TiB".parse::<ByteSize>(),
            Err(SizeError::Overflow(_))
        ));
    }

    #[test]
    fn serde_reads_numbers_and_strings() {
        #[derive(serde::Deserialize, serde::Serialize)]
        struct T {
            a: ByteSize,
            b: ByteSize,
        }
        let t: T = serde_json::from_str(r#"{"a": 4096, "b": "8GiB"}"#).unwrap();
        assert_eq!((t.a, t.b), (ByteSize(4096), ByteSize(8 << 30)));
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{"a":4096,"b":8589934592}"#
        );
        assert!(serde_json::from_str::<T>(r#"{"a": 1, "b": "8 parsecs"}"#).is_err());
    }

    #[test]
    fn displays_in_binary_units() {
        assert_eq!(ByteSize(8 << 30).to_string(), "8.00 GiB");
        assert_eq!(ByteSize(1536).to_string(), "1.50 KiB");
        assert_eq!(ByteSize(12).to_string(), "12 B");
    }
}
