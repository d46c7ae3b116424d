//! The one writer: every file and folder a run, a tool or a bench names itself goes through
//! here, so that what it does on a shared cluster is decided once.
//!
//! - **Whole or not at all.** A file is written to a temporary file beside the target, flushed to
//!   disk, and renamed over it: a full disk, a crash or a kill at any moment leaves either the
//!   previous file or the new one, never a torn one (and `make report` never reads half a run).
//!   The temporaries a killed writer left (`.<name>.<pid>.<random>.tmp`) are removed by the next
//!   write of the same name, unless their writer still runs on this machine.
//! - **Never through a link it did not make.** Results and checkpoint folders on a cluster are
//!   often shared with a project group. A temporary file with a name others can predict lets
//!   anyone who can write in the folder plant a symbolic link there first and make the run
//!   overwrite any file its user can write. So the temporary file gets a random name and is
//!   created with `O_CREAT | O_EXCL`, which never follows a link (the `tempfile` crate), and whoever
//!   fills it writes through that very file (`/proc/self/fd/N`), not through its name, which
//!   another user could swap for a link while it is written. The rename then replaces a link at
//!   the target's name without following it. Files appended to ([`append`]) or created under a
//!   fresh name ([`create_new`]), and the folders a run names itself ([`folder`]: a TensorBoard run
//!   folder, a sharded checkpoint's), refuse a link at their name. The folders a user names
//!   (`--results-dir`, `--tensorboard`) are the user's: links there are followed.
//! - **Never over something that is not a regular file.** A FIFO, a device node, a socket or a
//!   folder at a file's name is refused, not renamed over (`checkpoint export CK /dev/full` as
//!   root would otherwise replace the device node), and a file at a folder's name likewise.
//!   [`check_file`] and [`check_folder`] say so before a run's first step, with the words the
//!   write itself would use.
//! - **Said.** Every name written is recorded ([`written`]); with `COURSE_WRITTEN_LOG` set to a
//!   file, every process appends each name it writes there, a line each (a job's ranks share it):
//!   what a job wrote, listed by the writer itself.
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result};

use crate::error::UsageError;

/// The environment variable naming a file to which each name written is appended.
pub const WRITTEN_LOG: &str = "COURSE_WRITTEN_LOG";

/// What kind of thing a path names, without following a link at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Missing,
    File,
    Folder,
    Link,
    Fifo,
    Device,
    Socket,
}

impl Kind {
    /// The kind at `path` (a link is a link, not what it points to).
    pub fn of(path: &Path) -> std::io::Result<Kind> {
        use std::os::unix::fs::FileTypeExt;
        let meta = match std::fs::symlink_metadata(path) {
            Ok(meta) => meta,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Kind::Missing),
            Err(err) => return Err(err),
        };
        let kind = meta.file_type();
        Ok(if kind.is_symlink() {
            Kind::Link
        } else if kind.is_file() {
            Kind::File
        } else if kind.is_dir() {
            Kind::Folder
        } else if kind.is_fifo() {
            Kind::Fifo
        } else if kind.is_socket() {
            Kind::Socket
        } else {
            Kind::Device
        })
    }

    /// "a folder", "a FIFO", … for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Missing => "missing",
            Kind::File => "a regular file",
            Kind::Folder => "a folder",
            Kind::Link => "a symbolic link",
            Kind::Fifo => "a FIFO",
            Kind::Device => "a device",
            Kind::Socket => "a socket",
        }
    }
}

/// Whether `path` may be written as a file: missing, a regular file, or a link (replaced, never
/// followed). A folder, a FIFO, a device or a socket there is refused, a usage error naming what
/// is there: before a run's first step, with the words the write itself would use.
pub fn check_file(path: &Path) -> Result<()> {
    match Kind::of(path).with_context(|| format!("cannot look at {}", path.display()))? {
        Kind::Missing | Kind::File | Kind::Link => Ok(()),
        other => {
            Err(UsageError(format!("{} is {}, not a regular file: not replacing it (remove it, or write elsewhere)", path.display(), other.describe())).into())
        }
    }
}

/// Whether `path` may be used as a folder a run names itself: missing or a folder; a link (which
/// someone else may have planted to send the run's files elsewhere) or anything else is
/// refused, a usage error naming what is there.
pub fn check_folder(path: &Path) -> Result<()> {
    match Kind::of(path).with_context(|| format!("cannot look at {}", path.display()))? {
        Kind::Missing | Kind::Folder => Ok(()),
        Kind::Link => Err(UsageError(format!("{} is a symbolic link: not writing through it (remove it, or write elsewhere)", path.display())).into()),
        other => {
            Err(UsageError(format!("{} is {}, not a folder: not writing into it (remove it, or write elsewhere)", path.display(), other.describe())).into())
        }
    }
}

/// Creates the folder `path` a run names itself (its parents, the user's, as need be), or uses
/// it where it is already a folder; a link or anything else at its name is refused
/// ([`check_folder`]), also when it appears between the check and the creation.
pub fn folder(path: &Path) -> Result<()> {
    check_folder(path)?;
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    }
    match std::fs::create_dir(path) {
        Ok(()) => {}
        // Something is there now: a folder is fine, anything else refused (check_folder again).
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => check_folder(path)?,
        Err(err) => return Err(anyhow::Error::from(err).context(format!("cannot create {}", path.display()))),
    }
    record(path);
    Ok(())
}

/// Writes `bytes` to `path` atomically (see the module docs).
pub fn write(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    write_with(path, |tmp| std::fs::write(tmp, bytes.as_ref()).map_err(anyhow::Error::from))
}

/// Replaces `path` with what `fill` writes to the path it is given: a name for a new temporary
/// file in the same folder (so the rename stays on one file system), created for this call
/// only. When `fill` or anything after it fails, the temporary file is removed and `path` is
/// left as it was. Something other than a regular file or a link at `path` is refused first.
pub fn write_with(path: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    check_file(path)?;
    // A killed writer's leftovers, which nothing else would ever remove.
    remove_stale_temporaries(path)?;
    let written = (|| {
        let tmp = temporary_beside(path)?;
        let through = handle_path(tmp.as_file()).unwrap_or_else(|| tmp.path().to_path_buf());
        fill(&through)?;
        // The bytes on disk before the name points at them.
        tmp.as_file().sync_all().context("cannot flush it to disk")?;
        still_ours(&tmp)?;
        // A FIFO or a folder put at the name while the file was written is not replaced either.
        check_file(path)?;
        tmp.persist(path).map_err(|e| anyhow::Error::from(e.error)).context("cannot rename it into place")?;
        // And the rename itself.
        File::open(folder_of(path)).and_then(|dir| dir.sync_all()).context("cannot flush its folder to disk")
    })();
    written.with_context(|| format!("cannot write {}", path.display()))?;
    record(path);
    Ok(())
}

/// Replaces `path` with the file `fill` makes at the name it is given, for a writer that opens
/// (and may rename) its files itself, as LibTorch's profiler does: that name is inside a new
/// folder of a random name beside `path`, private to this process (mode 0700, so nobody else can
/// plant anything in it), and the regular file made there is renamed over `path`, as [`write`]
/// renames. The private folder is removed however it ends.
pub fn write_by_name(path: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    check_file(path)?;
    let written = (|| {
        let private = tempfile::Builder::new()
            .prefix(&temporary_prefix(path, std::process::id()))
            .suffix(".dir")
            .tempdir_in(folder_of(path))
            .context("cannot create a private folder beside it")?;
        let inside = private.path().join(path.file_name().unwrap_or(std::ffi::OsStr::new("file")));
        fill(&inside)?;
        anyhow::ensure!(Kind::of(&inside)? == Kind::File, "the writer made no regular file at {}", inside.display());
        File::open(&inside).and_then(|file| file.sync_all()).context("cannot flush it to disk")?;
        check_file(path)?;
        std::fs::rename(&inside, path).context("cannot rename it into place")?;
        File::open(folder_of(path)).and_then(|dir| dir.sync_all()).context("cannot flush its folder to disk")
    })();
    written.with_context(|| format!("cannot write {}", path.display()))?;
    record(path);
    Ok(())
}

/// Gives the regular file `from` a second name `to`: a hard link (no second copy of the bytes)
/// where the file system allows, else a copy written as [`write`] writes. A regular file or a
/// link at `to` is replaced; anything else there is refused ([`check_file`]).
pub fn second_name(from: &Path, to: &Path) -> Result<()> {
    check_file(to)?;
    match std::fs::remove_file(to) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            return Err(anyhow::Error::from(err).context(format!("cannot replace {}", to.display())));
        }
        _ => {}
    }
    if std::fs::hard_link(from, to).is_err() {
        // (A link planted between the removal and here is replaced by the rename, not followed.)
        write_with(to, |tmp| std::fs::copy(from, tmp).map(drop).map_err(anyhow::Error::from))?;
    }
    record(to);
    Ok(())
}

/// Opens `path` for appending (created if missing), refusing a symbolic link at that name (an
/// appended log in a shared folder must not grow some other file) and anything but a regular
/// file (opened without waiting: a FIFO with no reader would block the writer forever).
pub fn append(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    check_file(path)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o666)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| refusal(path, e))?;
    regular(&file, path)?;
    record(path);
    Ok(file)
}

/// Creates `path`, which must not exist yet, not even as a link (`O_CREAT | O_EXCL`).
pub fn create_new(path: &Path) -> Result<File> {
    let file = std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| refusal(path, e))?;
    record(path);
    Ok(file)
}

/// Whether `dir` can be written to: creates it if need be, then a temporary file of a random
/// name there, which is removed again (also when writing it fails), and then the folders it
/// created: a run refused after this check leaves the tree as it found it. The run creates
/// its folders when it writes into them.
pub fn probe_folder(dir: &Path) -> std::io::Result<()> {
    use std::io::Write;
    // The folders missing now, outermost first, to be removed innermost first.
    let missing: Vec<&Path> = dir.ancestors().take_while(|d| !d.as_os_str().is_empty() && std::fs::symlink_metadata(d).is_err()).collect();
    let probed = std::fs::create_dir_all(dir).and_then(|()| {
        let mut probe = tempfile::Builder::new().prefix(".write-test-").tempfile_in(dir)?;
        probe.write_all(b"x")?;
        probe.as_file().sync_all()
    });
    for created in missing {
        // (Empty unless another process wrote there meanwhile: then it stays.)
        let _ = std::fs::remove_dir(created);
    }
    probed
}

/// Every name this process has written, in the order written (each once).
pub fn written() -> Vec<PathBuf> {
    WRITTEN.lock().map(|names| names.clone()).unwrap_or_default()
}

static WRITTEN: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Notes `path` as written: in [`written`], and in the file `COURSE_WRITTEN_LOG` names (one
/// line, appended in one write, so the ranks' lines do not interleave).
fn record(path: &Path) {
    if let Ok(mut names) = WRITTEN.lock() {
        if !names.iter().any(|p| p == path) {
            names.push(path.to_path_buf());
        }
    }
    if let Some(log) = std::env::var_os(WRITTEN_LOG) {
        use std::io::Write;
        use std::os::unix::ffi::OsStrExt;
        let mut line = path.as_os_str().as_bytes().to_vec();
        line.push(b'\n');
        if let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = file.write_all(&line);
        }
    }
}

/// The temporary files a killed writer of `path` left beside it (`.<name>.<pid>.<random>.tmp`,
/// as large as what it wrote: a checkpoint's are gigabytes), removed, except those of a
/// process still running on this machine (a writer of the same name, which this one would
/// race anyway). Regular files only: a link planted under such a name is not followed. Returns
/// what it removed.
pub fn remove_stale_temporaries(path: &Path) -> Result<Vec<PathBuf>> {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else { return Ok(Vec::new()) };
    let prefix = format!(".{name}.");
    let Ok(entries) = std::fs::read_dir(folder_of(path)) else { return Ok(Vec::new()) };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let stale = entry.file_name().to_str().filter(|n| n.ends_with(".tmp")).and_then(|n| n.strip_prefix(&prefix)?.split('.').next()?.parse::<u32>().ok());
        let Some(pid) = stale else { continue };
        if pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        std::fs::remove_file(entry.path()).with_context(|| format!("cannot remove the stale temporary file {}", entry.path().display()))?;
        removed.push(entry.path());
    }
    Ok(removed)
}

/// The error for a file that cannot be opened, saying so plainly when a link was in the way.
fn refusal(path: &Path, err: std::io::Error) -> anyhow::Error {
    match Kind::of(path) {
        Ok(Kind::Link) => UsageError(format!("{} is a symbolic link: not writing through it (remove it, or choose another folder)", path.display())).into(),
        Ok(kind @ (Kind::Fifo | Kind::Device | Kind::Socket | Kind::Folder)) => {
            UsageError(format!("{} is {}, not a regular file: not writing to it (remove it, or write elsewhere)", path.display(), kind.describe())).into()
        }
        _ => anyhow::Error::from(err).context(format!("cannot open {}", path.display())),
    }
}

/// `file`, opened at `path`, is a regular file (not something put there since it was checked).
fn regular(file: &File, path: &Path) -> Result<()> {
    let meta = file.metadata().with_context(|| format!("cannot look at {}", path.display()))?;
    anyhow::ensure!(meta.file_type().is_file(), UsageError(format!("{} is not a regular file: not writing to it", path.display())));
    Ok(())
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
        // Someone puts a folder at the name while the new file is written: it is not renamed
        // over, and the temporary file is removed.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        std::fs::write(&path, "old").unwrap();
        let err = write_with(&path, |tmp| {
            std::fs::write(tmp, "new")?;
            // Someone puts a folder at the name while the file is written.
            std::fs::remove_file(&path)?;
            std::fs::create_dir(&path)?;
            Ok(())
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("is a folder, not a regular file: not replacing it"), "{err:#}");
        assert!(path.is_dir());
        assert_eq!(names(dir.path()), ["run.json"]);
    }

    #[test]
    fn nothing_but_a_regular_file_or_a_link_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("run.json");
        std::fs::create_dir(&folder).unwrap();
        let fifo = dir.path().join("run.safetensors");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        for (path, kind) in [(&folder, "a folder"), (&fifo, "a FIFO")] {
            for err in [
                write(path, "x").unwrap_err(),
                append(path).unwrap_err(),
                check_file(path).unwrap_err(),
                second_name(&dir.path().join("none"), path).unwrap_err(),
            ] {
                let message = format!("{err:#}");
                assert!(message.contains(&format!("{} is {kind}, not a regular file", path.display())), "{message}");
                assert!(err.chain().any(|cause| cause.is::<UsageError>()), "a usage error: {message}");
            }
        }
        assert!(
            folder.is_dir() && {
                use std::os::unix::fs::FileTypeExt;
                std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo()
            }
        );
        // Nothing but the planted ones is left: no temporary file.
        assert_eq!(names(dir.path()), ["run.json", "run.safetensors"]);
        check_file(&dir.path().join("missing")).unwrap();
    }

    #[test]
    fn the_folders_a_run_names_itself_are_never_links() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let run = dir.path().join("tb").join("exercise1-cnn-cpu");
        folder(&run).unwrap();
        folder(&run).unwrap(); // there already: used as it is
        assert!(run.is_dir());
        let planted = dir.path().join("tb").join("exercise1-cnn-cuda");
        symlink(&elsewhere, &planted).unwrap();
        let err = format!("{:#}", folder(&planted).unwrap_err());
        assert!(err.contains("exercise1-cnn-cuda is a symbolic link: not writing through it"), "{err}");
        let file = dir.path().join("tb").join("a-file");
        std::fs::write(&file, "x").unwrap();
        assert!(format!("{:#}", folder(&file).unwrap_err()).contains("is a regular file, not a folder"));
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    }

    #[test]
    fn a_killed_writers_temporaries_are_removed_by_the_next_write_of_the_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.json");
        // A writer that no longer runs (no process has pid 4,000,000,000), and one that does.
        let dead = dir.path().join(format!("{}AbC.tmp", temporary_prefix(&path, 4_000_000_000)));
        let alive = dir.path().join(format!("{}XyZ.tmp", temporary_prefix(&path, 1)));
        let other = dir.path().join(format!("{}AbC.tmp", temporary_prefix(&dir.path().join("other.json"), 4_000_000_000)));
        for leftover in [&dead, &alive, &other] {
            std::fs::write(leftover, "half").unwrap();
        }
        write(&path, "{}").unwrap();
        assert!(!dead.exists(), "the dead writer's temporary file is removed");
        assert!(alive.exists(), "a running writer's is left alone");
        assert!(other.exists(), "another name's is not this write's to remove");
    }

    #[test]
    fn a_second_name_is_a_link_to_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (latest, previous) = (dir.path().join("ck.safetensors"), dir.path().join("ck.previous.safetensors"));
        write(&latest, "step 3").unwrap();
        std::fs::write(&previous, "step 1").unwrap();
        second_name(&latest, &previous).unwrap();
        assert_eq!(std::fs::read_to_string(&previous).unwrap(), "step 3");
        write(&latest, "step 6").unwrap();
        assert_eq!(std::fs::read_to_string(&previous).unwrap(), "step 3", "the rename left the second name's file alone");
        // A link planted at the second name is replaced, not written through.
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::fs::remove_file(&previous).unwrap();
        symlink(&victim, &previous).unwrap();
        second_name(&latest, &previous).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(!std::fs::symlink_metadata(&previous).unwrap().file_type().is_symlink());
    }

    #[test]
    fn every_name_written_is_listed() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (dir.path().join("a.json"), dir.path().join("b.csv"), dir.path().join("c"));
        write(&a, "{}").unwrap();
        drop(append(&b).unwrap());
        folder(&c).unwrap();
        write(&a, "{}").unwrap();
        let listed = written();
        let ours: Vec<&PathBuf> = listed.iter().filter(|p| p.starts_with(dir.path())).collect();
        assert_eq!(ours, [&a, &b, &c], "each once, in the order first written");
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
        std::fs::create_dir(&sub).unwrap();
        probe_folder(&sub).unwrap();
        assert!(names(&sub).is_empty());
        // The folders it had to create are gone again, the ones that were there stay.
        let deep = sub.join("a/b");
        probe_folder(&deep).unwrap();
        assert!(sub.is_dir() && !sub.join("a").exists());
        // Nor do they stay where the probe fails.
        let read_only = dir.path().join("read-only");
        std::fs::create_dir(&read_only).unwrap();
        std::fs::set_permissions(&read_only, std::os::unix::fs::PermissionsExt::from_mode(0o500)).unwrap();
        // (Refused, or allowed where root runs the test: either way nothing stays.)
        let _ = probe_folder(&read_only.join("x"));
        assert!(!read_only.join("x").exists());
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
