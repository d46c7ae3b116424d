//! torchvision's ImageNet weights for the course models (`IMAGENET1K_V1`, the weights exercise 1
//! starts ResNet34 and VGG19 from), without Python: the `.pth` file torchvision publishes,
//! fetched from its address, checked against the hash in its name, cached where torchvision
//! caches it, and read without Python ([`super::torch_save`]).
//!
//! The cache is torchvision's own (`$TORCH_HOME/hub/checkpoints`, `TORCH_HOME` defaulting to
//! `$XDG_CACHE_HOME/torch`, then `~/.cache/torch`), so a file torchvision fetched before is
//! used as it is, and the other way round. A cached file is checked again at every use (a few
//! seconds for VGG19's 548 MiB): a cache a crashed copy left torn is refused, not trained from.
//! The download goes through `curl` (or `wget`, or Python's urllib), which honour the site's proxy settings and
//! certificate store, into a temporary file in the cache that is renamed only once its hash is
//! right: a failed or wrong download leaves nothing cached. `COURSE_WEIGHTS_URL` replaces the
//! published address's folder (a site mirror; the tests' local server).
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::Arch;

/// Where torchvision publishes its weights.
pub const PUBLISHED_URL: &str = "https://download.pytorch.org/models";

/// torchvision's `IMAGENET1K_V1` file of each ImageNet model (torchvision.models.*_Weights).
/// The hex digits after the last `-` are the start of the file's SHA-256.
/// (`COURSE_TEST_PUBLISHED=MODEL:FILE` stands another file in for MODEL's: the tests' own, made by
/// torchvision, whose hash they know; the published files cannot be fetched where they run.)
pub fn published_file(arch: Arch) -> Option<String> {
    if let Some((model, file)) = std::env::var("COURSE_TEST_PUBLISHED").ok().as_deref().and_then(|v| v.split_once(':')) {
        if model == arch.name() {
            return Some(file.to_string());
        }
    }
    match arch {
        Arch::Resnet34 => Some("resnet34-b627a593.pth"),
        Arch::Resnet50 => Some("resnet50-0676ba61.pth"),
        Arch::Vgg19 => Some("vgg19-dcbb9e9d.pth"),
        // Keras publishes ResNet50V2's ImageNet weights, in its own format; the course trains it
        // from scratch.
        Arch::Cnn | Arch::Resnet50v2 => None,
    }
    .map(String::from)
}

/// torchvision's cache folder for downloaded weights.
pub fn cache_dir() -> Result<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let torch_home = match (var("TORCH_HOME"), var("XDG_CACHE_HOME"), var("HOME")) {
        (Some(home), _, _) => home,
        (None, Some(cache), _) => cache.join("torch"),
        (None, None, Some(home)) => home.join(".cache/torch"),
        (None, None, None) => bail!("no cache folder for the weights: set TORCH_HOME (or HOME)"),
    };
    Ok(torch_home.join("hub/checkpoints"))
}

/// The address `file` is fetched from.
pub fn url_of(file: &str) -> String {
    let base = std::env::var("COURSE_WEIGHTS_URL").ok().filter(|u| !u.is_empty()).unwrap_or_else(|| PUBLISHED_URL.to_string());
    format!("{}/{file}", base.trim_end_matches('/'))
}

/// The hash prefix a published file's name carries (`vgg19-dcbb9e9d.pth` → `dcbb9e9d`).
fn hash_prefix(file: &str) -> &str {
    let stem = file.strip_suffix(".pth").unwrap_or(file);
    stem.rsplit('-').next().unwrap_or(stem)
}

/// Fails unless the SHA-256 of `path` starts with the hash `file`'s name carries.
fn check_hash(path: &Path, file: &str) -> Result<()> {
    let mut reader = crate::input::open(path, "remove it from the weights cache")?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buffer).with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    let digest: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    let want = hash_prefix(file);
    if !digest.starts_with(want) {
        bail!("{} has SHA-256 {}…, not the {want}… its name {file} promises: a torn download or another file", path.display(), &digest[..16]);
    }
    Ok(())
}

/// The checked ImageNet weights of `arch` in the cache, fetched first when missing and `fetch`
/// allows it. Without them, one line says which file to put where.
pub fn imagenet_weights(arch: Arch, fetch: bool) -> Result<PathBuf> {
    let Some(file) = published_file(arch) else {
        bail!("--weights imagenet: torchvision publishes no ImageNet weights for {} (only resnet34, resnet50 and vgg19)", arch.name())
    };
    let file = file.as_str();
    let dir = cache_dir()?;
    let path = dir.join(file);
    if path.is_file() {
        check_hash(&path, file)
            .with_context(|| format!("the cached ImageNet weights of {} are damaged: remove {} to fetch them again", arch.name(), path.display()))?;
        return Ok(path);
    }
    let url = url_of(file);
    if !fetch {
        bail!("no ImageNet weights of {} at {}: fetch them with `prepare_data weights {}`, or put {url} there", arch.name(), path.display(), arch.name());
    }
    download(&url, &dir, file)
        .with_context(|| format!("cannot fetch the ImageNet weights of {}: put {url} at {} by hand (no network here?)", arch.name(), path.display()))?;
    Ok(path)
}

/// `url` into `dir/file`, through a temporary file there renamed only once its hash is checked.
fn download(url: &str, dir: &Path, file: &str) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot make the cache folder {}", dir.display()))?;
    let partial = tempfile::Builder::new()
        .prefix(&format!(".{file}."))
        .suffix(".partial")
        .tempfile_in(dir)
        .with_context(|| format!("cannot write in {}", dir.display()))?;
    let target = partial.path().to_path_buf();
    // Python's urllib last: python3 is on every machine the project sets up on (its .venv).
    let attempts: [(&str, Vec<&str>); 3] = [
        ("curl", vec!["--fail", "--location", "--silent", "--show-error", "--retry", "2", "--connect-timeout", "20", "--output"]),
        ("wget", vec!["--quiet", "--tries=3", "--timeout=20", "--output-document"]),
        ("python3", vec!["-c", "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[2], sys.argv[1])"]),
    ];
    for (tool, args) in attempts {
        let out = match Command::new(tool).args(&args).arg(&target).arg(url).output() {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => bail!("cannot run {tool}: {e}"),
        };
        if !out.status.success() {
            let said = String::from_utf8_lossy(&out.stderr);
            bail!("{tool} {url}: {}", said.lines().last().unwrap_or("failed").trim());
        }
        check_hash(&target, file)?;
        partial.persist(dir.join(file)).with_context(|| format!("cannot put {} in place", dir.join(file).display()))?;
        return Ok(());
    }
    bail!("none of curl, wget and python3 is installed")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_prefix_is_the_last_part_of_the_name() {
        assert_eq!(hash_prefix("vgg19-dcbb9e9d.pth"), "dcbb9e9d");
        assert_eq!(hash_prefix("resnet50-0676ba61.pth"), "0676ba61");
    }

    #[test]
    fn a_file_whose_hash_differs_from_its_name_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.pth");
        std::fs::write(&path, b"abc").unwrap();
        // SHA-256("abc") = ba7816bf...
        check_hash(&path, "model-ba7816bf.pth").unwrap();
        let err = check_hash(&path, "model-dcbb9e9d.pth").unwrap_err().to_string();
        assert!(err.contains("ba7816bf8f01cfea") && err.contains("not the dcbb9e9d"), "{err}");
    }
}
