//! `--weights imagenet` and `prepare_data weights MODEL` as a participant meets them: the
//! published `.pth` fetched over HTTP into torchvision's cache (`$TORCH_HOME/hub/checkpoints`),
//! checked against the hash in its name, reused from there, and loaded by exercise 1; and every
//! way it goes wrong (no network, a wrong or torn download, a damaged cache, another model's
//! file, a model torchvision publishes no weights for) as one line and an exit status, with
//! nothing cached.
//!
//! The published files cannot be fetched here (no network but the package registries), so a
//! local server serves a file torchvision wrote the same way (`torch.save(model.state_dict())`,
//! named `resnet34-<its hash>.pth`), which `COURSE_TEST_PUBLISHED` stands in for the published
//! name; the address comes from `COURSE_WEIGHTS_URL`, as a site mirror's would.
mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use support::stderr;

/// A resnet34 `state_dict` that torchvision wrote (zip layout), named as torchvision names its
/// files: `resnet34-<first 8 hex digits of its SHA-256>.pth`.
fn torchvision_file(dir: &Path) -> PathBuf {
    let python = std::env::var_os("TORCH_PYTHON").expect("run through scripts/with-torch (make test does), which sets TORCH_PYTHON");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../common/tests/reference/torchvision_pth.py");
    let out = Command::new(python).arg(script).args(["resnet34", "zip"]).arg(dir).arg(dir.join("reference.npz")).output().unwrap();
    assert!(out.status.success(), "torchvision (scripts/python-tools installs it): {}", stderr(&out));
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|e| e == "pth")).unwrap()
}

/// Serves `body` for every request, `requests` times, on a local port; returns its address.
fn serve(body: Vec<u8>, requests: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = format!("http://{}/models", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().take(requests) {
            let mut stream = stream.unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap() > 2 {
                line.clear();
            }
            let _ = write!(stream, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = stream.write_all(&body);
        }
    });
    address
}

/// An address nothing answers at (a port just freed).
fn dead_address() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}/models", listener.local_addr().unwrap())
}

fn prepare(model: &str, torch_home: &Path, published: &str, url: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prepare_data"))
        .args(["weights", model])
        .env("TORCH_HOME", torch_home)
        .env("COURSE_TEST_PUBLISHED", published)
        .env("COURSE_WEIGHTS_URL", url)
        .output()
        .unwrap()
}

/// The one line a failure prints (after the warnings of generated data, if any).
fn error_line(out: &Output) -> String {
    let err = stderr(out);
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("WARNING")).collect();
    assert_eq!(lines.len(), 1, "one line, not: {err}");
    assert!(!err.contains("panicked"), "{err}");
    lines[0].to_string()
}

fn cached(torch_home: &Path) -> Vec<String> {
    let dir = torch_home.join("hub/checkpoints");
    std::fs::read_dir(&dir).map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()).unwrap_or_default()
}

#[test]
fn imagenet_weights_are_fetched_checked_cached_and_trained_from() {
    let made = tempfile::tempdir().unwrap();
    let file = torchvision_file(made.path());
    let name = file.file_name().unwrap().to_str().unwrap().to_string();
    let published = format!("resnet34:{name}");
    let bytes = std::fs::read(&file).unwrap();

    // No network: one line naming the file and where to put it; nothing cached.
    let home = tempfile::tempdir().unwrap();
    let out = prepare("resnet34", home.path(), &published, &dead_address());
    assert_eq!(out.status.code(), Some(1));
    let line = error_line(&out);
    assert!(line.contains(&format!("/models/{name}")) && line.contains(&home.path().join("hub/checkpoints").join(&name).display().to_string()), "{line}");
    assert!(cached(home.path()).is_empty(), "{:?}", cached(home.path()));

    // A download whose hash is not the name's (another file, a proxy's error page): refused,
    // nothing cached, not even the partial file.
    let mut other = bytes.clone();
    other[bytes.len() / 2] ^= 1;
    let out = prepare("resnet34", home.path(), &published, &serve(other, 1));
    assert_eq!(out.status.code(), Some(1));
    assert!(error_line(&out).contains("not the"), "{}", stderr(&out));
    assert!(cached(home.path()).is_empty(), "{:?}", cached(home.path()));

    // Fetched and checked; a second time it is taken from the cache (the server is gone).
    let out = prepare("resnet34", home.path(), &published, &serve(bytes.clone(), 1));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(cached(home.path()), std::slice::from_ref(&name));
    let out = prepare("resnet34", home.path(), &published, &dead_address());
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("(checked)"), "{}", stderr(&out));

    // Exercise 1 starts from them, as the slides' runs start from IMAGENET1K_V1.
    let data = tempfile::tempdir().unwrap();
    support::generated_cifar10(data.path(), 16, 8);
    let results = tempfile::tempdir().unwrap();
    let exercise1 = |model: &str, weights: &str| {
        Command::new(env!("CARGO_BIN_EXE_exercise1"))
            .args(["--model", model, "--weights", weights, "--device", "cpu", "--epochs", "1", "--max-steps", "1", "--batch-size", "4", "--data-dir"])
            .arg(data.path())
            .arg("--results-dir")
            .arg(results.path())
            .env("TORCH_HOME", home.path())
            .env("COURSE_TEST_PUBLISHED", &published)
            .env("COURSE_WEIGHTS_URL", dead_address())
            .output()
            .unwrap()
    };
    let out = exercise1("resnet34", "imagenet");
    assert!(out.status.success(), "{}", stderr(&out));
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &stderr(&out);
    assert!(said.contains(&format!("tensors loaded from {}", home.path().join("hub/checkpoints").join(&name).display())), "{said}");
    assert!(!said.contains("this run trained from scratch"), "started where the course does: {said}");

    // Another model's file (resnet34's given to resnet50): one line listing what does not fit.
    let out = exercise1("resnet50", file.to_str().unwrap());
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(error_line(&out).contains("does not fit the model"), "{}", stderr(&out));
    // A model torchvision publishes no weights for: a usage error before anything runs.
    let out = exercise1("cnn", "imagenet");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(error_line(&out).contains("no ImageNet weights for cnn"), "{}", stderr(&out));

    // A cache a crashed copy left torn: refused with what to do, and not trained from.
    let cached_file = home.path().join("hub/checkpoints").join(&name);
    std::fs::write(&cached_file, &bytes[..bytes.len() / 2]).unwrap();
    let out = exercise1("resnet34", "imagenet");
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let line = error_line(&out);
    assert!(line.contains("damaged") && line.contains(&format!("remove {}", cached_file.display())), "{line}");
}
