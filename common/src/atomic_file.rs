//! Files replaced whole or not at all, and never written through a link someone else planted.
//!
//! What a run leaves behind (its checkpoint, its results, its charts) is written to a temporary
//! file beside the target, flushed to disk, and renamed over it: a full disk, a crash or a kill
//! at any moment leaves either the previous file or the new one, never a torn one (and `make
//! report` never reads half a run).
//!
//! Results and checkpoint folders on a cluster are often shared with a project group. A
//! temporary file with a name others can predict (the process id) lets anyone who can write in
//! the folder plant a symbolic link there first and make the run overwrite any file its user can
//! write. So the temporary file gets a random name and is created with `O_CREAT | O_EXCL`, which
//! never follows a link (the `tempfile` crate), and whoever fills it writes through that very
//! file (`/proc/self/fd/N`), not through its name, which another user could swap for a link
//! while it is written. The rename then replaces whatever is at the target's name, a link
//! included, without following it. Files that are appended to ([`append`]) or created under a
//! fresh name ([`create_new`]) refuse a link at their name.
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Writes `bytes` to `path` atomically (see the module docs).
pub fn write(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    write_with(path, |tmp| std::fs::write(tmp, bytes.as_ref()).map_err(anyhow::Error::from))
}

/// Replaces `path` with what `fill` writes to the path it is given: a name for a new temporary
/// file in the same folder (so the rename stays on one file system), created for this call
/// only. When `fill` or anything after it fails, the temporary file is removed and `path` is
/// left as it was.
pub fn write_with(path: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let written = (|| {
        let tmp = temporary_beside(path)?;
        let through = handle_path(tmp.as_file()).unwrap_or_else(|| tmp.path().to_path_buf());
        fill(&through)?;
        // The bytes on disk before the name points at them.
        tmp.as_file().sync_all().context("cannot flush it to disk")?;
        still_ours(&tmp)?;
        tmp.persist(path).map_err(|e| anyhow::Error::from(e.error)).context("cannot rename it into place")?;
        // And the rename itself.
        File::open(folder_of(path)).and_then(|dir| dir.sync_all()).context("cannot flush its folder to disk")
    })();
    written.with_context(|| format!("cannot write {}", path.display()))
}

/// Opens `path` for appending (created if missing), refusing a symbolic link at that name:
/// an appended log in a shared folder must not grow some other file.
pub fn append(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().create(true).append(true).mode(0o666).custom_flags(libc::O_NOFOLLOW).open(path).map_err(|e| refusal(path, e))
}

/// Creates `path`, which must not exist yet, not even as a link (`O_CREAT | O_EXCL`).
pub fn create_new(path: &Path) -> Result<File> {
    std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| refusal(path, e))
}

/// Whether `dir` can be written to: creates it if need be, then a temporary file of a random
/// name there, which is removed again (also when writing it fails).
pub fn probe_folder(dir: &Path) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let mut probe = tempfile::Builder::new().prefix(".write-test-").tempfile_in(dir)?;
    probe.write_all(b"x")?;
    probe.as_file().sync_all()
}

/// The error for a file that cannot be opened, saying so plainly when a link was in the way.
fn refusal(path: &Path, err: std::io::Error) -> anyhow::Error {
    let link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if link {
        anyhow::anyhow!("{} is a symbolic link: not writing through it (remove it, or choose another folder)", path.display())
    } else {
        anyhow::Error::from(err).context(format!("cannot open {}", path.display()))
    }
}

/// The folder `path` is in (`.` for a bare file name).
fn folder_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The prefix of the temporary files this process writes `path` through: `.<name>.<pid>.`
/// (the process id tells a later run whether the writer of a leftover one is still alive;
/// the random part after it is what nobody can predict).
pub fn temporary_prefix(path: &Path, pid: u32) -> String {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    format!(".{name}.{pid}.")
}

/// `.<name>.<pid>.<random>.tmp` beside `path`, new (`O_EXCL`) and private to this call;
/// readable as the process's umask allows once in place, as a file created plainly would be.
fn temporary_beside(path: &Path) -> Result<tempfile::NamedTempFile> {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix(&temporary_prefix(path, std::process::id()))
        .suffix(".tmp")
        .permissions(std::fs::Permissions::from_mode(0o666))
        .tempfile_in(folder_of(path))
        .context("cannot create a temporary file beside it")
}

/// Whether the temporary file's name still names the file this process created, not a link or
/// file someone else put in its place while it was written (which the rename would otherwise
/// move to the target's name).
fn still_ours(tmp: &tempfile::NamedTempFile) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let ours = tmp.as_file().metadata().context("cannot stat its temporary file")?;
    let named = std::fs::symlink_metadata(tmp.path()).context("its temporary file is gone")?;
    anyhow::ensure!(
        (ours.dev(), ours.ino()) == (named.dev(), named.ino()),
        "its temporary file {} was replaced by someone else while it was written: not moving that into place",
        tmp.path().display()
    );
    Ok(())
}

/// A name that opens exactly `file` again (`/proc/self/fd/N`, Linux), whatever happens to the
/// name it was created under; None where /proc is not mounted.
fn handle_path(file: &File) -> Option<PathBuf> {
    use std::os::fd::AsRawFd;
    let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    path.exists().then_some(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

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
        assert_eq!(message.matches("No space left").count(), 1, "{message}");
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
    fn links_planted_in_a_shared_folder_are_never_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        let path = dir.path().join("run.json");
        // The old temporary names, `<name>.tmp-<pid>-<n>`, all planted as links to the victim,
        // and the target itself a link too.
        for n in 0..8 {
            symlink(&victim, dir.path().join(format!("run.json.tmp-{}-{n}", std::process::id()))).unwrap();
        }
        symlink(&victim, &path).unwrap();
        write(&path, "{\"steps\": 1}\n").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
        assert!(!std::fs::symlink_metadata(&path).unwrap().file_type().is_symlink(), "the link at the target's name was replaced, not followed");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"steps\": 1}\n");

        // An appended file or a fresh one refuses a link at its name.
        let log = dir.path().join("exercise1.csv");
        symlink(&victim, &log).unwrap();
        let err = format!("{:#}", append(&log).unwrap_err());
        assert!(err.contains("exercise1.csv is a symbolic link: not writing through it"), "{err}");
        let events = dir.path().join("events.out.tfevents.1");
        symlink(&victim, &events).unwrap();
        assert!(format!("{:#}", create_new(&events).unwrap_err()).contains("is a symbolic link"));
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    }

    #[test]
    fn the_fill_writes_the_file_it_was_given_even_if_its_name_is_swapped() {
        // Another user removes the temporary file while it is being written and puts a link to
        // the victim in its place: the writer's bytes go to the file it created (its descriptor),
        // never through the link, and the link is not moved to the target's name.
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        let path = dir.path().join("ck.safetensors");
        let err = write_with(&path, |through| {
            for entry in std::fs::read_dir(dir.path()).unwrap().flatten() {
                let name = entry.file_name().into_string().unwrap();
                if name.ends_with(".tmp") {
                    std::fs::remove_file(entry.path()).unwrap();
                    symlink(&victim, entry.path()).unwrap();
                }
            }
            std::fs::write(through, "checkpoint\n").map_err(anyhow::Error::from)
        })
        .unwrap_err();
        // The link was not moved to the target's name either: the run says so instead.
        assert!(format!("{err:#}").contains("was replaced by someone else while it was written"), "{err:#}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
        assert!(std::fs::symlink_metadata(&path).is_err(), "nothing was put at the target's name");
    }

    #[test]
    fn the_folder_probe_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("results");
        probe_folder(&sub).unwrap();
        assert!(names(&sub).is_empty());
        let file = dir.path().join("a-file");
        std::fs::write(&file, "x").unwrap();
        assert!(probe_folder(&file).is_err());
    }

    #[test]
    fn written_files_are_readable_as_plainly_created_ones() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (ours, plain) = (dir.path().join("ours"), dir.path().join("plain"));
        write(&ours, "x").unwrap();
        std::fs::write(&plain, "x").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&ours), mode(&plain));
    }

    #[test]
    fn a_bare_file_name_is_written_in_the_current_folder() {
        assert_eq!(folder_of(Path::new("run.json")), Path::new("."));
        assert_eq!(folder_of(Path::new("/r/run.json")), Path::new("/r"));
    }
}
