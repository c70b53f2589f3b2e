//! What text from outside may hold, and how two people's names are compared.
//!
//! Names a console renders or a person reads (actors, names, reasons) must show what they
//! are: a character that is invisible, reorders the text around it (bidirectional
//! controls) or drives a terminal (control characters, ANSI escapes) lets one name pass
//! for another. Such characters are refused when text arrives (a token, a request body, an
//! inbound event); text already stored is read back as it is.
//!
//! The same holds for every other text a console will render (names, reasons, summaries,
//! links): names are at most [`MAX_NAME`] characters without control or invisible
//! characters, free text at most [`MAX_REASON`] characters (line breaks and tabs allowed),
//! links are `http://` or `https://` URLs. Aggregates check what a caller sent with
//! [`check_name`], [`check_free_text`] and [`check_web_url`] when a command arrives; text
//! Ferry writes itself from what a tenant controls (a program's output in a failure reason)
//! is made inert with [`inert`] instead of refused.

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

/// The longest name (of a pipeline stage, a check, …) Ferry keeps.
pub const MAX_NAME: usize = 256;
/// The longest free text (a reason, a summary) Ferry keeps.
pub const MAX_REASON: usize = 2000;
/// The longest link Ferry keeps.
pub const MAX_URL: usize = 2048;

/// Why a text a caller sent was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TextProblem {
    /// Empty or blank.
    #[error("must not be empty")]
    Empty,
    /// Too long.
    #[error("must be at most {max} characters")]
    TooLong {
        /// The limit.
        max: usize,
    },
    /// A control, format or otherwise invisible character.
    #[error("must not contain control, format or invisible characters (found U+{:04X})", u32::from(*found))]
    Hidden {
        /// The first offending character.
        found: char,
    },
    /// Not an `http://` or `https://` URL with a host.
    #[error("must be an http:// or https:// URL with a host")]
    NotWebUrl,
}

/// A text field a caller sent that was refused, and why; `field` is its path in the
/// request (`pipeline[2].url`, `reason`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct InvalidText {
    /// The field's path.
    pub field: String,
    /// Why.
    pub problem: TextProblem,
}

impl InvalidText {
    fn new(field: &str, problem: TextProblem) -> Self {
        Self {
            field: field.to_string(),
            problem,
        }
    }
}

fn check_length(field: &str, text: &str, max: usize) -> Result<(), InvalidText> {
    if text.trim().is_empty() {
        return Err(InvalidText::new(field, TextProblem::Empty));
    }
    // Counting stops at the limit, so a huge text costs no more than a long one.
    if text.chars().nth(max).is_some() {
        return Err(InvalidText::new(field, TextProblem::TooLong { max }));
    }
    Ok(())
}

/// A name (one line): 1 to `max` characters, none of them control or invisible.
pub fn check_name_within(field: &str, text: &str, max: usize) -> Result<(), InvalidText> {
    check_length(field, text, max)?;
    match first_hidden_or_control(text) {
        Some(found) => Err(InvalidText::new(field, TextProblem::Hidden { found })),
        None => Ok(()),
    }
}

/// A name: 1 to [`MAX_NAME`] characters, none of them control or invisible.
pub fn check_name(field: &str, text: &str) -> Result<(), InvalidText> {
    check_name_within(field, text, MAX_NAME)
}

/// Free text (a reason, a summary): 1 to [`MAX_REASON`] characters; line breaks and tabs
/// are kept, every other control or invisible character (an ANSI escape, a bidirectional
/// override) is refused.
pub fn check_free_text(field: &str, text: &str) -> Result<(), InvalidText> {
    check_length(field, text, MAX_REASON)?;
    match text
        .chars()
        .find(|c| !matches!(c, '\n' | '\t') && is_hidden_or_control(*c))
    {
        Some(found) => Err(InvalidText::new(field, TextProblem::Hidden { found })),
        None => Ok(()),
    }
}

/// Free text that may be left out: none, or blank, passes; anything else is
/// [`check_free_text`].
pub fn check_optional_free_text(field: &str, text: Option<&str>) -> Result<(), InvalidText> {
    match text {
        Some(text) if !text.trim().is_empty() => check_free_text(field, text),
        _ => Ok(()),
    }
}

/// A link a console may render: an `http://` or `https://` URL with a host, at most
/// [`MAX_URL`] characters, without spaces, control or invisible characters (so no
/// `javascript:`, `data:` or `file:` links).
pub fn check_web_url(field: &str, text: &str) -> Result<(), InvalidText> {
    check_name_within(field, text, MAX_URL)?;
    let scheme_end = text.find("://").unwrap_or(0);
    let scheme = text[..scheme_end].to_ascii_lowercase();
    if text.chars().any(char::is_whitespace) || !matches!(scheme.as_str(), "http" | "https") {
        return Err(InvalidText::new(field, TextProblem::NotWebUrl));
    }
    match url::Url::parse(text) {
        Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => Ok(()),
        _ => Err(InvalidText::new(field, TextProblem::NotWebUrl)),
    }
}

/// Text Ferry keeps from a source it does not vouch for (a program's output, an error a
/// remote service sent): every control or invisible character but line breaks and tabs
/// becomes U+FFFD, and text longer than `max` characters is cut there, ending in `…`.
pub fn inert(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max)
        .map(|c| {
            if !matches!(c, '\n' | '\t') && is_hidden_or_control(c) {
                '\u{FFFD}'
            } else {
                c
            }
        })
        .collect();
    if text.chars().nth(max).is_some() {
        out.pop();
        out.push('…');
    }
    out
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

    #[test]
    fn names_refuse_markup_escapes_and_length_but_keep_words() {
        assert!(check_name("name", "unit tests (linux) ✓ 名前").is_ok());
        // Markup is kept as text: the console renders it inert; what is refused is what
        // cannot be seen.
        assert!(check_name("name", "<script>alert(1)</script>").is_ok());
        for bad in ["\u{1b}[31mred", "a\nb", "a\u{202E}b", "", "   "] {
            assert!(check_name("name", bad).is_err(), "{bad:?}");
        }
        let long = "x".repeat(MAX_NAME + 1);
        assert_eq!(
            check_name("pipeline[0].name", &long),
            Err(InvalidText {
                field: "pipeline[0].name".into(),
                problem: TextProblem::TooLong { max: MAX_NAME }
            })
        );
        assert!(check_name("name", &"x".repeat(MAX_NAME)).is_ok());
    }

    #[test]
    fn free_text_keeps_lines_and_refuses_escapes_and_length() {
        assert!(check_free_text("reason", "first line\n\tsecond line").is_ok());
        assert!(check_free_text("reason", "\u{1b}]8;;https://evil\u{7}x").is_err());
        assert!(check_free_text("reason", "ok\u{200B}").is_err());
        assert!(check_free_text("reason", &"y".repeat(250_000)).is_err());
        assert!(check_free_text("reason", &"y".repeat(MAX_REASON)).is_ok());
    }

    #[test]
    fn links_are_web_urls_only() {
        for good in ["https://ci.example/run/1", "http://10.0.0.1:8080/x?y=1#z"] {
            assert!(check_web_url("url", good).is_ok(), "{good}");
        }
        for bad in [
            "javascript:alert(1)",
            "JAVASCRIPT:alert(1)",
            " javascript:alert(1)",
            "data:text/html,<script>alert(1)</script>",
            "file:///etc/passwd",
            "vbscript:msgbox",
            "https://",
            "http:/x",
            "//evil.example/x",
            "https://ex ample.com",
            "https://example.com/\u{202E}",
            "ftp://example.com/",
        ] {
            assert!(check_web_url("url", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn inert_text_shows_what_it_is_and_is_bounded() {
        assert_eq!(
            inert("\u{1b}[31mred\u{1b}[0m\nok", 100),
            "\u{FFFD}[31mred\u{FFFD}[0m\nok"
        );
        let cut = inert(&"z".repeat(5000), MAX_REASON);
        assert_eq!(cut.chars().count(), MAX_REASON);
        assert!(cut.ends_with('…'));
        assert_eq!(inert("short", 10), "short");
    }
}
