//! The two tokenizers of the course's language-model references, reproduced exactly, down to
//! which characters Python counts as whitespace and where it ends a line.

/// The special tokens: the end-of-line marker of word_language_model's `Corpus`, and the
/// unknown word (already in WikiText's text, and torchtext's default entry).
pub const EOS: &str = "<eos>";
pub const UNK: &str = "<unk>";

/// Whitespace as Python's `str.split()` and `re`'s `\s` see it: Rust's Unicode `White_Space`
/// plus the ASCII separators U+001C–U+001F, which Python also counts as space.
pub fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `line.split()` (no argument): runs of whitespace separate, none gives empty tokens.
pub fn python_split(line: &str) -> impl Iterator<Item = &str> {
    line.split(is_python_space).filter(|token| !token.is_empty())
}

/// The lines of a text as Python's text-mode file iteration yields them (universal newlines:
/// `\n`, `\r\n` and a lone `\r` each end a line), without their endings; no empty last line
/// after a final newline. This is how word_language_model reads its files.
pub fn python_lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let (line, tail) = match rest.find(['\n', '\r']) {
            Some(end) => {
                let ending = if rest[end..].starts_with("\r\n") { 2 } else { 1 };
                (&rest[..end], &rest[end + ending..])
            }
            None => (rest, ""),
        };
        rest = tail;
        Some(line)
    })
}

/// torchtext's `basic_english` substitutions (`torchtext.data.utils._patterns` and
/// `_replacements`), in its order. Every pattern there is a literal string (`\'`, `\.`, `<br \/>`
/// … only escape), so replacing literals left to right is exactly `re.sub`. The order matters:
/// `"` is deleted before `<br />` is looked for, so `<br "/>` is removed too.
/// torchtext's last rule, `\s+` → `" "`, only merges whitespace, which the final split ignores.
const BASIC_ENGLISH_RULES: [(&str, &str); 11] =
    [("'", " '  "), ("\"", ""), (".", " . "), ("<br />", " "), (",", " , "), ("(", " ( "), (")", " ) "), ("!", " ! "), ("?", " ? "), (";", " "), (":", " ")];

/// torchtext's `get_tokenizer("basic_english")`: lowercase (Unicode, as Python's `str.lower`),
/// the substitutions above, then `str.split()`.
pub fn basic_english(line: &str) -> Vec<String> {
    let mut line = line.to_lowercase();
    for (pattern, replacement) in BASIC_ENGLISH_RULES {
        if line.contains(pattern) {
            line = line.replace(pattern, replacement);
        }
    }
    python_split(&line).map(str::to_owned).collect()
}
