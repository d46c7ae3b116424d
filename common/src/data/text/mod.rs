//! WikiText-2 for the Transformer language-model exercise: the splits as token-id tensors,
//! tokenized and numbered exactly as the course's two PyTorch references do it, and the
//! tutorial's batching.
//!
//! * [`Tokenizer::Whitespace`] is PyTorch examples/word_language_model's `Corpus`: every line,
//!   empty ones included, becomes `line.split() + ["<eos>"]`; ids are given in order of first
//!   appearance over train, then valid, then test.
//! * [`Tokenizer::BasicEnglish`] is the tutorial "Language modeling with nn.Transformer and
//!   torchtext": torchtext's `basic_english` tokenizer, lines without tokens dropped, no
//!   `<eos>`, and the vocabulary of `build_vocab_from_iterator(train, specials=["<unk>"])` with
//!   `<unk>` as the default index (so valid/test words never seen in train become `<unk>`).
//!
//! Without the data, [`generate_wikitext`] writes a stand-in in WikiText's own file format.
mod batches;
mod generate;
mod tokenize;

pub use batches::TokenBatches;
pub use generate::{generate_wikitext, WikitextSizes};
pub use tokenize::{basic_english, is_python_space, python_lines, python_split, EOS, UNK};

use super::GENERATED_MARKER;
use anyhow::Context;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// The splits, in the order the references read them (word_language_model numbers words in
/// this order).
pub const SPLITS: [&str; 3] = ["train", "valid", "test"];

/// How text becomes tokens and tokens become ids: one of the course's two references.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Tokenizer {
    /// PyTorch examples/word_language_model: `line.split()` plus `<eos>` on every line.
    Whitespace,
    /// torchtext's `basic_english`, as in the nn.Transformer tutorial.
    #[value(alias = "basic-english")]
    BasicEnglish,
}

impl Tokenizer {
    /// The name on the command line and in reports (torchtext's spelling for `basic_english`).
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::Whitespace => "whitespace",
            Tokenizer::BasicEnglish => "basic_english",
        }
    }

    /// The tokens of one line, before any `<eos>`.
    pub fn tokenize(self, line: &str) -> Vec<String> {
        match self {
            Tokenizer::Whitespace => python_split(line).map(str::to_owned).collect(),
            Tokenizer::BasicEnglish => basic_english(line),
        }
    }

    /// A split's text as the reference turns it into token lists, line by line:
    /// word_language_model keeps every line and ends each with `<eos>`; the tutorial drops
    /// lines without tokens (torchtext reads lines up to each `\n`).
    pub fn lines(self, text: &str) -> Vec<Vec<String>> {
        match self {
            Tokenizer::Whitespace => python_lines(text)
                .map(|line| {
                    let mut tokens = self.tokenize(line);
                    tokens.push(EOS.to_owned());
                    tokens
                })
                .collect(),
            Tokenizer::BasicEnglish => text.split('\n').map(|line| self.tokenize(line)).filter(|tokens| !tokens.is_empty()).collect(),
        }
    }
}

/// Token ↔ id mapping. Ids are `i64`, the dtype of the tensors they index.
#[derive(Debug, Clone, Default)]
pub struct Vocab {
    itos: Vec<String>,
    stoi: HashMap<String, i64>,
    /// The id that unknown tokens get (torchtext's `set_default_index`); none for a vocabulary
    /// that has seen every token it will be asked for.
    default: Option<i64>,
}

impl Vocab {
    /// word_language_model's `Dictionary`: ids in order of first appearance, no default.
    pub fn by_first_appearance<'a>(tokens: impl IntoIterator<Item = &'a str>) -> Self {
        let mut vocab = Vocab::default();
        for token in tokens {
            vocab.insert(token);
        }
        vocab
    }

    /// torchtext's `build_vocab_from_iterator(tokens, specials=["<unk>"])` followed by
    /// `set_default_index(vocab["<unk>"])`: `<unk>` is 0, then the tokens by descending count,
    /// equal counts in lexicographic (code point) order. A `<unk>` in the text is the special
    /// itself (torchtext pops it from the counts), so it is counted once.
    pub fn by_frequency<'a>(tokens: impl IntoIterator<Item = &'a str>) -> Self {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for token in tokens {
            *counts.entry(token).or_default() += 1;
        }
        counts.remove(UNK);
        let mut sorted: Vec<(&str, usize)> = counts.into_iter().collect();
        // UTF-8 byte order is code point order, which is Python's string order.
        sorted.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let mut vocab = Vocab::default();
        vocab.default = Some(vocab.insert(UNK));
        for (token, _) in sorted {
            vocab.insert(token);
        }
        vocab
    }

    /// The token's id, adding it at the end if new.
    fn insert(&mut self, token: &str) -> i64 {
        if let Some(&id) = self.stoi.get(token) {
            return id;
        }
        let id = self.itos.len() as i64;
        self.itos.push(token.to_owned());
        self.stoi.insert(token.to_owned(), id);
        id
    }

    pub fn len(&self) -> usize {
        self.itos.len()
    }

    pub fn is_empty(&self) -> bool {
        self.itos.is_empty()
    }

    /// The token's id; an unknown token gets the default (`<unk>`) id where there is one.
    pub fn id(&self, token: &str) -> Option<i64> {
        self.stoi.get(token).copied().or(self.default)
    }

    /// The token with this id.
    pub fn token(&self, id: i64) -> Option<&str> {
        usize::try_from(id).ok().and_then(|i| self.itos.get(i)).map(String::as_str)
    }

    /// All tokens, by id.
    pub fn itos(&self) -> &[String] {
        &self.itos
    }

    /// The ids of `tokens`; an error for a token the vocabulary neither has nor can default.
    pub fn encode<'a>(&self, tokens: impl IntoIterator<Item = &'a str>) -> anyhow::Result<Vec<i64>> {
        tokens.into_iter().map(|token| self.id(token).with_context(|| format!("token {token:?} is not in the vocabulary"))).collect()
    }
}

/// A tokenized corpus: the vocabulary and each split as a 1-D int64 tensor of token ids.
#[derive(Debug)]
pub struct Corpus {
    pub vocab: Vocab,
    pub train: Tensor,
    pub valid: Tensor,
    pub test: Tensor,
    /// True when the files were made by [`generate_wikitext`], not downloaded.
    pub generated: bool,
    pub tokenizer: Tokenizer,
}

impl Corpus {
    /// Tokenizes and numbers the three splits' texts as `tokenizer`'s reference does.
    /// `generated` is left false: only [`load_corpus`] knows where the text came from.
    pub fn from_texts(train: &str, valid: &str, test: &str, tokenizer: Tokenizer) -> anyhow::Result<Corpus> {
        let lines = [train, valid, test].map(|text| tokenizer.lines(text));
        for (split, lines) in SPLITS.iter().zip(&lines) {
            anyhow::ensure!(!lines.is_empty(), "the {split} split has no tokens");
        }
        fn tokens(lines: &[Vec<String>]) -> impl Iterator<Item = &str> {
            lines.iter().flatten().map(String::as_str)
        }
        let vocab = match tokenizer {
            Tokenizer::Whitespace => Vocab::by_first_appearance(lines.iter().flat_map(|split| tokens(split))),
            Tokenizer::BasicEnglish => Vocab::by_frequency(tokens(&lines[0])),
        };
        let [train, valid, test] = lines.map(|split| vocab.encode(tokens(&split)).map(|ids| Tensor::from_slice(&ids)));
        Ok(Corpus { vocab, train: train?, valid: valid?, test: test?, generated: false, tokenizer })
    }
}

/// The file-name layouts of the splits, as (prefix, suffix): the official WikiText release
/// (`wiki.train.tokens`), and plain `train.txt`.
const LAYOUTS: [(&str, &str); 2] = [("wiki.", ".tokens"), ("", ".txt")];

/// The three split files under `dir`: in `dir` itself or in a `wikitext-2/` folder (as the
/// official zip unpacks), in either layout. The first place holding any split file must
/// hold all three; an error names the missing one.
pub fn locate(dir: &Path) -> anyhow::Result<[PathBuf; 3]> {
    for folder in [dir.to_path_buf(), dir.join("wikitext-2")] {
        for (prefix, suffix) in LAYOUTS {
            let paths = SPLITS.map(|split| folder.join(format!("{prefix}{split}{suffix}")));
            if paths.iter().any(|path| path.is_file()) {
                if let Some(missing) = paths.iter().find(|path| !path.is_file()) {
                    anyhow::bail!("{} is missing (WikiText-2 needs its train, valid and test splits); run `make data` to fetch WikiText-2", missing.display());
                }
                return Ok(paths);
            }
        }
    }
    anyhow::bail!(
        "{} holds no WikiText-2 splits (looked for wiki.{{train,valid,test}}.tokens, also under wikitext-2/, \
         and {{train,valid,test}}.txt); run `make data` to fetch WikiText-2 or pass --data-dir",
        dir.display()
    )
}

/// Reads WikiText-2 from `dir` (see [`locate`] for the layouts) and tokenizes it. A missing
/// directory or file gets an error that names it and says how to get the data.
pub fn load_corpus(dir: &Path, tokenizer: Tokenizer) -> anyhow::Result<Corpus> {
    crate::input::folder(dir, "data directory", "run `make data` (fetches WikiText-2 where a network exists, else generates a stand-in) or pass --data-dir")?;
    let paths = locate(dir)?;
    let mut texts = Vec::with_capacity(3);
    for path in &paths {
        let bytes = super::read_file(path)?;
        texts.push(String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", path.display()))?);
    }
    let mut corpus = Corpus::from_texts(&texts[0], &texts[1], &texts[2], tokenizer)
        .with_context(|| format!("WikiText-2 in {}", paths[0].parent().unwrap_or(dir).display()))?;
    // The generator leaves its marker beside the files; check the folder given too.
    corpus.generated = paths[0].with_file_name(GENERATED_MARKER).exists() || dir.join(GENERATED_MARKER).exists();
    Ok(corpus)
}

/// The tutorial's `batchify`: drops the tokens that do not fill a column, and lays the rest
/// out as `batch_size` contiguous streams side by side: `[len / batch_size, batch_size]`.
pub fn batchify(data: &Tensor, batch_size: i64) -> Tensor {
    assert!(batch_size > 0, "batch size must be positive, got {batch_size}");
    let seq_len = data.size1().expect("batchify takes a 1-D tensor of token ids") / batch_size;
    data.narrow(0, 0, seq_len * batch_size).view([batch_size, seq_len]).tr().contiguous()
}

/// The tutorial's `get_batch`: rows `i..i+seq_len` of a batchified `source` as input
/// (`[seq_len, batch]`), and the rows one step later, flattened, as target; `seq_len` is
/// `bptt`, shorter for the last batch so that every input has its next token.
pub fn get_batch(source: &Tensor, i: i64, bptt: i64) -> (Tensor, Tensor) {
    let len = source.size()[0];
    let seq_len = bptt.min(len - 1 - i);
    assert!(seq_len > 0 && i >= 0, "batch start {i} out of range for {len} rows (the last start is {})", len - 2);
    (source.narrow(0, i, seq_len), source.narrow(0, i + 1, seq_len).reshape([-1]))
}

/// The batch starts of one pass over a batchified `source`: the tutorial's
/// `range(0, source.size(0) - 1, bptt)`.
pub fn batch_starts(source: &Tensor, bptt: i64) -> impl Iterator<Item = i64> {
    assert!(bptt > 0, "bptt must be positive, got {bptt}");
    (0..source.size()[0] - 1).step_by(bptt as usize)
}

/// Perplexity on `eval` of the add-one smoothed unigram model estimated on `train` (ids in
/// `0..vocab_len`, any shape): the baseline a language model has to beat to have learnt
/// anything about context.
pub fn unigram_perplexity(train: &Tensor, eval: &Tensor, vocab_len: i64) -> f64 {
    let counts = train.reshape([-1]).bincount::<Tensor>(None, vocab_len);
    assert_eq!(counts.size()[0], vocab_len, "train holds ids beyond the vocabulary of {vocab_len}");
    let counts = counts.to_kind(Kind::Double) + 1.0;
    let log_p = counts.log() - counts.sum(Kind::Double).log();
    let nll = -log_p.index_select(0, &eval.reshape([-1]).to_device(log_p.device())).mean(Kind::Double);
    nll.exp().double_value(&[])
}
