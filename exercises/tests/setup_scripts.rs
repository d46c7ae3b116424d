//! The shell front door: `scripts/with-torch` refuses a wrong PyTorch with the required
//! version in the message, and `scripts/fetch_data.sh` verifies downloads and falls back to
//! generated data in the official format.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A stand-in `python` that claims to have the given torch version.
fn fake_python(dir: &Path, version: &str) -> PathBuf {
    let path = dir.join("python");
    std::fs::write(&path, format!("#!/bin/sh\necho '{version} /nonexistent/torch/lib'\n")).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path
}

#[test]
fn with_torch_refuses_another_pytorch_version_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let python = fake_python(dir.path(), "2.10.0+cpu");
    let out = Command::new(repo().join("scripts/with-torch")).arg("true").env("TORCH_PYTHON", &python).env_remove("LIBTORCH").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let msg = text(&out);
    assert!(msg.contains("PyTorch 2.10.0+cpu") && msg.contains("requires PyTorch 2.11.0"), "{msg}");

    let ok = fake_python(dir.path(), "2.11.0+cu130");
    let out = Command::new(repo().join("scripts/with-torch"))
        .args(["sh", "-c", "echo $TORCH_VERSION $LIBTORCH_USE_PYTORCH $LD_LIBRARY_PATH"])
        .env("TORCH_PYTHON", &ok)
        .env_remove("LIBTORCH")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).starts_with("2.11.0+cu130 1 /nonexistent/torch/lib"), "{}", text(&out));
}

#[test]
fn with_torch_refuses_a_libtorch_folder_of_another_version() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("lib")).unwrap();
    std::fs::write(dir.path().join("build-version"), "2.9.1+cu126\n").unwrap();
    let out = Command::new(repo().join("scripts/with-torch")).arg("true").env("LIBTORCH", dir.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("version '2.9.1+cu126'") && text(&out).contains("requires LibTorch 2.11.0"), "{}", text(&out));
}

fn fetch(data_dir: &Path, dataset: &str, env: &[(&str, String)]) -> Output {
    let mut cmd = Command::new(repo().join("scripts/fetch_data.sh"));
    cmd.arg(dataset).env("DATA_DIR", data_dir).env("PREPARE_DATA", env!("CARGO_BIN_EXE_prepare_data"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn md5(path: &Path) -> String {
    let out = Command::new("md5sum").arg(path).output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().next().unwrap().to_string()
}

#[test]
fn a_verified_download_is_unpacked_and_used() {
    // A CIFAR-10-format archive laid out like the official one, served from a file:// URL.
    let src = tempfile::tempdir().unwrap();
    let inner = src.path().join("cifar-10-batches-bin");
    let status = Command::new(env!("CARGO_BIN_EXE_prepare_data"))
        .args(["generate", "--dataset", "cifar10", "--train", "10", "--test", "5", "--out"])
        .arg(&inner)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::remove_file(inner.join("GENERATED.txt")).unwrap();
    let archive = src.path().join("cifar-10-binary.tar.gz");
    let status = Command::new("tar").arg("-czf").arg(&archive).arg("-C").arg(src.path()).arg("cifar-10-batches-bin").status().unwrap();
    assert!(status.success());

    let data = tempfile::tempdir().unwrap();
    let url = format!("file://{}", archive.display());
    let out = fetch(data.path(), "cifar10", &[("FETCH_CIFAR_URL", url), ("FETCH_CIFAR_MD5", md5(&archive))]);
    assert!(out.status.success(), "{}", text(&out));
    let msg = text(&out);
    assert!(msg.contains("10 train + 5 test images") && !msg.contains("GENERATED"), "{msg}");
    assert!(data.path().join("cifar10/cifar-10-batches-bin/test_batch.bin").exists());
    assert!(!data.path().join("cifar10/cifar-10-binary.tar.gz").exists(), "the archive is removed after unpacking");

    // A second `make data` finds the data and downloads nothing.
    let out = fetch(data.path(), "cifar10", &[("FETCH_CIFAR_URL", "file:///nonexistent".into())]);
    assert!(out.status.success() && !text(&out).contains("downloading"), "{}", text(&out));
}

#[test]
fn a_download_with_the_wrong_checksum_is_discarded_and_data_generated_loudly() {
    let src = tempfile::tempdir().unwrap();
    let archive = src.path().join("cifar-10-binary.tar.gz");
    std::fs::write(&archive, b"not the archive").unwrap();
    let data = tempfile::tempdir().unwrap();
    let out = fetch(data.path(), "cifar10", &[("FETCH_CIFAR_URL", format!("file://{}", archive.display()))]);
    assert!(out.status.success(), "{}", text(&out));
    let msg = text(&out);
    assert!(msg.contains("expected c32a1d4ab5d03f1284b67883e8d87530; discarding"), "{msg}");
    assert!(msg.contains("GENERATING a stand-in"), "{msg}");
    assert!(data.path().join("cifar10/GENERATED.txt").exists());
    assert!(data.path().join("cifar10/data_batch_5.bin").exists());
}

#[test]
fn mnist_without_network_falls_back_to_generated_idx_files() {
    let data = tempfile::tempdir().unwrap();
    let out = fetch(data.path(), "mnist", &[("FETCH_MNIST_URL", "file:///nonexistent".into())]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("GENERATING a stand-in"), "{}", text(&out));
    assert!(text(&out).contains("60000 train + 10000 test"), "{}", text(&out));
    assert!(data.path().join("mnist/t10k-labels-idx1-ubyte.gz").exists());
}

#[test]
fn an_unknown_data_set_name_is_refused() {
    let data = tempfile::tempdir().unwrap();
    let out = fetch(data.path(), "imagenet", &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("unknown data set 'imagenet'"), "{}", text(&out));
}

fn fetch_wikitext(data_dir: &Path, env: &[(&str, String)]) -> Output {
    let mut cmd = Command::new(repo().join("scripts/fetch_wikitext.sh"));
    cmd.env("DATA_DIR", data_dir).env("PREPARE_DATA", env!("CARGO_BIN_EXE_prepare_data"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn a_verified_wikitext_zip_is_unpacked_where_the_loader_finds_it() {
    // A zip laid out like wikitext-2-v1.zip: wikitext-2/wiki.{train,valid,test}.tokens.
    let src = tempfile::tempdir().unwrap();
    let zip = src.path().join("wikitext-2-v1.zip");
    let script = "import sys, zipfile\n\
                  z = zipfile.ZipFile(sys.argv[1], 'w')\n\
                  for s in ('train', 'valid', 'test'):\n    z.writestr(f'wikitext-2/wiki.{s}.tokens', ' = Title = \\n\\n the cat sat on the mat . \\n')\n\
                  z.close()";
    let status = Command::new("python3").args(["-c", script]).arg(&zip).status().unwrap();
    assert!(status.success());
    let data = tempfile::tempdir().unwrap();
    // A dead address first, as the S3 bucket is today: the next one is tried.
    let urls = format!("file:///nonexistent/wikitext-2-v1.zip file://{}", zip.display());
    let env = [("FETCH_WIKITEXT_URL", urls), ("FETCH_WIKITEXT_MD5", md5(&zip))];
    let out = fetch_wikitext(data.path(), &env);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("file:///nonexistent/wikitext-2-v1.zip: not available (trying the next"), "{}", text(&out));
    assert!(text(&out).contains("wikitext-2 in") && !text(&out).contains("GENERATED"), "{}", text(&out));
    assert!(data.path().join("wikitext-2/wikitext-2/wiki.valid.tokens").exists());
    assert!(!data.path().join("wikitext-2/wikitext-2-v1.zip").exists(), "the zip is removed after unpacking");
}

#[test]
fn wikitext_with_a_bad_checksum_or_no_network_is_generated_loudly() {
    let src = tempfile::tempdir().unwrap();
    let zip = src.path().join("wikitext-2-v1.zip");
    std::fs::write(&zip, b"not a zip").unwrap();
    let data = tempfile::tempdir().unwrap();
    let out = fetch_wikitext(data.path(), &[("FETCH_WIKITEXT_URL", format!("file://{}", zip.display()))]);
    assert!(out.status.success(), "{}", text(&out));
    let msg = text(&out);
    assert!(msg.contains("expected 542ccefacc6c27f945fb54453812b3cd; discarding"), "{msg}");
    assert!(msg.contains("GENERATING a stand-in") && msg.contains("(GENERATED stand-in)"), "{msg}");
    assert!(data.path().join("wikitext-2/GENERATED.txt").exists());
    assert!(data.path().join("wikitext-2/wiki.train.tokens").exists());
}

/// A `curl` that records the addresses asked of it and fails, as with no network.
fn recording_curl(dir: &Path) -> (String, PathBuf) {
    let log = dir.join("urls.log");
    let curl = dir.join("curl");
    std::fs::write(&curl, format!("#!/bin/sh\nfor a; do case \"$a\" in http*) echo \"$a\" >> {}; esac; done\nexit 7\n", log.display())).unwrap();
    std::fs::set_permissions(&curl, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    (format!("{}:{}", dir.display(), std::env::var("PATH").unwrap()), log)
}

#[test]
fn the_data_scripts_try_the_addresses_that_still_serve_first_then_the_old_ones() {
    let bin = tempfile::tempdir().unwrap();
    let (path, log) = recording_curl(bin.path());
    let data = tempfile::tempdir().unwrap();
    let out = fetch_wikitext(data.path(), &[("PATH", path.clone())]);
    assert!(out.status.success() && text(&out).contains("GENERATING a stand-in"), "{}", text(&out));
    let asked = std::fs::read_to_string(&log).unwrap();
    // The author's own host (the S3 bucket answers 403 since 2024), then the bucket.
    assert_eq!(
        asked.lines().collect::<Vec<_>>(),
        ["https://wikitext.smerity.com/wikitext-2-v1.zip", "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip"]
    );
    std::fs::remove_file(&log).unwrap();
    let out = fetch(data.path(), "mnist", &[("PATH", path)]);
    assert!(out.status.success(), "{}", text(&out));
    let asked = std::fs::read_to_string(&log).unwrap();
    // PyTorch's copy, then the original page, for the same file (the first one asked for).
    let first: Vec<_> = asked.lines().take(2).collect();
    let file = first[0].rsplit('/').next().unwrap();
    assert!(file.ends_with("-ubyte.gz"), "{asked}");
    assert_eq!(first, [format!("https://ossci-datasets.s3.amazonaws.com/mnist/{file}"), format!("http://yann.lecun.com/exdb/mnist/{file}")]);
}

/// `scripts/find-libclang` run on a fake file tree `root`, with the search variables given
/// (and no others from this machine).
fn find_libclang(root: &Path, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(repo().join("scripts/find-libclang"));
    cmd.arg("--root").arg(root).env_remove("LIBCLANG_PATH").env_remove("LD_LIBRARY_PATH").env_remove("LIBRARY_PATH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// Creates the (empty) files `paths` under `root`.
fn files(root: &Path, paths: &[&str]) {
    for path in paths {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"").unwrap();
    }
}

#[test]
fn libclang_is_found_as_bindgen_finds_it_and_libclang_cpp_does_not_count() {
    // What Debian 12's LLVM toolchain installs without libclang-dev: LLVM's C++ library only.
    let toolchain_only = tempfile::tempdir().unwrap();
    files(toolchain_only.path(), &["usr/lib/llvm-14/lib/libclang-cpp.so.14", "usr/lib/x86_64-linux-gnu/libclang-cpp.so.14"]);
    let out = find_libclang(toolchain_only.path(), &[]);
    assert_eq!(out.status.code(), Some(1), "libclang-cpp must not count as libclang: {}", text(&out));

    // After libclang-dev: the versioned library bindgen loads at run time.
    let with_libclang = tempfile::tempdir().unwrap();
    files(with_libclang.path(), &["usr/lib/llvm-14/lib/libclang-cpp.so.14", "usr/lib/llvm-14/lib/libclang-14.so.1"]);
    let out = find_libclang(with_libclang.path(), &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).trim().ends_with("usr/lib/llvm-14/lib/libclang-14.so.1"), "{}", text(&out));

    // LIBCLANG_PATH is the only place looked at when it is set: a folder or the file itself.
    let module = tempfile::tempdir().unwrap();
    files(module.path(), &["opt/llvm/17/lib/libclang.so", "opt/llvm/cpp-only/libclang-cpp.so.17"]);
    assert!(find_libclang(module.path(), &[]).status.code() == Some(1), "/opt is not searched without LIBCLANG_PATH");
    for path in ["/opt/llvm/17/lib", "/opt/llvm/17/lib/libclang.so"] {
        let out = find_libclang(module.path(), &[("LIBCLANG_PATH", path)]);
        assert!(out.status.success(), "LIBCLANG_PATH={path}: {}", text(&out));
    }
    for path in ["/opt/llvm/cpp-only", "/opt/llvm/cpp-only/libclang-cpp.so.17", "/opt/llvm/missing"] {
        let out = find_libclang(module.path(), &[("LIBCLANG_PATH", path)]);
        assert_eq!(out.status.code(), Some(1), "LIBCLANG_PATH={path}: {}", text(&out));
    }
    // LD_LIBRARY_PATH is searched, as clang-sys does.
    let out = find_libclang(module.path(), &[("LD_LIBRARY_PATH", "/nowhere:/opt/llvm/17/lib")]);
    assert!(out.status.success(), "{}", text(&out));
}

/// In a container (sbatch/exercise1_container.sbatch), `scripts/container-torch` uses the
/// container's PyTorch when it is the release 2.11.0, and the project's .venv with one line
/// saying so when it is an NGC pre-release build (`2.11.0a0+git…`), which tch refuses.
#[test]
fn container_torch_takes_the_images_pytorch_only_when_it_is_the_release() {
    let dir = tempfile::tempdir().unwrap();
    let run = |version: &str, mode: &str| {
        let python = dir.path().join(format!("python-{}", version.replace('+', "_")));
        std::fs::write(&python, format!("#!/bin/sh\necho '{version} /nonexistent/torch/lib'\n")).unwrap();
        std::fs::set_permissions(&python, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        Command::new(repo().join("scripts/container-torch"))
            .args(["sh", "-c", "echo $TORCH_VERSION"])
            .env("CONTAINER_PYTHON", &python)
            .env("USE_CONTAINER_TORCH", mode)
            .env_remove("TORCH_PYTHON")
            .env_remove("LIBTORCH")
            .output()
            .unwrap()
    };
    let release = run("2.11.0+cu999", "auto");
    assert!(release.status.success() && String::from_utf8_lossy(&release.stdout).trim() == "2.11.0+cu999", "{}", text(&release));
    assert!(release.stderr.is_empty(), "{}", text(&release));

    let ngc = run("2.11.0a0+git5c1b2e3", "auto");
    let said = String::from_utf8_lossy(&ngc.stderr);
    assert_eq!(said.lines().count(), 1, "{said}");
    assert!(said.contains("the container's PyTorch is 2.11.0a0+git5c1b2e3") && said.contains("using the project's .venv"), "{said}");
    // The .venv's PyTorch (or with-torch's own refusal where there is none), never the image's.
    assert!(!String::from_utf8_lossy(&ngc.stdout).contains("2.11.0a0"), "{}", text(&ngc));

    let bad = run("2.11.0+cu999", "sometimes");
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad));
}

/// A participant's first `make exercise1` leaves `git status` clean: what runs write into
/// `results/` (their JSON, CSV rows and charts) is ignored, and the committed reference run sits
/// apart, in `results/reference/`.
#[test]
fn a_runs_own_results_are_ignored_and_the_reference_runs_kept_apart() {
    for written in [
        "results/exercise1-cnn-cpu.json",
        "results/exercise1.csv",
        "results/exercise1-cnn-cpu.svg",
        "results/exercise1_nlp-transformer-cuda.json",
        "results/exercise2-resnet34-cuda.json",
        "results/exercise2-resnet34-cuda.config.toml",
        "results/scaling/strong/ranks-2/exercise2-cnn-cpu.config.toml",
    ] {
        let out = Command::new("git").args(["check-ignore", "--no-index", "-q", written]).current_dir(repo()).output().unwrap();
        assert!(out.status.success(), "git would show {written} as new or modified after a run");
    }
    assert!(repo().join("results/reference/exercise1-cnn-cpu.json").is_file());
}
