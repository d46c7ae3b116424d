//! A stand-in for WikiText-2 on machines that cannot download it, written as
//! `wiki.{train,valid,test}.tokens` in WikiText's own line format so that it goes through the
//! same reader and tokenizers: ` = Title = ` and ` = = Section = = ` headings between empty
//! lines, one paragraph a line, tokens separated by spaces, with WikiText's ` @-@ `, ` @,@ `,
//! ` @.@ `, ` , `, ` . `, `( … )` and `<unk>`.
//!
//! The text has structure a language model can learn, and a unigram model cannot: every word
//! belongs to a class (content classes, function-word classes, numbers, comma, full stop),
//! each class may be followed by only a few classes, and words within a class are
//! Zipf-distributed. So the previous word narrows the next one down a lot (a bigram model
//! beats the unigram one by far), and an article's title words recur through its paragraphs
//! (longer context helps further). One grammar, drawn from the seed, is shared by the three
//! splits; each split's text has its own random stream.
use super::{SPLITS, UNK};
use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashSet;
use std::path::Path;

/// Sizes of the generated splits, in tokens as word_language_model counts them (`<eos>`
/// included); each split stops at the first paragraph end past its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WikitextSizes {
    pub train: usize,
    pub valid: usize,
    pub test: usize,
}

impl Default for WikitextSizes {
    /// WikiText-2's own sizes.
    fn default() -> Self {
        WikitextSizes { train: 2_088_628, valid: 217_646, test: 245_569 }
    }
}

/// Writes a generated WikiText-2 stand-in into `dir` (created if needed), with the
/// [`crate::data::GENERATED_MARKER`] beside it.
pub fn generate_wikitext(dir: &Path, seed: u64, sizes: WikitextSizes) -> anyhow::Result<()> {
    let note = format!(
        "GENERATED stand-in for WikiText-2 (not the real data set): about {} train + {} valid + {} test tokens \
         (with <eos>), seed {seed}.\n\
         Words of a made-up lexicon follow a random class grammar with collocations and Zipf word frequencies.\n\
         Delete this folder and run `make data` on a machine with network access for the real data.\n",
        sizes.train, sizes.valid, sizes.test
    );
    crate::data::generate::mark_generated(dir, &note)?;
    let language = Language::new(&mut ChaCha8Rng::seed_from_u64(seed));
    let targets = [sizes.train, sizes.valid, sizes.test];
    for (stream, (split, target)) in SPLITS.iter().zip(targets).enumerate() {
        // Stream 0 drew the grammar; each split continues on a stream of its own.
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream as u64 + 1);
        // Whole or not at all: a full disk leaves no torn split behind.
        crate::output::write(&dir.join(format!("wiki.{split}.tokens")), language.text(&mut rng, target))?;
    }
    Ok(())
}

/// What a word class emits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Nouns, verbs, …: most of the vocabulary, each class its own set of words.
    Content,
    /// A few very frequent short words ("the", "of").
    Function,
    Number,
    Comma,
    /// Ends the sentence.
    Stop,
}

const CONTENT_CLASSES: usize = 40;
const CONTENT_WORDS: usize = 24_000;
const FUNCTION_CLASSES: usize = 6;
const FUNCTION_WORDS_PER_CLASS: usize = 8;
/// How many classes may follow a class, and how likely each is.
const SUCCESSOR_WEIGHTS: [f64; 4] = [0.4, 0.3, 0.2, 0.1];
/// Chance that a sentence ends after a content word or number (sentences of ~20 tokens).
const STOP_WEIGHT: f64 = 0.12;
const MAX_SENTENCE: usize = 80;
/// Chances, per content word, of WikiText's decorations, and of the article's title instead.
const UNK_RATE: f64 = 0.05;
const COMPOUND_RATE: f64 = 0.02;
const PAREN_RATE: f64 = 0.01;
const TITLE_RATE: f64 = 0.03;
const FOLLOWER_RATE: f64 = 0.3;

struct Class {
    role: Role,
    /// Most frequent first; empty for comma, stop and numbers.
    words: Vec<String>,
    /// Zipf over `words`.
    word: Option<WeightedIndex<f64>>,
    /// For content words: the word that often comes right after each (a collocation).
    followers: Vec<String>,
    /// The classes that may follow, and their chances.
    next: Vec<usize>,
    next_pick: WeightedIndex<f64>,
}

/// One random grammar: the classes with their words and successors.
struct Language {
    classes: Vec<Class>,
    /// Classes a sentence may start with.
    starts: Vec<usize>,
    /// The content classes (headings draw from them).
    content: Vec<usize>,
    /// The full stop's class.
    stop: usize,
}

/// The indices of the roles among `allowed`.
fn classes_with(roles: &[Role], allowed: &[Role]) -> Vec<usize> {
    (0..roles.len()).filter(|&c| allowed.contains(&roles[c])).collect()
}

impl Language {
    fn new(rng: &mut ChaCha8Rng) -> Self {
        let mut lexicon = Lexicon::default();
        let mut roles = vec![Role::Function; FUNCTION_CLASSES];
        roles.extend([Role::Content; CONTENT_CLASSES]);
        roles.extend([Role::Number, Role::Comma, Role::Stop]);
        let stop = roles.len() - 1;
        // Content classes of uneven sizes, as parts of speech are.
        let shares: Vec<f64> = (0..CONTENT_CLASSES).map(|_| rng.random_range(0.2..1.0)).collect();
        let total: f64 = shares.iter().sum();
        let mut shares = shares.into_iter();
        let mut classes = roles
            .iter()
            .map(|&role| {
                let words: Vec<String> = match role {
                    Role::Function => (0..FUNCTION_WORDS_PER_CLASS).map(|_| lexicon.word(rng, 1..=1)).collect(),
                    Role::Content => {
                        let count = (shares.next().unwrap() / total * CONTENT_WORDS as f64).ceil() as usize;
                        (0..count).map(|_| lexicon.word(rng, 2..=3)).collect()
                    }
                    _ => Vec::new(),
                };
                let word = (!words.is_empty()).then(|| zipf(words.len()));
                // Function words lead to content; a comma never follows a comma; only a
                // content word or number ends a sentence.
                let allowed: &[Role] = match role {
                    Role::Function | Role::Comma => &[Role::Content, Role::Function, Role::Number],
                    _ => &[Role::Content, Role::Function, Role::Number, Role::Comma],
                };
                let mut next: Vec<usize> = classes_with(&roles, allowed).choose_multiple(rng, SUCCESSOR_WEIGHTS.len()).copied().collect();
                let mut weights = SUCCESSOR_WEIGHTS.to_vec();
                if matches!(role, Role::Content | Role::Number) {
                    next.push(stop);
                    weights.push(STOP_WEIGHT);
                }
                let next_pick = WeightedIndex::new(weights).expect("positive weights");
                Class { role, words, word, followers: Vec::new(), next, next_pick }
            })
            .collect::<Vec<_>>();
        // Collocations: any content word, Zipf-distributed like the text itself.
        let content = classes_with(&roles, &[Role::Content]);
        for &c in &content {
            let followers = (0..classes[c].words.len()).map(|_| classes[*content.choose(rng).expect("content classes")].pick(rng).to_owned()).collect();
            classes[c].followers = followers;
        }
        let starts = classes_with(&roles, &[Role::Content, Role::Function]);
        Language { classes, starts, content, stop }
    }

    /// Articles until `target` tokens (with `<eos>`) are reached at a paragraph's end.
    fn text(&self, rng: &mut ChaCha8Rng, target: usize) -> String {
        let mut out = Writer::default();
        while out.tokens < target {
            let title = self.heading_words(rng, 1..=3);
            out.heading(1, &title);
            let sections = rng.random_range(1..=5);
            for section in 0..sections {
                // The first section is the untitled introduction; some have a subsection.
                if section > 0 {
                    let level = if rng.random_bool(0.2) { 3 } else { 2 };
                    out.heading(level, &self.heading_words(rng, 1..=2));
                }
                for _ in 0..rng.random_range(1..=4) {
                    self.paragraph(rng, &title, &mut out);
                    if out.tokens >= target {
                        return out.text;
                    }
                }
            }
        }
        out.text
    }

    fn heading_words(&self, rng: &mut ChaCha8Rng, count: std::ops::RangeInclusive<usize>) -> Vec<String> {
        let count = rng.random_range(count);
        (0..count).map(|_| self.classes[*self.content.choose(rng).expect("content classes")].pick(rng).to_owned()).collect()
    }

    fn paragraph(&self, rng: &mut ChaCha8Rng, title: &[String], out: &mut Writer) {
        out.text.push(' ');
        for _ in 0..rng.random_range(2..=7) {
            let mut class = *self.starts.choose(rng).expect("start classes");
            for length in 1.. {
                let current = &self.classes[class];
                self.emit(rng, current, title, out);
                if current.role == Role::Stop {
                    break;
                }
                class = if length >= MAX_SENTENCE { self.stop } else { current.next[current.next_pick.sample(rng)] };
            }
        }
        out.end_line();
    }

    fn emit(&self, rng: &mut ChaCha8Rng, class: &Class, title: &[String], out: &mut Writer) {
        match class.role {
            Role::Function => out.token(class.pick(rng)),
            Role::Comma => out.token(","),
            Role::Stop => out.token("."),
            Role::Number => out.tokens_of(&number(rng)),
            Role::Content => {
                if rng.random_bool(TITLE_RATE) {
                    title.iter().for_each(|word| out.token(word));
                } else if rng.random_bool(UNK_RATE) {
                    out.token(UNK);
                } else {
                    let word = class.draw(rng);
                    out.token(&class.words[word]);
                    if rng.random_bool(COMPOUND_RATE) {
                        out.token("@-@");
                        out.token(class.pick(rng));
                    } else if rng.random_bool(FOLLOWER_RATE) {
                        out.token(&class.followers[word]);
                    }
                }
                if rng.random_bool(PAREN_RATE) {
                    out.token("(");
                    out.tokens_of(&number(rng));
                    out.token(")");
                }
            }
        }
    }
}

impl Class {
    /// A word's index, by the class's Zipf law.
    fn draw(&self, rng: &mut ChaCha8Rng) -> usize {
        self.word.as_ref().expect("a class with words").sample(rng)
    }

    fn pick(&self, rng: &mut ChaCha8Rng) -> &str {
        &self.words[self.draw(rng)]
    }
}

/// Zipf's law over `n` ranks: the r-th word about 1/r as likely as the first.
fn zipf(n: usize) -> WeightedIndex<f64> {
    WeightedIndex::new((1..=n).map(|rank| 1.0 / rank as f64)).expect("positive weights")
}

/// A number as WikiText writes them: years, small counts, ` @,@ ` thousands, ` @.@ ` decimals.
fn number(rng: &mut ChaCha8Rng) -> String {
    match rng.random_range(0..4) {
        0 => rng.random_range(1800..2016).to_string(),
        1 => rng.random_range(1..100).to_string(),
        2 => format!("{} @,@ {:03}", rng.random_range(1..1000), rng.random_range(0..1000)),
        _ => format!("{} @.@ {}", rng.random_range(0..100), rng.random_range(0..10)),
    }
}

/// Made-up words, every one new.
#[derive(Default)]
struct Lexicon {
    seen: HashSet<String>,
}

impl Lexicon {
    fn word(&mut self, rng: &mut ChaCha8Rng, syllables: std::ops::RangeInclusive<usize>) -> String {
        const ONSETS: &[&str] = &["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "st", "tr", "br"];
        const VOWELS: &[&str] = &["a", "e", "i", "o", "u", "ai", "ou"];
        const CODAS: &[&str] = &["", "", "", "n", "r", "s", "l", "m"];
        loop {
            let word: String = (0..rng.random_range(syllables.clone()))
                .flat_map(|_| [ONSETS.choose(rng), VOWELS.choose(rng), CODAS.choose(rng)])
                .map(|part| *part.expect("non-empty"))
                .collect();
            if self.seen.insert(word.clone()) {
                return word;
            }
        }
    }
}

/// Text in WikiText's line format, counting tokens as word_language_model does.
#[derive(Default)]
struct Writer {
    text: String,
    tokens: usize,
}

impl Writer {
    /// One token and the space after it (WikiText lines start with a space and end with one).
    fn token(&mut self, token: &str) {
        self.text.push_str(token);
        self.text.push(' ');
        self.tokens += 1;
    }

    fn tokens_of(&mut self, tokens: &str) {
        tokens.split(' ').for_each(|token| self.token(token));
    }

    /// Ends a line; word_language_model adds an `<eos>` for it.
    fn end_line(&mut self) {
        self.text.push('\n');
        self.tokens += 1;
    }

    fn empty_line(&mut self) {
        self.text.push(' ');
        self.end_line();
    }

    /// ` = = Title = = ` for level 2, between empty lines.
    fn heading(&mut self, level: usize, words: &[String]) {
        self.empty_line();
        self.text.push(' ');
        (0..level).for_each(|_| self.token("="));
        words.iter().for_each(|word| self.token(word));
        (0..level).for_each(|_| self.token("="));
        self.end_line();
        self.empty_line();
    }
}
