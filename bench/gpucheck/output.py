"""The one writer of the Python benches and the GPU check: every file and folder they name
themselves goes through here, as the Rust side's go through common/src/output.rs, with the same
rules and the same words.

- **Whole or not at all.** A file is written to a temporary file beside it
  (`.<name>.<pid>.<random>.tmp`, created with O_CREAT | O_EXCL | O_NOFOLLOW, so never through a
  link), flushed to disk and renamed over it: a full disk, a crash or a kill leaves the old file
  or the new one, never half of one. The temporaries a killed writer left are removed by the
  next write of the same name, unless their writer still runs on this machine.
- **Never through a link it did not make.** The temporary file is filled through its own
  descriptor, not its name, and checked to still be the file created before it is renamed; the
  rename replaces a link at the target's name without following it. Files appended to
  (`append`) and the folders a run names itself (`folder`) refuse a link at their name. The
  folders a user names (`--results`, `--csv`'s folder) are the user's: links there are followed.
- **Never over something that is not a regular file.** A FIFO, a device, a socket or a folder at
  a file's name is refused, not renamed over or opened (a FIFO with no reader would block the
  writer forever), and a file at a folder's name likewise: `Refused`, one line naming what is
  there. Scripts print it and exit 2.
"""
import contextlib
import errno
import os
import re
import secrets
import shutil
import stat


class Refused(OSError):
    """Something at a name this writer will not write to or through: a link, a FIFO, a device, a
    socket, a folder (or a file at a folder's name). Its text is one line naming the path."""

    def __init__(self, message):
        super().__init__(message)
        self.message = message

    def __str__(self):
        return self.message


def kind(path):
    """What `path` names, without following a link there: "missing", "file", "folder", "link",
    "fifo", "socket" or "device"."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


DESCRIBE = {"missing": "missing", "file": "a regular file", "folder": "a folder", "link": "a symbolic link", "fifo": "a FIFO", "device": "a device",
            "socket": "a socket"}


def check_file(path):
    """Whether `path` may be written as a file: missing, a regular file, or a link (replaced, never
    followed); anything else there is `Refused`."""
    found = kind(path)
    if found not in ("missing", "file", "link"):
        raise Refused(f"{path} is {DESCRIBE[found]}, not a regular file: not replacing it (remove it, or write elsewhere)")


def check_folder(path):
    """Whether `path` may be used as a folder a run names itself: missing or a folder. A link
    (which someone else may have planted to send the run's files elsewhere) or anything else
    there is `Refused`."""
    found = kind(path)
    if found == "link":
        raise Refused(f"{path} is a symbolic link: not writing through it (remove it, or write elsewhere)")
    if found not in ("missing", "folder"):
        raise Refused(f"{path} is {DESCRIBE[found]}, not a folder: not writing into it (remove it, or write elsewhere)")


def folder(path):
    """Creates the folder `path` a run names itself (its parents, the user's, as need be), or uses
    it where it is already a folder; a link or anything else at its name is `Refused`, also when
    it appears between the check and the creation."""
    check_folder(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path)
    except FileExistsError:
        check_folder(path)  # something is there now: a folder is fine, anything else refused
    return path


def write(path, data):
    """Replaces `path` with `data` (str, written as UTF-8, or bytes), whole or not at all."""
    with replacing(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def copy(source, path):
    """Replaces `path` with the bytes of the file `source`, as `write` writes (a link or a FIFO
    at `path` is never written through, unlike shutil.copy)."""
    with open(source, "rb") as src, replacing(path, "wb") as f:
        shutil.copyfileobj(src, f)


@contextlib.contextmanager
def replacing(path, mode="w", newline=None):
    """A file object ("w": text, UTF-8; "wb": bytes) on a new temporary file beside `path`, for a
    writer that takes a file (csv, tarfile's fileobj=). When the block ends, the file is flushed
    to disk and renamed over `path`; when it raises, the temporary file is removed and `path` is
    left as it was. Something other than a regular file or a link at `path` is `Refused` first,
    and again just before the rename."""
    if mode not in ("w", "wb"):
        raise ValueError(f"replacing: mode {mode!r}, not 'w' or 'wb'")
    check_file(path)
    remove_stale_temporaries(path)  # a killed writer's leftovers, which nothing else would remove
    fd, tmp = _temporary_beside(path)
    renamed = False
    try:
        with os.fdopen(fd, mode, **({} if mode == "wb" else {"encoding": "utf-8", "newline": newline})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the name points at them
            _still_ours(f.fileno(), tmp, path)
        check_file(path)  # a FIFO or a folder put at the name meanwhile is not replaced either
        os.replace(tmp, path)
        renamed = True
    finally:
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _sync_folder(path)


def append(path, text):
    """Appends `text` (str, as UTF-8, or bytes) to `path`, created if missing, in one write where
    the system allows. A link at the name is refused (an appended log in a shared folder must
    not grow some other file), and anything but a regular file too (opened without waiting: a
    FIFO with no reader would block forever)."""
    check_file(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        refusal = _refusal(path, e)
        if refusal is e:
            raise
        raise refusal from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refused(f"{path} is not a regular file: not writing to it")
        data = memoryview(text.encode("utf-8") if isinstance(text, str) else text)
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def header(path, line):
    """Makes the table `path` with `line` as its first line where it is missing; a regular file
    there is kept as it is. What `append` would refuse at the name (a link, a FIFO, a folder) is
    refused here, so that a bench that appends a row after each run stops before the first."""
    found = kind(path)
    if found == "missing":
        write(path, line + "\n")
    elif found == "link":
        raise Refused(f"{path} is a symbolic link: not appending through it (remove it, or choose another folder)")
    elif found != "file":
        raise Refused(f"{path} is {DESCRIBE[found]}, not a regular file: not appending to it (remove it, or write elsewhere)")


def main(argv):
    """The shell scripts' way in (`python3 -m gpucheck.output`, bench/ on PYTHONPATH):
    `header FILE LINE` (`header`), `append FILE` (standard input appended, `append`). A refusal
    is one line and exit 2."""
    import sys
    try:
        match argv:
            case ["header", path, line]:
                header(path, line)
            case ["append", path]:
                append(path, sys.stdin.buffer.read())
            case _:
                print("usage: python3 -m gpucheck.output header FILE LINE | append FILE < TEXT", file=sys.stderr)
                return 2
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def temporary_prefix(path, pid):
    """`.<name>.<pid>.`: the prefix of the temporary files process `pid` writes `path` through
    (the pid tells a later run whether the writer of a leftover one still runs)."""
    return f".{os.path.basename(path)}.{pid}."


def remove_stale_temporaries(path):
    """The temporary files a killed writer of `path` left beside it (`.<name>.<pid>.<random>.tmp`),
    removed, except those of a process still running on this machine. Regular files only: a link
    planted under such a name is left alone. Returns what it removed."""
    name = os.path.basename(path)
    if not name:
        return []
    pattern = re.compile(re.escape(f".{name}.") + r"(\d+)\.[^.]+\.tmp")
    removed = []
    try:
        entries = list(os.scandir(_folder_of(path)))
    except OSError:
        return []
    for entry in entries:
        found = pattern.fullmatch(entry.name)
        if not found or not entry.is_file(follow_symlinks=False):
            continue
        pid = int(found.group(1))
        if pid != os.getpid() and _running(pid):
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue  # another writer of the name removed it first
        removed.append(entry.path)
    return removed


def _running(pid):
    if os.path.isdir("/proc/self"):
        return os.path.exists(f"/proc/{pid}")
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass
    return True


def _folder_of(path):
    return os.path.dirname(path) or "."


def _temporary_beside(path):
    """(descriptor, name) of a new `.<name>.<pid>.<random>.tmp` beside `path`: O_EXCL, never
    through a link; readable as the umask allows once in place, as a plainly created file is."""
    prefix = os.path.join(_folder_of(path), temporary_prefix(path, os.getpid()))
    for _ in range(100):
        tmp = f"{prefix}{secrets.token_hex(4)}.tmp"
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"cannot write {path}: no free temporary name beside it")


def _still_ours(fd, tmp, path):
    """The temporary file's name still names the file created, not a link or a file someone else
    put in its place while it was written (which the rename would move to the target's name)."""
    ours = os.fstat(fd)
    try:
        named = os.lstat(tmp)
    except FileNotFoundError:
        raise Refused(f"cannot write {path}: its temporary file {tmp} is gone") from None
    if (ours.st_dev, ours.st_ino) != (named.st_dev, named.st_ino):
        raise Refused(f"cannot write {path}: its temporary file {tmp} was replaced by someone else while it was written: not moving that into place")


def _sync_folder(path):
    """The rename on disk too (where the file system lets a folder be flushed)."""
    try:
        fd = os.open(_folder_of(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _refusal(path, error):
    """The error for a file that cannot be opened, saying so plainly when a link or something
    that is not a regular file was in the way; else the error itself."""
    found = kind(path)
    if found == "link":
        return Refused(f"{path} is a symbolic link: not writing through it (remove it, or choose another folder)")
    if found in ("fifo", "device", "socket", "folder"):
        return Refused(f"{path} is {DESCRIBE[found]}, not a regular file: not writing to it (remove it, or write elsewhere)")
    return error


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
