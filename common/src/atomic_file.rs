//! Files replaced whole or not at all. What a run leaves behind (its checkpoint, its results)
//! is written to a temporary file beside the target, flushed to disk, and renamed over it: a
//! full disk, a crash or a kill at any moment leaves either the previous file or the new one,
//! never a torn one (and `make report` never reads half a run).
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result};

/// Writes `bytes` to `path` atomically (see the module docs).
pub fn write(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    write_with(path, |tmp| std::fs::write(tmp, bytes.as_ref()).with_context(|| format!("cannot write {}", tmp.display())))
}

/// Replaces `path` with what `fill` writes to the temporary path it is given (in the same
/// folder, so the rename stays on one file system). When `fill` or anything after it fails,
/// the temporary file is removed and `path` is left as it was.
pub fn write_with(path: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temporary_beside(path);
    let written = fill(&tmp).and_then(|()| {
        // The bytes on disk before the name points at them.
        std::fs::File::open(&tmp).and_then(|file| file.sync_all()).with_context(|| format!("cannot flush {} to disk", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
        // And the rename itself.
        std::fs::File::open(folder_of(path)).and_then(|dir| dir.sync_all()).with_context(|| format!("cannot flush the folder of {} to disk", path.display()))
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.with_context(|| format!("cannot write {}", path.display()))
}

/// The folder `path` is in (`.` for a bare file name).
fn folder_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// `<name>.tmp-<pid>-<n>` beside `path`: private to this process and this call (ranks or
/// threads writing the same file do not share one).
fn temporary_beside(path: &Path) -> PathBuf {
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, Ordering::Relaxed);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    folder_of(path).join(format!("{name}.tmp-{}-{n}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        names
    }

    #[test]
    fn the_new_content_replaces_the_old_and_nothing_else_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        write(&path, "{\"old\": 1}\n").unwrap();
        write(&path, "{\"new\": 2}\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"new\": 2}\n");
        assert_eq!(names(dir.path()), ["run.json"]);
    }

    #[test]
    fn a_write_that_fails_midway_leaves_the_old_file_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        let old = "{\"steps\": 200, \"history\": [1, 2, 3]}\n";
        write(&path, old).unwrap();
        // Half the new content is on disk when the write fails (a full disk, say).
        let err = write_with(&path, |tmp| {
            std::fs::write(tmp, "{\"steps\": 0, \"hist").unwrap();
            anyhow::bail!("No space left on device (os error 28)")
        })
        .unwrap_err();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), old);
        assert_eq!(names(dir.path()), ["run.json"], "the temporary file is removed");
        let message = format!("{err:#}");
        assert!(message.starts_with(&format!("cannot write {}", path.display())) && message.contains("No space left"), "{message}");
    }

    #[test]
    fn a_rename_that_fails_leaves_the_target_and_no_temporary_file() {
        // The target is a folder with a file in it: the rename over it fails.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("inside"), "x").unwrap();
        let err = write(&path, "{}").unwrap_err();
        assert!(format!("{err:#}").contains("cannot rename"), "{err:#}");
        assert!(path.is_dir());
        assert_eq!(names(dir.path()), ["run.json"]);
    }

    #[test]
    fn a_bare_file_name_is_written_in_the_current_folder() {
        assert_eq!(folder_of(Path::new("run.json")), Path::new("."));
        assert_eq!(temporary_beside(Path::new("run.json")).parent(), Some(Path::new(".")));
        let tmp = temporary_beside(Path::new("/r/run.json"));
        assert!(tmp.starts_with("/r") && tmp.file_name().unwrap().to_str().unwrap().starts_with("run.json.tmp-"), "{}", tmp.display());
    }
}
