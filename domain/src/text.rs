//! What text from outside may hold, and how two people's names are compared.
//!
//! Names a console renders or a person reads (actors, names, reasons) must show what they
//! are: a character that is invisible, reorders the text around it (bidirectional
//! controls) or drives a terminal (control characters, ANSI escapes) lets one name pass
//! for another. Such characters are refused when text arrives (a token, a request body, an
//! inbound event); text already stored is read back as it is.

use unicode_normalization::UnicodeNormalization;
use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};

/// Whether `c` must not appear in a name: control characters, format characters (zero-width
/// spaces and joiners, bidirectional marks, embeddings, overrides and isolates, the byte
/// order mark, soft hyphens), line and paragraph separators, private-use, surrogate and
/// unassigned code points, and the other default-ignorable characters that render as
/// nothing (variation selectors, Hangul fillers, the combining grapheme joiner).
pub fn is_hidden_or_control(c: char) -> bool {
    matches!(
        c.general_category(),
        GeneralCategory::Control
            | GeneralCategory::Format
            | GeneralCategory::LineSeparator
            | GeneralCategory::ParagraphSeparator
            | GeneralCategory::PrivateUse
            | GeneralCategory::Surrogate
            | GeneralCategory::Unassigned
    ) || matches!(
        c,
        '\u{034F}'
            | '\u{115F}'
            | '\u{1160}'
            | '\u{17B4}'
            | '\u{17B5}'
            | '\u{180B}'..='\u{180F}'
            | '\u{2800}'
            | '\u{3164}'
            | '\u{FE00}'..='\u{FE0F}'
            | '\u{FFA0}'
            | '\u{E0100}'..='\u{E01EF}'
    )
}

/// The first character of `text` that [`is_hidden_or_control`] refuses.
pub fn first_hidden_or_control(text: &str) -> Option<char> {
    text.chars().find(|c| is_hidden_or_control(*c))
}

/// The form in which two names of one person are equal: Unicode compatibility
/// normalisation (NFKC: full-width letters, ligatures and the like become their plain
/// forms), full lowercasing, without the characters [`is_hidden_or_control`] refuses (names
/// stored before they were refused), trimmed. `Alice`, `alice ` and `alice` followed by a
/// zero-width space all give `alice`.
pub fn person_key(name: &str) -> String {
    let visible: String = name.nfkc().filter(|c| !is_hidden_or_control(*c)).collect();
    // Lowercasing can leave text that is not NFKC (and NFKC text that lowercases further),
    // so normalise again after it.
    let folded: String = visible.to_lowercase().nfkc().collect::<String>();
    folded.trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_person_has_one_key() {
        for name in [
            "alice",
            "Alice",
            "ALICE",
            "alice ",
            " alice",
            "alice\u{200B}",
            "al\u{200D}ice",
            "\u{FEFF}alice",
            "\u{202E}alice",
            "ａｌｉｃｅ",
            "alice\u{00A0}",
        ] {
            assert_eq!(person_key(name), "alice", "{name:?}");
        }
        assert_ne!(person_key("alice"), person_key("alicia"));
        assert_ne!(person_key("alice"), person_key("al ice"));
    }

    #[test]
    fn hidden_and_control_characters_are_found() {
        for c in [
            '\u{0}',
            '\u{1B}',
            '\u{7F}',
            '\u{85}',
            '\u{AD}',
            '\u{200B}',
            '\u{200E}',
            '\u{202A}',
            '\u{202E}',
            '\u{2066}',
            '\u{2069}',
            '\u{2028}',
            '\u{FEFF}',
            '\u{E000}',
            '\u{3164}',
            '\u{FE0F}',
            '\u{E0001}',
        ] {
            assert!(is_hidden_or_control(c), "{:?}", c);
        }
        for c in ['a', 'Z', '0', ' ', '-', 'é', 'ß', 'א', 'ع', '名', '@', '.'] {
            assert!(!is_hidden_or_control(c), "{c:?}");
        }
        assert_eq!(first_hidden_or_control("al\u{200B}ice"), Some('\u{200B}'));
        assert_eq!(first_hidden_or_control("alice"), None);
    }
}
