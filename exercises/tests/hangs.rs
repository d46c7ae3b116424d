//! A rank that stops (SIGSTOP: as a hung GPU or a node whose connection stays open) no longer
//! leaves the others waiting in their collective forever: past `--collective-timeout` the job
//! ends, with one line naming the rank that did not answer. 2 and 4 CPU ranks under mpirun. A
//! rank that never arrives at the job's start (stuck, or ended, before MPI's start-up) no longer
//! leaves the others waiting inside `MPI_Init`: past `--startup-timeout` the job ends, naming it.
mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{rank_process, signal, stderr, Job};

fn generated_cifar(dir: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_prepare_data"))
        .args(["generate", "--dataset", "cifar10", "--train", "64", "--test", "16", "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `ranks` ranks train; once the first epoch has ended, the last rank is stopped: the job must
/// end (non-zero) within the timeout and a margin, naming it.
fn a_stopped_rank_ends_the_job_naming_it(ranks: usize) {
    a_stopped_rank_is_blamed(ranks, ranks - 1, &[]);
}

/// `ranks` ranks of exercise2 with `extra` flags; once the first epoch has ended, rank `last`
/// is stopped: the job ends within the timeout and a margin, blaming that rank and no other.
fn a_stopped_rank_is_blamed(ranks: usize, last: usize, extra: &[&str]) {
    let (data, results) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    generated_cifar(data.path());
    let timeout = 3;
    let mut job = Command::new(env!("CARGO_BIN_EXE_exercise2"))
        .args(["--model", "cnn", "--num-classes", "10", "--device", "cpu", "--threads", "1", "--workers", "0", "--batch-size", "8", "--epochs", "100000"])
        .args(["--nproc-per-node", &ranks.to_string(), "--max-ranks-per-core", "8", "--quiet", "--collective-timeout", &timeout.to_string()])
        .arg("--data-dir")
        .arg(data.path())
        .arg("--results-dir")
        .arg(results.path())
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The first epoch's line: the ranks are past start-up and inside the training loop.
    let stdout = BufReader::new(job.stdout.take().unwrap());
    let mut said = Vec::new();
    for line in stdout.lines().map_while(Result::ok) {
        let started = line.contains("epoch 1/");
        said.push(line);
        if started {
            break;
        }
    }
    let stopped = rank_process(job.id(), last).unwrap_or_else(|| panic!("no process of rank {last} under the launcher: {said:?}"));
    signal(stopped, "-STOP");
    let since = Instant::now();
    let bound = Duration::from_secs(timeout + 40);
    let status = loop {
        if let Some(status) = job.try_wait().unwrap() {
            break Some(status);
        }
        if since.elapsed() > bound {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let waited = since.elapsed();
    // Whatever happened, leave nothing behind.
    signal(stopped, "-KILL");
    let Some(status) = status else {
        let _ = job.kill();
        panic!("{ranks} ranks, rank {last} stopped: the job had not ended after {waited:?}");
    };
    let out = job.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(!status.success(), "{err}");
    let named = format!("rank {last} does not answer");
    assert!(err.contains(&named) && err.contains("--collective-timeout"), "{ranks} ranks: no '{named}' in: {err}");
    assert_eq!(err.lines().filter(|l| l.starts_with("error on rank")).count(), 1, "one rank reports: {err}");
    if extra.is_empty() {
        // A training rank reports, and says what a resume would train again (no --checkpoint-dir here).
        assert!(err.contains("(after step ") && err.contains("no checkpoint committed in this run"), "{err}");
    }
    println!(
        "{ranks} ranks, rank {last} stopped: the job ended after {:.1} s (timeout {timeout} s): {}",
        waited.as_secs_f64(),
        err.lines().find(|l| l.contains(&named)).unwrap_or_default()
    );
}

/// An asynchronous parameter-server job (workers 0 and 1, the server 2) whose worker 1 stops:
/// the other worker waits in its own group's collective, not the server's, and still answers
/// the server's roll call, so only worker 1 is blamed (the server used to blame ranks 0 and 1).
#[test]
fn a_stopped_asynchronous_worker_is_the_only_one_blamed() {
    a_stopped_rank_is_blamed(3, 1, &["--strategy", "parameter-server", "--async"]);
}

#[test]
fn a_stopped_rank_of_two_ends_the_job_naming_it() {
    a_stopped_rank_ends_the_job_naming_it(2);
}

#[test]
fn a_stopped_rank_of_four_ends_the_job_naming_it() {
    a_stopped_rank_ends_the_job_naming_it(4);
}

/// Rank 1 of 3 never arrives at MPI's start-up (stuck before it; one that ended before it with
/// exit code 0, before the others got there, is the same to them): the others waited inside
/// MPI_Init for ever. Past --startup-timeout the job ends, non-zero, with one line naming rank 1.
/// Generous bounds: 10 s from each rank's own arrival (rank 0 and 2 load LibTorch at their own
/// pace on loaded cores: one that arrived later than that would be named too, rightly), and the
/// job may take minutes; the line, not the time, is the point.
#[test]
fn a_rank_that_never_arrives_at_start_up_is_named_past_the_startup_timeout() {
    let (data, results) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    generated_cifar(data.path());
    let mut job = Job::start(
        Command::new(env!("CARGO_BIN_EXE_exercise2"))
            .args(["--model", "cnn", "--num-classes", "10", "--device", "cpu", "--threads", "1", "--workers", "0", "--batch-size", "8", "--epochs", "1"])
            .args(["--nproc-per-node", "3", "--max-ranks-per-core", "8", "--quiet", "--startup-timeout", "10"])
            .arg("--data-dir")
            .arg(data.path())
            .arg("--results-dir")
            .arg(results.path())
            .env(common::comm::startup::TEST_NEVER_ARRIVES, "1"),
    );
    let Some(status) = job.wait(Duration::from_secs(300)) else {
        panic!("the job still waited for rank 1 after 300 s: {}", job.kill_all());
    };
    let err = job.stderr();
    assert!(!status.success(), "{err}");
    // One line besides the launcher's warning that 3 ranks share 2 cores (mpirun's box about
    // the exit code, and the launcher's line about it, add nothing to it).
    let said: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty() && !l.starts_with("warning: ")).collect();
    assert_eq!(said.len(), 1, "one line: {err}");
    assert!(said[0].starts_with("error on rank ") && said[0].contains("MPI start-up waited 10 s (--startup-timeout)"), "{err}");
    let named = said[0].split(": rank").nth(1).and_then(|rest| rest.split(" of the 3 never arrived").next()).unwrap_or_default();
    let named: Vec<&str> = named.trim_start_matches('s').split(',').map(str::trim).collect();
    assert!(named.contains(&"1"), "rank 1 is named: {err}");
}
