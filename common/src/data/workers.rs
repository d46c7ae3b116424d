//! The loaders' worker threads: jobs made in parallel, results handed out in job order.
//!
//! Job `i` goes to worker `i % workers`, whose results wait in a channel of `prefetch` places;
//! the consumer takes result `i` from that same worker. The order is therefore the jobs' order
//! whatever the number of workers or their speed, which keeps a seeded epoch the same batches on
//! any machine. The jobs themselves come from one feeder thread: a batch number for data in
//! memory or in files named up front, the next samples read from a tar shard for streamed data
//! (reading stays sequential, decoding is what runs in parallel).
//!
//! Dropping the iterator (an epoch cut short by `--max-steps`) closes the channels: each worker
//! stops at its next send, and the feeder at its next job.
use anyhow::{anyhow, Result};
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

/// The most worker threads a loader may be given: beyond the cores of any node they only wait,
/// and each reserves its stack and channels.
pub const MAX_WORKERS: usize = 256;

/// `make(job)` for every job of `jobs`, on `workers` threads (none: in the calling thread, when
/// the iterator is advanced), up to `prefetch` results ahead per worker; results in job order.
/// A job that panics gives an error in its place rather than a hang or a short epoch.
pub fn ordered_map<J, T>(
    jobs: impl Iterator<Item = J> + Send + 'static,
    workers: usize,
    prefetch: usize,
    make: impl Fn(J) -> Result<T> + Send + Sync + 'static,
) -> Box<dyn Iterator<Item = Result<T>> + Send>
where
    J: Send + 'static,
    T: Send + 'static,
{
    if workers == 0 {
        return Box::new(jobs.map(make));
    }
    let make = Arc::new(make);
    let mut threads = Vec::with_capacity(workers);
    let (inputs, outputs): (Vec<_>, Vec<_>) = (0..workers)
        .map(|worker| {
            let (job_sender, job_receiver) = sync_channel::<J>(1);
            let (result_sender, result_receiver) = sync_channel(prefetch.max(1));
            let make = Arc::clone(&make);
            let thread = std::thread::Builder::new()
                .name(format!("loader-{worker}"))
                .spawn(move || {
                    for job in job_receiver {
                        let result = std::panic::catch_unwind(AssertUnwindSafe(|| make(job)))
                            .unwrap_or_else(|_| Err(anyhow!("data loader thread {worker} failed (see the message above)")));
                        if result_sender.send(result).is_err() {
                            break;
                        }
                    }
                })
                .expect("cannot start a data loader thread");
            threads.push(thread);
            (job_sender, result_receiver)
        })
        .unzip();
    std::thread::Builder::new()
        .name("loader-feed".into())
        .spawn(move || {
            for (i, job) in jobs.enumerate() {
                if inputs[i % inputs.len()].send(job).is_err() {
                    break;
                }
            }
        })
        .expect("cannot start a data loader thread");
    Box::new(InOrder { outputs, next: 0, workers: threads })
}

/// The consumer's side: result `i` from worker `i % workers`.
struct InOrder<T> {
    outputs: Vec<Receiver<Result<T>>>,
    next: usize,
    workers: Vec<std::thread::JoinHandle<()>>,
}

/// Dropped before the epoch's end (`--max-steps`, an error, the process ending): the workers
/// are waited for, each finishing at most the job in its hands. They make LibTorch tensors,
/// which must not happen while a returning `main` tears LibTorch down. (The feeder, which
/// touches no tensor, is left to stop at its next job.)
impl<T> Drop for InOrder<T> {
    fn drop(&mut self) {
        self.outputs.clear();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

impl<T> Iterator for InOrder<T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        let worker = self.next % self.outputs.len();
        self.next += 1;
        // A worker's channel closes only when the feeder has no job for it any more (a panic
        // inside `make` is caught and sent as an error): the jobs ran out.
        self.outputs[worker].recv().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_in_job_order_whatever_the_workers() {
        for workers in [0, 1, 3, 8] {
            // Later jobs finish first: job i sleeps less the larger i is.
            let results: Vec<usize> = ordered_map(0..20usize, workers, 2, |i| {
                std::thread::sleep(std::time::Duration::from_millis((20 - i as u64) % 4));
                Ok(i * i)
            })
            .collect::<Result<_>>()
            .unwrap();
            assert_eq!(results, (0..20).map(|i| i * i).collect::<Vec<_>>(), "{workers} workers");
        }
    }

    #[test]
    fn an_error_is_passed_on_in_its_place_and_a_panic_is_an_error() {
        let results: Vec<Result<usize>> = ordered_map(0..6usize, 2, 1, |i| if i == 3 { Err(anyhow!("job 3 failed")) } else { Ok(i) }).collect();
        assert_eq!(results.len(), 6);
        assert_eq!(results[3].as_ref().unwrap_err().to_string(), "job 3 failed");
        assert!(results.iter().enumerate().all(|(i, r)| i == 3 || *r.as_ref().unwrap() == i));
        let mut panicking = ordered_map(0..6usize, 2, 1, |i| if i == 2 { panic!("worker panics (expected in this test)") } else { Ok(i) });
        assert_eq!(panicking.next().unwrap().unwrap(), 0);
        assert_eq!(panicking.next().unwrap().unwrap(), 1);
        assert!(panicking.next().unwrap().unwrap_err().to_string().contains("failed"));
        assert_eq!(panicking.map(|r| r.unwrap()).collect::<Vec<_>>(), [3, 4, 5]);
    }

    #[test]
    fn dropping_the_results_stops_the_feeder_and_the_workers() {
        let fed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = Arc::clone(&fed);
        let jobs = (0..1_000_000usize).inspect(move |_| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
        let mut results = ordered_map(jobs, 2, 2, Ok);
        assert_eq!(results.next().unwrap().unwrap(), 0);
        drop(results);
        // The feeder blocks on full channels (a few jobs per worker), then finds them closed: it
        // never runs through the million jobs, however long it is given.
        std::thread::sleep(std::time::Duration::from_millis(200));
        let fed = fed.load(std::sync::atomic::Ordering::SeqCst);
        assert!(fed < 100, "the feeder went on after the consumer left: {fed} jobs");
    }
}
