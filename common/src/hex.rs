//! Lower-case hex for the few binary values that travel inside JSON control
//! messages (endpoint names, queue-pair info): short, bounded, validated.

/// Lower-case hex of `bytes`.
pub fn encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// Why a hex string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HexError {
    #[error("hex of {chars} characters is longer than {max_bytes} bytes allow")]
    TooLong { chars: usize, max_bytes: usize },
    #[error("hex has an odd number of characters ({0})")]
    OddLength(usize),
    #[error("{found:?} at character {at} is not a hex digit")]
    NotHex { at: usize, found: char },
}

/// Parses [`encode`]'s output (either case), refusing more than `max_bytes`.
pub fn decode(text: &str, max_bytes: usize) -> Result<Vec<u8>, HexError> {
    if text.len() > max_bytes.saturating_mul(2) {
        return Err(HexError::TooLong {
            chars: text.len(),
            max_bytes,
        });
    }
    if !text.len().is_multiple_of(2) {
        return Err(HexError::OddLength(text.len()));
    }
    let digit = |at: usize, c: u8| {
        (c as char)
            .to_digit(16)
            .map(|d| d as u8)
            .ok_or(HexError::NotHex {
                at,
                found: c as char,
            })
    };
    let b = text.as_bytes();
    (0..b.len() / 2)
        .map(|i| Ok(digit(2 * i, b[2 * i])? << 4 | digit(2 * i + 1, b[2 * i + 1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let v: Vec<u8> = (0..=255).collect();
        assert_eq!(decode(&encode(&v), 256).unwrap(), v);
        assert_eq!(decode("ABff", 2).unwrap(), vec![0xab, 0xff]);
        assert_eq!(decode("", 0).unwrap(), Vec::<u8>::new());
        assert_eq!(decode("abc", 4), Err(HexError::OddLength(3)));
        assert_eq!(
            decode("abcdef", 2),
            Err(HexError::TooLong {
                chars: 6,
                max_bytes: 2
            })
        );
        let e = decode("0g", 4).unwrap_err();
        assert_eq!(e, HexError::NotHex { at: 1, found: 'g' });
        assert!(e.to_string().contains("'g' at character 1"), "{e}");
    }
}
