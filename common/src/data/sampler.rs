//! Which examples an epoch visits, in what order.
//!
//! The order is a pure function of (seed, epoch): a resumed run and every rank of a
//! data-parallel job compute it alike without talking to each other.
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone)]
pub struct Sampler {
    len: usize,
    shuffle: bool,
    seed: u64,
}

impl Sampler {
    pub fn new(len: usize, shuffle: bool, seed: u64) -> Self {
        Sampler { len, shuffle, seed }
    }

    /// Number of indices an epoch yields.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The indices of one epoch: a fresh permutation per epoch when shuffling, else in order.
    pub fn indices(&self, epoch: usize) -> Vec<usize> {
        let mut indices: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
            rng.set_stream(epoch as u64);
            indices.shuffle(&mut rng);
        }
        indices
    }
}
