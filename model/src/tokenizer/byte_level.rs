//! GPT-2's reversible byte <-> character table. Byte-level BPE vocabularies store every
//! byte as a printable character so a token is always a valid string: bytes that are
//! printable Latin-1 (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves, the other 68
//! (controls, space, DEL, NBSP, soft hyphen) map in byte order to U+0100..=U+0143.
//! Computed, not tabled: both directions are a couple of comparisons.

/// Bytes that represent themselves.
fn is_direct(b: u8) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The character standing for byte `b`.
pub(crate) fn byte_to_char(b: u8) -> char {
    if is_direct(b) {
        return char::from(b);
    }
    // Rank of `b` among the 68 shifted bytes: 0x00..=0x20, then 0x7F..=0xA0, then 0xAD.
    let rank = match b {
        0x00..=0x20 => u32::from(b),
        0x7F..=0xA0 => 33 + u32::from(b - 0x7F),
        _ => 67,
    };
    char::from_u32(256 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// The byte a character stands for, or `None` if it is not in the table.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = u32::from(c);
    if cp < 256 {
        let b = cp as u8;
        return is_direct(b).then_some(b);
    }
    match cp - 256 {
        r @ 0..=32 => Some(r as u8),
        r @ 33..=66 => Some(0x7F + (r - 33) as u8),
        67 => Some(0xAD),
        _ => None,
    }
}

/// Appends the byte-level form of `text` to `out`.
pub(crate) fn encode_into(text: &str, out: &mut String) {
    out.reserve(text.len() * 2);
    for &b in text.as_bytes() {
        out.push(byte_to_char(b));
    }
}

/// Appends the bytes a byte-level token stands for to `out`. A character outside the
/// table (a malformed vocabulary) is copied as its own UTF-8, so nothing is dropped.
pub(crate) fn decode_into(token: &str, out: &mut Vec<u8>) {
    for c in token.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_a_bijection_onto_256_chars() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b);
            assert!(seen.insert(c), "byte {b:#x} collides");
            assert_eq!(char_to_byte(c), Some(b));
        }
        // GPT-2's well-known anchors: space is U+0120 'Ġ', newline U+010A 'Ċ'.
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(0xAD), '\u{143}');
        assert_eq!(char_to_byte('\u{144}'), None);
        assert_eq!(char_to_byte('\u{A0}'), None);
    }
}
