//! Every link of README.md and docs/*.md resolves: the file (or folder) it names exists, relative
//! to the page's folder, and a `#anchor` names a heading of its page (GitHub's slugs). README.md
//! stays a front page (at most 220 lines) and links to every docs/ page. Links and images in code
//! spans and fenced code blocks are not links; http(s): and mailto: targets are not checked.
//! Only std: nothing here needs LibTorch.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

const README_MAX_LINES: usize = 220;

/// A link or image found on a page: its 1-based line and its target as written.
struct Link {
    line: usize,
    text: String,
    target: String,
}

/// The project's root, the folder above the `exercises` package.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// README.md, then docs/*.md in name order.
fn pages(root: &Path) -> Vec<PathBuf> {
    let mut docs: Vec<PathBuf> = match fs::read_dir(root.join("docs")) {
        Ok(dir) => dir.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "md")).collect(),
        Err(_) => Vec::new(),
    };
    docs.sort();
    let mut all = vec![root.join("README.md")];
    all.extend(docs);
    all
}

/// Whether a line opens or closes a fenced code block: its fence character and length.
fn fence(line: &str) -> Option<(char, usize)> {
    let indent = line.len() - line.trim_start_matches(' ').len();
    if indent > 3 {
        return None;
    }
    let rest = &line[indent..];
    let c = rest.chars().next()?;
    if c != '`' && c != '~' {
        return None;
    }
    let n = rest.chars().take_while(|&x| x == c).count();
    (n >= 3).then_some((c, n))
}

/// The page's text outside fenced code blocks, as blocks of consecutive non-blank lines (a code
/// span may run over a line break within one), each with the 1-based number of its first line.
fn blocks(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    let mut open: Option<(char, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        if let Some((c, n)) = open {
            if fence(line).is_some_and(|(c2, n2)| c2 == c && n2 >= n && line.trim().chars().all(|x| x == c)) {
                open = None;
            }
            continue;
        }
        if let Some(f) = fence(line) {
            out.extend(current.take());
            open = Some(f);
            continue;
        }
        if line.trim().is_empty() {
            out.extend(current.take());
            continue;
        }
        match &mut current {
            Some((_, block)) => {
                block.push('\n');
                block.push_str(line);
            }
            None => current = Some((i + 1, line.to_string())),
        }
    }
    out.extend(current);
    out
}

/// The block with every code span's contents (backticks included) replaced by spaces, so that
/// nothing inside one reads as a link; byte offsets and line breaks stay where they were.
fn without_code_spans(block: &str) -> String {
    let bytes = block.as_bytes();
    let mut out = bytes.to_vec();
    let run_at = |i: usize| bytes[i..].iter().take_while(|&&b| b == b'`').count();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'`' => {
                let n = run_at(i);
                // The closing run: the next run of exactly n backticks.
                let mut j = i + n;
                let mut close = None;
                while j < bytes.len() {
                    if bytes[j] == b'`' {
                        let m = run_at(j);
                        if m == n {
                            close = Some(j);
                            break;
                        }
                        j += m;
                    } else {
                        j += 1;
                    }
                }
                match close {
                    Some(j) => {
                        for b in &mut out[i..j + n] {
                            if *b != b'\n' {
                                *b = b' ';
                            }
                        }
                        i = j + n;
                    }
                    // An unmatched run is literal text.
                    None => i += n,
                }
            }
            _ => i += 1,
        }
    }
    // Only ASCII bytes were replaced by ASCII spaces, whole code spans at a time.
    String::from_utf8(out).expect("code spans blanked on character boundaries")
}

/// The links and images `[text](target)` / `![alt](target)` of a page, outside code.
fn links(text: &str) -> Vec<Link> {
    let mut found = Vec::new();
    for (first_line, block) in blocks(text) {
        let plain = without_code_spans(&block);
        let b = plain.as_bytes();
        let mut search = 0;
        while let Some(k) = plain[search..].find("](").map(|k| k + search) {
            search = k + 2;
            // The `[` that opens this link's text, brackets balanced.
            let mut depth = 0usize;
            let mut open = None;
            for j in (0..k).rev() {
                match b[j] {
                    b']' => depth += 1,
                    b'[' if depth == 0 => {
                        open = Some(j);
                        break;
                    }
                    b'[' => depth -= 1,
                    _ => {}
                }
            }
            let Some(open) = open else { continue };
            // The target runs to the `)` that balances the `(`.
            let mut depth = 0usize;
            let mut end = None;
            for (j, &c) in b.iter().enumerate().skip(k + 2) {
                match c {
                    b'(' => depth += 1,
                    b')' if depth == 0 => {
                        end = Some(j);
                        break;
                    }
                    b')' => depth -= 1,
                    b'\n' => break,
                    _ => {}
                }
            }
            let Some(end) = end else { continue };
            let inner = plain[k + 2..end].trim();
            // An optional title after the destination; a destination in <...>.
            let target =
                if let Some(rest) = inner.strip_prefix('<') { rest.split('>').next().unwrap_or("") } else { inner.split_whitespace().next().unwrap_or("") };
            let line = first_line + plain[..k].matches('\n').count();
            let start = if open > 0 && b[open - 1] == b'!' { open - 1 } else { open };
            found.push(Link { line, text: block[start..k + 1].to_string(), target: target.to_string() });
            search = end + 1;
        }
    }
    found
}

/// GitHub's anchor for a heading's text: lowercase; characters other than letters, digits,
/// spaces, hyphens and underscores removed; spaces to hyphens.
fn slug(heading: &str) -> String {
    heading.to_lowercase().chars().filter(|&c| c.is_alphanumeric() || c == ' ' || c == '-' || c == '_').map(|c| if c == ' ' { '-' } else { c }).collect()
}

/// A heading's text as GitHub renders it for its anchor: links and images as their text.
fn heading_text(raw: &str) -> String {
    let mut text = raw.trim().trim_end_matches('#').trim_end().to_string();
    for link in links(&text) {
        let shown = link.text.trim_start_matches('!').trim_start_matches('[').trim_end_matches(']').to_string();
        let written = format!("{}({})", link.text, link.target);
        text = text.replacen(&written, &shown, 1);
    }
    text
}

/// The anchors of a page's headings (ATX headings outside fenced code), duplicates numbered -1, -2, ...
fn anchors(text: &str) -> HashSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = HashSet::new();
    let mut open: Option<(char, usize)> = None;
    for line in text.lines() {
        if let Some((c, n)) = open {
            if fence(line).is_some_and(|(c2, n2)| c2 == c && n2 >= n && line.trim().chars().all(|x| x == c)) {
                open = None;
            }
            continue;
        }
        if let Some(f) = fence(line) {
            open = Some(f);
            continue;
        }
        let trimmed = line.trim_start_matches(' ');
        if line.len() - trimmed.len() > 3 {
            continue;
        }
        let hashes = trimmed.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !(trimmed[hashes..].is_empty() || trimmed[hashes..].starts_with(' ')) {
            continue;
        }
        let base = slug(&heading_text(&trimmed[hashes..]));
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 { base.clone() } else { format!("{base}-{n}") });
        *n += 1;
    }
    out
}

/// Every broken link of the pages under `root`, and what README.md lacks, one line each.
fn problems(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    let pages = pages(root);
    let rel = |p: &Path| p.strip_prefix(root).unwrap_or(p).display().to_string();
    let mut anchors_of: HashMap<PathBuf, HashSet<String>> = HashMap::new();
    let mut anchors_for = |page: &Path| -> Option<HashSet<String>> {
        let key = fs::canonicalize(page).ok()?;
        if let Some(found) = anchors_of.get(&key) {
            return Some(found.clone());
        }
        let found = anchors(&fs::read_to_string(&key).ok()?);
        anchors_of.insert(key, found.clone());
        Some(found)
    };
    let mut readme_links: HashSet<PathBuf> = HashSet::new();
    for page in &pages {
        let Ok(text) = fs::read_to_string(page) else {
            problems.push(format!("{}: cannot be read", rel(page)));
            continue;
        };
        let is_readme = page.file_name().is_some_and(|n| n == "README.md") && page.parent() == Some(root);
        if is_readme && text.lines().count() > README_MAX_LINES {
            problems.push(format!("README.md: {} lines, more than {README_MAX_LINES}: it is the front page; move the detail to docs/", text.lines().count()));
        }
        let folder = page.parent().unwrap_or(root);
        for link in links(&text) {
            let target = link.target.as_str();
            let at = format!("{}:{}: {}({})", rel(page), link.line, link.text, target);
            if target.is_empty() {
                problems.push(format!("{at}: empty target"));
                continue;
            }
            let lower = target.to_ascii_lowercase();
            if lower.starts_with("http://") || lower.starts_with("https://") || lower.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target, None),
            };
            let file = if path.is_empty() { page.clone() } else { folder.join(path) };
            if !file.exists() {
                problems.push(format!("{at}: no such file {}", rel(&file)));
                continue;
            }
            if is_readme {
                if let Ok(canonical) = fs::canonicalize(&file) {
                    readme_links.insert(canonical);
                }
            }
            let Some(anchor) = anchor else { continue };
            if file.extension().is_none_or(|x| x != "md") {
                continue;
            }
            match anchors_for(&file) {
                Some(found) if found.contains(anchor) => {}
                Some(_) => problems.push(format!("{at}: {} has no heading whose anchor is #{anchor}", rel(&file))),
                None => problems.push(format!("{at}: {} cannot be read for its headings", rel(&file))),
            }
        }
    }
    for page in pages.iter().skip(1) {
        let linked = fs::canonicalize(page).is_ok_and(|c| readme_links.contains(&c));
        if !linked {
            problems.push(format!("README.md: does not link to {}", rel(page)));
        }
    }
    problems
}

#[test]
fn docs_links_resolve() {
    let root = root();
    assert!(root.join("README.md").is_file(), "no README.md at {}", root.display());
    assert!(root.join("docs").is_dir(), "no docs/ at {}", root.display());
    let problems = problems(&root);
    assert!(problems.is_empty(), "{} broken link(s) or README problem(s):\n{}", problems.len(), problems.join("\n"));
}

/// The check itself: a scratch project with one link of every kind that must fail, and the
/// ones that must pass.
#[test]
fn docs_link_check_reports_what_is_broken() {
    let dir = std::env::temp_dir().join(format!("docs-links-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("docs")).unwrap();
    fs::create_dir_all(dir.join("results")).unwrap();
    fs::write(dir.join("results/chart.svg"), "<svg/>").unwrap();
    let mut readme = String::from("# Front\n\n[a](docs/a.md) and [a's part](docs/a.md#part-two-make-it) and [top](#front)\n");
    readme.push_str("`[not a link](nowhere.md)` and [https](https://example.org/x) [mail](mailto:x@example.org)\n");
    readme.push_str("```\n[in a fence](nowhere-either.md)\n```\n[broken](docs/missing.md) [bad anchor](docs/a.md#no-such-part)\n");
    readme.push_str(&"filler\n".repeat(README_MAX_LINES));
    fs::write(dir.join("README.md"), readme).unwrap();
    let a = "# A\n\n[back](../README.md)\n\n## Part two: `make it`\n\n![chart](../results/chart.svg) ![gone](results/chart.svg)\n\
             [self](#part-two-make-it) [dup](#a-1) [code `span`\nover a line](b.md)\n\n## A\n";
    fs::write(dir.join("docs/a.md"), a).unwrap();
    fs::write(dir.join("docs/b.md"), "# B\n").unwrap();
    let found = problems(&dir);
    let _ = fs::remove_dir_all(&dir);
    let expected = [
        "README.md:8: [broken](docs/missing.md): no such file docs/missing.md",
        "README.md:8: [bad anchor](docs/a.md#no-such-part): docs/a.md has no heading whose anchor is #no-such-part",
        "docs/a.md:7: ![gone](results/chart.svg): no such file docs/results/chart.svg",
        "README.md: does not link to docs/b.md",
    ];
    for e in expected {
        assert!(found.iter().any(|p| p == e), "not reported: {e}\nreported:\n{}", found.join("\n"));
    }
    assert!(found.iter().any(|p| p.starts_with("README.md: 228 lines, more than 220")), "README's length not reported:\n{}", found.join("\n"));
    assert_eq!(found.len(), expected.len() + 1, "reported more than the broken links:\n{}", found.join("\n"));
}
