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

/// The most bytes a results table read back may have (`make bench-plan`'s, the largest, is under
/// a megabyte after a month of benches).
const CSV_LIMIT: u64 = 256 << 20;

/// A CSV table (a results or bench table read back), its header checked: a column named twice
/// is refused, naming it. serde reads a row by its header's names, and where two columns share
/// one, which of them a field gets is the reader's choice, not the writer's.
pub fn csv(path: &Path, remedy: &str) -> Result<csv::Reader<std::io::Cursor<Vec<u8>>>> {
    let mut reader = csv::Reader::from_reader(std::io::Cursor::new(read(path, CSV_LIMIT, remedy)?));
    let header = reader.headers().with_context(|| format!("{}: unreadable header line", path.display()))?;
    let mut seen = std::collections::HashSet::new();
    if let Some(twice) = header.iter().find(|name| !seen.insert(*name)) {
        anyhow::bail!("{}: the column `{twice}` is named twice in its header: {remedy}", path.display());
    }
    Ok(reader)
}

/// The largest safetensors header the format allows (the safetensors crate's own bound).
const SAFETENSORS_HEADER_LIMIT: u64 = 100_000_000;

/// The header (its length and tensor table) of the safetensors file whose bytes are `bytes`,
/// refusing a header that names a tensor or a metadata key twice: the safetensors crate keeps
/// the last one silently, so a second entry of one name would replace the first unseen.
pub fn safetensors_metadata(bytes: &[u8]) -> Result<(usize, safetensors::tensor::Metadata)> {
    if let Some(text) = safetensors_header_text(bytes) {
        json_value(text).map_err(|e| anyhow::anyhow!("its header: {e}"))?;
    }
    safetensors::SafeTensors::read_metadata(bytes).map_err(|e| anyhow::anyhow!("{e}"))
}

/// The header text of a safetensors file (a little-endian length, then that many bytes of
/// JSON), where the bytes hold one; the format's own checks say what is wrong otherwise.
fn safetensors_header_text(bytes: &[u8]) -> Option<&str> {
    let length = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    std::str::from_utf8(bytes.get(8..8usize.checked_add(length)?)?).ok()
}

/// Checks the header of the safetensors file `path` (see [`safetensors_metadata`]) without
/// reading its tensors: for a file a library reads itself (LibTorch's loader for `--weights`).
pub fn check_safetensors_header(path: &Path, remedy: &str) -> Result<()> {
    use std::io::Read;
    let mut file = open(path, remedy)?;
    let mut length = [0u8; 8];
    file.read_exact(&mut length).map_err(|_| anyhow::anyhow!("{} is not a safetensors file (shorter than its header's length): {remedy}", path.display()))?;
    let size = u64::from_le_bytes(length);
    if size > SAFETENSORS_HEADER_LIMIT {
        anyhow::bail!("{} is not a safetensors file (its header would be {size} bytes): {remedy}", path.display());
    }
    let mut bytes = length.to_vec();
    file.take(size).read_to_end(&mut bytes).with_context(|| format!("cannot read {}", path.display()))?;
    let text =
        safetensors_header_text(&bytes).ok_or_else(|| anyhow::anyhow!("{} is not a safetensors file (a torn or non-text header): {remedy}", path.display()))?;
    json_value(text).map_err(|e| anyhow::anyhow!("{}: its header: {e}: {remedy}", path.display()))?;
    Ok(())
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

    #[test]
    fn a_csv_column_named_twice_is_refused_naming_it() {
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct Row {
            a: u32,
            b: u32,
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.csv");
        std::fs::write(&path, "a,b\n1,2\n").unwrap();
        let rows: Vec<Row> = csv(&path, REMEDY).unwrap().deserialize().collect::<Result<_, _>>().unwrap();
        assert_eq!(rows, vec![Row { a: 1, b: 2 }]);
        // A column the rows do not read, named twice, is refused as well: the table is not one
        // its writer wrote.
        std::fs::write(&path, "a,b,note,note\n1,2,x,y\n").unwrap();
        let err = csv(&path, REMEDY).unwrap_err().to_string();
        assert_eq!(err, format!("{}: the column `note` is named twice in its header: give a file", path.display()));
        std::fs::write(&path, "a,b,a\n1,2,3\n").unwrap();
        assert!(csv(&path, REMEDY).unwrap_err().to_string().contains("the column `a` is named twice"));
    }

    /// A safetensors file whose header's text is `header`, then the four bytes of one float32.
    fn safetensors_bytes(header: &str) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&1.0f32.to_le_bytes());
        bytes
    }

    #[test]
    fn a_safetensors_header_naming_a_tensor_or_a_metadata_key_twice_is_refused() {
        let entry = r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#;
        let once = safetensors_bytes(&format!(r#"{{"__metadata__":{{"m":"1"}},"w":{entry}}}"#));
        let (_, header) = safetensors_metadata(&once).unwrap();
        assert_eq!(header.tensors().len(), 1);
        for header in [format!(r#"{{"w":{entry},"w":{entry}}}"#), format!(r#"{{"__metadata__":{{"m":"1","m":"2"}},"w":{entry}}}"#)] {
            let twice = safetensors_bytes(&header);
            // The safetensors crate takes it (one entry wins unseen): the check is ours.
            assert!(safetensors::SafeTensors::read_metadata(&twice).is_ok());
            let err = safetensors_metadata(&twice).unwrap_err().to_string();
            assert!(err.starts_with("its header: the key `") && err.contains("is given twice"), "{err}");
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("w.safetensors");
            std::fs::write(&path, &twice).unwrap();
            let err = check_safetensors_header(&path, REMEDY).unwrap_err().to_string();
            assert!(err.contains("is given twice") && err.ends_with(REMEDY), "{err}");
            std::fs::write(&path, &once).unwrap();
            check_safetensors_header(&path, REMEDY).unwrap();
        }
        // A header length beyond the format's bound, and a file shorter than the length field.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        std::fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
        assert!(check_safetensors_header(&path, REMEDY).unwrap_err().to_string().contains("is not a safetensors file (its header would be"));
        std::fs::write(&path, b"abc").unwrap();
        assert!(check_safetensors_header(&path, REMEDY).unwrap_err().to_string().contains("shorter than its header's length"));
    }
}
