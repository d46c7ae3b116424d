//! The language model's batch source: a split batchified into streams on the device, cut
//! into `bptt`-long windows in order, as the tutorial's training loop does.
use super::{batch_starts, batchify, get_batch};
use crate::train::{Batch, BatchSource, Batches};
use tch::{Device, Tensor};

pub struct TokenBatches {
    /// `[len / batch_size, batch_size]` token ids on the training device.
    data: Tensor,
    bptt: i64,
    /// Windows side by side in one batch (evaluation: see [`TokenBatches::grouped`]).
    group: usize,
}

impl TokenBatches {
    /// Batchifies `tokens` (1-D ids) into `batch_size` streams and moves them to `device` once.
    pub fn new(tokens: &Tensor, batch_size: i64, bptt: i64, device: Device) -> Self {
        TokenBatches { data: batchify(tokens, batch_size).to_device(device), bptt, group: 1 }
    }

    /// Replica `index` of `count`'s share of the batches one process would make with
    /// `batch_size × count` streams: its `batch_size` consecutive streams of each. The replicas
    /// together train exactly the single process's batches (data parallelism that equals one
    /// process with the whole batch).
    pub fn sharded(tokens: &Tensor, batch_size: i64, bptt: i64, device: Device, (index, count): (usize, usize)) -> Self {
        let all = batchify(tokens, batch_size * count as i64);
        let mine = all.narrow(1, index as i64 * batch_size, batch_size).contiguous();
        TokenBatches { data: mine.to_device(device), bptt, group: 1 }
    }

    /// Replica `index` of `count`'s share of an evaluation split: the `batch_size` streams one
    /// process makes of it, stream `s` to replica `s mod count`. The replicas together evaluate
    /// exactly one process's windows, so the evaluation loss does not depend on the job's size
    /// (with [`TokenBatches::sharded`]'s `batch_size × count` streams it did: 4 replicas scored
    /// 9.5114 where one scored 9.5047). Every replica holds as many windows as the others (the
    /// streams are equally long), so those whose forward passes meet in collectives (ZeRO-3's
    /// gathers) take as many passes. With more replicas than streams, each takes one stream of
    /// `count`: every replica needs one.
    pub fn evaluation_share(tokens: &Tensor, batch_size: i64, bptt: i64, device: Device, (index, count): (usize, usize)) -> Self {
        let streams = batch_size.max(count as i64);
        let all = batchify(tokens, streams);
        if all.size()[0] == 0 {
            // Fewer tokens than streams: not one window (the run's checks refuse it, naming
            // --eval-batch-size). The streams are not listed: 10^12 of them fill no memory.
            return TokenBatches { data: all.narrow(1, 0, 0).to_device(device), bptt, group: 1 };
        }
        let mine: Vec<i64> = (index as i64..streams).step_by(count).collect();
        let mine = all.index_select(1, &Tensor::from_slice(&mine)).contiguous();
        TokenBatches { data: mine.to_device(device), bptt, group: 1 }
    }

    /// The same windows, `group` of them side by side in each batch (`[bptt, batch × group]`;
    /// the shorter last window alone): what evaluation runs, since every window is evaluated
    /// on its own anyway (each column is one stream's window, its own causal context), so the
    /// losses are the same, in a few large passes instead of many small ones.
    pub fn grouped(mut self, group: usize) -> Self {
        self.group = group.max(1);
        self
    }
}

impl TokenBatches {
    /// The window starts in groups of `self.group` full windows; a shorter last window alone.
    fn chunks<'a>(&self, starts: &'a [i64]) -> impl Iterator<Item = &'a [i64]> + 'a {
        let rows = self.data.size()[0];
        let full = starts.iter().take_while(|&&i| i + self.bptt < rows).count();
        let (full, short) = starts.split_at(full);
        full.chunks(self.group).chain(short.chunks(1))
    }
}

impl BatchSource for TokenBatches {
    fn batches_per_epoch(&self) -> usize {
        let starts: Vec<i64> = batch_starts(&self.data, self.bptt).collect();
        self.chunks(&starts).count()
    }

    /// The same windows every epoch: the tutorial does not shuffle a language-model corpus.
    fn epoch(&self, _epoch: usize) -> Batches<'_> {
        let starts: Vec<i64> = batch_starts(&self.data, self.bptt).collect();
        let batches: Vec<Batch> = self
            .chunks(&starts)
            .map(|group| {
                let windows: Vec<(Tensor, Tensor)> = group.iter().map(|&i| get_batch(&self.data, i, self.bptt)).collect();
                if let [(inputs, targets)] = &windows[..] {
                    return Batch { inputs: inputs.shallow_clone(), targets: targets.shallow_clone() };
                }
                // Side by side: inputs along the batch dimension, targets likewise (they are
                // each window's `[seq, batch]` flattened).
                let seq = windows[0].0.size()[0];
                let inputs: Vec<Tensor> = windows.iter().map(|(x, _)| x.shallow_clone()).collect();
                let targets: Vec<Tensor> = windows.iter().map(|(_, y)| y.view([seq, -1])).collect();
                Batch { inputs: Tensor::cat(&inputs, 1), targets: Tensor::cat(&targets, 1).reshape([-1]) }
            })
            .collect();
        Box::new(batches.into_iter().map(Ok))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// Every (input, target) pair of token ids the batches of `source` hold, sorted: each input
    /// token with the token it must predict.
    fn pairs(source: &TokenBatches) -> Vec<(i64, i64)> {
        let mut pairs = Vec::new();
        for batch in source.epoch(0) {
            let batch = batch.unwrap();
            let inputs = Vec::<i64>::try_from(batch.inputs.reshape([-1])).unwrap();
            let targets = Vec::<i64>::try_from(&batch.targets).unwrap();
            pairs.extend(inputs.into_iter().zip(targets));
        }
        pairs.sort();
        pairs
    }

    /// The replicas' shares of an evaluation split hold, together, exactly the pairs one process
    /// evaluates, each once, in as many batches on every replica; with more replicas than
    /// streams each still gets one. (The training shares, `batch_size × count` streams, would
    /// not: their streams break the split elsewhere, 4 replicas' windows another set.)
    #[test]
    fn the_replicas_evaluate_one_processs_windows_between_them() {
        let tokens = Tensor::arange(1003, (Kind::Int64, Device::Cpu));
        let (streams, bptt) = (10, 7);
        let one = pairs(&TokenBatches::evaluation_share(&tokens, streams, bptt, Device::Cpu, (0, 1)).grouped(3));
        assert_eq!(one, pairs(&TokenBatches::new(&tokens, streams, bptt, Device::Cpu)), "one replica evaluates what one process does");
        for count in [2, 3, 4, 10] {
            let shares: Vec<TokenBatches> =
                (0..count).map(|i| TokenBatches::evaluation_share(&tokens, streams, bptt, Device::Cpu, (i, count)).grouped(3)).collect();
            let mut together: Vec<(i64, i64)> = shares.iter().flat_map(pairs).collect();
            together.sort();
            assert_eq!(together, one, "{count} replicas");
            assert!(shares.iter().all(|s| s.batches_per_epoch() == shares[0].batches_per_epoch()), "{count} replicas: as many passes each");
        }
        let sharded: Vec<(i64, i64)> = {
            let mut all: Vec<(i64, i64)> = (0..4).flat_map(|i| pairs(&TokenBatches::sharded(&tokens, streams, bptt, Device::Cpu, (i, 4)))).collect();
            all.sort();
            all
        };
        assert_ne!(sharded, one, "the training shares cut the split into other streams");
        let many: Vec<TokenBatches> = (0..12).map(|i| TokenBatches::evaluation_share(&tokens, streams, bptt, Device::Cpu, (i, 12))).collect();
        assert!(
            many.iter().all(|s| s.data.size()[1] == 1 && s.batches_per_epoch() == many[0].batches_per_epoch()),
            "12 replicas of 10 streams: one stream each"
        );
    }

    /// More streams than the split has tokens: no window, and no list of streams the size of
    /// the batch (`--eval-batch-size 1000000000000` aborted allocating it).
    #[test]
    fn a_split_shorter_than_its_streams_has_no_window() {
        let tokens = Tensor::arange(100, (Kind::Int64, Device::Cpu));
        for (streams, count) in [(1_000_000_000_000, 1), (101, 2)] {
            let share = TokenBatches::evaluation_share(&tokens, streams, 7, Device::Cpu, (0, count));
            assert_eq!(share.batches_per_epoch(), 0, "{streams} streams");
        }
        assert_eq!(TokenBatches::evaluation_share(&tokens, 50, 7, Device::Cpu, (0, 1)).batches_per_epoch(), 1, "two tokens a stream: one window");
    }
}
