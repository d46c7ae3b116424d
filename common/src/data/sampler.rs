//! Which examples an epoch visits, in what order, and on which replica.
//!
//! The order is a pure function of (seed, epoch): a resumed run and every rank of a
//! data-parallel job compute it alike without talking to each other. With several replicas
//! the sampler behaves as torch's `DistributedSampler` (drop_last=False): the permutation is
//! padded by repeating its start until it divides evenly, and replica `r` of `w` takes
//! positions `r, r + w, r + 2w, …`, so shards are disjoint (up to the padding), cover the data
//! set, and have equal length — every rank takes the same number of steps.
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone)]
pub struct Sampler {
    dataset_len: usize,
    shuffle: bool,
    seed: u64,
    /// (this replica's rank, number of replicas)
    shard: (usize, usize),
}

impl Sampler {
    /// A sampler over the whole data set (one replica).
    pub fn new(dataset_len: usize, shuffle: bool, seed: u64) -> Self {
        Sampler { dataset_len, shuffle, seed, shard: (0, 1) }
    }

    /// The share of replica `rank` of `world_size`.
    pub fn sharded(self, rank: usize, world_size: usize) -> Self {
        assert!(world_size > 0 && rank < world_size, "rank {rank} of {world_size}");
        Sampler { shard: (rank, world_size), ..self }
    }

    /// Number of indices an epoch yields on this replica.
    pub fn len(&self) -> usize {
        self.dataset_len.div_ceil(self.shard.1)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The indices of one epoch on this replica: a fresh permutation per epoch when shuffling,
    /// else in order; then this replica's stride of it.
    pub fn indices(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.dataset_len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
            rng.set_stream(epoch as u64);
            order.shuffle(&mut rng);
        }
        let (rank, world) = self.shard;
        if world == 1 {
            return order;
        }
        let total = self.len() * world;
        let padding: Vec<usize> = order.iter().copied().cycle().take(total - order.len()).collect();
        order.extend(padding);
        order.into_iter().skip(rank).step_by(world).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn shards_are_disjoint_equal_and_cover_the_data_set() {
        for (len, world) in [(10, 2), (11, 2), (7, 3), (5, 8)] {
            let shards: Vec<Vec<usize>> = (0..world).map(|r| Sampler::new(len, true, 9).sharded(r, world).indices(4)).collect();
            let per_rank = len.div_ceil(world);
            assert!(shards.iter().all(|s| s.len() == per_rank), "equal length for {len}/{world}");
            let all: Vec<usize> = shards.iter().flatten().copied().collect();
            let distinct: HashSet<usize> = all.iter().copied().collect();
            assert_eq!(distinct, (0..len).collect(), "cover the data set for {len}/{world}");
            // Only the padding repeats: exactly total − len duplicates.
            assert_eq!(all.len() - distinct.len(), per_rank * world - len);
        }
    }

    #[test]
    fn every_rank_agrees_on_the_epoch_permutation() {
        // Interleaving the shards gives back one permutation, the same a single replica sees.
        let single = Sampler::new(12, true, 5).indices(3);
        let shards: Vec<Vec<usize>> = (0..3).map(|r| Sampler::new(12, true, 5).sharded(r, 3).indices(3)).collect();
        let interleaved: Vec<usize> = (0..4).flat_map(|i| shards.iter().map(move |s| s[i])).collect();
        assert_eq!(interleaved, single);
        // A new epoch reshuffles, on every rank alike.
        assert_ne!(Sampler::new(12, true, 5).sharded(1, 3).indices(4), shards[1]);
        assert_eq!(Sampler::new(12, true, 5).sharded(1, 3).indices(3), shards[1]);
    }

    #[test]
    fn without_shuffle_the_order_is_the_data_sets() {
        assert_eq!(Sampler::new(5, false, 1).indices(7), vec![0, 1, 2, 3, 4]);
        assert_eq!(Sampler::new(5, false, 1).sharded(1, 2).indices(0), vec![1, 3, 0]);
    }
}
