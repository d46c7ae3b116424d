//! torchvision's `ImageFolder` layout: `<split>/<class>/**/<image>`, one folder per class.
//!
//! The classes and the files are listed exactly as torchvision lists them, so that label `k`
//! here is label `k` there and sample `i` is sample `i` (tested against torchvision's rules):
//! - the classes are the split's sub-folders (symbolic links followed), sorted by name
//!   (`find_classes`: Python sorts by code point, as Rust sorts UTF-8 bytes);
//! - each class's files are found recursively, folders in the order of their sorted paths
//!   (`sorted(os.walk(...))`), files sorted by name within a folder, keeping those whose name
//!   ends, in any case, with one of [`IMAGE_EXTENSIONS`].
//!
//! Unlike torchvision, a split whose classes differ from the training split's is an error
//! (torchvision would silently number them differently).
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// torchvision's `IMG_EXTENSIONS`: the files `ImageFolder` takes for images.
pub const IMAGE_EXTENSIONS: [&str; 9] = [".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"];

/// The folder of each split under `--data-dir`, as in the usual ImageNet copy (`train/`, and
/// `val/` sorted into class folders).
pub fn split_folder(split: super::Split) -> &'static str {
    match split {
        super::Split::Train => "train",
        super::Split::Test => "val",
    }
}

/// One split of an image folder: its classes and its images with their labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageFolder {
    pub root: PathBuf,
    /// Class names; a sample's label indexes this list.
    pub classes: Vec<String>,
    pub samples: Vec<Sample>,
    /// Folders reached again through a symbolic link (a loop such as `ln -s .. loop`, or two
    /// links to one folder): listed once, at the first path found, and named here so a user
    /// can be told. torchvision follows such a loop until the path gets too long, listing the
    /// same images over and over under other labels.
    pub skipped: Vec<PathBuf>,
}

/// An image file and its class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub path: PathBuf,
    pub label: usize,
}

impl ImageFolder {
    /// Lists `root` as torchvision's `ImageFolder(root)` does (see the module docs). Classes are
    /// listed in parallel: on a parallel file system a listing waits on the metadata server,
    /// not on this machine.
    pub fn scan(root: &Path) -> Result<ImageFolder> {
        let classes = find_classes(root)?;
        // The split's folder and every class folder are where they are: a link back to one of
        // them (`ln -s .. loop`) is a loop, not more images of this class.
        let mut fixed = HashSet::from([identity(root)?]);
        for class in &classes {
            fixed.insert(identity(&root.join(class))?);
        }
        let listed: Vec<(Vec<PathBuf>, Vec<PathBuf>)> = classes.par_iter().map(|class| image_files(&root.join(class), &fixed)).collect::<Result<_>>()?;
        let empty: Vec<&str> = classes.iter().zip(&listed).filter(|(_, (files, _))| files.is_empty()).map(|(class, _)| class.as_str()).collect();
        if !empty.is_empty() {
            bail!("{}: no image in the class folder(s) {} (images are files ending in {})", root.display(), empty.join(", "), IMAGE_EXTENSIONS.join(" "));
        }
        let mut skipped = Vec::new();
        let mut samples = Vec::new();
        for (label, (paths, loops)) in listed.into_iter().enumerate() {
            samples.extend(paths.into_iter().map(|path| Sample { path, label }));
            skipped.extend(loops);
        }
        Ok(ImageFolder { root: root.to_path_buf(), classes, samples, skipped })
    }

    /// Lists split `split` of the data set in `dir` (`dir/train` or `dir/val`), checking that
    /// its classes are `classes` when given (the training split's).
    pub fn scan_split(dir: &Path, split: super::Split, classes: Option<&[String]>) -> Result<ImageFolder> {
        let folder = ImageFolder::scan(&split_root(dir, split)?)?;
        if let Some(expected) = classes {
            check_same_classes(&folder, expected)?;
        }
        Ok(folder)
    }

    /// The warning for [`ImageFolder::skipped`], when there is something to say.
    pub fn skipped_note(&self) -> Option<String> {
        const SHOWN: usize = 5;
        if self.skipped.is_empty() {
            return None;
        }
        let mut names: Vec<String> = self.skipped.iter().take(SHOWN).map(|p| p.strip_prefix(&self.root).unwrap_or(p).display().to_string()).collect();
        if self.skipped.len() > SHOWN {
            names.push(format!("and {} more", self.skipped.len() - SHOWN));
        }
        Some(format!(
            "WARNING: {}: {} folder(s) reached again through a symbolic link were skipped (a loop, or a second path to a folder already listed; \
             torchvision would list their images again): {}",
            self.root.display(),
            self.skipped.len(),
            names.join(", ")
        ))
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// The folder of split `split` in the data set `dir`, which must exist.
pub fn split_root(dir: &Path, split: super::Split) -> Result<PathBuf> {
    let root = dir.join(split_folder(split));
    crate::input::folder(
        &root,
        "the image folder's split",
        "an image folder holds train/<class>/<image> and val/<class>/<image> (torchvision's ImageFolder layout; `prepare_data generate-images` writes a stand-in)",
    )?;
    Ok(root)
}

/// The class folders of `root`, sorted (torchvision's `find_classes`).
pub fn find_classes(root: &Path) -> Result<Vec<String>> {
    let mut classes = Vec::new();
    for entry in std::fs::read_dir(root).with_context(|| format!("cannot list {}", root.display()))? {
        let entry = entry.with_context(|| format!("cannot list {}", root.display()))?;
        // `is_dir` of the path follows symbolic links, as Python's `DirEntry.is_dir()` does.
        if entry.path().is_dir() {
            let name = entry.file_name().into_string().map_err(|name| anyhow::anyhow!("{}: class folder {name:?} is not UTF-8", root.display()))?;
            classes.push(name);
        }
    }
    if classes.is_empty() {
        bail!("{}: no class folder in it (an image folder holds one folder of images per class)", root.display());
    }
    classes.sort();
    Ok(classes)
}

/// The image files under `dir`, in torchvision's order: folders by sorted path, files by
/// sorted name; and the folders skipped because they were reached before (through a link).
/// Symbolic links are followed, as torchvision follows them, but each folder is listed once
/// (by device and inode), and the split's and class folders (`fixed`) only where they are. An entry with an image's name that is not a regular file (a FIFO, a
/// device, a socket, a dangling link) is an error naming it: reading it would block, never end,
/// or fail in the middle of training.
fn image_files(dir: &Path, fixed: &HashSet<(u64, u64)>) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let mut visited = fixed.clone();
    let mut skipped = Vec::new();
    // (folder, its file names), for every folder below `dir`.
    let mut folders: Vec<(PathBuf, Vec<OsString>)> = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        let mut entries = Vec::new();
        for entry in std::fs::read_dir(&folder).with_context(|| format!("cannot list {}", folder.display()))? {
            let entry = entry.with_context(|| format!("cannot list {}", folder.display()))?;
            // The entry's own type costs no system call; a link is followed with one.
            let kind = entry.file_type().with_context(|| format!("cannot list {}", entry.path().display()))?;
            let kind = if kind.is_symlink() { std::fs::metadata(entry.path()).map(|m| m.file_type()).ok() } else { Some(kind) };
            entries.push((entry.file_name(), kind));
        }
        // In name order, so that which of two paths to one folder is listed does not depend on
        // the order the file system returns them in.
        entries.sort_by(|(a, _), (b, _)| a.as_encoded_bytes().cmp(b.as_encoded_bytes()));
        let (mut names, mut below) = (Vec::new(), Vec::new());
        for (name, kind) in entries {
            let path = folder.join(&name);
            match kind {
                Some(kind) if kind.is_dir() => {
                    if visited.insert(identity(&path)?) {
                        below.push(path);
                    } else {
                        skipped.push(path);
                    }
                }
                Some(kind) if kind.is_file() => names.push(name),
                _ if is_image_file(&name) => {
                    bail!("{} is not a regular file (a FIFO, a device, a socket or a dangling link): remove it from the data", path.display())
                }
                _ => {}
            }
        }
        pending.extend(below.into_iter().rev());
        folders.push((folder, names));
    }
    folders.sort_by(|(a, _), (b, _)| a.as_os_str().as_encoded_bytes().cmp(b.as_os_str().as_encoded_bytes()));
    skipped.sort();
    let files =
        folders.into_iter().flat_map(|(folder, names)| names.into_iter().filter(|name| is_image_file(name)).map(move |name| folder.join(name))).collect();
    Ok((files, skipped))
}

/// A folder's device and inode (links followed): the same folder under two paths is one.
fn identity(path: &Path) -> Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| (m.dev(), m.ino())).with_context(|| format!("cannot list {}", path.display()))
}

/// Whether a file name ends, in any case, with one of [`IMAGE_EXTENSIONS`].
pub fn is_image_file(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy().to_lowercase();
    IMAGE_EXTENSIONS.iter().any(|extension| name.ends_with(extension))
}

fn check_same_classes(folder: &ImageFolder, expected: &[String]) -> Result<()> {
    if folder.classes != expected {
        let missing: Vec<&String> = expected.iter().filter(|c| !folder.classes.contains(c)).take(3).collect();
        let extra: Vec<&String> = folder.classes.iter().filter(|c| !expected.contains(c)).take(3).collect();
        bail!(
            "{}: its {} classes are not the training split's {} (missing: {missing:?}, not in training: {extra:?}); the labels would not match",
            folder.root.display(),
            folder.classes.len(),
            expected.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"x").unwrap();
    }

    #[test]
    fn classes_and_files_are_listed_in_torchvisions_order() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // Upper case sorts before lower case (code points), "b" before "b_x", sub-folders by path.
        for file in ["b/z.JPG", "b/a.png", "b/sub/c.jpeg", "b/sub2/a.webp", "b/notes.txt", "B/1.jpg", "b_x/q.bmp", "a/deep/er/x.tiff", "a/m.ppm", "a/n.pgm"] {
            touch(&root.join(file));
        }
        touch(&root.join("stray.jpg")); // a file beside the classes is no class
        let folder = ImageFolder::scan(root).unwrap();
        assert_eq!(folder.classes, ["B", "a", "b", "b_x"]);
        let listed: Vec<(String, usize)> =
            folder.samples.iter().map(|s| (s.path.strip_prefix(root).unwrap().to_string_lossy().into_owned(), s.label)).collect();
        let expected = [
            ("B/1.jpg", 0),
            ("a/m.ppm", 1),
            ("a/n.pgm", 1),
            ("a/deep/er/x.tiff", 1),
            ("b/a.png", 2),
            ("b/z.JPG", 2),
            ("b/sub/c.jpeg", 2),
            ("b/sub2/a.webp", 2),
            ("b_x/q.bmp", 3),
        ];
        assert_eq!(listed, expected.map(|(p, l)| (p.to_string(), l)));
    }

    #[test]
    fn an_empty_class_or_no_class_is_an_error_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        touch(&dir.path().join("cat/1.jpg"));
        touch(&dir.path().join("dog/readme.txt"));
        std::fs::create_dir(dir.path().join("emu")).unwrap();
        let err = ImageFolder::scan(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no image in the class folder(s) dog, emu"), "{err}");
        let flat = tempfile::tempdir().unwrap();
        touch(&flat.path().join("1.jpg"));
        let err = ImageFolder::scan(flat.path()).unwrap_err().to_string();
        assert!(err.contains("no class folder"), "{err}");
    }

    #[test]
    fn a_split_must_exist_and_have_the_training_splits_classes() {
        let dir = tempfile::tempdir().unwrap();
        for file in ["train/cat/1.jpg", "train/dog/1.jpg", "val/cat/2.jpg", "val/eel/2.jpg"] {
            touch(&dir.path().join(file));
        }
        let train = ImageFolder::scan_split(dir.path(), super::super::Split::Train, None).unwrap();
        let err = ImageFolder::scan_split(dir.path(), super::super::Split::Test, Some(&train.classes)).unwrap_err().to_string();
        assert!(err.contains("missing: [\"dog\"]") && err.contains("not in training: [\"eel\"]"), "{err}");
        let err = ImageFolder::scan_split(&dir.path().join("nowhere"), super::super::Split::Train, None).unwrap_err().to_string();
        assert!(err.contains("nowhere/train does not exist"), "{err}");
    }
}
