//! The one reader: every input file (data, checkpoints, configs, profiles, weights, results read
//! back) is opened here, so that what is wrong with it is said the same way everywhere, before
//! anything waits on it or reads it.
//!
//! A file is opened without waiting (`O_NONBLOCK`: a FIFO given where a file is expected would
//! otherwise block its reader forever, and a job with it) and refused unless what was opened is a
//! regular file: a FIFO, a device such as /dev/zero behind a link, a socket or a folder get "is not
//! a regular file (a FIFO)". A missing file "does not exist", a file the user may not read "is not
//! readable". Reading it whole reserves its bytes first, so that a file larger than the memory
//! left is one line saying how much it needed, not an abort. Folders given as inputs (a data set's)
//! get the same three words from [`folder`].
use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::Value;

/// What is wrong with an input that cannot be used, in the words the messages use.
fn problem(path: &Path, err: &std::io::Error) -> String {
    match err.kind() {
        std::io::ErrorKind::NotFound => format!("{} does not exist", path.display()),
        std::io::ErrorKind::PermissionDenied => format!("{} is not readable (permission denied)", path.display()),
        _ => format!("cannot read {}: {err}", path.display()),
    }
}

/// "a FIFO", "a device", "a socket" or "a folder": what a non-regular file is.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let kind = meta.file_type();
    if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "a folder"
    }
}

/// Opens the regular file `path` for reading, without waiting on it; anything else is refused
/// with one line naming it and what it is, ending with `remedy` (what to give instead).
pub fn open(path: &Path, remedy: &str) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(|err| anyhow::anyhow!(problem(path, &err)))?;
    let meta = file.metadata().map_err(|err| anyhow::anyhow!(problem(path, &err)))?;
    if !meta.file_type().is_file() {
        anyhow::bail!("{} is not a regular file ({}): {remedy}", path.display(), kind_of(&meta));
    }
    // Blocking reads again from here (a regular file never blocks; the flag only served the open).
    clear_nonblocking(&file);
    Ok(file)
}

/// Checks that `path` is a regular file this process can read, as [`open`] would: for a reader
/// that opens the file itself (LibTorch's, say) and must not be handed a FIFO.
pub fn check(path: &Path, remedy: &str) -> Result<()> {
    open(path, remedy).map(drop)
}

/// Reads the regular file `path` whole (see [`open`]), of at most `limit` bytes, naming it in
/// every error.
pub fn read(path: &Path, limit: u64, remedy: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    let file = open(path, remedy)?;
    let size = file.metadata().with_context(|| format!("cannot read {}", path.display()))?.len();
    if size > limit {
        anyhow::bail!("{} is {size} bytes, more than the {limit} a file of this kind may have: not read", path.display());
    }
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(size as usize).map_err(|_| {
        anyhow::anyhow!("{}: cannot read it, its {:.1} MiB do not fit in the memory left to this process", path.display(), size as f64 / (1 << 20) as f64)
    })?;
    // A file that grows while read is read to the limit and refused past it.
    let read = file.take(limit.saturating_add(1)).read_to_end(&mut bytes).with_context(|| format!("cannot read {}", path.display()))?;
    if read as u64 > limit {
        anyhow::bail!("{} grew past {limit} bytes while it was read: not read", path.display());
    }
    Ok(bytes)
}

/// [`read`] as UTF-8 text.
pub fn read_to_string(path: &Path, limit: u64, remedy: &str) -> Result<String> {
    String::from_utf8(read(path, limit, remedy)?).map_err(|_| anyhow::anyhow!("{} is not UTF-8 text: {remedy}", path.display()))
}

/// Checks that `dir`, given as `flag`, is a folder this process can list: "does not exist",
/// "is not readable" or "is a file, not a folder" (ending with `remedy`) otherwise.
pub fn folder(dir: &Path, flag: &str, remedy: &str) -> Result<()> {
    let meta = std::fs::metadata(dir).map_err(|err| anyhow::anyhow!("{flag} {}: {remedy}", problem(dir, &err)))?;
    if !meta.is_dir() {
        let what = if meta.is_file() { "a file" } else { kind_of(&meta) };
        anyhow::bail!("{flag} {} is {what}, not a folder: {remedy}", dir.display());
    }
    std::fs::read_dir(dir).map_err(|err| anyhow::anyhow!("{flag} {}: {remedy}", problem(dir, &err)))?;
    Ok(())
}

/// JSON text as a value, refusing an object that names a key twice: serde_json keeps the last
/// one silently, so a second `"lr"` in a config, or a second piece of the same name in a
/// checkpoint's index, would win unseen. Every JSON file read is read through it ([`json`]).
pub fn json_value(text: &str) -> Result<Value, serde_json::Error> {
    use serde::de::{Deserialize, Deserializer, Error, MapAccess, SeqAccess, Visitor};
    struct Unique(Value);
    impl<'de> Deserialize<'de> for Unique {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Unique, D::Error> {
            deserializer.deserialize_any(UniqueVisitor).map(Unique)
        }
    }
    struct UniqueVisitor;
    impl<'de> Visitor<'de> for UniqueVisitor {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_f64<E: Error>(self, v: f64) -> Result<Value, E> {
            serde_json::Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom(format!("{v} is not a finite number")))
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(Value::String(v.to_string()))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let mut items = Vec::new();
            while let Some(Unique(item)) = seq.next_element()? {
                items.push(item);
            }
            Ok(Value::Array(items))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut object = serde_json::Map::new();
            while let Some(key) = map.next_key::<String>()? {
                let Unique(value) = map.next_value()?;
                if object.insert(key.clone(), value).is_some() {
                    return Err(A::Error::custom(format!("the key `{key}` is given twice")));
                }
            }
            Ok(Value::Object(object))
        }
    }
    let mut deserializer = serde_json::Deserializer::from_str(text);
    let Unique(value) = Unique::deserialize(&mut deserializer)?;
    deserializer.end()?;
    Ok(value)
}

/// JSON text (a file's bytes) as a `T`, a key given twice refused ([`json_value`]).
pub fn json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    let text = std::str::from_utf8(bytes).map_err(|e| <serde_json::Error as serde::de::Error>::custom(format!("not UTF-8 text: {e}")))?;
    serde_json::from_value(json_value(text)?)
}

/// Turns `O_NONBLOCK` off again on `file`.
fn clear_nonblocking(file: &File) {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function's caller owns, changing its status flags only.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REMEDY: &str = "give a file";

    #[test]
    fn a_json_key_given_twice_is_refused_at_any_depth() {
        #[derive(serde::Deserialize, Debug)]
        struct Index {
            pieces: std::collections::BTreeMap<String, u64>,
        }
        let once: Index = json(br#"{"pieces": {"a": 1, "b": 2}}"#).unwrap();
        assert_eq!(once.pieces.len(), 2);
        let twice = json::<Index>(br#"{"pieces": {"a": 1, "a": 2}}"#).unwrap_err().to_string();
        assert!(twice.contains("the key `a` is given twice"), "{twice}");
        assert!(json_value(r#"[{"x": 1}, {"y": [{"z": 0, "z": 0}]}]"#).unwrap_err().to_string().contains("`z` is given twice"));
        assert!(json::<Index>(b"{\"pieces\": {\"\xff\": 1}}").is_err(), "not UTF-8");
    }

    #[test]
    fn only_regular_files_within_the_limit_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small.jpg");
        std::fs::write(&small, b"12345").unwrap();
        assert_eq!(read(&small, 5, REMEDY).unwrap(), b"12345");
        let err = read(&small, 4, REMEDY).unwrap_err().to_string();
        assert!(err.contains("small.jpg is 5 bytes, more than the 4"), "{err}");
        let sparse = dir.path().join("sparse.jpg");
        std::fs::File::create(&sparse).unwrap().set_len(8 << 30).unwrap();
        assert!(read(&sparse, 256 << 20, REMEDY).unwrap_err().to_string().contains("more than the 268435456"));
        let zero = dir.path().join("zero.jpg");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        assert_eq!(read(&zero, u64::MAX, REMEDY).unwrap_err().to_string(), format!("{} is not a regular file (a device): give a file", zero.display()));
        let fifo = dir.path().join("fifo.jpg");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        // Opened without waiting for a writer: refused at once, by every entry point.
        for err in [read(&fifo, u64::MAX, REMEDY).unwrap_err(), check(&fifo, REMEDY).unwrap_err(), read_to_string(&fifo, 10, REMEDY).unwrap_err()] {
            assert!(err.to_string().contains("fifo.jpg is not a regular file (a FIFO): give a file"), "{err}");
        }
        assert!(read(dir.path(), u64::MAX, REMEDY).unwrap_err().to_string().contains("not a regular file (a folder)"));
        let missing = dir.path().join("missing.json");
        assert_eq!(check(&missing, REMEDY).unwrap_err().to_string(), format!("{} does not exist", missing.display()));
        let text = dir.path().join("latin1.txt");
        std::fs::write(&text, b"caf\xe9").unwrap();
        assert!(read_to_string(&text, 10, REMEDY).unwrap_err().to_string().contains("is not UTF-8 text"));
    }

    #[test]
    fn a_regular_file_opened_reads_as_a_blocking_file() {
        use std::io::Read;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.txt");
        std::fs::write(&path, "abc").unwrap();
        let mut file = open(&path, REMEDY).unwrap();
        let mut text = String::new();
        file.read_to_string(&mut text).unwrap();
        assert_eq!(text, "abc");
        use std::os::fd::AsRawFd;
        assert_eq!(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) } & libc::O_NONBLOCK, 0);
    }

    #[test]
    fn folders_are_said_missing_a_file_or_another_kind() {
        let dir = tempfile::tempdir().unwrap();
        folder(dir.path(), "--data-dir", "give the data's folder").unwrap();
        let missing = dir.path().join("nothing");
        let err = folder(&missing, "--data-dir", "run make data").unwrap_err().to_string();
        assert_eq!(err, format!("--data-dir {} does not exist: run make data", missing.display()));
        let file = dir.path().join("f");
        std::fs::write(&file, "x").unwrap();
        let err = folder(&file, "--data-dir", "give the data's folder").unwrap_err().to_string();
        assert!(err.contains("f is a file, not a folder: give the data's folder"), "{err}");
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        assert!(folder(&fifo, "--data-dir", "x").unwrap_err().to_string().contains("is a FIFO, not a folder"));
    }
}
