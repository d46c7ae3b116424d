//! `make gpu-bundle`: the folder that checks this commit on a bare GPU node. Built here, copied
//! to a folder of its own, and run from there as on a node: no checkout, no Rust on `PATH`, the
//! virtualenv's Python standing in for the node's, and, where this machine lets a test make a
//! mount namespace (root), this machine's Open MPI hidden, so that the ranks can only have used
//! the bundle's. Its CPU self-test runs the harness's checks that need no GPU.
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use support::{read_json, stderr};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&source, &target);
        } else {
            std::fs::copy(&source, &target).unwrap();
        }
    }
}

fn folder_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir).unwrap().flatten().map(|e| if e.file_type().unwrap().is_dir() { folder_bytes(&e.path()) } else { e.metadata().unwrap().len() }).sum()
}

/// Hides this machine's Open MPI and PMIx (their folders and libraries, mpirun) in a private
/// mount namespace, then runs the command: what `unshare` is handed.
const HIDE_MPI: &str = r#"set -e
L=/usr/lib/x86_64-linux-gnu
for d in $L/openmpi $L/pmix2 /usr/share/openmpi /usr/share/pmix /etc/openmpi; do [ -d "$d" ] && mount -t tmpfs none "$d"; done
for f in $L/libmpi.so.40* $L/libopen-rte.so.40* $L/libopen-pal.so.40* $L/libpmix.so.2* $L/libhwloc.so.15* $L/libevent_core-2.1.so.7* $L/libevent_pthreads-2.1.so.7* $L/libmunge.so.2* /usr/bin/orterun /usr/bin/orted; do
  [ -e "$f" ] && mount --bind /dev/null "$(readlink -f "$f")"
done
exec "$@""#;

/// `run.sh args` from `work`, with nothing of this machine's build environment: `PATH` without
/// Rust, the virtualenv's Python as the node's, and this machine's MPI hidden where possible.
fn on_a_bare_node(bundle: &Path, work: &Path, args: &[&str], hide_mpi: bool) -> Output {
    let python = std::env::var_os("TORCH_PYTHON").expect("TORCH_PYTHON is not set: run the tests through scripts/with-torch");
    let mut command = if hide_mpi {
        let mut c = Command::new("unshare");
        c.args(["--mount", "--propagation", "private", "sh", "-c", HIDE_MPI, "hide-mpi"]);
        c
    } else {
        Command::new("env")
    };
    command
        .arg(bundle.join("run.sh"))
        .args(args)
        .current_dir(work)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", work)
        .env("TORCH_PYTHON", python)
        .output()
        .unwrap()
}

#[test]
fn the_bundle_checks_this_commit_from_a_folder_without_the_checkout() {
    let dir = tempfile::tempdir().unwrap();
    let built = dir.path().join("built");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_exercise1")).parent().unwrap().to_path_buf();
    let out = Command::new(root().join("scripts/gpu-bundle")).arg("--bin").arg(&bin).arg("--out").arg(&built).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{said}\n{}", stderr(&out));
    print!("{said}");
    let bytes = folder_bytes(&built);
    assert!(bytes < 64 << 20, "the bundle is {bytes} bytes, over 64 MiB");
    assert!(said.contains(&format!("{} MiB", bytes >> 20)), "the size is printed: {said}");
    for file in ["run.sh", "payload.tar.gz", "COMMIT", "PAYLOAD_ID", "MANIFEST.txt", "bench/gpu_check.py", "bench/bench.sh", "bench/exercise1_lightning.py"] {
        assert!(built.join(file).is_file(), "no {file} in the bundle");
    }

    // On the "node": a copy of the bundle alone, run from another folder.
    let node = dir.path().join("node");
    let (bundle, work) = (node.join("bundle"), node.join("work"));
    copy_tree(&built, &bundle);
    std::fs::create_dir_all(&work).unwrap();
    let rust = Command::new("env").args(["-i", "PATH=/usr/bin:/bin", "sh", "-c", "command -v cargo || command -v rustc"]).output().unwrap();
    assert!(!rust.status.success(), "Rust is on the bare PATH: {}", String::from_utf8_lossy(&rust.stdout));
    let probe = Command::new("unshare").args(["--mount", "--propagation", "private", "sh", "-c", HIDE_MPI, "probe", "true"]).output();
    let hide_mpi = probe.as_ref().is_ok_and(|o| o.status.success());
    if !hide_mpi {
        println!("note: cannot hide this machine's Open MPI here (unshare --mount needs root): the ranks were shown the bundle's first, but this machine's was there too");
    }

    // Where each binary's MPI comes from: the bundle.
    let out = on_a_bare_node(&bundle, &work, &["--libraries"], hide_mpi);
    let libraries = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{libraries}\n{}", stderr(&out));
    let mpi: Vec<&str> = libraries.lines().filter(|l| l.contains("libmpi.so") || l.contains("libopen-pal.so")).collect();
    assert!(!mpi.is_empty() && mpi.iter().all(|l| l.contains(bundle.to_str().unwrap())), "MPI from outside the bundle:\n{libraries}");

    // Its CPU self-test: the harness's checks that need no GPU, through the bundle's binaries
    // and MPI (2 ranks), the PyTorch and pytorch-lightning references included.
    let selection = [
        "exercise1 cnn 32",
        "exercise1 cnn bf16-true",
        "fused kernel",
        "checkpoint + --resume",
        "pipeline 1f1b",
        "profiler",
        "from JPEG files, batch 4: the loader",
        "exercise2 (Horovod style)",
        "collective watchdog",
        "pipeline across",
        "sharded checkpoint",
        "parameter-server",
        "estimate-memory: exercise1 cnn",
        "pytorch-lightning",
    ];
    let mut args = vec!["--device", "cpu", "--budget", "900", "--out", "results"];
    for pattern in selection {
        args.extend(["--only", pattern]);
    }
    let out = on_a_bare_node(&bundle, &work, &args, hide_mpi);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}\n{}", stderr(&out));
    let recorded = read_json(&work.join("results/gpu-check-cpu.json"));
    let checks = recorded["checks"].as_array().unwrap();
    for pattern in selection {
        let matching: Vec<&serde_json::Value> = checks.iter().filter(|c| c["path"].as_str().unwrap().contains(pattern)).collect();
        assert!(!matching.is_empty(), "no row for {pattern:?}:\n{stdout}");
        for c in matching {
            // A timing against a peer may be slower on this machine: it works, which is what is checked here.
            let ok = c["verdict"] == "pass" || (c["verdict"] == "below goal" && c["path"].as_str().unwrap().starts_with("timing"));
            assert!(ok, "{}: {} {} {}\n{stdout}", c["path"], c["verdict"], c["figure"], c["detail"]);
            assert!(c["seconds"].as_f64().is_some(), "every row that ran records its wall time: {c}");
        }
    }
    assert_eq!(recorded["commit"].as_str(), std::fs::read_to_string(built.join("COMMIT")).ok().as_deref().map(str::trim), "the bundle's commit");
    assert!(work.join("results/gpu-check-cpu.md").exists());
    let fired = checks.iter().find(|c| c["path"].as_str().unwrap().contains("never completes")).unwrap();
    assert!(fired["figure"].as_str().unwrap().contains("exit 3"), "{fired}");

    // A node whose Python has another PyTorch is told so in one line.
    let fake = node.join("python");
    std::fs::write(&fake, "#!/bin/sh\nexec /usr/bin/env python3 -c 'print(\"2.5.1\"); print(\"/nowhere\")'\n").unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = Command::new(bundle.join("run.sh")).current_dir(&work).env("TORCH_PYTHON", &fake).arg("--device").arg("cpu").output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("has PyTorch 2.5.1; these binaries need 2.11.0"), "{}", stderr(&out));
}
