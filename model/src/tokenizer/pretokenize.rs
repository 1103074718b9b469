//! BPE pre-tokenizers: the regex passes that cut text into words before merging, chosen
//! by `tokenizer.ggml.pre` the way llama.cpp's `llm_tokenizer_bpe` chooses them.
//!
//! Semantics follow llama.cpp's `unicode_regex_split`: the patterns run in order; each one
//! splits every current piece into its matches *and* the unmatched gaps between them (a gap
//! is a piece of its own, it is never dropped), and the next pattern works on those pieces.
//! llama.cpp hand-codes the GPT-2/Llama 3/Qwen2 patterns and maps Unicode classes onto
//! std::regex; here `fancy-regex` runs the same patterns with real Unicode classes (`\p{L}`,
//! `\p{N}`, `\s` = White_Space, Unicode 16), which classify every assigned code point the
//! same way. The case-insensitive contractions use llama.cpp's `'[sS]` form rather than
//! `(?i:'s)`, so that `ſ` (long s) and the Kelvin sign do not match.

use fancy_regex::Regex;

use super::error::{Result, TokenizerError};

/// GPT-2's pattern (gaps cover llama.cpp's extra `|\s+` branch: a lone whitespace before a
/// non-space becomes its own piece either way).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK3_MAIN: &str = r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer names accepted, for error messages and docs.
pub(crate) const SUPPORTED_NAMES: &str = "default (or missing), gpt-2 family (gpt-2, phi-2, mpt, olmo, jais, \
     exaone4, ...), llama3 family (llama3, llama-v3, llama-bpe, falcon3, pixtral, ...), dbrx, smaug-bpe, \
     qwen2 family (qwen2, deepseek-r1-qwen, megrez, stablelm2, hunyuan, ...), qwen35, starcoder family \
     (starcoder, smollm, refact, command-r, codeshell, exaone, minerva-7b, mellum2), falcon, deepseek-coder, \
     deepseek-v3";

/// How a named pre-tokenizer splits, plus the vocabulary defaults llama.cpp ties to it.
pub(crate) struct PreConfig {
    pub patterns: &'static [&'static str],
    /// Detokenizer removes spaces before `?!.,` and some contractions (llama.cpp `clean_spaces`).
    pub clean_spaces: bool,
    /// A word that is a whole vocabulary entry is taken as is, without merging.
    pub ignore_merges: bool,
    /// Default for `add_bos` when the metadata does not say.
    pub add_bos: bool,
}

const fn cfg(patterns: &'static [&'static str], clean_spaces: bool) -> PreConfig {
    PreConfig { patterns, clean_spaces, ignore_merges: false, add_bos: false }
}

/// The configuration for `tokenizer.ggml.pre`. A missing or empty name means llama.cpp's
/// `default`; a name llama.cpp knows but Tessera does not support is an error rather than
/// a silently different tokenization.
pub(crate) fn config_for(name: Option<&str>) -> Result<PreConfig> {
    const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];
    const FALCON: &[&str] = &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"];
    const STARCODER: &[&str] = &[r"\p{N}", GPT2];
    // llama.cpp replaces non-ASCII whitespace before running this explicit-range pattern,
    // so the U+0800..U+4E00 range is written here without the White_Space code points.
    const DEEPSEEK_CODER: &[&str] = &[
        "[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        r"[一-龥ࠀ-\u{167F}\u{1681}-\u{1FFF}\u{200B}-\u{2027}\u{202A}-\u{202E}\u{2030}-\u{205E}\u{2060}-\u{2FFF}\u{3001}-一가-퟿]+",
        r"\p{N}",
    ];
    const DEEPSEEK3: &[&str] = &[r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3_MAIN];

    let name = name.unwrap_or("");
    let config = match name {
        "" | "default" => cfg(DEFAULT, true),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" => PreConfig { patterns: &[LLAMA3], clean_spaces: true, ignore_merges: true, add_bos: true },
        "dbrx" | "smaug-bpe" => cfg(&[LLAMA3], true),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum"
        | "modern-bert" | "mpt" | "olmo" | "jais" | "exaone4" => cfg(&[GPT2], true),
        "trillion" | "granite-docling" => cfg(&[GPT2], false),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => cfg(STARCODER, true),
        "smollm" | "command-r" => cfg(STARCODER, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "solar-open" => cfg(&[QWEN2], false),
        "stablelm2" | "megrez" => cfg(&[QWEN2], true),
        "qwen35" => cfg(&[QWEN35], false),
        "falcon" => cfg(FALCON, true),
        "deepseek-coder" => cfg(DEEPSEEK_CODER, false),
        "deepseek-v3" => cfg(DEEPSEEK3, false),
        other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
    };
    Ok(config)
}

/// Compiled split patterns.
pub(crate) struct PreTokenizer {
    regexes: Vec<Regex>,
}

impl PreTokenizer {
    pub(crate) fn new(patterns: &[&str]) -> Result<Self> {
        let regexes = patterns
            .iter()
            .map(|p| {
                Regex::new(p).map_err(|e| TokenizerError::Regex { pattern: (*p).to_string(), reason: e.to_string() })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { regexes })
    }

    /// Cuts `text` into words; concatenated, the words are `text` again.
    pub(crate) fn split<'t>(&self, text: &'t str) -> Result<Vec<&'t str>> {
        let mut pieces: Vec<&'t str> = Vec::new();
        if text.is_empty() {
            return Ok(pieces);
        }
        pieces.push(text);
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                let mut last = 0;
                for m in re.find_iter(piece) {
                    let m = m.map_err(|e| TokenizerError::Regex {
                        pattern: re.as_str().to_string(),
                        reason: e.to_string(),
                    })?;
                    if m.start() > last {
                        next.push(&piece[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                    }
                    last = m.end();
                }
                if last < piece.len() {
                    next.push(&piece[last..]);
                }
            }
            pieces = next;
        }
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(name: &str, text: &str) -> Vec<String> {
        let cfg = config_for(Some(name)).unwrap();
        let pre = PreTokenizer::new(cfg.patterns).unwrap();
        pre.split(text).unwrap().into_iter().map(str::to_string).collect()
    }

    #[test]
    fn gpt2_keeps_the_space_before_words_and_leaves_the_last_of_a_run() {
        assert_eq!(split("gpt-2", "Hello  world's 42!"), ["Hello", " ", " world", "'s", " 42", "!"]);
        assert_eq!(split("gpt-2", "a\t\tb"), ["a", "\t", "\t", "b"]);
    }

    #[test]
    fn smollm_isolates_every_digit_first() {
        assert_eq!(split("smollm", "x 1234 y"), ["x", " ", "1", "2", "3", "4", " y"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_keeps_newline_runs() {
        assert_eq!(split("llama-bpe", "12345 ab\n\n  c"), ["123", "45", " ab", "\n\n", " ", " c"]);
        assert_eq!(split("llama3", "I'M ok"), ["I", "'M", " ok"]);
    }

    #[test]
    fn unknown_names_are_errors_and_missing_means_default() {
        assert!(matches!(config_for(Some("no-such-pre")), Err(TokenizerError::UnsupportedPreTokenizer(_))));
        assert_eq!(config_for(None).unwrap().patterns.len(), 4);
    }

    #[test]
    fn pieces_always_concatenate_to_the_input() {
        let text = "  Ünïcödé ١٢٣ 中文 🙂👍🏽 \u{a0}\u{3000}x\r\n\ty's";
        for name in
            ["default", "gpt-2", "llama3", "qwen2", "qwen35", "smollm", "falcon", "deepseek-coder", "deepseek-v3"]
        {
            assert_eq!(split(name, text).concat(), text, "{name}");
        }
    }
}
