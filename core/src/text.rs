//! Text that came from a peer or a handler, made safe to store and to show on a terminal.

/// Whether `c` would be taken as an instruction by a terminal or reorder what surrounds
/// it: control characters (C0, DEL, C1: escape sequences, carriage returns, bells) and
/// the Unicode bidirectional formatting characters.
fn hazardous(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

/// `s` as one printable line of at most `max_chars` characters: every control or
/// bidirectional formatting character is written out as an escape (`\u{1b}`, `\n`), so
/// it is visible but does nothing, and a longer text is cut and ends in `…`.
pub fn printable(s: &str, max_chars: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max_chars.saturating_mul(4)));
    let mut used = 0usize;
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        let piece: String = if hazardous(c) {
            match c {
                '\n' => "\\n".into(),
                '\t' => "\\t".into(),
                '\r' => "\\r".into(),
                c => format!("\\u{{{:x}}}", c as u32),
            }
        } else {
            c.to_string()
        };
        let width = piece.chars().count();
        let last = chars.peek().is_none();
        // Room for the piece, and for the ellipsis unless nothing follows.
        if used + width + usize::from(!last) > max_chars {
            if used < max_chars {
                out.push('…');
            }
            return out;
        }
        out.push_str(&piece);
        used += width;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn escapes_do_nothing_and_show() {
        assert_eq!(
            printable("a\u{1b}[2Kb\u{7}\r\n", 100),
            "a\\u{1b}[2Kb\\u{7}\\r\\n"
        );
        // OSC 52 (clipboard) and C1 CSI.
        assert_eq!(
            printable("\u{1b}]52;c;eA==\u{7}", 100),
            "\\u{1b}]52;c;eA==\\u{7}"
        );
        assert_eq!(printable("x\u{9b}y", 100), "x\\u{9b}y");
        assert_eq!(printable("abc\u{202e}def", 100), "abc\\u{202e}def");
        assert_eq!(printable("ünïcödé ok", 100), "ünïcödé ok");
    }

    #[test]
    fn bounded_in_characters() {
        assert_eq!(printable("abcdef", 6), "abcdef");
        assert_eq!(printable("abcdefg", 6), "abcde…");
        assert_eq!(printable("ééééééé", 3), "éé…");
        assert_eq!(printable("a\u{1b}", 3), "a…");
        assert_eq!(printable("", 0), "");
        assert_eq!(printable("a", 0), "");
        let long = "x".repeat(10_000);
        assert_eq!(printable(&long, 200).chars().count(), 200);
    }
}
